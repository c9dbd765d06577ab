"""Writes into several schema versions at once (what a consumer does during a deploy)."""

from __future__ import annotations

import time

import redis

from freshline.pipeline.cache.recompute import Batch
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, fresh_version

TXN_90D = REGISTRY["txn_90d"]


def _batch(count: int, watermark: int, entities: tuple[str, ...] = ("1", "2")) -> Batch:
    values = {name: 0 for name in TXN_90D.field_names} | {"txn_count": count}
    return Batch(
        TXN_90D, {("acme", e): dict(values) for e in entities}, watermark, int(time.time() * 1000)
    )


def test_one_write_into_two_versions_keeps_each_versions_newest(
    redis_client: redis.Redis, version: int
) -> None:
    old, new = version, fresh_version()
    store = EntryStore(redis_client, old, registry=REGISTRY)
    ref = EntityRef("txn_90d", "acme", "1")
    # The new version already holds a newer entry for entity 1 (a warm got there first).
    assert store.write(_batch(9, 300, ("1",)), schema_version=new).written == 1

    result = store.write(_batch(5, 200), versions=(old, new))

    assert (result.written, result.refused) == (3, 1)
    old_entry, new_entry = (
        store.read([ref])[0],
        EntryStore(redis_client, new, registry=REGISTRY).read([ref])[0],
    )
    assert old_entry is not None and old_entry.values["txn_count"] == 5
    assert new_entry is not None and new_entry.values["txn_count"] == 9  # kept: newer
    other = EntryStore(redis_client, new, registry=REGISTRY).read(
        [EntityRef("txn_90d", "acme", "2")]
    )[0]
    assert other is not None and other.values["txn_count"] == 5
    for v in (old, new):
        for entity in ("1", "2"):
            assert redis_client.pttl(store.key(EntityRef("txn_90d", "acme", entity), v)) > 0


def test_one_invalidation_into_two_versions_fences_both(
    redis_client: redis.Redis, version: int
) -> None:
    old, new = version, fresh_version()
    store = EntryStore(redis_client, old, registry=REGISTRY)
    ref = EntityRef("txn_90d", "acme", "1")
    store.write(_batch(5, 200, ("1",)), versions=(old, new))

    assert store.invalidate([ref], 250, versions=(old, new)).written == 2

    for v in (old, new):
        assert EntryStore(redis_client, v, registry=REGISTRY).read([ref])[0] is None
        late = EntryStore(redis_client, v, registry=REGISTRY).write(_batch(6, 240, ("1",)))
        assert late.refused == 1  # the tombstone's watermark fences the older write
