"""Issue 30, items 4, 7 and 12: lockouts that cannot be turned against others, label
sets callers cannot grow, and secrets that never reach text; on the real services."""

from __future__ import annotations

import asyncio
import functools
import http.server
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict

import anyio.from_thread
import httpx
import numpy as np
import pytest
import redis
import sqlalchemy as sa
from prometheus_client import REGISTRY as METRICS
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.middleware.authentication import AuthenticationMiddleware

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.api.addresses import address_group
from freshline.pipeline.api.authentication import ApiKeyBackend
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.settings import Settings, load_settings, redact
from freshline.pipeline.inference.models import LogisticModel, ModelRegistry
from tests.helpers import REGISTRY, api_app, http_server, running

URL = "/v1/features/txn_90d/1"
REFRESH_S = 0.05  # how long a throttled guess waits at most (the key index's refresh)


class Services(TypedDict, total=False):
    """The clients :func:`create_app` takes instead of making its own."""

    engine: Engine
    redis_client: redis.Redis


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


def guard(app: Starlette) -> ApiKeyBackend:
    """The app's :class:`ApiKeyBackend` (built with its middleware stack, on first use)."""
    layer: Any = app.middleware_stack
    while not isinstance(layer, AuthenticationMiddleware):
        # granian's proxy-header wrapper copies the attributes of what it wraps.
        layer = getattr(layer, "__wrapped__", None) or layer.app
    assert isinstance(layer.backend, ApiKeyBackend)
    return layer.backend


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


def guarded_app(
    settings: Settings, engine: Engine, redis_client: redis.Redis, **update: Any
) -> Starlette:
    limits = {
        "api_auth_failures_burst": 3,
        "api_auth_failures_per_min": 0.001,  # no refill within a test
        "api_key_index_refresh_s": REFRESH_S,
        **update,
    }
    return api_app(settings, engine, redis_client, **limits)


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


def test_a_flood_of_guesses_at_once_looks_up_no_more_keys_than_the_budget(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenants: list[str]
) -> None:
    # Guesses sent at once, before any has failed, must not each find the budget
    # unspent: every one would be a Postgres lookup in the thread pool.
    app = guarded_app(settings, engine, redis_client)
    with calling(app) as api:
        guesses = api.flood(URL, [f"fl_herd{i}" for i in range(60)], address="192.0.2.8")
        assert all(r.status_code == 401 for r in guesses)
        assert app.state.services.auth.lookups <= 3  # api_auth_failures_burst
        # A valid key from the locked-out address is still served, and gives back
        # nothing it did not take: the next guess is refused with no lookup.
        valid = create_api_key(engine, tenants[1])
        assert api.get(URL, key=valid, address="192.0.2.8").status_code == 200
        lookups = app.state.services.auth.lookups
        assert throttled(api.get(URL, key="fl_herd_after", address="192.0.2.8"))
        assert app.state.services.auth.lookups == lookups


def test_a_valid_key_gives_back_the_failure_token_its_lookup_took(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenants: list[str]
) -> None:
    app = guarded_app(settings, engine, redis_client)
    valid = [create_api_key(engine, tenants[i % 2]) for i in range(5)]
    with calling(app) as api:
        # More valid keys than the failure budget, never seen: each is looked up and
        # served, and none of them spends the address's budget of failures.
        assert all(api.get(URL, key=k, address="192.0.2.10").status_code == 200 for k in valid)
        guesses = [api.get(URL, key=f"fl_guess{i}", address="192.0.2.10") for i in range(4)]
        assert [throttled(r) for r in guesses] == [False] * 3 + [True]


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
        for family in METRICS.collect()
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
        registry=REGISTRY,
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
        exposed = api.ops("/metrics").text
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


# -- 12: no secret or internal address in text -----------------------------------------

SECRETS = ("pg-pa@ss:w0rd", "r3d:is@pw", "adm/in@pw", "emb@pw:x", "sk-embed-key", "kafka-pw")


def test_settings_and_redact_never_show_a_password() -> None:
    s = Settings(
        # A database URL needs an '@' in its password written %40 (Settings refuse it
        # raw: tests/test_redaction.py); redact() masks a raw one all the same, below.
        postgres_url="postgresql+psycopg://svc:pg-pa%40ss:w0rd@db.internal:5432/app",
        postgres_admin_url="postgresql+psycopg://owner:adm%2Fin%40pw@db.internal/app?password=adm/in@pw",
        redis_url="redis://api:r3d:is@pw@cache.internal:6379/0",
        redis_password=SecretStr("r3d:is@pw"),
        kafka_sasl_password=SecretStr("kafka-pw"),
        semantic_embeddings_url="https://user:emb@pw:x@embed.internal/v1",
        semantic_embeddings_api_key=SecretStr("sk-embed-key"),
    )
    texts = [str(s), repr(s), str(s.redacted()), f"{s}", f"{s!r}"]
    texts += [redact(url) for url in (s.postgres_url, s.redis_url, s.semantic_embeddings_url)]
    texts.append(redact(s.postgres_admin_url))
    texts.append(redact("postgresql+psycopg://svc:pg-pa@ss:w0rd@db.internal:5432/app"))
    for text in texts:
        for secret in SECRETS:
            for part in (secret, *secret.split("@")[1:]):  # nor what follows an '@' in it
                assert part not in text, f"{part!r} in {text!r}"
    assert redact(s.postgres_url) == "postgresql+psycopg://svc:***@db.internal:5432/app"
    assert redact(s.redis_url) == "redis://api:***@cache.internal:6379/0"
    assert redact("redis://:pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact("redis://cache.internal:6379/0") == "redis://cache.internal:6379/0"


def answering(status: int, body: bytes) -> type[http.server.BaseHTTPRequestHandler]:
    """A request handler that answers every POST with ``status`` and ``body``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def upstream() -> Iterator[str]:
    """An embeddings endpoint that fails, naming internals the API must not repeat."""
    body = b'{"error": "quota of org-internal-42 exceeded, key sk-upstream"}'
    with http_server(answering(500, body)) as url:
        yield url


def test_server_errors_name_no_internal_url_path_or_upstream_text(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenants: list[str],
    upstream: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)

    def app_embedding_at(url: str) -> Starlette:
        update = {"semantic_enabled": True, "semantic_embeddings_url": url, "semantic_warm": False}
        return create_app(
            settings.model_copy(update=update),
            engine=engine,
            redis_client=redis_client,
            follow_deploys=False,
            registry=REGISTRY,
        )

    lookup: dict[str, Any] = {"model": "bot", "model_version": "v1", "template_version": "t1"}
    lookup.update(prompt="hi", params={"temperature": 0})
    key = create_api_key(engine, tenants[0])
    answers: list[httpx.Response] = []
    # An embeddings endpoint that does not answer (503), one that fails (502).
    dead = "http://127.0.0.1:1/v1"
    failing = f"{upstream}/v1"
    for url in (dead, failing):
        with running(app_embedding_at(url), key) as api:
            answers.append(api.post("/v1/llm/cache/lookup", json=lookup))
    # A registered model whose file has gone (500).
    name = f"m_{uuid.uuid4().hex[:10]}"
    x = np.random.default_rng(0).normal(size=(50, 2))
    y = (x[:, 0] > 0).astype(float)
    model = LogisticModel.fit(x, y, version="v1", feature_names=("a", "b"), name=name, epochs=5)
    (tmp_path / "internal-models").mkdir()
    path = model.save(tmp_path / "internal-models" / "v1.json")
    ModelRegistry(redis_client).register(path)
    path.unlink()
    app = create_app(
        settings, engine=engine, redis_client=redis_client, follow_deploys=False, registry=REGISTRY
    )
    with running(app, key) as api:
        answers.append(api.post(f"/v1/models/{name}/predict", json={"inputs": [[0.1, 0.2]]}))

    # Redis, then Postgres, not answering (503 both).
    dead_redis = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)
    dead_pg = sa.create_engine(engine.url.set(port=1), connect_args={"connect_timeout": 1})
    cases: tuple[Services, ...] = (
        {"redis_client": dead_redis, "engine": engine},
        {"engine": dead_pg},
    )
    for services in cases:
        services.setdefault("redis_client", redis_client)
        app = create_app(settings, follow_deploys=False, **services, registry=REGISTRY)
        with running(app, key) as api:
            answers.append(api.get(URL))
    dead_pg.dispose()
    dead_redis.close()

    assert [a.status_code for a in answers] == [503, 502, 500, 503, 503]
    for answer in answers:
        text = answer.text
        leaks = ("127.0.0.1", "/v1/embeddings", "org-internal", "sk-upstream", ":1/", "port 1")
        for leak in (*leaks, settings.redis_url, settings.postgres_url):
            assert leak not in text, f"{leak!r} in {text}"
        assert str(tmp_path) not in text and "internal-models" not in text
    # The operator's log has what failed.
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "127.0.0.1:1/v1/embeddings" in logged and "org-internal" in logged
    assert str(path) in logged
