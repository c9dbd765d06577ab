"""History through the commands a user runs: ``plan`` shows it, ``apply`` creates and
backfills it, ``freshline record`` records plain SQL changes through Debezium, and
``freshline audit --history`` finds no difference. On the README's quick-start tables,
in a database freshline did not create."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from pipeline.core.settings import Settings
from tests.helpers import FRESHLINE, drop_database, recreate_database

pytestmark = [pytest.mark.kafka, pytest.mark.connect]

ROOT = Path(__file__).resolve().parents[3]
TABLES = (ROOT / "docs" / "quickstart.sql").read_text()
HISTORY = '\n[history]\nenabled = true\nretention = "30d"\n'


@pytest.fixture
def own_database(base_settings: Settings) -> Iterator[str]:
    name = f"freshline_history_{uuid.uuid4().hex[:8]}"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql(TABLES)
        conn.execute(sa.text("INSERT INTO members VALUES ('lib', 1, 'Ada'), ('lib', 2, 'Bo')"))
        conn.execute(sa.text("INSERT INTO books VALUES ('lib', 1, 'Dune'), ('lib', 2, 'Emma')"))
    engine.dispose()
    yield url
    drop_database(base_settings, name)


def test_plan_apply_record_and_audit_history(
    own_database: str, settings: Settings, tmp_path: Path
) -> None:
    prefix = f"hs{uuid.uuid4().hex[:6]}."
    repo = tmp_path / "myrepo"
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": own_database,
        "FRESHLINE_POSTGRES_ADMIN_URL": own_database,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_TOPIC_PREFIX": prefix,
        "FRESHLINE_CONSUMER_GROUP": f"{prefix}freshline",
        "FRESHLINE_REPO": str(repo),
    }

    def freshline(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [FRESHLINE, *args], capture_output=True, text=True, env=env, timeout=180
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done

    assert freshline("init", str(repo)).returncode == 0
    with (repo / "freshline.toml").open("a") as config:
        config.write(HISTORY)
    planned = freshline("plan")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "history: on, ended versions kept 30d" in planned.stdout
    assert "apply creates freshline.h_public__loans" in planned.stdout
    engine = sa.create_engine(own_database, poolclass=sa.pool.NullPool)
    recorder: subprocess.Popen[Any] | None = None
    log = (tmp_path / "record.log").open("w")
    try:
        applied = freshline("apply", "--alter-tables")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "history: backfilled from snapshot" in applied.stderr + applied.stdout
        recorder = subprocess.Popen(
            [FRESHLINE, "record"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO members VALUES ('lib', 3, 'Cy')"))
            conn.execute(
                sa.text(
                    "INSERT INTO loans (library_id, member_id, book_id, loaned_at, due_at) "
                    "VALUES ('lib', 1, 1, now(), now() + interval '14 days')"
                )
            )
        with engine.begin() as conn:  # twice in one transaction: one version
            conn.execute(sa.text("UPDATE members SET name = 'Ada L' WHERE member_id = 1"))
            conn.execute(sa.text("UPDATE members SET name = 'Ada Lovelace' WHERE member_id = 1"))
            conn.execute(sa.text("DELETE FROM members WHERE member_id = 2"))
        with engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE books"))
            conn.execute(sa.text("INSERT INTO books VALUES ('lib', 3, 'Ulysses')"))
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE loans SET returned_at = now()"))
        audited = freshline("audit", "--history", "--duration", "90s")
        if audited.returncode:  # the recorder's own account, flushed as it stops
            os.killpg(recorder.pid, signal.SIGTERM)
            recorder.wait(timeout=30)
        assert audited.returncode == 0, (
            audited.stdout + audited.stderr + (tmp_path / "record.log").read_text()[-3000:]
        )
        assert "public.members" in audited.stdout
        replanned = freshline("plan")
        assert "h_public__members, from S0" in replanned.stdout, replanned.stdout
    finally:
        if recorder is not None:
            os.killpg(recorder.pid, signal.SIGTERM)
            try:
                recorder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(recorder.pid, signal.SIGKILL)
        log.close()
        freshline("cdc", "remove")
        engine.dispose()
