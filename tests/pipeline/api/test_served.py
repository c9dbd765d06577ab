"""The served log: what the read API answered, from the read path through Kafka into
Parquet, on the real stack (the Kafka login is the tests' admin; topics are prefixed)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.kafka import admin_client
from freshline.consumers.served import ServedSink
from freshline.consumers.topics import allow_consumer, ensure
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.codec import encode_entry
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.keys import feature_key
from freshline.pipeline.core.repository import active
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import SERVED, qualified
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.inference.models import LogisticModel, ModelRegistry
from freshline.pipeline.observe import served
from freshline.pipeline.observe.served import LOGGED, Served, ServedLog
from freshline.pipeline.observe.served_files import ParquetLog
from freshline.pipeline.observe.served_training import from_logs
from tests.helpers import (
    REGISTRY,
    Api,
    cli,
    fresh_version,
    kafka_login,
    running,
    wait_until,
)

LOG = {"Freshline-Log": "1"}
ENTITY_FEATURES = ("txn_90d.txn_count", "txn_90d.txn_sum", "geo.distinct_countries_30d")


@pytest.fixture
def logged(settings: Settings) -> Settings:
    """Settings with a topic prefix of the test's own and its served topic made."""
    prefixed = settings.model_copy(
        update={"topic_prefix": f"t{uuid.uuid4().hex[:8]}.", "schema_version": fresh_version()}
    )
    ensure(admin_client(prefixed), 1, topics=[qualified(prefixed, SERVED)])
    return prefixed


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=6, transactions=80).tenants[0]


@pytest.fixture
def api_factory(
    logged: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> Iterator[Callable[..., Api]]:
    """``api_factory(local=False)``: the API with the served log, tier or not."""
    stack: list[Any] = []

    def make(local: bool = False) -> Api:
        tier = LocalTier(redis_client, max_entries=1000, registry=REGISTRY) if local else None
        if tier is not None:
            tier.start()
            stack.append(tier.close)
        app = create_app(
            logged.model_copy(update={"local_cache_size": 0}),
            engine=engine,
            redis_client=redis_client,
            follow_deploys=False,
            local=tier,
            registry=REGISTRY,
        )
        ctx = running(app, create_api_key(engine, tenant))
        api = ctx.__enter__()
        stack.append(lambda: ctx.__exit__(None, None, None))
        return api

    yield make
    for close in reversed(stack):
        close()


def sink_rows(settings: Settings, directory: Path, n: int) -> list[dict[str, Any]]:
    """Run the sink until ``n`` rows are written; the rows of the log, in request order."""
    sink = ServedSink(settings, REGISTRY, directory, poll_s=0.2)
    try:
        sink.run(max_rows=n, timeout=60)
    finally:
        sink.close()
    assert sink.written == n
    table = ParquetLog(directory).read().sort_by([("requested_at", "ascending")])
    return list(table.to_pylist())


def truth(engine: Engine, tenant: str, fs: str, entity: str) -> dict[str, Any]:
    return dict(compute(engine, REGISTRY[fs], [(tenant, entity)]).values[(tenant, entity)])


def test_single_reads_round_trip_from_read_through_redis_and_tier(
    api_factory: Callable[..., Api], logged: Settings, engine: Engine, tenant: str, tmp_path: Path
) -> None:
    api = api_factory(local=True)
    url = "/v1/features/txn_90d/3"
    first = api.get(url, headers=LOG)  # a miss: computed by the read-through
    assert first.status_code == 200, first.text
    assert first.json()["source"] == "computed"
    # Not asked for (and txn_90d logs nothing by itself): the tier fills, unlogged.
    assert wait_until(lambda: api.get(url).json()["source"] == "local", timeout=10)
    assert "x-request-id" not in api.get(url).headers
    second = api.get(url, headers=LOG)
    assert second.json()["source"] == "local"
    ids = [first.headers["x-request-id"], second.headers["x-request-id"]]
    assert len(set(ids)) == 2

    api2 = api_factory(local=False)
    from_redis = api2.get(url, headers={**LOG, "X-Request-Id": "caller-id.1"})
    assert from_redis.json()["source"] == "hit"
    assert from_redis.headers["x-request-id"] == "caller-id.1"
    bad = api2.get(url, headers={**LOG, "X-Request-Id": "no spaces allowed"})
    assert bad.headers["x-request-id"] != "no spaces allowed"

    expected = truth(engine, tenant, "txn_90d", "3")
    assert first.json()["values"] == expected
    rows = sink_rows(logged, tmp_path, 4)
    by_id = {r["request_id"]: r for r in rows}
    assert by_id[ids[0]]["source"] == "read-through"
    assert by_id[ids[1]]["source"] == "tier"
    assert {r["source"] for r in rows} == {"read-through", "redis", "tier"}
    assert by_id["caller-id.1"]["source"] == "redis"
    for row in rows:
        assert row["tenant"] == tenant and row["feature_set"] == "txn_90d"
        assert row["entity"] == "3" and row["route"] == "features"
        assert orjson.loads(row["values"]) == expected, row
        assert row["watermark"] is not None and int(row["watermark"]) > 0
        assert row["entry"] is not None and row["entry"].startswith(b"1")
        assert "Bearer" not in str(row)
    # One entry, so one watermark whatever the source.
    assert len({r["watermark"] for r in rows}) == 1


def test_batch_and_predict_round_trip(
    api_factory: Callable[..., Api],
    logged: Settings,
    engine: Engine,
    tenant: str,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    api = api_factory()
    users = ["1", "2", "4"]
    batch = api.post(
        "/v1/features/batch",
        json={"feature_sets": ["txn_90d", "geo"], "entities": users},
        headers=LOG,
    )
    assert batch.status_code == 200, batch.text
    # One feature set, every entry a hit: the spliced answer is logged too.
    spliced = api.post(
        "/v1/features/batch", json={"feature_sets": ["txn_90d"], "entities": users}, headers=LOG
    )
    assert spliced.status_code == 200, spliced.text
    name = f"m_{uuid.uuid4().hex[:10]}"
    rng = np.random.default_rng(3)
    x = rng.normal(loc=(5, 500, 1), scale=(3, 300, 1), size=(200, 3))
    model = LogisticModel.fit(
        x,
        (x[:, 0] > 5).astype(float),
        version="e1",
        feature_names=ENTITY_FEATURES,
        name=name,
        epochs=20,
    )
    ModelRegistry(redis_client).register(model.save(tmp_path / "e1.json"))
    predicted = api.post(f"/v1/models/{name}/predict", json={"entities": users}, headers=LOG)
    assert predicted.status_code == 200, predicted.text

    rows = sink_rows(logged, tmp_path / "log", 6 + 3 + 6)
    by_request: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_request.setdefault(row["request_id"], []).append(row)
    assert len(by_request[batch.headers["x-request-id"]]) == 6
    assert len(by_request[spliced.headers["x-request-id"]]) == 3
    for item in batch.json()["items"]:
        [row] = [
            r
            for r in by_request[batch.headers["x-request-id"]]
            if (r["feature_set"], r["entity"]) == (item["feature_set"], item["entity"])
        ]
        assert orjson.loads(row["values"]) == item["values"]
        assert row["route"] == "batch"
    for row in by_request[spliced.headers["x-request-id"]]:
        assert row["source"] == "redis"
        assert orjson.loads(row["values"]) == truth(engine, tenant, "txn_90d", row["entity"])
    pred_rows = by_request[predicted.headers["x-request-id"]]
    assert {r["model"] for r in pred_rows} == {name}
    assert {r["model_version"] for r in pred_rows} == {"e1"}
    answers = {p["entity"]: p["value"] for p in predicted.json()["predictions"]}
    for row in pred_rows:
        assert row["route"] == "predict"
        assert orjson.loads(row["prediction"]) == answers[row["entity"]]
        assert orjson.loads(row["values"]) == truth(
            engine, tenant, row["feature_set"], row["entity"]
        )

    # Training on what was served: by request id (exact), else the latest read of the
    # entity at or before the moment, within the tolerance; none: nulls and a flag.
    first_at = min(r["requested_at"] for r in rows)
    last_at = max(r["requested_at"] for r in rows)
    spine = pa.table(
        {
            "tenant_id": [tenant] * 3,
            "user_id": pa.array([1, 2, 4], pa.int64()),
            "request_id": [batch.headers["x-request-id"], None, None],
            "timestamp": pa.array(
                [None, last_at + dt.timedelta(seconds=1), first_at - dt.timedelta(seconds=1)],
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )
    got = from_logs(
        active(),
        spine,
        ["txn_90d:txn_sum", "geo"],
        ParquetLog(tmp_path / "log"),
        tolerance=dt.timedelta(minutes=1),
    ).to_pylist()
    served_values = {(i["feature_set"], i["entity"]): i["values"] for i in batch.json()["items"]}
    assert got[0]["txn_90d__txn_sum"] == served_values["txn_90d", "1"]["txn_sum"]
    assert got[0]["geo__logged"] and got[0]["txn_90d__logged"]
    assert got[1]["txn_90d__txn_sum"] == truth(engine, tenant, "txn_90d", "2")["txn_sum"]
    assert (
        got[1]["geo__distinct_countries_30d"] == served_values["geo", "2"]["distinct_countries_30d"]
    )
    assert not got[2]["txn_90d__logged"] and got[2]["txn_90d__txn_sum"] is None


def test_a_full_buffer_drops_and_counts_and_the_read_answers(
    api_factory: Callable[..., Api], logged: Settings
) -> None:
    api = api_factory()
    log: ServedLog = api.app.state.services.served
    # Hold the queue full: the thread that empties it is not started, a stand-in for a
    # Kafka that cannot keep up (a broker that slow cannot be made for real here).
    log._thread = object()  # type: ignore[assignment]
    try:
        for _ in range(log.capacity):
            log._queue.put_nowait(Served("x", "t", "features", 0, []))
        before = log.dropped
        counted = LOGGED.labels("dropped")._value.get()
        answer = api.get("/v1/features/txn_90d/2", headers=LOG)
        assert answer.status_code == 200, answer.text
        assert answer.json()["values"] is not None
        assert log.dropped == before + 1
        assert LOGGED.labels("dropped")._value.get() == counted + 1
    finally:
        log._thread = None
        while not log._queue.empty():
            log._queue.get_nowait()


def test_sampling_is_by_request_id_and_logs_a_batch_whole() -> None:
    ids = [f"r{i}" for i in range(20_000)]
    picked = [rid for rid in ids if served.sampled(rid, 0.01)]
    assert 100 < len(picked) < 300
    assert picked == [rid for rid in ids if served.sampled(rid, 0.01)]
    assert all(served.sampled(rid, 1.0) for rid in ids[:10])
    assert not any(served.sampled(rid, 0.0) for rid in ids[:10])
    assert served.request_id("abc-DEF_1.2:3") == "abc-DEF_1.2:3"
    assert len(served.request_id("x" * 65)) == 32


def test_a_feature_set_logs_its_share_without_the_header(
    logged: Settings, engine: Engine, redis_client: redis.Redis, tenant: str, tmp_path: Path
) -> None:
    sets = [dataclasses.replace(fs, log_sample=1.0) if fs.name == "geo" else fs for fs in REGISTRY]
    app = create_app(
        logged.model_copy(update={"local_cache_size": 0}),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        registry=Registry(sets),
    )
    with running(app, create_api_key(engine, tenant)) as api:
        geo = api.get("/v1/features/geo/1")
        assert geo.status_code == 200 and "x-request-id" in geo.headers
        assert "x-request-id" not in api.get("/v1/features/txn_90d/1").headers
        both = {"feature_sets": ["geo", "txn_90d"], "entities": ["1"]}
        assert "x-request-id" in api.post("/v1/features/batch", json=both).headers
    # The sink as the command line runs it.
    done = cli(
        "served",
        "sink",
        "--dir",
        str(tmp_path),
        "--max-rows",
        "3",
        "--timeout",
        "60",
        FRESHLINE_TOPIC_PREFIX=logged.topic_prefix,
    )
    assert done.returncode == 0, done.stderr
    rows = ParquetLog(tmp_path).read().to_pylist()
    assert sorted((r["route"], r["feature_set"]) for r in rows) == [
        ("batch", "geo"),
        ("batch", "txn_90d"),
        ("features", "geo"),
    ]


@pytest.mark.parametrize(("share", "logged_ids"), [(0.0, 0), (1.0, 5)])
def test_the_setting_logs_every_feature_set(
    logged: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    share: float,
    logged_ids: int,
) -> None:
    app = create_app(
        logged.model_copy(update={"local_cache_size": 0, "served_log_sample": share}),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        registry=REGISTRY,
    )
    with running(app, create_api_key(engine, tenant)) as api:
        answers = [api.get(f"/v1/features/txn_90d/{u}") for u in range(1, 6)]
    assert all(a.status_code == 200 for a in answers)
    assert sum("x-request-id" in a.headers for a in answers) == logged_ids


@pytest.mark.parametrize("local", [False, True], ids=["redis", "tier"])
def test_a_read_asking_for_freshness_logs_the_entry_it_served(
    api_factory: Callable[..., Api],
    logged: Settings,
    engine: Engine,
    tenant: str,
    tmp_path: Path,
    local: bool,
) -> None:
    api = api_factory(local=local)
    svc = api.app.state.services
    url = "/v1/features/txn_90d/3"
    assert api.get(url).status_code == 200  # the entry, computed and stored
    # Overwritten with one too old for the bound and a value of its own: the bounded
    # read must not serve it, and its log must not name it.
    fs = REGISTRY["txn_90d"]
    version = svc.reader.schema_version
    wrong = {**truth(engine, tenant, "txn_90d", "3"), "txn_count": 10_000}
    old = time.time_ns() // 1_000_000 - 60_000
    svc.redis.set(
        feature_key(version, EntityRef("txn_90d", tenant, "3")),
        encode_entry([wrong[f] for f in fs.field_names], version, old, 1),
        px=fs.ttl_s * 1000,
    )
    bounded = api.get(f"{url}?max_staleness_ms=1000&wait_ms=0", headers=LOG)
    assert bounded.status_code == 200, bounded.text
    assert bounded.json()["source"] == "computed"
    assert bounded.json()["values"] == truth(engine, tenant, "txn_90d", "3")

    [row] = sink_rows(logged, tmp_path, 1)
    assert row["request_id"] == bounded.headers["x-request-id"]
    assert row["source"] == "read-through"
    assert orjson.loads(row["values"]) == bounded.json()["values"]
    assert row["entry"] is not None, "logged without its entry"
    assert row["watermark"] is not None and int(row["watermark"]) > 1, row


def test_the_python_client_logs_its_reads_as_the_api_does(
    logged: Settings, engine: Engine, redis_client: redis.Redis, tenant: str, tmp_path: Path
) -> None:
    version = logged.schema_version
    EntryStore(redis_client, version, registry=REGISTRY).write(
        compute(engine, REGISTRY["txn_90d"], [(tenant, "1"), (tenant, "2")])
    )
    # The consumers' Kafka login, granted the prefix's topics as apply grants them:
    # besides the admin, the one that may write the log.
    as_consumers = kafka_login(logged, "consumer")
    allow_consumer(admin_client(logged), as_consumers.kafka_sasl_username or "", logged)
    queued = LOGGED.labels("queued")._value.get()
    client = FeatureClient(redis_client, version, registry=REGISTRY, served=ServedLog(as_consumers))
    sampled = FeatureClient(
        redis_client,
        version,
        registry=REGISTRY,
        served=ServedLog(as_consumers.model_copy(update={"served_log_sample": 1.0})),
    )
    bounded = FeatureClient(
        redis_client,
        version,
        registry=REGISTRY,
        readthrough=ReadThrough(EntryStore(redis_client, version, registry=REGISTRY), engine),
        served=ServedLog(as_consumers),
    )
    try:
        assert client.get("txn_90d", tenant, 1) is not None  # no share, not asked: unlogged
        assert LOGGED.labels("queued")._value.get() == queued
        items: list[tuple[str, str, str | int]] = [
            ("txn_90d", tenant, 1),
            ("txn_90d", tenant, "2"),
            ("geo", tenant, 1),
        ]
        got = client.get_many(items, request_id="client-call.1", log=True)
        every = sampled.get("txn_90d", tenant, 2)  # the settings' share: every call
        # A bounded read of an entry too old for it: computed, and logged as computed.
        fs = REGISTRY["txn_90d"]
        wrong = {**truth(engine, tenant, "txn_90d", "3"), "txn_count": 10_000}
        redis_client.set(
            feature_key(version, EntityRef("txn_90d", tenant, "3")),
            encode_entry([wrong[f] for f in fs.field_names], version, 1, 1),
            px=fs.ttl_s * 1000,
        )
        fresh = bounded.get(
            "txn_90d", tenant, 3, max_staleness_ms=1000, wait_ms=0, request_id="b", log=True
        )
    finally:
        client.close()
        sampled.close()
        bounded.close()
    assert every is not None and got[0] is not None and got[1] is not None and got[2] is None
    assert fresh is not None and fresh.values == truth(engine, tenant, "txn_90d", "3")

    rows = sink_rows(logged, tmp_path, 5)
    assert {(r["route"], r["tenant"]) for r in rows} == {("client", tenant)}
    by_key = {(r["request_id"], r["feature_set"], r["entity"]): r for r in rows}
    [other] = [rid for rid, _, _ in by_key if rid not in ("client-call.1", "b")]
    computed = by_key["b", "txn_90d", "3"]
    assert computed["source"] == "read-through"
    assert orjson.loads(computed["values"]) == fresh.values
    assert int(computed["watermark"]) == fresh.watermark > 1
    assert by_key["client-call.1", "geo", "1"]["source"] == "miss"
    assert by_key["client-call.1", "geo", "1"]["values"] is None
    for key, features in [
        (("client-call.1", "txn_90d", "1"), got[0]),
        (("client-call.1", "txn_90d", "2"), got[1]),
        ((other, "txn_90d", "2"), every),
    ]:
        row = by_key[key]
        assert row["source"] == "redis"
        assert orjson.loads(row["values"]) == features.values
        assert int(row["watermark"]) == features.watermark
        assert row["schema_version"] == version
