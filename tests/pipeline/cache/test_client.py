from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, fresh_version


class CountingRedis(redis.Redis):
    """A real client that counts the commands it sends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: list[str] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands.append(str(args[0]))
        return super().execute_command(*args, **options)


def test_many_entities_in_one_round_trip_with_misses_reported(
    settings: Settings,
    redis_client: redis.Redis,
    engine: Engine,
    tenant_factory: Callable[..., SeedSummary],
) -> None:
    version = fresh_version()
    tenant = tenant_factory(users=20, transactions=400).tenants[0]
    store = EntryStore(redis_client, version, registry=REGISTRY)
    refs = [(tenant, str(u)) for u in range(1, 11)]
    for fs in REGISTRY:
        store.write(compute(engine, fs, refs))
    counting = CountingRedis.from_url(settings.redis_url)
    assert isinstance(counting, CountingRedis)
    client = FeatureClient(counting, version, registry=REGISTRY)
    items = [(fs.name, tenant, u) for fs in REGISTRY for u in range(1, 13)]
    got = client.get_many(items)
    assert counting.commands == ["MGET"]
    assert len(got) == len(items)
    for (fs_name, _, user), features in zip(items, got, strict=True):
        if user > 10:
            assert features is None
            continue
        assert features is not None
        assert features.feature_set == fs_name and features.entity == str(user)
        assert features.schema_version == version
        assert 0 <= features.age_ms < 600_000
        assert set(features.values) == set(REGISTRY[fs_name].field_names)
    one = client.get("txn_90d", tenant, 3)
    assert one is not None and one.values == got[2].values  # type: ignore[union-attr]


def test_the_client_answers_as_the_store_reads(
    redis_client: redis.Redis,
    engine: Engine,
    tenant_factory: Callable[..., SeedSummary],
) -> None:
    """Tombstones, truncate floors and other tenants: the client's rows and the store's
    entries agree, field for field, across feature sets."""
    version = fresh_version()
    first, second = tenant_factory(users=6, transactions=120, tenants=2).tenants
    store = EntryStore(redis_client, version, registry=REGISTRY)
    for tenant in (first, second):
        for fs in REGISTRY:
            store.write(compute(engine, fs, [(tenant, str(u)) for u in range(1, 6)]))
    [entry] = store.read([EntityRef("txn_90d", first, "2")])
    assert entry is not None
    store.invalidate([EntityRef("txn_90d", first, "2")], entry.watermark + 1)  # a tombstone
    [geo] = store.read([EntityRef("geo", second, "1")])
    assert geo is not None
    store.truncate("geo", geo.watermark + 1)  # every geo entry computed before is void
    items = [
        (fs.name, tenant, u) for u in range(1, 7) for fs in REGISTRY for tenant in (first, second)
    ]
    got = FeatureClient(redis_client, version, registry=REGISTRY).get_many(items)
    expected = store.read([EntityRef(fs, t, str(u)) for fs, t, u in items])
    assert [g and (g.values, g.schema_version, g.watermark) for g in got] == [
        e and (e.values, e.schema_version, e.watermark) for e in expected
    ]
    answered = {(fs, t, u) for (fs, t, u), g in zip(items, got, strict=True) if g is not None}
    assert ("txn_90d", first, 2) not in answered and ("txn_90d", first, 3) in answered
    assert not any(fs == "geo" for fs, _, _ in answered)
    assert ("device_risk", second, 5) in answered and ("device_risk", second, 6) not in answered
