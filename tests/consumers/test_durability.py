"""Visible is not durable: a batch waits for Postgres to flush past its snapshot.

A private Postgres whose WAL writer wakes only every 10 s (``wal_writer_delay``, its
maximum), so a commit made with ``synchronous_commit = off`` stays visible and not
flushed for real; ``pg_ctl stop -m immediate`` is the crash that would then lose it. The
WAL writer may still flush early (it is woken when a WAL page fills), so each test
first checks that the lag it needs is there, and takes another commit if not.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from fraud.seed import seed
from freshline.consumers.processor import Processor, SourceChanged
from freshline.consumers.source import encode
from freshline.pipeline.cache.recompute import (
    FORCE_RETRY_S,
    NotYetDurable,
    compute,
    flushed_lsn,
    force_flush,
    source_identity,
    take_snapshot,
    wait_durable,
)
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.versions import Pointer
from freshline.pipeline.core.keys import source_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import ChangeEvent, EntityRef
from freshline.pipeline.deploy.purge import purge
from tests.helpers import ANCHOR, REGISTRY, free_port, migrate
from tests.pipeline.cache.test_visibility import initdb, postgres, private_cluster

ATTEMPTS = 5
INSERT_LSN = sa.text("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")


@dataclass
class Cluster:
    engine: Engine
    url: str
    crash: Callable[[], None]


@pytest.fixture(scope="module")
def lagging() -> Iterator[Cluster]:
    """A private Postgres with the fraud schema, seeded, whose WAL writer sleeps 10 s."""
    root, data, log, port = private_cluster("freshline-durable-", "pg_ctl")
    options = (
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c autovacuum=off "
        "-c wal_writer_delay=10000 -c checkpoint_timeout=3600"
    )
    start = ["pg_ctl", "-D", str(data), "-l", str(log), "-o", options, "-w", "start"]
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)

    def crash() -> None:
        postgres("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop", log=log)
        postgres(*start, log=log)

    try:
        initdb(data)
        postgres(*start, log=log)
        with engine.begin() as conn:
            for role in ("freshline_api", "freshline_consumer"):
                conn.execute(sa.text(f"CREATE ROLE {role}"))
        migrate(url)
        seed(engine, users=10, transactions=200, tenant_prefix="durable-", anchor=ANCHOR)
        yield Cluster(engine, url, crash)
    finally:
        engine.dispose()
        if (data / "postmaster.pid").exists():
            postgres("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root)


def commit_async(conn: Connection, statement: str, params: dict[str, object]) -> int:
    """Run ``statement`` in a transaction committed with ``synchronous_commit = off``;
    the WAL insert position after its commit."""
    conn.execute(sa.text("SET synchronous_commit = off"))
    conn.execute(sa.text(statement), params)
    conn.commit()
    return int(conn.execute(INSERT_LSN).scalar_one())


def commit_sync(engine: Engine) -> None:
    """A synchronous commit of a transaction that wrote: Postgres flushes the WAL up
    to its commit record, so past every earlier commit."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TEMP TABLE flush_me (x int) ON COMMIT DROP"))


def test_the_wait_lasts_until_the_flush_reaches_the_snapshot(lagging: Cluster) -> None:
    with lagging.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS async_rows (v int)"))
    timed_out = waited = 0
    for _ in range(ATTEMPTS):
        with lagging.engine.connect() as writer, lagging.engine.connect() as reader:
            commit_async(writer, "INSERT INTO async_rows VALUES (1)", {})
            snap = take_snapshot(reader)
            if flushed_lsn(reader) >= snap.lsn:
                continue  # the WAL writer was woken meanwhile: take another commit
            # Nothing flushes within the bound: not durable, transient.
            try:
                wait_durable(reader, snap.lsn, 0.05)
            except NotYetDurable as exc:
                assert exc.lsn == snap.lsn and exc.flushed < snap.lsn
                timed_out += 1
            # A synchronous commit elsewhere flushes: the wait returns at once after it.
            polls: list[int] = []

            def poll(_: float) -> None:
                polls.append(flushed_lsn(reader))
                commit_sync(lagging.engine)

            if flushed_lsn(reader) >= snap.lsn:
                continue
            flushed = wait_durable(reader, snap.lsn, 60, poll=poll)
            assert polls and polls[0] < snap.lsn <= flushed
            waited += 1
    assert timed_out and waited


def test_a_wal_tail_no_commit_asked_to_flush_is_flushed_by_force(lagging: Cluster) -> None:
    # A read that prunes, a transaction still running: WAL the WAL writer leaves in a
    # partial page until someone commits. Here: a transaction that wrote and is open.
    with lagging.engine.connect() as held, lagging.engine.connect() as reader:
        held.execute(sa.text("CREATE TABLE IF NOT EXISTS held_rows (v int)"))
        held.commit()
        for _ in range(ATTEMPTS):
            held.execute(sa.text("INSERT INTO held_rows VALUES (1)"))
            snap = take_snapshot(reader)
            if flushed_lsn(reader) < snap.lsn:
                break
            held.rollback()
        else:
            pytest.fail("the WAL writer flushed every attempt at once")
        with pytest.raises(NotYetDurable):
            wait_durable(reader, snap.lsn, 0.05)  # nothing else will flush it
        forced: list[int] = []

        def force() -> None:
            forced.append(flushed_lsn(reader))
            force_flush(lagging.engine)

        assert wait_durable(reader, snap.lsn, 60, force=force) >= snap.lsn
        assert len(forced) == 1 and forced[0] < snap.lsn
        held.rollback()


def test_a_batch_never_writes_a_commit_a_crash_can_undo(
    lagging: Cluster, redis_client: redis.Redis, version: int
) -> None:
    with lagging.engine.connect() as conn:
        tenant = conn.execute(sa.text("SELECT min(id) FROM freshline.tenants")).scalar_one()
    processor = Processor(
        lagging.engine, redis_client, versions=lambda: [version], registry=REGISTRY
    )
    ref = EntityRef("txn_90d", tenant, "7")
    store = EntryStore(redis_client, version, registry=REGISTRY)
    event = ChangeEvent("transactions", "u", tenant, {"tenant_id": tenant, "user_id": 7})
    before = compute(lagging.engine, REGISTRY["txn_90d"], [(tenant, "7")]).values
    for _ in range(ATTEMPTS):
        with lagging.engine.connect() as writer:
            committed_at = commit_async(
                writer,
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, device_id, "
                "ip) VALUES (:t, 7, 999.00, 'm-async', 'd1', '11.0.16.5')",
                {"t": tenant},
            )
            if flushed_lsn(writer) < committed_at:
                break
    else:
        pytest.fail("the WAL writer flushed every asynchronous commit at once")
    # Visible, not flushed: the batch sees it, and writes only once it is durable.
    report = processor.apply([event])
    assert report.writes.written == 2  # txn_90d, geo
    assert report.flushed_lsn >= max(report.lsn, committed_at) > 0
    [entry] = store.read([ref])
    assert entry is not None and entry.values != before[(tenant, "7")]
    lagging.crash()
    # The crash cannot take back what the entry holds.
    after = compute(lagging.engine, REGISTRY["txn_90d"], [(tenant, "7")]).values
    assert entry.values == after[(tenant, "7")]


def test_a_new_postgres_under_the_consumer_stops_its_writes(
    engine: Engine, lagging: Cluster, redis_client: redis.Redis, version: int
) -> None:
    with engine.connect() as one, lagging.engine.connect() as other:
        first, second = source_identity(one), source_identity(other)
    assert first.system_identifier != second.system_identifier
    assert first.timeline >= 1 and second.timeline >= 1
    processor = Processor(engine, redis_client, versions=lambda: [version], registry=REGISTRY)
    processor.apply([])
    assert processor.source == first
    processor.engine = lagging.engine  # the consumer's Postgres URL now names another cluster
    with lagging.engine.connect() as conn:
        tenant = conn.execute(sa.text("SELECT min(id) FROM freshline.tenants")).scalar_one()
    event = ChangeEvent("transactions", "u", tenant, {"tenant_id": tenant, "user_id": 3})
    with pytest.raises(SourceChanged) as changed:
        processor.apply([event])
    assert (changed.value.before, changed.value.now) == (first, second)
    assert EntryStore(redis_client, version, registry=REGISTRY).read(
        [EntityRef("txn_90d", tenant, "3")]
    ) == [None]


def test_a_consumer_started_on_another_history_finds_the_recorded_one(
    engine: Engine, lagging: Cluster, redis_client: redis.Redis, settings: Settings, version: int
) -> None:
    """Each version records the history its entries came from: a consumer with none in
    memory (restarted during the failover, say) compares its own with that."""
    with engine.connect() as one, lagging.engine.connect() as other:
        first, second = source_identity(one), source_identity(other)
        tenant = other.execute(sa.text("SELECT min(id) FROM freshline.tenants")).scalar_one()
    key = source_key(version)
    before = Processor(engine, redis_client, versions=lambda: [version], registry=REGISTRY)
    before.apply([])  # a fresh version: nothing recorded, so its history is
    assert redis_client.get(key) == encode(first).encode()
    assert 0 < redis_client.pttl(key) <= before.record_ttl_ms
    Processor(engine, redis_client, versions=lambda: [version], registry=REGISTRY).apply(
        []
    )  # the same: passes
    # The consumer's Postgres URL now names another cluster, and the consumer restarts.
    restarted = Processor(
        lagging.engine, redis_client, versions=lambda: [version], registry=REGISTRY
    )
    event = ChangeEvent("transactions", "u", tenant, {"tenant_id": tenant, "user_id": 4})
    with pytest.raises(SourceChanged) as changed:
        restarted.apply([event])
    assert (changed.value.before, changed.value.now) == (first, second)
    assert restarted.source is None
    assert EntryStore(redis_client, version, registry=REGISTRY).read(
        [EntityRef("txn_90d", tenant, "4")]
    ) == [None]
    assert redis_client.get(key) == encode(first).encode()
    # The operator purges the version: the held batch goes through, on the new history.
    assert purge(redis_client, settings, version, pointer=Pointer.scoped(uuid.uuid4().hex)).done
    assert restarted.apply([event]).writes.written == 2  # txn_90d, geo
    assert redis_client.get(key) == encode(second).encode()


def test_a_promoted_standby_under_the_consumer_stops_its_writes(
    lagging: Cluster, redis_client: redis.Redis, version: int
) -> None:
    """A standby of a private primary, promoted for real: the same system, timeline 2."""
    root = Path(tempfile.mkdtemp(prefix="freshline-promote-"))
    user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    if user:
        os.chown(root, user.pw_uid, user.pw_gid)
    data, log, port = root / "data", root / "postgres.log", free_port()
    primary_port = lagging.engine.url.port
    standby = sa.create_engine(
        f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", poolclass=sa.pool.NullPool
    )
    try:
        postgres(
            "pg_basebackup", "-D", str(data), "-R", "-X", "stream", "-c", "fast",
            "-h", "127.0.0.1", "-p", str(primary_port), "-U", "postgres",
        )  # fmt: skip
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
        postgres("pg_ctl", "-D", str(data), "-l", str(log), "-o", options, "-w", "start", log=log)
        processor = Processor(
            lagging.engine, redis_client, versions=lambda: [version], registry=REGISTRY
        )
        processor.apply([])
        before = processor.source
        assert before is not None
        postgres("pg_ctl", "-D", str(data), "-w", "promote", log=log)
        processor.engine = standby  # the consumer's Postgres name moves to the promoted one
        with pytest.raises(SourceChanged) as changed:
            processor.apply([])
        now = changed.value.now
        assert now.system_identifier == before.system_identifier
        assert now.timeline == before.timeline + 1
    finally:
        standby.dispose()
        if (data / "postmaster.pid").exists():
            postgres("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root)


def test_a_role_that_may_not_force_a_flush_says_so_once_and_tries_again_later(
    lagging: Cluster, redis_client: redis.Redis, version: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="freshline.consumer")
    with lagging.engine.begin() as conn:
        conn.execute(sa.text("CREATE ROLE no_temp LOGIN"))
        conn.execute(sa.text("REVOKE TEMPORARY ON DATABASE postgres FROM PUBLIC"))
    limited = sa.create_engine(
        lagging.engine.url.set(username="no_temp"), poolclass=sa.pool.NullPool
    )
    granted = False
    now = [1000.0]
    try:
        processor = Processor(limited, redis_client, versions=lambda: [version], registry=REGISTRY)
        processor.flusher.clock = lambda: now[0]
        processor._force()  # refused: the batch then waits for a commit to flush
        now[0] += FORCE_RETRY_S + 1
        processor._force()  # refused again: said once
        assert not processor.can_force
        warned = [r.getMessage() for r in caplog.records if "TEMPORARY" in r.getMessage()]
        assert len(warned) == 1, warned
        with lagging.engine.begin() as conn:
            conn.execute(sa.text("GRANT TEMPORARY ON DATABASE postgres TO PUBLIC"))
        granted = True
        now[0] += FORCE_RETRY_S / 2
        processor._force()  # too soon to try again
        assert not processor.can_force
        now[0] += FORCE_RETRY_S
        processor._force()  # the grant holds now: no restart needed
        assert processor.can_force
        assert any("may now" in r.getMessage() for r in caplog.records)
    finally:
        limited.dispose()
        with lagging.engine.begin() as conn:
            if not granted:
                conn.execute(sa.text("GRANT TEMPORARY ON DATABASE postgres TO PUBLIC"))
            conn.execute(sa.text("DROP ROLE no_temp"))
