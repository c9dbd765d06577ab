"""The replica read path leases before it reads the primary's watermark.

A fill computed on a replica is stored under the primary's watermark W; a source write
that lands after W was read must revoke its lease, as one landing after any fill's
lease does, so the fill never replaces a write it did not see.

The single topology runs no replica (``tests/cluster/test_pg_replica.py`` uses the
cluster topology's real one). Here the primary stands in for a replica that has
replayed everything: only ``pg_is_in_recovery()`` and the replay position are faked,
and what is tested, the order of the lease and the watermark against Redis, does not
depend on replication.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache import readthrough
from freshline.pipeline.cache.readthrough import ReadThrough, ReplicaBehind
from freshline.pipeline.cache.recompute import Batch, Position, primary_position
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.keys import feature_key, lease_key
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY

TXN_90D = REGISTRY["txn_90d"]


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=3, transactions=12).tenants[0]


@pytest.fixture
def rt(
    redis_client: redis.Redis, engine: Engine, version: int, monkeypatch: pytest.MonkeyPatch
) -> ReadThrough:
    """A read-through of the test's schema version on the stand-in replica, which has
    replayed everything unless the test says otherwise."""
    rt = ReadThrough(
        EntryStore(redis_client, version, registry=REGISTRY),
        engine,
        primary=engine,
        early_refresh=False,
    )
    rt._standby = True  # the stand-in replica (module docstring)
    monkeypatch.setattr(readthrough, "replayed_lsn", lambda _: 1 << 62)  # replayed it all
    return rt


def on_watermark_read(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None]) -> None:
    """Run ``then`` each time the primary's watermark has just been read."""
    real = primary_position

    def read(primary: Engine) -> Position:
        position = real(primary)
        then()
        return position

    monkeypatch.setattr(readthrough, "primary_position", read)


def test_a_miss_holds_its_lease_when_the_primarys_watermark_is_read(
    rt: ReadThrough,
    redis_client: redis.Redis,
    tenant: str,
    version: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref = EntityRef("txn_90d", tenant, "1")
    leased: list[int] = []
    on_watermark_read(
        monkeypatch, lambda: leased.append(int(redis_client.exists(lease_key(version, ref))))
    )
    result = rt.get(ref)
    assert leased == [1]
    assert result.source == "computed"
    assert redis_client.exists(feature_key(version, ref)) == 1  # stored under W
    assert redis_client.exists(lease_key(version, ref)) == 0  # and the lease ended


def test_a_write_after_the_watermark_is_not_replaced_by_the_fill(
    rt: ReadThrough, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A freshness read's recompute on the replica, and a consumer's write landing
    just after the primary's watermark was read. Its watermark does not order against
    W (an LSN-based one, as an earlier consumer wrote): only the lease protects it."""
    ref = EntityRef("txn_90d", tenant, "2")
    store = rt.store
    consumers = {(tenant, "2"): dict.fromkeys(TXN_90D.field_names, 0) | {"txn_count": 999}}

    def consumer_writes() -> None:
        batch = Batch(TXN_90D, consumers, 5, time.time_ns() // 1_000_000)
        assert store.write(batch).written == 1

    on_watermark_read(monkeypatch, consumer_writes)
    [result] = rt.recompute([ref], accept=lambda entry: True)
    assert result.source == "computed"  # answered, but not stored: its lease was revoked
    [entry] = store.read([ref])
    assert entry is not None and entry.values["txn_count"] == 999
    assert rt.counters.refused == 1


def test_a_lagging_replica_releases_its_leases_and_stores_nothing(
    rt: ReadThrough,
    redis_client: redis.Redis,
    tenant: str,
    version: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(readthrough, "replayed_lsn", lambda _: 0)  # behind the primary
    ref = EntityRef("txn_90d", tenant, "3")
    assert rt.get(ref).source == "uncached"
    assert redis_client.exists(lease_key(version, ref)) == 0
    assert redis_client.exists(feature_key(version, ref)) == 0
    with pytest.raises(ReplicaBehind):
        rt.recompute([ref], accept=lambda entry: True)
    assert redis_client.exists(lease_key(version, ref)) == 0
    assert rt.counters.lagging == 2
