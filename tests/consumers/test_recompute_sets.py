"""A batch's feature sets are computed at the same time, all from the batch's snapshot."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.processor import Processor
from freshline.pipeline.cache.recompute import compute, unpack_watermark
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.types import ChangeEvent, EntityRef
from tests.helpers import REGISTRY, wait_until

# Feature statements of this database waiting for a lock (pg_stat_activity keeps a
# query's first 1 kB: their opening, from feature_statement).
_BLOCKED = sa.text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND wait_event_type = 'Lock' AND query LIKE 'SELECT w.snapshot, w.us, w.invisible, f.*%'"
)


def blocked(conn: sa.Connection) -> int:
    """How many feature queries of this database wait for a lock now (a transaction
    of its own each time: pg_stat_activity holds still within one)."""
    count = int(conn.execute(_BLOCKED).scalar_one())
    conn.rollback()
    return count


def test_each_set_of_a_batch_runs_beside_the_others_on_the_batchs_snapshot(
    engine: Engine,
    redis_client: redis.Redis,
    tenant_factory: Callable[..., SeedSummary],
    version: int,
) -> None:
    """geo reads geoip and device_risk reads devices: with both tables locked, both
    queries wait at once only if neither waits for the other to finish."""
    tenant = tenant_factory(users=20, transactions=400).tenants[0]
    sets = Registry([REGISTRY["geo"], REGISTRY["device_risk"]])
    processor = Processor(engine, redis_client, versions=lambda: [version], registry=sets)
    user_changed = ChangeEvent("users", "u", tenant, {"tenant_id": tenant, "id": 5})
    pool = ThreadPoolExecutor(1)
    try:
        with engine.connect() as locker, engine.connect() as watcher:
            locker.execute(sa.text("LOCK TABLE geoip, devices IN ACCESS EXCLUSIVE MODE"))
            applied = pool.submit(processor.apply, [user_changed])
            both = wait_until(lambda: blocked(watcher) == 2, timeout=30)
            locker.rollback()  # the locks go; the batch goes on
            report = applied.result(timeout=60)
        assert both, "the second feature set's query never ran while the first waited"
    finally:
        pool.shutdown()
    assert set(report.recompute_ms) == {"geo", "device_risk"}
    assert report.writes.written == 2
    store = EntryStore(redis_client, version, registry=REGISTRY)
    entries = {
        name: store.read([EntityRef(name, tenant, "5")])[0] for name in ("geo", "device_risk")
    }
    ranks = set()
    for name, entry in entries.items():
        assert entry is not None, name
        want = compute(engine, REGISTRY[name], [(tenant, "5")]).values[(tenant, "5")]
        assert entry.values == want, name
        ranks.add(unpack_watermark(entry.watermark)[0])
    assert len(ranks) == 1  # one snapshot: the same rank, only the clocks differ
