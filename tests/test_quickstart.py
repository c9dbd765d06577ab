"""The README's quick start, end to end, on the real stack: a database freshline did not
create, tables it has never seen, and only the commands a new user runs (``init``,
``plan``, ``apply``, ``tenants create``, ``consume``, ``serve``), then a change made
with plain SQL that reaches the served value through Debezium.

The tables are the README's own (``docs/quickstart.sql``) and the definitions are the
ones ``freshline init`` writes, so the README cannot drift from what works.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from pipeline.core.settings import Settings
from tests.helpers import FRESHLINE, drop_database, free_port, recreate_database, wait_until

ROOT = Path(__file__).resolve().parents[1]
TABLES = (ROOT / "docs" / "quickstart.sql").read_text()


@pytest.fixture
def own_database(base_settings: Settings) -> Iterator[str]:
    name = f"freshline_quickstart_{uuid.uuid4().hex[:8]}"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql(TABLES)  # the user's tables, made without freshline
    engine.dispose()
    yield url
    drop_database(base_settings, name)


@pytest.mark.connect
def test_the_readme_quick_start_serves_a_change_made_with_plain_sql(
    own_database: str, settings: Settings, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:6]
    prefix, tenant = f"qs{run}.", f"lib{run}"  # the test Redis outlives a run: keys differ
    port = free_port()
    repo = tmp_path / "myrepo"
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": own_database,
        "FRESHLINE_POSTGRES_ADMIN_URL": own_database,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_TOPIC_PREFIX": prefix,
        "FRESHLINE_CONSUMER_GROUP": f"{prefix}freshline",
        "FRESHLINE_API_PORT": str(port),
        "FRESHLINE_REPO": str(repo),
    }

    def freshline(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [FRESHLINE, *args], capture_output=True, text=True, env=env, timeout=180
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done

    assert freshline("init", str(repo)).returncode == 0
    planned = freshline("plan")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "freshline schema: missing" in planned.stdout
    assert "ALTER TABLE loans REPLICA IDENTITY FULL" in planned.stdout
    # Without the flag, apply refuses to touch the user's tables, and changes nothing.
    refused = freshline("apply")
    assert refused.returncode == 1 and "--alter-tables" in refused.stderr
    engine = sa.create_engine(own_database, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT to_regnamespace('freshline')")).scalar() is None

    children: list[subprocess.Popen[Any]] = []
    client: httpx.Client | None = None
    files = contextlib.ExitStack()
    try:
        applied = freshline("apply", "--alter-tables")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "RUNNING" in applied.stderr
        with engine.connect() as conn:
            assert (
                conn.execute(
                    sa.text("SELECT relreplident FROM pg_class WHERE relname = 'loans'")
                ).scalar()
                == "f"
            )
            # Debezium streams from the slot; a change before it exists would be lost.
            slot = sa.text("SELECT active FROM pg_replication_slots WHERE database = :db")
            assert wait_until(
                lambda: bool(conn.execute(slot, {"db": engine.url.database}).scalar()), 60
            )
        key = freshline("tenants", "create", tenant).stdout.strip().splitlines()[-1]
        logs = tmp_path / "logs"
        logs.mkdir()
        for command in ("consume", "serve"):
            children.append(
                subprocess.Popen(
                    [FRESHLINE, command],
                    env=env,
                    stdout=files.enter_context((logs / f"{command}.log").open("w")),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO members VALUES (:t, 7, 'Ada')"), {"t": tenant})
            conn.execute(
                sa.text(
                    "INSERT INTO loans (library_id, member_id, book_id, loaned_at, due_at) "
                    "VALUES (:t, 7, 1, now(), now() + interval '14 days')"
                ),
                {"t": tenant},
            )
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}
        )

        def read() -> dict[str, Any] | None:
            try:
                answer = client.get("/v1/features/loans_30d/7")
            except httpx.TransportError:
                return None  # not listening yet
            return answer.json() if answer.status_code == 200 else None

        assert wait_until(lambda: read() is not None, 60), (logs / "serve.log").read_text()
        first = read()
        assert first is not None and first["values"]["open_loans"] == 1
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE loans SET returned_at = now() WHERE member_id = 7"))

        def returned() -> bool:
            found = read()
            return found is not None and found["values"]["open_loans"] == 0

        assert wait_until(returned, 60), (logs / "consume.log").read_text()[-3000:]
    finally:
        for child in children:
            os.killpg(child.pid, signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
        if client is not None:
            client.close()
        files.close()
        freshline("cdc", "remove")
        engine.dispose()
