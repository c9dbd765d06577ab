"""The operator's endpoints apart from the API (issue 30, item 5), on the real services.

``/metrics``, ``/status`` and ``/status.json`` are not on the API port for anyone
without the operator key; the ops app serves them; requests drive at most one Redis
sample per cache period; probes on the API port are limited per address and
``/readyz`` checks once for any number of callers; no page shows a model name that
only a tenant's request named.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
import redis
from pydantic import SecretStr
from sqlalchemy.engine import Engine

from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key, create_tenant
from freshline.pipeline.api.ops import Ops, SharedObserver
from freshline.pipeline.core.services import redis_client as make_redis_client
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY, Api, fresh_version, running

OPERATOR_PAGES = ("/metrics", "/status", "/status.json")
OPS_KEY = "ops-" + "k" * 40


def get_from(api: Api, url: str, address: str, app: Any = None) -> httpx.Response:
    """GET ``url`` from the API app (or ``app``) as a client at ``address``."""

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app or api.app, client=(address, 40_000))
        async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
            return await client.get(url)

    return api.portal.call(get)


@pytest.fixture
def ops_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "schema_version": fresh_version(),
            "local_cache_size": 0,
            "consumer_metrics_port": 0,
        }
    )


@pytest.fixture
def tenant(engine: Engine) -> str:
    name = f"ops-{uuid.uuid4().hex[:8]}"
    create_tenant(engine, name)
    return name


def serve(settings: Settings, engine: Engine, client: redis.Redis, key: str | None = None) -> Any:
    app = create_app(
        settings, engine=engine, redis_client=client, follow_deploys=False, registry=REGISTRY
    )
    return running(app, key)


def test_the_api_port_serves_no_operator_page_without_the_operator_key(
    ops_settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    tenant_key = create_api_key(engine, tenant)
    with serve(ops_settings, engine, redis_client, tenant_key) as api:
        for url in OPERATOR_PAGES:
            for key in (None, tenant_key):
                answer = api.get(url, key=key)
                assert answer.status_code == 404, (url, key, answer.text)
                assert answer.json()["error"]["code"] == "not_found"
            assert api.ops(url).status_code == 200, url
        assert "freshline_api_request_seconds" in api.ops("/metrics").text
        assert "freshline status" in api.ops("/status").text
        assert "feature_sets" in api.ops("/status.json").json()
        for url in ("/healthz", "/readyz"):
            assert api.get(url, key=None).status_code == 200
            assert api.ops(url).status_code == 200
        assert not set(OPERATOR_PAGES) & set(api.get("/openapi.json").json()["paths"])

    keyed = ops_settings.model_copy(update={"ops_key": SecretStr(OPS_KEY)})
    with serve(keyed, engine, redis_client, tenant_key) as api:
        for url in OPERATOR_PAGES:
            for key in (None, tenant_key, OPS_KEY[:-1] + "x", OPS_KEY + "k"):
                answer = api.get(url, key=key)
                assert answer.status_code == 401, (url, key, answer.text)
                assert answer.json()["error"]["code"] == "unauthorized"
                assert answer.headers["www-authenticate"] == "Bearer"
            assert api.get(url, key=OPS_KEY).status_code == 200, url
        assert OPS_KEY not in repr(api.app.state.ops)
        paths = api.get("/openapi.json").json()["paths"]
        for url in OPERATOR_PAGES:
            assert paths[url]["get"]["security"] == [{"operator": []}]
            assert "401" in paths[url]["get"]["responses"]


class Counted(redis.Connection):
    """A connection to the real Redis that counts the SCANs sent through it."""

    scans = 0

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        if args and str(args[0]).upper() == "SCAN":
            type(self).scans += 1
        super().send_command(*args, **kwargs)


def test_requests_drive_at_most_one_redis_sample_per_period(
    ops_settings: Settings, engine: Engine, tenant: str
) -> None:

    class CountedHere(Counted):
        scans = 0  # this test's own count

    counted = CountedHere
    client = make_redis_client(ops_settings, connection_class=counted)
    cached = ops_settings.model_copy(update={"ops_cache_s": 3600.0})
    try:
        with serve(cached, engine, client, create_api_key(engine, tenant)) as api:
            assert api.ops("/metrics").status_code == 200
            one_sample = counted.scans
            assert one_sample >= 1, "the first scrape samples Redis"
            for _ in range(20):
                for url in OPERATOR_PAGES:
                    assert api.ops(url).status_code == 200
            assert counted.scans == one_sample
            observer = api.app.state.ops.board.observer
            assert isinstance(observer, SharedObserver) and observer.samples == 1

        # With no cache period, every scrape samples again: what the count above saw
        # was the cache, not a sample too small to scan.
        with serve(
            ops_settings.model_copy(update={"ops_cache_s": 0.0}), engine, client, None
        ) as api:
            before = counted.scans
            for _ in range(3):
                api.ops("/metrics")
            assert counted.scans >= before + 3
    finally:
        client.close()


def test_probes_on_the_api_port_are_limited_per_address(
    ops_settings: Settings, engine: Engine, redis_client: redis.Redis
) -> None:
    # About one token a quarter-hour: none comes back while the test runs.
    limited = ops_settings.model_copy(update={"api_probe_rate_per_s": 0.001, "api_probe_burst": 3})
    with serve(limited, engine, redis_client) as api:
        for url in ("/healthz", "/readyz", "/healthz"):
            assert get_from(api, url, "192.0.2.1").status_code == 200
        refused = get_from(api, "/readyz", "192.0.2.1")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limited"
        assert int(refused.headers["retry-after"]) >= 1
        assert get_from(api, "/healthz", "192.0.2.2").status_code == 200  # another address
        ops_app = api.app.state.ops_app
        for _ in range(10):  # the ops port's probes are not limited
            assert get_from(api, "/readyz", "192.0.2.1", app=ops_app).status_code == 200


def test_readyz_checks_once_for_any_number_of_callers(
    ops_settings: Settings, engine: Engine, redis_client: redis.Redis
) -> None:
    cached = ops_settings.model_copy(update={"api_ready_cache_s": 3600.0})
    with serve(cached, engine, redis_client) as api:
        state: Ops = api.app.state.ops

        async def many() -> list[int]:
            transport = httpx.ASGITransport(app=api.app.state.ops_app)
            async with httpx.AsyncClient(transport=transport, base_url="http://ops.test") as c:
                answers = await asyncio.gather(*(c.get("/readyz") for _ in range(50)))
            return [a.status_code for a in answers]

        assert api.portal.call(many) == [200] * 50
        for _ in range(20):
            assert api.get("/readyz", key=None).status_code == 200
        assert state.readiness.computed == 1


def test_no_page_shows_a_model_name_only_a_tenant_sent(
    ops_settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    secret = f"acme-secret-{uuid.uuid4().hex[:8]}"
    semantic = ops_settings.model_copy(
        update={"semantic_enabled": True, "ops_key": SecretStr(OPS_KEY)}
    )
    scope = {"model_version": "v1", "template_version": "t1", "params": {"temperature": 0}}
    with serve(semantic, engine, redis_client, create_api_key(engine, tenant)) as api:
        lookup = {**scope, "model": secret, "prompt": "what is my balance?"}
        assert api.post("/v1/llm/cache/lookup", json=lookup).status_code == 200
        stored = api.post(
            "/v1/llm/cache/store",
            json={**scope, "model": secret, "prompt": "hi", "response": "yo", "generation_ms": 5},
        )
        assert stored.status_code == 201, stored.text
        unknown = secret.replace("-", "_")
        refused = api.post(f"/v1/models/{unknown}/predict", json={"inputs": [[1.0]]})
        assert refused.status_code == 404
        pages = [api.ops(url).text for url in OPERATOR_PAGES]
        pages += [api.get(url, key=OPS_KEY).text for url in OPERATOR_PAGES]
        assert "acme_secret" not in "".join(pages)
        for page in pages:
            assert secret not in page
        assert '"model":"other"' in api.ops("/status.json").text.replace(" ", "")
