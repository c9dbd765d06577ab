"""Issue 30, items 4, 7 and 12: lockouts that cannot be turned against others, label
sets callers cannot grow, and secrets that never reach text; on the real services."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio.from_thread
import httpx
import pytest
import redis
from prometheus_client import REGISTRY
from sqlalchemy.engine import Engine
from starlette.applications import Starlette

from fraud.seed import SeedSummary
from pipeline.api import create_app
from pipeline.api.auth import create_api_key
from pipeline.api.limits import AccessGuard, address_group
from pipeline.core.errors import ConfigError
from pipeline.core.settings import Settings, load_settings
from tests.conftest import fresh_version
from tests.pipeline.test_api import running

URL = "/v1/features/txn_90d/1"
REFRESH_S = 0.05  # how long a throttled guess waits at most (the key index's refresh)


class Callers:
    """Requests to an app in process, each from the client address the test names."""

    def __init__(self, app: Starlette, portal: anyio.from_thread.BlockingPortal) -> None:
        self.app = app
        self.portal = portal
        self.clients: dict[str, httpx.AsyncClient] = {}

    def get(self, url: str, *, key: str, address: str, **kwargs: Any) -> httpx.Response:
        client = self.clients.get(address)
        if client is None:
            transport = httpx.ASGITransport(app=self.app, client=(address, 40_000))
            client = self.clients[address] = httpx.AsyncClient(
                transport=transport, base_url="http://freshline.test"
            )
        headers = {"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})}
        return self.portal.call(functools.partial(client.get, url, headers=headers, **kwargs))

    def flood(self, url: str, keys: list[str], *, address: str) -> list[httpx.Response]:
        """One request per key, all at once."""
        self.get("/healthz", key="-", address=address)  # makes the address's client

        async def send() -> list[httpx.Response]:
            client = self.clients[address]
            return await asyncio.gather(
                *(client.get(url, headers={"Authorization": f"Bearer {k}"}) for k in keys)
            )

        return self.portal.call(send)


def guard(app: Starlette) -> AccessGuard:
    """The app's :class:`AccessGuard` (built with its middleware stack, on first use)."""
    layer: Any = app.middleware_stack
    while not isinstance(layer, AccessGuard):
        layer = layer.app
    return layer


@contextmanager
def calling(app: Starlette) -> Iterator[Callers]:
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(app.router.lifespan_context(app)),
    ):
        callers = Callers(app, portal)
        try:
            yield callers
        finally:
            for client in callers.clients.values():
                portal.call(client.aclose)


@pytest.fixture(scope="module")
def tenants(tenant_factory_module: Callable[..., SeedSummary]) -> list[str]:
    return tenant_factory_module(users=5, transactions=50, tenants=2).tenants


@pytest.fixture
def audit(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """The audit lines written during the test, parsed."""
    logger = logging.getLogger("freshline.audit")
    logger.addHandler(caplog.handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    yield lambda: [json.loads(r.getMessage()) for r in caplog.records if r.name == logger.name]
    logger.removeHandler(caplog.handler)
    logger.setLevel(previous)


def guarded_app(
    settings: Settings, engine: Engine, redis_client: redis.Redis, **update: Any
) -> Starlette:
    limits = {
        "schema_version": fresh_version(),
        "local_cache_size": 0,
        "api_auth_failures_burst": 3,
        "api_auth_failures_per_min": 0.001,  # no refill within a test
        "api_key_index_refresh_s": REFRESH_S,
        **update,
    }
    return create_app(
        settings.model_copy(update=limits),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
    )


def throttled(response: httpx.Response) -> bool:
    return response.status_code == 401 and "too many failed" in response.json()["error"]["message"]


# -- 4: a lockout never refuses a valid key --------------------------------------------


def test_a_valid_key_is_served_from_an_address_that_others_locked_out(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenants: list[str]
) -> None:
    app = guarded_app(settings, engine, redis_client)
    shared = "192.0.2.7"  # one NAT, or one proxy, for the attacker and the tenant
    with calling(app) as api:
        bad = [api.get(URL, key=f"fl_guess{i}", address=shared) for i in range(25)]
        assert all(r.status_code == 401 for r in bad)
        assert throttled(bad[-1])
        # Another tenant's key, never seen by this worker, from the same address.
        valid = create_api_key(engine, tenants[1])
        served = api.get(URL, key=valid, address=shared)
        assert served.status_code == 200, served.text
        # Guesses stay refused with no key lookup; a flood of them shares the reads of
        # the key index, one per refresh interval at most.
        lookups, top_ups = app.state.services.auth.lookups, guard(app).keys.top_ups
        started = time.monotonic()
        again = api.flood(URL, [f"fl_again{i}" for i in range(200)], address=shared)
        elapsed = time.monotonic() - started
        assert all(throttled(r) for r in again)
        assert app.state.services.auth.lookups == lookups
        assert guard(app).keys.top_ups - top_ups <= 1 + elapsed / REFRESH_S


def test_failed_authentications_are_counted_per_ipv6_64(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenants: list[str]
) -> None:
    app = guarded_app(settings, engine, redis_client)
    with calling(app) as api:
        rotating = [
            api.get(URL, key=f"fl_guess{i}", address=f"2001:db8:1:2::{i:x}") for i in range(1, 9)
        ]
        assert [throttled(r) for r in rotating] == [False] * 3 + [True] * 5
        # The next /64 has a budget of its own.
        other = api.get(URL, key="fl_guess", address="2001:db8:1:3::1")
        assert other.status_code == 401 and not throttled(other)


def test_address_groups() -> None:
    assert address_group("192.0.2.7") == "192.0.2.7"
    assert address_group("2001:db8:1:2:aaaa:bbbb:cccc:dddd") == "2001:db8:1:2::/64"
    assert address_group("2001:DB8:1:2::1") == "2001:db8:1:2::/64"
    assert address_group("::ffff:192.0.2.7") == "192.0.2.7"
    assert address_group("fe80::1%eth0") == "fe80::/64"
    assert address_group("not-an-address") == "not-an-address"


def test_behind_a_trusted_proxy_each_client_has_its_own_budget(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenants: list[str],
    audit: Callable[[], list[dict[str, Any]]],
) -> None:
    app = guarded_app(settings, engine, redis_client, api_trusted_proxies=["10.0.0.0/8"])
    proxy = "10.1.2.3"

    def via_proxy(client: str, key: str) -> httpx.Response:
        # The client's forged entry first, then what the proxy appended: its peer.
        forwarded = {"X-Forwarded-For": f"198.51.100.1, {client}"}
        return api.get(URL, key=key, address=proxy, headers=forwarded)

    with calling(app) as api:
        attacker = [via_proxy("203.0.113.5", f"fl_guess{i}") for i in range(6)]
        assert [throttled(r) for r in attacker] == [False] * 3 + [True] * 3
        # Another client behind the same proxy is not locked out with the attacker.
        bystander = via_proxy("203.0.113.6", "fl_typo")
        assert bystander.status_code == 401 and not throttled(bystander)
        # An untrusted peer's X-Forwarded-For is ignored: rotating it buys nothing.
        direct = [
            api.get(URL, key=f"fl_x{i}", address="192.0.2.9", headers={"X-Forwarded-For": f"{i}"})
            for i in range(1, 6)
        ]
        assert [throttled(r) for r in direct] == [False] * 3 + [True] * 2
    clients = {line["client"] for line in audit() if line["event"] == "auth.refused"}
    assert clients == {"203.0.113.5", "203.0.113.6", "192.0.2.9"}


def test_trusted_proxies_are_comma_separated_networks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRESHLINE_API_TRUSTED_PROXIES", "10.0.0.0/8, fd00::/8,192.0.2.1")
    assert load_settings().api_trusted_proxies == ["10.0.0.0/8", "fd00::/8", "192.0.2.1/32"]
    monkeypatch.setenv("FRESHLINE_API_TRUSTED_PROXIES", "*")
    with pytest.raises(ConfigError, match="FRESHLINE_API_TRUSTED_PROXIES"):
        load_settings()


# -- 7: callers cannot grow the metrics' label sets -------------------------------------


def label_values(name: str, label: str) -> set[str]:
    """Every value of ``label`` in the samples of the metric family ``name``."""
    return {
        sample.labels[label]
        for family in REGISTRY.collect()
        if family.name == name
        for sample in family.samples
        if label in sample.labels
    }


def test_llm_model_labels_are_bounded_to_configured_models(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenants: list[str]
) -> None:
    run = uuid.uuid4().hex[:8]
    named = f"bot-{run}-named"
    app = create_app(
        settings.model_copy(update={"semantic_enabled": True, "semantic_models": [named]}),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
    )
    scope: dict[str, Any] = {"model_version": "v1", "template_version": "t1", "prompt": "hi"}
    scope["params"] = {"temperature": 0}
    with running(app, create_api_key(engine, tenants[0])) as api:
        models = [f"bot-{run}-{i}" for i in range(200)] + [named]
        for model in models:
            answer = api.post("/v1/llm/cache/lookup", json={**scope, "model": model})
            assert answer.status_code == 200, answer.text
        stored = api.post(
            "/v1/llm/cache/store",
            json={**scope, "model": models[0], "response": "yo", "generation_ms": 5},
        )
        assert stored.status_code == 201, stored.text
        flagged = api.post(
            "/v1/llm/cache/flag", json={**scope, "model": models[1], "entry_id": "00000000000000aa"}
        )
        assert flagged.status_code == 200, flagged.text
        exposed = api.get("/metrics", key=None).text
    families = [
        ("freshline_semantic_lookups", "model"),
        ("freshline_semantic_stored", "model"),
        ("freshline_semantic_flagged", "model"),
        ("freshline_semantic_lookup_seconds", "model"),
        ("freshline_semantic_embedding_seconds", "model"),
        ("freshline_cache_read_seconds", "name"),
        ("freshline_cache_miss_seconds", "name"),
        ("freshline_compute_seconds", "name"),
    ]
    for family, label in families:
        seen = {v for v in label_values(family, label) if run in v}
        assert seen <= {named}, f"{family}: {len(seen)} label values from request bodies"
    assert named in label_values("freshline_semantic_lookups", "model")
    assert "other" in label_values("freshline_semantic_lookups", "model")
    assert f"bot-{run}-0" not in exposed
