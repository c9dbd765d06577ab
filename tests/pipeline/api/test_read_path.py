"""The fast read path: async reads on the event loop, keys, entity ids, hot-read sampling."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import httpx
import pytest
import redis
import redis.asyncio
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.api.fastpath import async_client
from freshline.pipeline.api.reader import (
    Answer,
    FeatureReader,
    Lookup,
    parse_entities,
    parse_entity,
)
from freshline.pipeline.cache.hot import HotReads
from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.cluster import is_cluster
from freshline.pipeline.core.codec import (
    decode_entry,
    decode_rows,
    encode_entry,
    encode_tombstone,
    watermark_hex,
)
from freshline.pipeline.core.errors import CorruptEntry, InvalidId, SchemaVersionMismatch
from freshline.pipeline.core.keys import feature_key, feature_keys, grid_keys, hot_key, validate_ids
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, api_app, fresh_version, running, wait_until
from tests.pipeline.cache.test_subscriptions import Forwarder, address


@pytest.fixture(scope="module")
def tenant(tenant_factory_module: Callable[..., SeedSummary]) -> str:
    return tenant_factory_module(users=12, transactions=200).tenants[0]


# -- keys and ids --------------------------------------------------------------------


def test_feature_keys_are_feature_key_of_each_ref() -> None:
    refs = [
        EntityRef(fs, t, e)
        for fs in ("txn_90d", "geo")
        for t in ("acme", "b-2")
        for e in ("1", "x.y", "Z_9")
    ]
    assert feature_keys(7, refs) == [feature_key(7, r) for r in refs]


@pytest.mark.parametrize(
    "ref",
    [
        EntityRef("txn_90d", "ac:me", "1"),
        EntityRef("txn_90d", "acme", "1}"),
        EntityRef("txn_90d", "acme", "*"),
    ],
)
def test_feature_keys_refuse_what_feature_key_refuses(ref: EntityRef) -> None:
    with pytest.raises(InvalidId):
        feature_keys(7, [EntityRef("txn_90d", "acme", "2"), ref])


@pytest.mark.parametrize("good", ["0", "7", "42", "9" * 18])
def test_parse_entity_takes_canonical_user_ids(good: str) -> None:
    assert parse_entity(good) == good


@pytest.mark.parametrize(
    "bad", ["007", "1" + "0" * 18, "\uff11\uff12", "\u00b2", "-1", "", "1.0", "a"]
)
def test_parse_entity_refuses_the_rest(bad: str) -> None:
    with pytest.raises(InvalidId):
        parse_entity(bad)


def test_grid_keys_are_the_lookups_feature_keys_in_order() -> None:
    lookup = Lookup("acme", ["txn_90d", "geo"], ["1", "x.y", "Z_9"])
    assert grid_keys(7, "acme", lookup.feature_sets, lookup.entities) == [
        feature_key(7, ref) for ref in lookup
    ]
    # One feature set and one entity (a GET), tenants with and without punctuation.
    for tenant in ("acme", "t3cc84b7-acme", "a.b_c"):
        for one in (Lookup(tenant, ["geo"], ["x.y"]), Lookup(tenant, ("txn_90d",), ("7",))):
            assert grid_keys(7, tenant, one.feature_sets, one.entities) == [feature_key(7, one[0])]
    assert [lookup[i] for i in range(len(lookup))] == list(lookup)
    assert lookup[-1] == EntityRef("geo", "acme", "Z_9") and lookup[1:3] == list(lookup)[1:3]
    with pytest.raises(IndexError):
        lookup[len(lookup)]
    with pytest.raises(IndexError):
        lookup[-len(lookup) - 1]
    assert lookup[-len(lookup)] == lookup[0] and lookup[::-2] == list(lookup)[::-2]


@pytest.mark.parametrize("bad", ["ac:me", "", "a" * 65, "*", "-a", "a\n", "\u00e9", "a}"])
def test_grid_keys_refuse_what_feature_key_refuses(bad: str) -> None:
    with pytest.raises(InvalidId, match="tenant"):
        grid_keys(7, bad, ["txn_90d"], ["1"])
    for entities in (["1", bad], [bad]):
        with pytest.raises(InvalidId, match="entity") as refused:
            grid_keys(7, "acme", ["txn_90d"], entities)
        with pytest.raises(InvalidId) as by_feature_key:
            feature_key(7, EntityRef("txn_90d", "acme", bad))
        assert str(refused.value) == str(by_feature_key.value)


# -- entries, decoded many at a time ----------------------------------------------------

FIELDS = REGISTRY["txn_90d"].field_names


def test_decode_rows_reads_entries_tombstones_and_floors() -> None:
    values = list(range(len(FIELDS)))
    raws = [
        encode_entry(values, 3, 1000, 0x20),
        None,
        encode_tombstone(0x30),
        encode_entry(values, 3, 2000, 0x10).decode(),
    ]
    rows = decode_rows(raws, FIELDS, 3)
    assert rows[1:3] == [None, None]
    assert rows[0] == (dict(zip(FIELDS, values, strict=True)), 1000, watermark_hex(0x20))
    assert rows[3] is not None and rows[3][1] == 2000  # a str reply decodes as bytes do
    # Below the floor is absent, at it is served.
    floored = decode_rows(raws, FIELDS, 3, watermark_hex(0x20).decode())
    assert [r is not None for r in floored] == [True, False, False, False]
    entry = decode_entry(raws[0], FIELDS, 3)  # type: ignore[arg-type]
    assert entry is not None and entry.watermark == 0x20 and entry.computed_at_ms == 1000


@pytest.mark.parametrize(
    "raw",
    [
        b"1" + b"0" * 30,  # a header and nothing else
        b"1" + b"0" * 30 + b"[3,1000,[1,2]]",  # too few values
        b"1" + b"0" * 30 + b'[3,"soon",[0,0,0,0,0,0,0,0]]',  # computed_at not an integer
        b"1" + b"0" * 30 + b'[3,1000,{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8}]',
        b"1" + b"0" * 30 + b"[3,1000,[0,0,0",  # cut short
        b"X" + b"0" * 30 + b"[3,1000,[0,0,0,0,0,0,0,0]]",  # not an entry
        b"",
    ],
)
def test_decode_rows_refuses_corrupt_entries(raw: bytes) -> None:
    with pytest.raises(CorruptEntry):
        decode_rows([encode_entry([0] * len(FIELDS), 3, 1, 1), raw], FIELDS, 3)


def test_a_watermark_that_is_not_hex_is_corrupt_where_it_is_read() -> None:
    raw = b"1" + b"z" * 30 + b"[3,1000,[0,0,0,0,0,0,0,0]]"
    with pytest.raises(CorruptEntry):
        decode_entry(raw, FIELDS, 3)


def test_decode_rows_refuses_another_schema_version() -> None:
    with pytest.raises(SchemaVersionMismatch):
        decode_rows([encode_entry([0] * len(FIELDS), 4, 1, 1)], FIELDS, 3)


# -- hot-read sampling ----------------------------------------------------------------


def test_sampling_counts_one_read_in_sample_weighted_by_sample(
    redis_client: redis.Redis, version: int
) -> None:
    draws = random.Random(15)
    hot = HotReads(redis_client, sample=16, flush_s=3600, rng=draws.random)
    for batch in range(160):  # 16,000 reads in batches of 100, one entity each
        hot.record(version, Lookup("acme", ["geo"], [str(batch * 100 + i) for i in range(100)]))
    hot.close()
    counted = cast(
        list[tuple[bytes, float]],
        redis_client.zrange(hot_key(version, "geo", "acme"), 0, -1, withscores=True),
    )
    assert {score for _, score in counted} == {16.0}  # each sampled read counts for 16
    # About one read in 16 (binomial: 1,000 expected, standard deviation 31).
    assert 800 <= len(counted) <= 1200


def test_background_sampling_makes_no_redis_call_until_it_flushes(
    redis_client: redis.Redis, version: int
) -> None:
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
        refs = [EntityRef("geo", "acme", f"r{round_}-{e}") for e in range(1, 21) for _ in range(e)]
        hot.record(version, refs)
        assert redis_client.zcard(key) == 5
    kept = cast(list[tuple[bytes, float]], redis_client.zrevrange(key, 0, -1, withscores=True))
    assert all(score >= 16 for _, score in kept)  # the most read survive
    assert {m for m, _ in kept} >= {b"r3-20", b"r3-19"}


def test_an_invalid_tenant_in_a_sample_does_not_stop_the_flush(
    redis_client: redis.Redis, version: int
) -> None:
    hot = HotReads(redis_client, sample=1, flush_s=3600)
    hot.record(version, [EntityRef("geo", "bad:tenant", "1"), EntityRef("geo", "ok", "1")])
    hot.close()
    assert redis_client.zscore(hot_key(version, "geo", "ok"), "1") == 1.0


# -- the asyncio read ------------------------------------------------------------------


@pytest.fixture
def filled(engine: Engine, redis_client: redis.Redis, tenant: str) -> Iterator[EntryStore]:
    store = EntryStore(redis_client, fresh_version(), registry=REGISTRY)
    store.write(compute(engine, REGISTRY["txn_90d"], [(tenant, str(u)) for u in range(1, 6)]))
    yield store


def _cached(
    reader: FeatureReader, settings: Settings, lookup: Lookup, mode: str
) -> list[Answer] | None:
    async def go() -> list[Answer] | None:
        reader.aredis = async_client(settings)
        try:
            return await reader.cached(lookup, mode)  # type: ignore[arg-type]
        finally:
            await reader.aredis.aclose()
            reader.aredis = None

    return asyncio.run(go())


def test_is_cluster_answers_per_client_class(settings: Settings, redis_client: redis.Redis) -> None:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    class OurCluster(RedisCluster):
        pass

    # Instances made without connecting: is_cluster looks at the class only.
    clusters = [object.__new__(cls) for cls in (RedisCluster, AsyncRedisCluster, OurCluster)]
    plain = [redis_client, async_client(settings), redis.Redis(), object()]
    for _ in range(2):  # the second time from what the first one learnt
        assert [is_cluster(c) for c in clusters] == [True, True, True]
        assert [is_cluster(c) for c in plain] == [False, False, False, False]


def test_the_async_read_answers_as_the_store_does(
    filled: EntryStore, engine: Engine, settings: Settings, tenant: str
) -> None:
    reader = FeatureReader(ReadThrough(filled, engine, early_refresh=False))
    lookup = Lookup(tenant, ["txn_90d"], ["1", "2", "99"])
    assert _cached(reader, settings, lookup, "read-through") is None  # 99 is a miss
    answers = _cached(reader, settings, lookup, "cache-only")
    assert answers is not None
    assert [a["source"] for a in answers] == ["hit", "hit", "miss"]
    assert [a["values"] for a in answers[:2]] == [e and e.values for e in filled.read(lookup[:2])]
    assert {a["schema_version"] for a in answers} == {filled.schema_version}

    def ageless(answers: list[Answer]) -> list[dict[str, object]]:
        return [{k: v for k, v in a.items() if k != "age_ms"} for a in answers]

    # The thread pool's path agrees.
    assert ageless(answers) == ageless(reader.read(lookup, "cache-only"))


def test_the_async_read_treats_entries_below_the_floor_as_absent(
    filled: EntryStore, engine: Engine, settings: Settings, tenant: str
) -> None:
    reader = FeatureReader(ReadThrough(filled, engine, early_refresh=False))
    lookup = Lookup(tenant, ["txn_90d"], ["1", "2"])
    [entry, _] = filled.read(lookup)
    assert entry is not None
    filled.truncate("txn_90d", entry.watermark + 1)
    answers = _cached(reader, settings, lookup, "cache-only")
    assert answers is not None and [a["source"] for a in answers] == ["miss", "miss"]
    assert _cached(reader, settings, lookup, "read-through") is None


def test_the_api_serves_a_truncated_entry_as_absent(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    version = fresh_version()
    app = api_app(settings, engine, redis_client, schema_version=version)
    with running(app, create_api_key(engine, tenant)) as api:
        assert api.get("/v1/features/txn_90d/3").json()["source"] == "computed"
        assert api.get("/v1/features/txn_90d/3").json()["source"] == "hit"
        [entry] = EntryStore(redis_client, version, registry=REGISTRY).read(
            [EntityRef("txn_90d", tenant, "3")]
        )
        assert entry is not None
        EntryStore(redis_client, version, registry=REGISTRY).truncate(
            "txn_90d", entry.watermark + 1
        )
        assert api.get("/v1/features/txn_90d/3?mode=cache-only").status_code == 404
        batch = api.post(
            "/v1/features/batch?mode=cache-only",
            json={"feature_sets": ["txn_90d"], "entities": ["3"]},
        )
        assert batch.json()["items"][0]["source"] == "miss"
        # Read-through computes it again from Postgres.
        again = api.get("/v1/features/txn_90d/3").json()
        assert again["source"] == "computed" and again["age_ms"] >= 0
        assert app.state.services.reader.aredis is not None  # the loop's own client
    assert app.state.services.reader.aredis is None


def test_the_reader_without_an_async_client_defers_to_the_thread_pool(
    filled: EntryStore, engine: Engine, tenant: str
) -> None:
    reader = FeatureReader(ReadThrough(filled, engine, early_refresh=False))
    lookup = Lookup(tenant, ["txn_90d"], ["1"])
    assert asyncio.run(reader.cached(lookup, "cache-only")) is None
    assert reader.read(lookup, "cache-only")[0]["source"] == "hit"


def test_a_redis_outage_on_the_async_path_is_a_503_and_it_recovers(
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
    settings: Settings,
    engine: Engine,
    tenant: str,
) -> None:
    url, stop, start = private_redis
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    app = create_app(
        settings.model_copy(update={"redis_url": url, "local_cache_size": 0}),
        engine=engine,
        redis_client=client,
        follow_deploys=False,
        registry=REGISTRY,
    )
    with running(app, create_api_key(engine, tenant)) as api:
        assert api.get("/v1/features/geo/4?mode=cache-only").status_code == 404  # a miss
        stop()
        down = api.get("/v1/features/geo/4?mode=cache-only")
        assert down.status_code == 503, down.text
        assert down.json()["error"]["code"]
        batch = api.post(
            "/v1/features/batch?mode=cache-only", json={"feature_sets": ["geo"], "entities": ["4"]}
        )
        assert batch.status_code == 503
        start()
        assert wait_until(
            lambda: api.get("/v1/features/geo/4?mode=cache-only").status_code == 404, timeout=10
        )
    client.close()


@pytest.mark.parametrize("ids", [["1", "2", "10", "0", "9" * 18], ["7"]])
def test_parse_entities_takes_canonical_ids_together(ids: list[str]) -> None:
    assert parse_entities(ids) == ids == [parse_entity(i) for i in ids]
    assert validate_ids("entity", ids) == ids


@pytest.mark.parametrize(
    "bad", ["007", "1,2", "", "1" + "0" * 18, "\u00b2", "-1", "1.0", "a", "00", "10 ", "\uff11"]
)
def test_parse_entities_refuses_what_parse_entity_refuses(bad: str) -> None:
    for ids in ([bad], ["1", bad], [bad, "12"], ["3", bad, "40"]):
        with pytest.raises(InvalidId):
            parse_entities(ids)


def test_parse_entities_takes_json_numbers_as_integers() -> None:
    assert parse_entities([7, 7.0, "8"]) == ["7", "7", "8"]
    with pytest.raises(InvalidId):
        parse_entities([7.5])


@pytest.mark.parametrize("bad", ["a:b", "", "x" * 65, "a b", "a}", "\u00e9", 5.0, None])
def test_validate_ids_refuses_what_validate_id_refuses(bad: object) -> None:
    for ids in ([bad], ["a1", bad], [bad, "b2"]):
        with pytest.raises(InvalidId):
            validate_ids("entity", ids)
    assert validate_ids("entity", ["a.b", "c-d", "E_9", 12]) == ["a.b", "c-d", "E_9", "12"]


def test_a_redis_that_stops_answering_is_a_503_and_the_next_read_is_clean(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    """The asyncio reads carry no socket timeout of their own: the reader's timer
    (``api_redis_timeout_s``) bounds them, and the connection it cancels is dropped,
    so no late reply answers the next request."""
    host, port, db = address(redis_client)
    EntryStore(redis_client, settings.schema_version, registry=REGISTRY).write(
        compute(engine, REGISTRY["geo"], [(tenant, "4"), (tenant, "5")])
    )
    with Forwarder(host, port) as hole:
        through_hole = {
            "redis_url": f"redis://127.0.0.1:{hole.port}/{db}",
            "api_redis_timeout_s": 0.5,
            "local_cache_size": 0,
        }
        app = create_app(
            settings.model_copy(update=through_hole),
            engine=engine,
            follow_deploys=False,
            registry=REGISTRY,
        )
        assert app.state.services.reader.timeout_s == 0.5
        with running(app, create_api_key(engine, tenant)) as api, ThreadPoolExecutor(1) as pool:

            def get(entity: str) -> httpx.Response:
                # A deadline on the test, not a timing claim: a hung read fails it.
                return pool.submit(api.get, f"/v1/features/geo/{entity}?mode=cache-only").result(
                    timeout=60
                )

            assert get("4").json()["entity"] == "4"
            hole.cut()  # every connection goes silent; nothing is closed
            try:
                down = get("4")
            finally:
                hole.heal()  # a read still waiting (a broken timer) is then answered
            assert down.status_code == 503, down.text
            assert wait_until(lambda: get("5").status_code == 200, timeout=10)
            assert get("5").json()["entity"] == "5"  # its own answer, not a late one
            assert get("4").json()["entity"] == "4"
