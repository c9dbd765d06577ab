from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from sqlalchemy.engine import Engine

from pipeline.cache.client import FeatureClient
from pipeline.cache.recompute import compute
from pipeline.cache.store import FeatureStore
from pipeline.core.features import REGISTRY
from pipeline.core.settings import Settings
from pipeline.dev.seed import SeedSummary
from tests.conftest import fresh_version


class CountingRedis(redis.Redis):
    """A real client that counts the commands it sends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: list[str] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands.append(str(args[0]))
        return super().execute_command(*args, **options)


def test_many_entities_in_one_round_trip_with_misses_reported(
    settings: Settings, redis_client: redis.Redis, engine: Engine,
    tenant_factory: Callable[..., SeedSummary],
) -> None:
    version = fresh_version()
    tenant = tenant_factory(users=20, transactions=400).tenants[0]
    store = FeatureStore(redis_client, version)
    refs = [(tenant, str(u)) for u in range(1, 11)]
    for fs in REGISTRY:
        store.write(compute(engine, fs, refs))
    counting = CountingRedis.from_url(settings.redis_url)
    client = FeatureClient(counting, version)
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
