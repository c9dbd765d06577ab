"""The read API in process, on the real Redis and Postgres: reads, batches, isolation, errors."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.cache.invalidation import Invalidation
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.recompute import Batch, compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.keys import INVALIDATION_CHANNEL, feature_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, Api, api_for, fresh_version, running, wait_until


@pytest.fixture
def api_settings(settings: Settings) -> Settings:
    # A schema version of the test's own keeps its Redis keys apart from other tests.
    return settings.model_copy(
        update={
            "schema_version": fresh_version(),
            "api_batch_limit": 12,
            "api_body_limit_bytes": 2048,
            "local_cache_size": 0,  # the Redis path; the tier's tests turn it on
        }
    )


@pytest.fixture(scope="module")
def two_tenants(tenant_factory_module: Callable[..., SeedSummary]) -> list[str]:
    return tenant_factory_module(users=20, transactions=600, tenants=2).tenants


@pytest.fixture
def api(
    api_settings: Settings, engine: Engine, redis_client: redis.Redis, two_tenants: list[str]
) -> Iterator[Api]:
    with api_for(api_settings, engine, redis_client, two_tenants[0]) as client:
        yield client


def truth(engine: Engine, feature_set: str, tenant: str, entity: str) -> dict[str, Any]:
    return compute(engine, REGISTRY[feature_set], [(tenant, entity)]).values[(tenant, entity)]


def test_read_through_then_hit(api: Api, engine: Engine, two_tenants: list[str]) -> None:
    tenant = two_tenants[0]
    first = api.get("/v1/features/txn_90d/3")
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["hit"] is False and body["source"] == "computed"
    assert body["feature_set"] == "txn_90d" and body["entity"] == "3"
    assert body["values"] == truth(engine, "txn_90d", tenant, "3")
    assert body["schema_version"] == api.app.state.services.reader.schema_version
    assert body["age_ms"] >= 0

    second = api.get("/v1/features/txn_90d/3").json()
    assert second["hit"] is True and second["source"] == "hit"
    assert second["values"] == body["values"]


def test_cache_only_reports_a_miss_and_stores_nothing(
    api: Api, redis_client: redis.Redis, two_tenants: list[str]
) -> None:
    version = api.app.state.services.reader.schema_version
    key = feature_key(version, EntityRef("geo", two_tenants[0], "4"))
    miss = api.get("/v1/features/geo/4?mode=cache-only")
    assert miss.status_code == 404
    assert miss.json()["error"]["code"] == "miss"
    assert redis_client.exists(key) == 0
    assert api.get("/v1/features/geo/4").json()["source"] == "computed"
    hit = api.get("/v1/features/geo/4?mode=cache-only")
    assert hit.status_code == 200 and hit.json()["hit"] is True


def test_batch_answers_equal_single_ones(api: Api) -> None:
    computed: list[list[EntityRef]] = []
    api.app.state.services.reader.readthrough.hooks.before_compute = computed.append
    sets = ["txn_90d", "device_risk", "geo"]
    body = {"feature_sets": sets, "entities": [5, "6", 7, "8"]}
    first = api.post("/v1/features/batch", json=body)
    assert first.status_code == 200, first.text
    items = first.json()["items"]
    assert [(i["entity"], i["feature_set"]) for i in items] == [
        (str(e), fs) for e in (5, 6, 7, 8) for fs in sets
    ]
    assert {i["source"] for i in items} == {"computed"}
    assert sorted(len(g) for g in computed) == [4, 4, 4]  # one query per feature set

    again = api.post("/v1/features/batch", json=body).json()["items"]
    assert {i["source"] for i in again} == {"hit"}
    for item in again:
        single = api.get(f"/v1/features/{item['feature_set']}/{item['entity']}").json()
        assert single["values"] == item["values"]
        assert single["hit"] is True
    assert len(computed) == 3


def test_batch_in_cache_only_mode_marks_misses(api: Api) -> None:
    api.get("/v1/features/txn_90d/9")
    out = api.post(
        "/v1/features/batch?mode=cache-only",
        json={"feature_sets": ["txn_90d"], "entities": [9, 10]},
    )
    assert out.status_code == 200
    first, second = out.json()["items"]
    assert first["source"] == "hit" and first["values"] is not None
    assert second["source"] == "miss" and second["values"] is None and second["hit"] is False


# -- tenant isolation -------------------------------------------------------------------

SENTINEL = 987_654_321


@pytest.fixture
def planted(api: Api, engine: Engine, redis_client: redis.Redis, two_tenants: list[str]) -> str:
    """Tenant B's entry for user 1, holding a value no real computation gives."""
    other = two_tenants[1]
    store = EntryStore(
        redis_client, api.app.state.services.reader.schema_version, registry=REGISTRY
    )
    values = dict(truth(engine, "txn_90d", other, "1"), txn_count=SENTINEL)
    store.write(
        Batch(REGISTRY["txn_90d"], {(other, "1"): values}, 1 << 100, time.time_ns() // 1_000_000)
    )
    return other


def _leaks(response: httpx.Response) -> bool:
    return str(SENTINEL) in response.text


@pytest.mark.parametrize(
    "path",
    [
        "/v1/features/txn_90d/1..:{OTHER}",
        "/v1/features/txn_90d/1:{OTHER}:1}",
        "/v1/features/txn_90d/%7BOTHER%3A1%7D",
        "/v1/features/txn_90d/1%3A%7BOTHER%3A1%7D",
        "/v1/features/txn_90d/OTHER%3A1",
        "/v1/features/txn_90d/OTHER/1",
        "/v1/features/txn_90d/..%2FOTHER%2F1",
        "/v1/features/txn_90d/*",
        "/v1/features/txn_90d/1?tenant=OTHER&tenant_id=OTHER",
        "/v1/features/txn_90d:{OTHER:1}/1",
    ],
)
def test_crafted_paths_never_reach_another_tenant(api: Api, planted: str, path: str) -> None:
    response = api.get(path.replace("OTHER", planted))
    assert not _leaks(response)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code == 200:
        assert response.json()["values"]["txn_count"] != SENTINEL
    else:
        assert response.json()["error"]["code"]


def test_the_tenant_comes_from_the_key_not_the_body(api: Api, planted: str, engine: Engine) -> None:
    body = {
        "feature_sets": ["txn_90d"],
        "entities": [1],
        "tenant": planted,
        "tenant_id": planted,
        "tenants": [planted],
    }
    response = api.post("/v1/features/batch", json=body, headers={"X-Tenant": planted})
    assert response.status_code == 200
    assert not _leaks(response)
    [item] = response.json()["items"]
    assert item["values"] == truth(engine, "txn_90d", api_tenant(api), "1")
    for crafted in [f"{{{planted}:1}}", f"{planted}:1", f"1}}:{{{planted}"]:
        bad = api.post(
            "/v1/features/batch", json={"feature_sets": ["txn_90d"], "entities": [crafted]}
        )
        assert bad.status_code == 400 and not _leaks(bad)


def test_the_other_tenants_key_reads_its_own_entry(api: Api, planted: str, engine: Engine) -> None:
    other = api.get("/v1/features/txn_90d/1", key=create_api_key(engine, planted))
    assert other.json()["values"]["txn_count"] == SENTINEL  # the plant is really there
    mine = api.get("/v1/features/txn_90d/1")
    assert mine.json()["values"]["txn_count"] != SENTINEL


def api_tenant(api: Api) -> str:
    assert api.key is not None
    return str(api.app.state.services.auth.tenant(api.key))


# -- bad requests -------------------------------------------------------------------------

BIG = b'{"feature_sets": ["txn_90d"], "entities": [' + b"1, " * 1000 + b"1]}"


async def _chunks() -> AsyncIterator[bytes]:
    """A body sent chunked, with no Content-Length: the limit applies to the stream."""
    for _ in range(10):
        yield b" " * 512


BAD: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("GET", "/v1/features/nope/1", {}, 404, "unknown_feature_set"),
    ("GET", "/v1/features/txn_90d/a:b", {}, 400, "invalid_id"),
    ("GET", "/v1/features/txn_90d/%7Bx%7D", {}, 400, "invalid_id"),
    ("GET", "/v1/features/txn_90d/007", {}, 400, "invalid_id"),
    ("GET", "/v1/features/txn_90d/-1", {}, 400, "invalid_id"),
    ("GET", "/v1/features/txn_90d/abc", {}, 400, "invalid_id"),
    ("GET", "/v1/features/txn_90d/" + "9" * 70, {}, 400, "invalid_id"),
    ("GET", "/v1/features/txn_90d/1?mode=sometimes", {}, 400, "invalid_mode"),
    ("POST", "/v1/features/txn_90d/1", {}, 405, "method_not_allowed"),
    ("GET", "/v1/features/batch", {}, 405, "method_not_allowed"),
    ("DELETE", "/healthz", {}, 405, "method_not_allowed"),
    ("GET", "/v2/features/txn_90d/1", {}, 404, "not_found"),
    ("GET", "/v1/features/txn_90d", {}, 404, "not_found"),
    ("POST", "/v1/features/batch", {"content": b"{not json"}, 400, "invalid_json"),
    ("POST", "/v1/features/batch", {"content": b""}, 400, "invalid_json"),
    ("POST", "/v1/features/batch", {"json": [1, 2]}, 422, "invalid_request"),
    ("POST", "/v1/features/batch", {"json": {"entities": [1]}}, 422, "invalid_request"),
    (
        "POST",
        "/v1/features/batch",
        {"json": {"feature_sets": "txn_90d", "entities": [1]}},
        422,
        "invalid_request",
    ),
    (
        "POST",
        "/v1/features/batch",
        {"json": {"feature_sets": ["txn_90d"], "entities": []}},
        422,
        "invalid_request",
    ),
    (
        "POST",
        "/v1/features/batch",
        {"json": {"feature_sets": ["nope"], "entities": [1]}},
        404,
        "unknown_feature_set",
    ),
    (
        "POST",
        "/v1/features/batch",
        {"json": {"feature_sets": [7], "entities": [1]}},
        400,
        "invalid_id",
    ),
    (
        "POST",
        "/v1/features/batch",
        {"json": {"feature_sets": ["geo"], "entities": [1.5]}},
        400,
        "invalid_id",
    ),
    (
        "POST",
        "/v1/features/batch",
        {"json": {"feature_sets": ["geo"], "entities": [True]}},
        400,
        "invalid_id",
    ),
    (
        "POST",
        "/v1/features/batch",
        {"json": {"feature_sets": ["geo"], "entities": [None]}},
        400,
        "invalid_id",
    ),
    (
        "POST",
        "/v1/features/batch",
        {"json": {"feature_sets": ["txn_90d", "geo", "device_risk"], "entities": [1, 2, 3, 4, 5]}},
        422,
        "batch_too_large",
    ),
    ("POST", "/v1/features/batch", {"content": BIG}, 413, "body_too_large"),
    ("POST", "/v1/features/batch", {"content": _chunks}, 413, "body_too_large"),
    (
        "POST",
        "/v1/features/batch",
        {"content": b"{}", "headers": {"Content-Length": "x"}},
        400,
        "bad_request",
    ),
    (
        "POST",
        "/v1/models/no_such_model/predict",
        {"json": {"inputs": [[1.0]]}},
        404,
        "unknown_model",
    ),
    ("POST", "/v1/models/Bad-Name/predict", {"json": {"inputs": [[1.0]]}}, 400, "invalid_id"),
    ("POST", "/v1/models/x/predict", {"json": {"inputs": "1"}}, 422, "invalid_request"),
    ("POST", "/v1/models/x/predict", {"json": {"inputs": [[1.0]] * 13}}, 422, "batch_too_large"),
    (
        "POST",
        "/v1/models/x/predict",
        {"json": {"inputs": [[1.0]], "arm": "a:b"}},
        400,
        "invalid_id",
    ),
    ("GET", "/v1/models/x/predict", {}, 405, "method_not_allowed"),
]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code"),
    BAD,
    ids=[f"{m} {p[:40]} {c}" for m, p, _, _, c in BAD],
)
def test_bad_requests_get_a_json_4xx(
    api: Api, method: str, path: str, kwargs: dict[str, Any], status: int, code: str
) -> None:
    kwargs = dict(kwargs)
    if callable(kwargs.get("content")):
        kwargs["content"] = kwargs["content"]()
    response = api.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"] and "Traceback" not in response.text


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Basic abc", "Bearer fl_not-a-key", "Bearer " + "x" * 500],
)
def test_missing_or_unknown_keys_are_401(api: Api, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    for path in ("/v1/features/txn_90d/1", "/v1/features/nope/1"):
        response = api.get(path, key=None, headers=headers)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"
    batch = api.post("/v1/features/batch", key=None, headers=headers, content=b"junk")
    assert batch.status_code == 401


def test_keys_are_cached_in_process(api: Api) -> None:
    auth = api.app.state.services.auth
    # Only a lookup begun once the revocation subscription is live may be cached.
    assert auth.wait_live(10), "the revocation subscription never became live"
    api.get("/v1/features/txn_90d/1")
    before = auth.lookups
    for _ in range(5):
        assert api.get("/v1/features/txn_90d/1").status_code == 200
    assert auth.lookups == before


def test_openapi_lists_every_route(api: Api) -> None:
    spec = api.get("/openapi.json", key=None).json()
    assert spec["openapi"].startswith("3.")
    for route in api.app.routes:
        path = getattr(route, "path", None)
        assert path in spec["paths"], path
        methods = {m.lower() for m in getattr(route, "methods", set())} - {"head"}
        assert methods <= set(spec["paths"][path]), (path, methods)
    for path, ops in spec["paths"].items():
        for op in ops.values():
            for ref in _refs(op):
                assert ref.rsplit("/", 1)[1] in spec["components"]["schemas"], (path, ref)


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def test_health_and_readiness(api: Api) -> None:
    assert api.get("/healthz", key=None).json() == {"status": "ok"}
    ready = api.get("/readyz", key=None)
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "checks": {"redis": "ok", "postgres": "ok"}}


def test_readiness_is_503_when_a_service_does_not_answer(
    api_settings: Settings, engine: Engine
) -> None:
    # Port 1 on loopback: nothing listens there, so both connections are refused.
    dead_redis = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)
    dead_pg = sa.create_engine(engine.url.set(port=1), connect_args={"connect_timeout": 1})
    for kwargs in (
        {"redis_client": dead_redis, "engine": engine},
        {"redis_client": redis.Redis.from_url(api_settings.redis_url), "engine": dead_pg},
    ):
        app = create_app(
            api_settings,
            follow_deploys=False,
            registry=REGISTRY,
            **kwargs,  # type: ignore[arg-type]
        )
        with running(app) as client:
            ready = client.get("/readyz", key=None)
            assert ready.status_code == 503
            body = ready.json()
            assert body["status"] == "unavailable"
            assert "unavailable" in " ".join(body["checks"].values())
            assert client.get("/healthz", key=None).status_code == 200
    dead_pg.dispose()
    dead_redis.close()


COUNTED = {
    "hits": ("freshline_api_feature_hits_total", {"feature_set": "device_risk", "tier": "redis"}),
    "misses": ("freshline_api_feature_misses_total", {"feature_set": "device_risk"}),
    "read_throughs": ("freshline_api_feature_read_throughs_total", {"feature_set": "device_risk"}),
    "requests": (
        "freshline_api_request_seconds_count",
        {"endpoint": "features", "feature_set": "device_risk", "status": "200"},
    ),
}


def scrape(api: Api) -> dict[str, float]:
    """The values of :data:`COUNTED` in ``/metrics`` now (0 for a series not there yet)."""
    samples = [
        s
        for family in text_string_to_metric_families(api.ops("/metrics").text)
        for s in family.samples
    ]
    return {
        what: sum(s.value for s in samples if s.name == name and s.labels == labels)
        for what, (name, labels) in COUNTED.items()
    }


def test_metrics_count_hits_misses_and_read_throughs(api: Api) -> None:
    # The counters are the process's: other tests have moved them, so count the change.
    before = scrape(api)
    assert api.get("/v1/features/device_risk/10").status_code == 200  # a miss, read through
    assert api.get("/v1/features/device_risk/10").status_code == 200  # a hit in Redis
    after = scrape(api)
    assert {what: after[what] - before[what] for what in COUNTED} == {
        "hits": 1,
        "misses": 1,
        "read_throughs": 1,
        "requests": 2,
    }


# -- with the in-process tier --------------------------------------------------------------


def test_the_api_serves_from_the_local_tier_until_invalidated(
    api_settings: Settings, engine: Engine, redis_client: redis.Redis, two_tenants: list[str]
) -> None:
    tenant = two_tenants[0]
    with_tier = api_settings.model_copy(update={"local_cache_size": 100})
    with api_for(with_tier, engine, redis_client, tenant) as client:
        local: LocalTier = client.app.state.services.reader.local
        assert local.wait_live(5)
        assert client.get("/v1/features/txn_90d/10").json()["source"] == "computed"
        # txn_90d has a horizon: the tier holds its entry back until it has read the
        # key's TTL, on its own thread. Wait for that, or the next read may be a "hit".
        assert wait_until(lambda: len(local) == 1)
        assert client.get("/v1/features/txn_90d/10").json()["source"] == "local"
        batch = client.post(
            "/v1/features/batch", json={"feature_sets": ["txn_90d", "geo"], "entities": [10]}
        )
        assert [i["source"] for i in batch.json()["items"]] == ["local", "computed"]

        message = Invalidation(tenant, "txn_90d", "10", 1, api_settings.schema_version)
        redis_client.publish(INVALIDATION_CHANNEL, message.encode())
        # Wait for this message, not any invalidation: the channel is the server's, and
        # other processes publish on it too.
        ref = EntityRef("txn_90d", tenant, "10")
        assert wait_until(lambda: local.get(ref, api_settings.schema_version) is None)
        assert client.get("/v1/features/txn_90d/10").json()["source"] == "hit"
