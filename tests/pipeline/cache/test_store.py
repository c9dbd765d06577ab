from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.recompute import Batch, compute, current_watermark
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.codec import decode_entry, encode_entry
from freshline.pipeline.core.errors import (
    CorruptEntry,
    InvalidId,
    SchemaVersionMismatch,
    UnknownFeatureSet,
)
from freshline.pipeline.core.keys import feature_pattern
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY

TXN_90D = REGISTRY["txn_90d"]


def _batch(
    values: Mapping[str, object], watermark: int, tenant: str = "acme", entity: str = "1"
) -> Batch:
    full = {name: values.get(name, 0) for name in TXN_90D.field_names}
    return Batch(TXN_90D, {(tenant, entity): full}, watermark, 1_700_000_000_000)


def test_conditional_writes_keep_the_newest_watermark(
    redis_client: redis.Redis, version: int
) -> None:
    store = EntryStore(redis_client, version, registry=REGISTRY)
    ref = EntityRef("txn_90d", "acme", "1")
    assert store.write(_batch({"txn_count": 5}, watermark=200)).written == 1
    older = store.write(_batch({"txn_count": 4}, watermark=100))
    assert older.refused == 1 and older.written == 0
    assert store.read([ref])[0].values["txn_count"] == 5  # type: ignore[union-attr]
    same = store.write(_batch({"txn_count": 99}, watermark=200))
    assert same.unchanged == 1
    assert store.read([ref])[0].values["txn_count"] == 5  # type: ignore[union-attr]
    newer = store.write(_batch({"txn_count": 6}, watermark=201))
    assert newer.written == 1
    entry = store.read([ref])[0]
    assert entry is not None
    assert entry.values["txn_count"] == 6 and entry.watermark == 201
    assert entry.schema_version == version


def test_invalidation_leaves_a_tombstone_that_refuses_older_writes(
    redis_client: redis.Redis, version: int
) -> None:
    store = EntryStore(redis_client, version, tombstone_ttl_s=60, registry=REGISTRY)
    ref = EntityRef("txn_90d", "acme", "2")
    store.write(_batch({"txn_count": 1}, 100, entity="2"))
    assert store.invalidate([ref], watermark=150).written == 1
    assert store.read([ref]) == [None]
    assert 0 < redis_client.pttl(store.key(ref)) <= 60_000
    assert store.write(_batch({"txn_count": 2}, 140, entity="2")).refused == 1
    assert store.read([ref]) == [None]
    assert store.write(_batch({"txn_count": 3}, 151, entity="2")).written == 1
    assert store.read([ref])[0].values["txn_count"] == 3  # type: ignore[union-attr]
    # An invalidation older than the entry does not remove it.
    assert store.invalidate([ref], watermark=120).refused == 1
    assert store.read([ref])[0] is not None


def test_every_key_written_has_a_ttl(
    redis_client: redis.Redis,
    engine: Engine,
    tenant_factory: Callable[..., SeedSummary],
    version: int,
) -> None:
    seeded = tenant_factory(users=60, transactions=600)
    store = EntryStore(redis_client, version, registry=REGISTRY)
    refs = [(seeded.tenants[0], str(u)) for u in range(1, 61)]
    for fs in REGISTRY:
        store.write(compute(engine, fs, refs))
    store.invalidate([EntityRef("geo", seeded.tenants[0], "1")], current_watermark(engine))
    keys = list(redis_client.scan_iter(match=feature_pattern(version), count=500))
    assert len(keys) == 3 * 60
    ttls = [redis_client.pttl(k) for k in keys]
    assert min(ttls) > 0, "a feature key without a TTL"
    assert max(ttls) <= max(fs.ttl_s for fs in REGISTRY) * 1000


def test_bad_input_raises_and_writes_nothing(redis_client: redis.Redis, version: int) -> None:
    store = EntryStore(redis_client, version, registry=REGISTRY)
    with pytest.raises(UnknownFeatureSet):
        store.read([EntityRef("nope", "acme", "1")])
    with pytest.raises(InvalidId):
        store.write(_batch({"txn_count": 1}, 10, tenant="ac:me"))
    with pytest.raises(InvalidId):
        store.invalidate([EntityRef("txn_90d", "acme", "*")], 10)
    assert list(redis_client.scan_iter(match=feature_pattern(version))) == []


def test_entries_of_another_schema_version_are_refused(
    redis_client: redis.Redis, version: int
) -> None:
    raw = encode_entry([0] * len(TXN_90D.field_names), version + 1, 1, 5)
    with pytest.raises(SchemaVersionMismatch):
        decode_entry(raw, TXN_90D.field_names, version)
    store = EntryStore(redis_client, version, registry=REGISTRY)
    ref = EntityRef("txn_90d", "acme", "9")
    redis_client.set(store.key(ref), raw, px=10_000)
    with pytest.raises(SchemaVersionMismatch):
        store.read([ref])
    redis_client.set(store.key(ref), b"garbage", px=10_000)
    with pytest.raises(CorruptEntry):
        store.read([ref])


def test_entry_encoding_is_compact(redis_client: redis.Redis, version: int) -> None:
    store = EntryStore(redis_client, version, registry=REGISTRY)
    values = {
        "txn_count": 12,
        "txn_sum": 1234.56,
        "txn_mean": 102.88,
        "txn_max": 640.0,
        "txn_std": 171.2345,
        "distinct_merchants": 11,
        "distinct_devices": 2,
        "last_txn_at": 1_796_000_000_000,
    }
    store.write(_batch(values, 10**20, entity="77"))
    raw = redis_client.get(store.key(EntityRef("txn_90d", "acme", "77")))
    assert isinstance(raw, bytes)
    assert len(raw) < 120
    assert raw.startswith(b"1")
