"""History through the commands a user runs: ``plan`` shows it, ``apply`` creates and
backfills it, ``freshline record`` records plain SQL changes through Debezium, and
``freshline audit --history`` finds no difference. On the README's quick-start tables
and on ``tests/repos/shop`` (declared aggregations, text keys), each in a database
freshline did not create."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from freshline.pipeline.core.settings import Settings
from tests.helpers import FRESHLINE, cli, drop_database, recreate_database
from tests.test_aggregations import TABLES as SHOP_TABLES

pytestmark = [pytest.mark.kafka, pytest.mark.connect]

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = (ROOT / "docs" / "quickstart.sql").read_text()
HISTORY = '\n[history]\nenabled = true\nretention = "30d"\n'
Freshline = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def own_database(base_settings: Settings) -> Iterator[str]:
    name = f"freshline_history_{uuid.uuid4().hex[:8]}"
    yield recreate_database(base_settings, name)
    drop_database(base_settings, name)


def run_history(
    url: str,
    settings: Settings,
    tmp_path: Path,
    make_repo: Callable[[Path, Freshline], None],
    setup: list[str],
    changes: list[list[str]],
    history_table: str,
) -> None:
    """``setup`` (the user's tables and rows), then plan, apply, record; each of
    ``changes`` as one transaction; then the history audit."""
    prefix = f"hs{uuid.uuid4().hex[:6]}."
    repo = tmp_path / "repo"
    env = {
        "FRESHLINE_POSTGRES_URL": url,
        "FRESHLINE_POSTGRES_ADMIN_URL": url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_TOPIC_PREFIX": prefix,
        "FRESHLINE_CONSUMER_GROUP": f"{prefix}freshline",
        "FRESHLINE_REPO": str(repo),
    }

    def freshline(*args: str) -> subprocess.CompletedProcess[str]:
        done = cli(*args, **env)
        assert "Traceback" not in done.stderr, done.stderr
        return done

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        for statement in setup:
            conn.exec_driver_sql(statement)
    make_repo(repo, freshline)
    with (repo / "freshline.toml").open("a") as config:
        config.write(HISTORY)
    planned = freshline("plan")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "history: on, ended versions kept 30d" in planned.stdout
    assert f"apply creates freshline.{history_table}" in planned.stdout
    recorder: subprocess.Popen[Any] | None = None
    log = (tmp_path / "record.log").open("w")
    try:
        applied = freshline("apply", "--alter-tables")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "history: backfilled from snapshot" in applied.stderr + applied.stdout
        recorder = subprocess.Popen(
            [FRESHLINE, "record"],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for transaction in changes:
            with engine.begin() as conn:
                for statement in transaction:
                    conn.exec_driver_sql(statement)
        audited = freshline("audit", "--history", "--duration", "90s")
        if audited.returncode:  # the recorder's own account, flushed as it stops
            os.killpg(recorder.pid, signal.SIGTERM)
            recorder.wait(timeout=30)
        assert audited.returncode == 0, (
            audited.stdout + audited.stderr + (tmp_path / "record.log").read_text()[-3000:]
        )
        replanned = freshline("plan")
        assert f"{history_table}, from S0" in replanned.stdout, replanned.stdout
    finally:
        if recorder is not None and recorder.poll() is None:
            os.killpg(recorder.pid, signal.SIGTERM)
            try:
                recorder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(recorder.pid, signal.SIGKILL)
        log.close()
        freshline("cdc", "remove")
        engine.dispose()


def test_quick_start_tables(own_database: str, settings: Settings, tmp_path: Path) -> None:
    def make_repo(repo: Path, freshline: Freshline) -> None:
        assert freshline("init", str(repo)).returncode == 0

    run_history(
        own_database,
        settings,
        tmp_path,
        make_repo,
        [
            QUICKSTART,
            "INSERT INTO members VALUES ('lib', 1, 'Ada'), ('lib', 2, 'Bo')",
            "INSERT INTO books VALUES ('lib', 1, 'Dune'), ('lib', 2, 'Emma')",
        ],
        [
            [
                "INSERT INTO members VALUES ('lib', 3, 'Cy')",
                "INSERT INTO loans (library_id, member_id, book_id, loaned_at, due_at) "
                "VALUES ('lib', 1, 1, now(), now() + interval '14 days')",
            ],
            [  # twice in one transaction: one version
                "UPDATE members SET name = 'Ada L' WHERE member_id = 1",
                "UPDATE members SET name = 'Ada Lovelace' WHERE member_id = 1",
                "DELETE FROM members WHERE member_id = 2",
            ],
            ["TRUNCATE books", "INSERT INTO books VALUES ('lib', 3, 'Ulysses')"],
            ["UPDATE loans SET returned_at = now()"],
        ],
        "h_public__members",
    )


def test_shop_repository(own_database: str, settings: Settings, tmp_path: Path) -> None:
    def make_repo(repo: Path, freshline: Freshline) -> None:
        shutil.copytree(ROOT / "tests" / "repos" / "shop", repo)

    order = (
        "INSERT INTO shop_orders (shop_id, customer_id, amount, sku, status, placed_at) "
        "VALUES ('s1', '{c}', {a}, 'sku-{a}', 'placed', now() - interval '{d} days')"
    )
    run_history(
        own_database,
        settings,
        tmp_path,
        make_repo,
        [
            *(s for s in SHOP_TABLES.split(";") if s.strip()),
            "INSERT INTO shop_customers VALUES ('s1', 'ann'), ('s1', 'ben')",
            order.format(c="ann", a=10, d=3),
        ],
        [
            [order.format(c="ben", a=120, d=1), order.format(c="ann", a=5, d=40)],
            ["UPDATE shop_orders SET status = 'cancelled' WHERE amount = 120"],
            ["UPDATE shop_orders SET customer_id = 'ben' WHERE amount = 10"],  # moved
            ["DELETE FROM shop_orders WHERE amount = 5"],
            ["INSERT INTO shop_customers VALUES ('s1', 'cy')", order.format(c="cy", a=7, d=0)],
        ],
        "h_public__shop_orders",
    )
