"""The fast read path: async reads on the event loop, keys, entity ids, hot-read sampling."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import cast

import pytest
import redis
import redis.asyncio
from sqlalchemy.engine import Engine

from pipeline.api import create_app
from pipeline.api.app import async_twin
from pipeline.api.auth import create_api_key
from pipeline.api.reader import Answer, FeatureReader, parse_entity
from pipeline.cache.hot import HotReads
from pipeline.cache.readthrough import ReadThrough
from pipeline.cache.recompute import compute
from pipeline.cache.store import FeatureStore
from pipeline.core.errors import InvalidId
from pipeline.core.features import REGISTRY
from pipeline.core.keys import feature_key, feature_keys, hot_key
from pipeline.core.settings import Settings
from pipeline.core.types import EntityRef
from pipeline.dev.seed import SeedSummary
from tests.conftest import fresh_version, wait_until
from tests.pipeline.test_api import running


@pytest.fixture(scope="module")
def tenant(tenant_factory_module: Callable[..., SeedSummary]) -> str:
    return tenant_factory_module(users=12, transactions=200).tenants[0]


# -- keys and ids --------------------------------------------------------------------

def test_feature_keys_are_feature_key_of_each_ref() -> None:
    refs = [EntityRef(fs, t, e) for fs in ("txn_90d", "geo") for t in ("acme", "b-2")
            for e in ("1", "x.y", "Z_9")]
    assert feature_keys(7, refs) == [feature_key(7, r) for r in refs]


@pytest.mark.parametrize("ref", [EntityRef("txn_90d", "ac:me", "1"),
                                 EntityRef("txn_90d", "acme", "1}"),
                                 EntityRef("txn_90d", "acme", "*")])
def test_feature_keys_refuse_what_feature_key_refuses(ref: EntityRef) -> None:
    with pytest.raises(InvalidId):
        feature_keys(7, [EntityRef("txn_90d", "acme", "2"), ref])


@pytest.mark.parametrize("good", ["0", "7", "42", "9" * 18])
def test_parse_entity_takes_canonical_user_ids(good: str) -> None:
    assert parse_entity(good) == good


@pytest.mark.parametrize("bad", ["007", "1" + "0" * 18, "\uff11\uff12", "\u00b2", "-1", "",
                                 "1.0", "a"])
def test_parse_entity_refuses_the_rest(bad: str) -> None:
    with pytest.raises(InvalidId):
        parse_entity(bad)


# -- hot-read sampling ----------------------------------------------------------------

def test_background_sampling_makes_no_redis_call_until_it_flushes(
        redis_client: redis.Redis, version: int) -> None:
    hot = HotReads(redis_client, sample=1, flush_s=3600)
    refs = [EntityRef("txn_90d", "acme", str(e)) for e in (1, 2, 2)]
    hot.record(version, refs)
    key = hot_key(version, "txn_90d", "acme")
    assert redis_client.exists(key) == 0  # counted in memory only
    hot.close()
    assert redis_client.zcard(key) == 2
    assert (redis_client.zscore(key, "1"), redis_client.zscore(key, "2")) == (1.0, 2.0)
    assert 0 < redis_client.ttl(key) <= hot.ttl_s


def test_hot_sets_never_exceed_their_cap(redis_client: redis.Redis, version: int) -> None:
    hot = HotReads(redis_client, sample=1, max_entities=5)
    key = hot_key(version, "geo", "acme")
    for round_ in range(4):
        # Entity e is read e times; each round brings 20 ids never seen before.
        refs = [EntityRef("geo", "acme", f"r{round_}-{e}")
                for e in range(1, 21) for _ in range(e)]
        hot.record(version, refs)
        assert redis_client.zcard(key) == 5
    kept = cast(list[tuple[bytes, float]], redis_client.zrevrange(key, 0, -1, withscores=True))
    assert all(score >= 16 for _, score in kept)  # the most read survive
    assert {m for m, _ in kept} >= {b"r3-20", b"r3-19"}


def test_an_invalid_tenant_in_a_sample_does_not_stop_the_flush(
        redis_client: redis.Redis, version: int) -> None:
    hot = HotReads(redis_client, sample=1, flush_s=3600)
    hot.record(version, [EntityRef("geo", "bad:tenant", "1"), EntityRef("geo", "ok", "1")])
    hot.close()
    assert redis_client.zscore(hot_key(version, "geo", "ok"), "1") == 1.0


# -- the asyncio read ------------------------------------------------------------------

@pytest.fixture
def filled(engine: Engine, redis_client: redis.Redis, tenant: str) -> Iterator[FeatureStore]:
    store = FeatureStore(redis_client, fresh_version())
    store.write(compute(engine, REGISTRY["txn_90d"], [(tenant, str(u)) for u in range(1, 6)]))
    yield store


def _cached(reader: FeatureReader, client: redis.Redis, refs: list[EntityRef],
            mode: str) -> list[Answer] | None:
    async def go() -> list[Answer] | None:
        reader.aredis = async_twin(client)
        try:
            return await reader.cached(refs, mode)  # type: ignore[arg-type]
        finally:
            await reader.aredis.aclose()
            reader.aredis = None

    return asyncio.run(go())


def test_the_async_read_answers_as_the_store_does(filled: FeatureStore, engine: Engine,
                                                 redis_client: redis.Redis,
                                                 tenant: str) -> None:
    reader = FeatureReader(ReadThrough(filled, engine, early_refresh=False))
    refs = [EntityRef("txn_90d", tenant, str(u)) for u in (1, 2, 99)]
    assert _cached(reader, redis_client, refs, "read-through") is None  # 99 is a miss
    answers = _cached(reader, redis_client, refs, "cache-only")
    assert answers is not None
    assert [a.source for a in answers] == ["hit", "hit", "miss"]
    assert [a.values for a in answers[:2]] == [e and e.values for e in filled.read(refs[:2])]
    assert {a.schema_version for a in answers} == {filled.schema_version}


def test_the_async_read_treats_entries_below_the_floor_as_absent(
        filled: FeatureStore, engine: Engine, redis_client: redis.Redis, tenant: str) -> None:
    reader = FeatureReader(ReadThrough(filled, engine, early_refresh=False))
    refs = [EntityRef("txn_90d", tenant, str(u)) for u in (1, 2)]
    [entry, _] = filled.read(refs)
    assert entry is not None
    filled.truncate("txn_90d", entry.watermark + 1)
    answers = _cached(reader, redis_client, refs, "cache-only")
    assert answers is not None and [a.source for a in answers] == ["miss", "miss"]
    assert _cached(reader, redis_client, refs, "read-through") is None


def test_the_api_serves_a_truncated_entry_as_absent(settings: Settings, engine: Engine,
                                                     redis_client: redis.Redis,
                                                     tenant: str) -> None:
    version = fresh_version()
    app = create_app(settings.model_copy(update={"schema_version": version,
                                                 "local_cache_size": 0}),
                     engine=engine, redis_client=redis_client, follow_deploys=False)
    with running(app, create_api_key(engine, tenant)) as api:
        assert api.get("/v1/features/txn_90d/3").json()["source"] == "computed"
        assert api.get("/v1/features/txn_90d/3").json()["source"] == "hit"
        [entry] = FeatureStore(redis_client, version).read([EntityRef("txn_90d", tenant, "3")])
        assert entry is not None
        FeatureStore(redis_client, version).truncate("txn_90d", entry.watermark + 1)
        assert api.get("/v1/features/txn_90d/3?mode=cache-only").status_code == 404
        batch = api.post("/v1/features/batch?mode=cache-only",
                          json={"feature_sets": ["txn_90d"], "entities": ["3"]})
        assert batch.json()["items"][0]["source"] == "miss"
        # Read-through computes it again from Postgres.
        again = api.get("/v1/features/txn_90d/3").json()
        assert again["source"] == "computed" and again["age_ms"] >= 0
        assert app.state.services.reader.aredis is not None  # the loop's own client
    assert app.state.services.reader.aredis is None


def test_the_reader_without_an_async_client_defers_to_the_thread_pool(
        filled: FeatureStore, engine: Engine, tenant: str) -> None:
    reader = FeatureReader(ReadThrough(filled, engine, early_refresh=False))
    refs = [EntityRef("txn_90d", tenant, "1")]
    assert asyncio.run(reader.cached(refs, "cache-only")) is None
    assert reader.read(refs, "cache-only")[0].source == "hit"


def test_a_redis_outage_on_the_async_path_is_a_503_and_it_recovers(
        private_redis: tuple[str, Callable[[], None], Callable[[], None]],
        settings: Settings, engine: Engine, tenant: str) -> None:
    url, stop, start = private_redis
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    app = create_app(settings.model_copy(update={"redis_url": url, "local_cache_size": 0}),
                     engine=engine, redis_client=client, follow_deploys=False)
    with running(app, create_api_key(engine, tenant)) as api:
        assert api.get("/v1/features/geo/4?mode=cache-only").status_code == 404  # a miss
        stop()
        down = api.get("/v1/features/geo/4?mode=cache-only")
        assert down.status_code == 503, down.text
        assert down.json()["error"]["code"]
        batch = api.post("/v1/features/batch?mode=cache-only",
                         json={"feature_sets": ["geo"], "entities": ["4"]})
        assert batch.status_code == 503
        start()
        assert wait_until(lambda: api.get("/v1/features/geo/4?mode=cache-only")
                          .status_code == 404, timeout=10)
    client.close()
