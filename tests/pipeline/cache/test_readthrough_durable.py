"""Visible is not durable, on the read path: a read-through fill stores only what a
Postgres crash cannot undo.

The private Postgres of ``tests/consumers/test_durability.py``, whose WAL writer wakes
only every 10 s: a commit made with ``synchronous_commit = off`` stays visible and not
flushed for real, and ``pg_ctl stop -m immediate`` is the crash that then loses it. The
WAL writer may still flush early (it is woken when a WAL page fills), so each test
takes another commit when the lag it needs is not there.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.recompute import FORCE_RETRY_S, compute, flushed_lsn
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.consumers.test_durability import ATTEMPTS, Cluster, commit_async, lagging
from tests.helpers import REGISTRY, api_app, fresh_version, nested_checkouts, running

__all__ = ["lagging"]  # the module's private Postgres, a fixture of this module too

USER = "7"
INSERT = (
    "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, device_id, ip) "
    "VALUES (:t, 7, 999.00, 'm-async', 'd1', '11.0.16.5')"
)


def tenant_of(cluster: Cluster) -> str:
    with cluster.engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT min(id) FROM freshline.tenants")).scalar_one())


def commit_not_flushed(cluster: Cluster, tenant: str) -> int:
    """An asynchronous commit of a transaction of ``USER`` that Postgres has not flushed
    yet; the WAL insert position after it."""
    for _ in range(ATTEMPTS):
        with cluster.engine.connect() as writer:
            committed_at = commit_async(writer, INSERT, {"t": tenant})
            if flushed_lsn(writer) < committed_at:
                return committed_at
    pytest.fail("the WAL writer flushed every asynchronous commit at once")


def txn_90d(engine: Engine, tenant: str) -> dict[str, object]:
    return dict(compute(engine, REGISTRY["txn_90d"], [(tenant, USER)]).values[(tenant, USER)])


@pytest.fixture
def no_temp(lagging: Cluster) -> Iterator[Engine]:
    """A login of ``freshline_api`` (the read-through's role) that may not create
    temporary tables, so cannot make Postgres flush."""
    with lagging.engine.begin() as conn:
        conn.execute(sa.text("CREATE ROLE reader_no_temp LOGIN IN ROLE freshline_api"))
        conn.execute(sa.text("REVOKE TEMPORARY ON DATABASE postgres FROM PUBLIC"))
    limited = sa.create_engine(
        lagging.engine.url.set(username="reader_no_temp"), poolclass=sa.pool.NullPool
    )
    try:
        yield limited
    finally:
        limited.dispose()
        with lagging.engine.begin() as conn:
            conn.execute(sa.text("GRANT TEMPORARY ON DATABASE postgres TO PUBLIC"))
            conn.execute(sa.text("DROP ROLE reader_no_temp"))


@pytest.fixture
def api_pool(lagging: Cluster) -> Iterator[Engine]:
    """A login of ``freshline_api`` with a pool of ``POOL`` connections and no overflow,
    which gives up waiting for one after ``POOL_TIMEOUT_S``."""
    with lagging.engine.begin() as conn:
        conn.execute(sa.text("CREATE ROLE reader_pooled LOGIN IN ROLE freshline_api"))
    pooled = sa.create_engine(
        lagging.engine.url.set(username="reader_pooled"),
        pool_size=POOL,
        max_overflow=0,
        pool_timeout=POOL_TIMEOUT_S,
    )
    try:
        yield pooled
    finally:
        pooled.dispose()
        with lagging.engine.begin() as conn:
            conn.execute(sa.text("DROP ROLE reader_pooled"))


POOL, POOL_TIMEOUT_S = 2, 10


def test_more_fills_than_the_pool_holds_each_flush_on_their_own_connection(
    lagging: Cluster, api_pool: Engine, redis_client: redis.Redis
) -> None:
    """Every pooled connection held by a fill whose snapshot is not flushed yet: each
    makes Postgres flush on the connection it holds, never on a second one from the
    same pool (which no fill would give back: each would wait out the pool's timeout)."""
    tenant = tenant_of(lagging)
    refs = [EntityRef("txn_90d", tenant, str(user)) for user in range(1, 2 * POOL + 1)]
    rt = ReadThrough(
        EntryStore(redis_client, fresh_version(), registry=REGISTRY), api_pool, early_refresh=False
    )
    pool_met(rt)
    commit_not_flushed(lagging, tenant)
    with nested_checkouts(api_pool) as nested, ThreadPoolExecutor(len(refs)) as threads:
        results = list(threads.map(rt.get, refs))
    assert nested == []
    assert [r.source for r in results] == ["computed"] * len(refs)
    assert rt.counters.stored == len(refs) and rt.counters.undurable == 0


def pool_met(rt: ReadThrough) -> None:
    """Make the first ``POOL`` fills of ``rt`` meet, each holding its connection, before
    any of them flushes."""
    arrivals = itertools.count()
    all_in = threading.Barrier(POOL, timeout=30)

    def hold(_: list[EntityRef]) -> None:
        if next(arrivals) < POOL:
            all_in.wait()

    rt.hooks.after_compute = hold


def test_the_api_answers_more_misses_than_its_pool_holds_while_wal_is_unflushed(
    lagging: Cluster, api_pool: Engine, redis_client: redis.Redis, settings: Settings
) -> None:
    """Every pooled connection of the API held by a miss whose snapshot is not flushed
    (a batch job's asynchronous commit): every miss is answered, none 500."""
    tenant = tenant_of(lagging)
    url = api_pool.url.render_as_string(hide_password=False)
    app = api_app(settings.model_copy(update={"postgres_url": url}), api_pool, redis_client)
    key = create_api_key(lagging.engine, tenant)
    with running(app, key) as api:
        assert api.get("/v1/features/geo/1").status_code == 200  # the key, cached
        pool_met(app.state.services.reader.readthrough)
        commit_not_flushed(lagging, tenant)
        sent: list[Future[httpx.Response]] = [
            api.portal.start_task_soon(
                functools.partial(
                    api.client.get,
                    f"/v1/features/txn_90d/{user}",
                    headers={"Authorization": f"Bearer {key}"},
                )
            )
            for user in range(1, 2 * POOL + 1)
        ]
        answers = [f.result(timeout=60) for f in sent]
    assert [a.status_code for a in answers] == [200] * len(answers), answers[0].text
    assert {a.json()["source"] for a in answers} == {"computed"}


def test_a_fill_never_stores_a_commit_a_crash_can_undo(
    lagging: Cluster, redis_client: redis.Redis, version: int
) -> None:
    tenant = tenant_of(lagging)
    store = EntryStore(redis_client, version, registry=REGISTRY)
    ref = EntityRef("txn_90d", tenant, USER)
    before = txn_90d(lagging.engine, tenant)
    committed_at = commit_not_flushed(lagging, tenant)
    # Visible, not flushed: the fill sees it, and stores it only once it is durable
    # (the role may force a flush, so it does).
    rt = ReadThrough(store, lagging.engine, early_refresh=False)
    result = rt.get(ref)
    assert result.source == "computed" and result.values != before
    [entry] = store.read([ref])
    assert entry is not None and entry.values == result.values
    with lagging.engine.connect() as conn:
        assert flushed_lsn(conn) >= committed_at
    lagging.crash()
    # The crash cannot take back what the entry holds.
    assert entry.values == txn_90d(lagging.engine, tenant)


def test_a_fill_that_cannot_be_made_durable_is_answered_not_stored(
    lagging: Cluster, no_temp: Engine, redis_client: redis.Redis
) -> None:
    tenant = tenant_of(lagging)
    ref = EntityRef("txn_90d", tenant, USER)
    for _ in range(ATTEMPTS):
        committed_at = commit_not_flushed(lagging, tenant)
        store = EntryStore(redis_client, fresh_version(), registry=REGISTRY)
        rt = ReadThrough(store, no_temp, early_refresh=False)
        result = rt.get(ref)
        with lagging.engine.connect() as conn:
            if flushed_lsn(conn) < committed_at:
                break  # nothing flushed it while the read waited
        # The WAL writer was woken meanwhile (so the entry may be stored): again.
    else:
        pytest.fail("the WAL writer flushed every asynchronous commit during the read")
    # The reader gets its answer, with the commit it saw; the cache stays absent, and
    # the lease is gone, so another reader computes at once rather than wait.
    assert result.source == "uncached"
    assert result.values == txn_90d(no_temp, tenant)
    assert store.read([ref]) == [None]
    assert store.read_leased([ref])[1] == [False]
    assert rt.counters.undurable == 1 and rt.counters.stored == 0
    # Once the role may force a flush (tried again after FORCE_RETRY_S), a read stores.
    with lagging.engine.begin() as conn:
        conn.execute(sa.text("GRANT TEMPORARY ON DATABASE postgres TO PUBLIC"))
    later = rt.flusher.clock() + FORCE_RETRY_S
    rt.flusher.clock = lambda: later
    again = rt.get(ref)
    assert again.source == "computed" and again.values == result.values
    assert store.read([ref])[0] is not None and rt.counters.stored == 1
