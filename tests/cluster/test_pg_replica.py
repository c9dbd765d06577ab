"""Read-through on the Postgres streaming replica, replay paused: the lagging result
is served but never stored, so no stale set reaches Redis; once the replica has
replayed past the primary's position, its results are stored with the primary's
watermark (``-m cluster``)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa

from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.recompute import compute, current_watermark
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.types import EntityRef
from tests.cluster.conftest import add_tenant
from tests.helpers import REGISTRY, wait_until

pytestmark = pytest.mark.cluster
TXN = REGISTRY["txn_90d"]


def count(engine: sa.Engine, tenant: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM transactions WHERE tenant_id = :t"), {"t": tenant}
            ).scalar()
            or 0
        )


def add_transaction(engine: sa.Engine, tenant: str, amount: float) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, amount, "
                "merchant_id) VALUES (:t, 1, :a, 'm1')"
            ),
            {"t": tenant, "a": amount},
        )


def one_transaction_replicated(
    primary: sa.Engine,
    replica: sa.Engine,
    client: redis.Redis,
) -> tuple[str, EntryStore, EntityRef]:
    """A new tenant whose user 1 has one transaction, replayed on the replica; a store
    under a version no other test uses, and the user's ``txn_90d`` ref."""
    tenant = f"rep-{uuid.uuid4().hex[:10]}"
    with primary.begin() as conn:
        add_tenant(conn, tenant, 1)
    add_transaction(primary, tenant, 10)
    assert wait_until(lambda: count(replica, tenant) == 1, 30)
    store = EntryStore(client, 900_000 + uuid.uuid4().int % 90_000, registry=REGISTRY)
    return tenant, store, EntityRef("txn_90d", tenant, "1")


@contextlib.contextmanager
def replay_paused(replica: sa.Engine) -> Iterator[None]:
    """WAL replay paused on the replica for the block, resumed after it however it ends."""
    with replica.connect() as conn:
        conn.execute(sa.text("SELECT pg_wal_replay_pause()"))
        conn.commit()
    try:
        yield
    finally:
        with replica.connect() as conn:
            conn.execute(sa.text("SELECT pg_wal_replay_resume()"))
            conn.commit()


def test_a_lagging_replica_serves_but_never_stores(
    engines: tuple[sa.Engine, sa.Engine], cluster_redis: redis.Redis
) -> None:
    primary, replica = engines
    tenant, store, ref = one_transaction_replicated(primary, replica, cluster_redis)
    on_replica = ReadThrough(store, replica, early_refresh=False)
    assert on_replica.standby and not ReadThrough(store, primary).standby

    with replay_paused(replica):
        add_transaction(primary, tenant, 90)  # the replica does not see this one
        # The consumer's part: the change invalidates the entity (a tombstone).
        store.invalidate([ref], compute(primary, TXN, [(tenant, "1")]).watermark)
        result = on_replica.get(ref)
        assert result.values["txn_count"] == 1  # lagging, as replica reads are
        assert result.source == "uncached"
        assert store.read([ref]) == [None]  # ... and not stored: no stale set
        fresh = ReadThrough(store, primary, early_refresh=False).get(ref)
        assert fresh.values["txn_count"] == 2 and fresh.source == "computed"
        assert on_replica.get(ref).values["txn_count"] == 2  # now a hit
    assert wait_until(lambda: count(replica, tenant) == 2, 30)


def test_a_replica_that_has_caught_up_stores_under_the_primarys_watermark(
    engines: tuple[sa.Engine, sa.Engine], cluster_redis: redis.Redis
) -> None:
    primary, replica = engines
    tenant, store, ref = one_transaction_replicated(primary, replica, cluster_redis)
    gated = ReadThrough(store, replica, early_refresh=False, primary=primary)

    with replay_paused(replica):
        add_transaction(primary, tenant, 90)  # past the replica's replay position
        lagging = gated.get(ref)
        assert lagging.values["txn_count"] == 1 and lagging.source == "uncached"
        assert gated.counters.lagging == 1
        assert store.read([ref]) == [None]  # the gate kept the lagging result out
    assert wait_until(lambda: count(replica, tenant) == 2, 30)

    before = current_watermark(primary)
    # The replica may still be replaying WAL written after that count became visible
    # (other tests' writes): ask until the gate opens.
    assert wait_until(lambda: gated.get(ref).source == "computed", 30)
    (entry,) = store.read([ref])
    assert entry is not None and entry.values["txn_count"] == 2
    # Stored under a primary watermark read at the miss: newer than one read before,
    # older than one read after, so any later computation outranks it.
    assert before < entry.watermark < current_watermark(primary)
