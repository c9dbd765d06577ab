"""The fraud example with history on, through the commands a user runs: ``apply``,
``consume`` and ``record`` side by side through a stream of inserts, corrections, a
transaction moved to another user, deletes and a truncate; then the history audit finds
no difference, and every entry the consumers wrote names a kept snapshot and ``as_of``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from freshline.pipeline.core.codec import HEADER, parse_watermark
from freshline.pipeline.core.keys import feature_pattern
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.history.snapshots import snapshots_of
from tests.helpers import FRESHLINE, drop_database, fresh_version, recreate_database, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.connect]

ROOT = Path(__file__).resolve().parents[3]
HISTORY = "\n[history]\nenabled = true\n"


@pytest.fixture
def own_database(base_settings: Settings) -> Iterator[str]:
    name = f"freshline_fraud_history_{uuid.uuid4().hex[:8]}"
    url = recreate_database(base_settings, name)
    yield url
    drop_database(base_settings, name)


def test_fraud_history_audits_clean_and_entries_name_their_snapshot(
    own_database: str, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    prefix = f"hf{uuid.uuid4().hex[:6]}."
    version = fresh_version()
    repo = tmp_path / "fraud"
    shutil.copytree(ROOT / "examples" / "fraud", repo)
    with (repo / "freshline.toml").open("a") as config:
        config.write(HISTORY)
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": own_database,
        "FRESHLINE_POSTGRES_ADMIN_URL": own_database,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_TOPIC_PREFIX": prefix,
        "FRESHLINE_CONSUMER_GROUP": f"{prefix}freshline",
        "FRESHLINE_SCHEMA_VERSION": str(version),
        "FRESHLINE_CONSUMER_METRICS_PORT": "0",
        "FRESHLINE_REPO": str(repo),
    }

    def freshline(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [FRESHLINE, *args], capture_output=True, text=True, env=env, timeout=300
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done

    assert freshline("db", "upgrade").returncode == 0
    seeded = freshline("fraud", "seed", "--users", "30", "--transactions", "600", "--tenants", "1")
    assert seeded.returncode == 0, seeded.stdout + seeded.stderr
    engine = sa.create_engine(own_database, poolclass=sa.pool.NullPool)
    children: list[subprocess.Popen[Any]] = []
    logs = []
    try:
        applied = freshline("apply", "--alter-tables")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "history: backfilled from snapshot" in applied.stdout + applied.stderr
        for command in ("consume", "record"):
            log = (tmp_path / f"{command}.log").open("w")
            logs.append(log)
            children.append(
                subprocess.Popen(
                    [FRESHLINE, command],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        with engine.connect() as conn:
            tenant = conn.execute(sa.text("SELECT min(tenant_id) FROM transactions")).scalar()
        for n in range(20):
            with engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, "
                        "device_id, ip) VALUES (:t, :u, :a, 'm-h', NULL, '10.0.0.1')"
                    ),
                    {"t": tenant, "u": n % 5 + 1, "a": 10 + n},
                )
        with engine.begin() as conn:  # a correction, twice in one transaction
            conn.execute(sa.text("UPDATE transactions SET amount = 1 WHERE merchant_id = 'm-h'"))
            conn.execute(sa.text("UPDATE transactions SET status = 'refunded' WHERE amount = 1"))
        with engine.begin() as conn:  # moved to another user
            conn.execute(
                sa.text(
                    "UPDATE transactions SET user_id = 7 WHERE id = "
                    "(SELECT min(id) FROM transactions WHERE merchant_id = 'm-h')"
                )
            )
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "DELETE FROM transactions WHERE id IN (SELECT id FROM transactions "
                    "WHERE merchant_id <> 'm-h' ORDER BY id LIMIT 5)"
                )
            )
        with engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE user_devices"))
            conn.execute(sa.text("INSERT INTO user_devices VALUES (:t, 1, 'd-new')"), {"t": tenant})
        audited = freshline("audit", "--history", "--duration", "120s")
        if audited.returncode:
            for child in children:
                os.killpg(child.pid, signal.SIGTERM)
                child.wait(timeout=30)
        assert audited.returncode == 0, (
            audited.stdout + audited.stderr + (tmp_path / "record.log").read_text()[-3000:]
        )

        def entries() -> list[int]:
            keys = list(redis_client.scan_iter(match=feature_pattern(version), count=1000))
            raws = redis_client.mget(keys) if keys else []
            return [
                parse_watermark(raw[1:HEADER])
                for raw in raws
                if isinstance(raw, bytes) and raw[:1] == b"1"
            ]

        assert wait_until(lambda: len(entries()) > 0, 60), (tmp_path / "consume.log").read_text()[
            -3000:
        ]
        watermarks = entries()
        kept = snapshots_of(engine, watermarks)
        assert set(watermarks) <= set(kept)
        assert all(s.snapshot.count(":") == 2 and s.as_of_us > 0 for s in kept.values())
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
        for log in logs:
            log.close()
        freshline("cdc", "remove")
        engine.dispose()
