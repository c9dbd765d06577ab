"""Read-through: hits, batched misses, no stale set, one computation per stampede."""

from __future__ import annotations

import multiprocessing as mp
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.readthrough import Hooks, ReadThrough, Result
from freshline.pipeline.cache.recompute import Batch, compute, current_watermark
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.keys import lease_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, counting_readthrough, nested_checkouts, paused_reader

TXN_90D = REGISTRY["txn_90d"]


@pytest.fixture(autouse=True)
def one_connection_per_thread(engine: Engine) -> Iterator[None]:
    """No read-through here checks out a second connection while it holds one (issue
    48: enough such threads deadlock the pool)."""
    with nested_checkouts(engine) as nested:
        yield
    assert nested == [], "a thread took a second connection from the pool"


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=30, transactions=900).tenants[0]


def truth(engine: Engine, ref: EntityRef) -> dict[str, object]:
    batch = compute(engine, TXN_90D, [(ref.tenant, ref.entity)])
    return batch.values[(ref.tenant, ref.entity)]


def bump_amounts(engine: Engine, ref: EntityRef) -> None:
    """A change that commits: every recent transaction of the user costs 1000 more."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE transactions SET amount = amount + 1000, updated_at = now() "
                "WHERE tenant_id = :t AND user_id = :u"
            ),
            {"t": ref.tenant, "u": int(ref.entity)},
        )


@pytest.fixture
def store(redis_client: redis.Redis, version: int) -> EntryStore:
    return EntryStore(redis_client, version, registry=REGISTRY)


@pytest.fixture
def rt(store: EntryStore, engine: Engine) -> ReadThrough:
    """A read-through on the test's store, without early refreshes."""
    return ReadThrough(store, engine, early_refresh=False)


def test_hit_miss_and_batch(
    redis_client: redis.Redis, engine: Engine, tenant: str, version: int
) -> None:
    rt, computed = counting_readthrough(
        EntryStore(redis_client, version, registry=REGISTRY), engine
    )
    refs = [EntityRef(fs, tenant, str(u)) for fs in ("txn_90d", "geo") for u in (1, 2, 3)]
    first = rt.get_many([*refs, refs[0]])
    assert [r.source for r in first] == ["computed"] * 7
    assert first[0] == first[-1]
    assert sorted(len(group) for group in computed) == [3, 3]  # one query per feature set
    second = rt.get_many(refs)
    assert [r.source for r in second] == ["hit"] * 6
    assert [r.values for r in second] == [r.values for r in first[:6]]
    assert all(r.schema_version == version for r in second)
    assert len(computed) == 2
    single = rt.get(refs[4])
    assert single.values == second[4].values and single.hit
    assert second[0].values == truth(engine, refs[0])


def test_a_miss_takes_one_connection_per_set_and_no_transaction(
    redis_client: redis.Redis, settings: Settings, tenant: str, version: int
) -> None:
    """A recompute's statements (the feature query, the WAL flush checks and any forced
    flush, the entity lookup) share one pooled connection in autocommit: one pool ping,
    and no BEGIN or ROLLBACK round trip, where three connections in turn took nine round
    trips more."""
    own = make_engine(settings)
    rt = ReadThrough(EntryStore(redis_client, version, registry=REGISTRY), own, early_refresh=False)
    assert not rt.standby  # asked once, before the reads counted below
    checkouts: list[object] = []
    statements: list[tuple[str, bool]] = []

    def checkout(*_: object) -> None:
        checkouts.append(object())

    def before(conn: sa.Connection, _c: object, statement: str, *_: object) -> None:
        driver = conn.connection.driver_connection
        statements.append((statement, bool(driver is not None and driver.autocommit)))

    sa.event.listen(own.pool, "checkout", checkout)
    sa.event.listen(own, "before_cursor_execute", before)
    try:
        refs = [EntityRef(fs, tenant, str(u)) for fs in ("txn_90d", "geo") for u in (1, 2)]
        assert [r.source for r in rt.get_many(refs)] == ["computed"] * 4
    finally:
        own.dispose()
    # A flush forced after a wait (nobody else committed) runs on the fill's connection.
    assert len(checkouts) == 2  # one per feature set
    reads = [(text, auto) for text, auto in statements if text.startswith("SELECT")]
    assert sum(text.startswith("SELECT e.") for text, _ in reads) == 2  # the lookups
    assert all(auto for _, auto in reads), [text[:60] for text, auto in reads if not auto]


def test_no_stale_set_when_an_invalidation_lands_mid_read(
    engine: Engine, tenant: str, store: EntryStore, rt: ReadThrough
) -> None:
    ref = EntityRef("txn_90d", tenant, "1")
    old = truth(engine, ref)
    # The reader has queried the database and is paused before its write.
    reader = paused_reader(rt, ref)
    # A change commits and its invalidation is applied.
    bump_amounts(engine, ref)
    store.invalidate([ref], current_watermark(engine))
    # The reader writes its older value: its caller gets it, the cache does not.
    answer = reader.finish()
    assert answer.source == "computed" and answer.values == old
    assert (rt.counters.stored, rt.counters.refused) == (0, 1)
    assert store.read([ref]) == [None]
    rt.hooks.after_compute = None
    fresh = rt.get(ref)
    assert fresh.source == "computed"
    assert fresh.values == truth(engine, ref) != old


def test_no_stale_set_when_the_newer_entry_is_evicted_mid_read(
    redis_client: redis.Redis, engine: Engine, tenant: str, store: EntryStore, rt: ReadThrough
) -> None:
    """Meta's "Cache made consistent" case: the newer entry is gone when the stale
    reader comes to write, so only the lease stands between it and the cache."""
    ref = EntityRef("txn_90d", tenant, "2")
    old = truth(engine, ref)
    reader = paused_reader(rt, ref)
    bump_amounts(engine, ref)
    store.write(compute(engine, TXN_90D, [(ref.tenant, ref.entity)]))  # the consumer
    redis_client.delete(store.key(ref))  # evicted
    answer = reader.finish()
    assert answer.source == "computed" and answer.values == old != truth(engine, ref)
    assert (rt.counters.stored, rt.counters.refused) == (0, 1)
    assert store.read([ref]) == [None]


def test_the_watermark_alone_refuses_a_stale_fill(
    redis_client: redis.Redis,
    engine: Engine,
    tenant: str,
    version: int,
    store: EntryStore,
    rt: ReadThrough,
) -> None:
    """Defence in depth: even if the lease survived, the tombstone's watermark wins."""
    ref = EntityRef("txn_90d", tenant, "3")
    lease = lease_key(version, ref)
    old = truth(engine, ref)
    reader = paused_reader(rt, ref)
    token = redis_client.get(lease)
    assert token is not None
    bump_amounts(engine, ref)
    store.invalidate([ref], current_watermark(engine))
    redis_client.set(lease, token, px=10_000)  # pretend the revocation was lost
    answer = reader.finish()
    assert answer.source == "computed" and answer.values == old
    assert (rt.counters.stored, rt.counters.refused) == (0, 1)
    assert store.read([ref]) == [None]


def read_at_once(rt: ReadThrough, ref: EntityRef, readers: int = 16) -> list[Result]:
    """``readers`` threads read ``ref`` through ``rt`` at once; their results."""
    start = threading.Barrier(readers)
    results: list[Result] = []

    def read() -> None:
        start.wait(timeout=30)
        results.append(rt.get(ref))

    threads = [threading.Thread(target=read) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_sixteen_threads_on_one_missing_key_compute_once(
    redis_client: redis.Redis, engine: Engine, tenant: str, version: int
) -> None:
    calls: list[int] = []
    lock = threading.Lock()

    def count(group: list[EntityRef]) -> None:
        with lock:
            calls.append(len(group))

    rt = ReadThrough(
        EntryStore(redis_client, version, registry=REGISTRY),
        engine,
        hooks=Hooks(before_compute=count),
        early_refresh=False,
    )
    results = read_at_once(rt, EntityRef("txn_90d", tenant, "4"))
    assert calls == [1]
    assert len(results) == 16
    assert len({str(r.values) for r in results}) == 1


def _process_reader(
    settings: Settings, version: int, ref: EntityRef, counter: str, start: mp.synchronize.Barrier
) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    engine = make_engine(settings, pool_size=1)

    def count(group: list[EntityRef]) -> None:
        client.incr(counter)

    rt = ReadThrough(
        EntryStore(client, version, registry=REGISTRY),
        engine,
        early_refresh=False,
        hooks=Hooks(before_compute=count),
    )
    start.wait(timeout=60)
    rt.get(ref)
    engine.dispose()


def test_sixteen_processes_on_one_missing_key_compute_once(
    redis_client: redis.Redis, settings: Settings, tenant: str, version: int
) -> None:
    # Sixteen processes, each its own Redis and Postgres connections; forked from a
    # server that imported this module once (a spawned interpreter each imported
    # freshline again, most of the test's time), never from this threaded process.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    start = ctx.Barrier(16)
    counter = f"test:computations:{uuid.uuid4().hex}"
    ref = EntityRef("txn_90d", tenant, "5")
    procs = [
        ctx.Process(target=_process_reader, args=(settings, version, ref, counter, start))
        for _ in range(16)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 16
    assert int(redis_client.get(counter) or 0) == 1
    redis_client.delete(counter)


def test_an_entry_near_expiry_is_refreshed_early_by_one_reader(
    redis_client: redis.Redis, engine: Engine, tenant: str, version: int
) -> None:
    """XFetch: past 90% of its TTL an entry is recomputed by the reader that sees it."""
    store = EntryStore(redis_client, version, registry=REGISTRY)
    ref = EntityRef("txn_90d", tenant, "6")
    batch = compute(engine, TXN_90D, [(ref.tenant, ref.entity)])
    old = batch.computed_at_ms - int(TXN_90D.ttl_s * 1000 * 0.95)
    store.write(Batch(TXN_90D, batch.values, batch.watermark, old))
    lazy = ReadThrough(store, engine, early_refresh=False)
    assert lazy.get(ref).source == "hit"
    eager = ReadThrough(store, engine, early_refresh=True)
    refreshed = eager.get(ref)
    assert refreshed.source == "computed"
    assert eager.counters.early_refresh == 1
    entry = store.read([ref])[0]
    assert entry is not None and entry.computed_at_ms > old
    assert eager.get(ref).source == "hit"  # fresh again: no second refresh
