"""Freshness on request: tokens from commits, reads after them, per-read staleness bounds.

Each test writes real rows and takes real tokens from ``freshline.token()``. No consumer
writes a test's own schema version unless the test runs one (``Processor``), so an entry
in Redis stays as old as the test left it.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from fraud.seed import SeedSummary
from freshline.consumers.processor import Processor
from freshline.pipeline.api import create_app
from freshline.pipeline.api import freshness as api_freshness
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.api.errors import ApiError
from freshline.pipeline.api.freshness import Demand
from freshline.pipeline.api.reader import FeatureReader, Lookup, Mode
from freshline.pipeline.cache.client import FeatureClient, freshline_token
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.tokens import SNAPSHOT, TRANSACTION, Token, decode, encode
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import ChangeEvent, EntityRef
from tests.helpers import (
    REGISTRY,
    Api,
    api_for,
    as_user,
    counting_readthrough,
    fresh_version,
    need,
    nested_checkouts,
    role_engine,
    running,
    wait_until,
)

TOKEN_SQL = sa.text("SELECT freshline.token()")


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=12, transactions=300).tenants[0]


@pytest.fixture(autouse=True)
def one_connection_per_thread(engine: Engine) -> Iterator[None]:
    """No read here checks out a second connection while it holds one (issue 48)."""
    with nested_checkouts(engine) as nested:
        yield
    assert nested == [], "a thread took a second connection from the pool"


@pytest.fixture
def fresh_settings(settings: Settings) -> Settings:
    """A schema version of the test's own; no tier unless a test turns it on."""
    return settings.model_copy(
        update={"schema_version": fresh_version(), "local_cache_size": 0, "token_wait_max_ms": 500}
    )


@pytest.fixture
def api(
    fresh_settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> Iterator[Api]:
    with api_for(fresh_settings, engine, redis_client, tenant) as client:
        yield client


def key_of(engine: Engine) -> bytes:
    with engine.connect() as conn:
        return bytes(conn.execute(sa.text("SELECT key FROM freshline.token_key")).scalar_one())


def bump(conn: sa.Connection, tenant: str, user: int) -> None:
    """A change to the user's features: every transaction of theirs costs 1000 more."""
    conn.execute(
        sa.text(
            "UPDATE transactions SET amount = amount + 1000, updated_at = now() "
            "WHERE tenant_id = :t AND user_id = :u"
        ),
        {"t": tenant, "u": user},
    )


def write(engine: Engine, tenant: str, user: int, *, inside: bool) -> str:
    """Commit a change to ``user`` and return a token taken inside its transaction (after
    the write) or right after its commit."""
    with engine.begin() as conn:
        bump(conn, tenant, user)
        token = freshline_token(conn) if inside else None
    return token or freshline_token(engine)


def truth(engine: Engine, tenant: str, user: int, feature_set: str = "txn_90d") -> Any:
    return compute(engine, REGISTRY[feature_set], [(tenant, str(user))]).values[(tenant, str(user))]


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"] and "Traceback" not in response.text


# -- the token ------------------------------------------------------------------------


def test_the_function_names_the_transaction_inside_it_and_a_snapshot_after(
    engine: Engine, tenant: str
) -> None:
    key = key_of(engine)
    with engine.begin() as conn:
        bump(conn, tenant, 1)
        inside = conn.execute(TOKEN_SQL).scalar_one()
        xid = int(conn.execute(sa.text("SELECT pg_current_xact_id()::text")).scalar_one())
    assert decode(key, inside) == Token(TRANSACTION, xid, 0)
    with engine.connect() as conn:
        after = decode(key, conn.execute(TOKEN_SQL).scalar_one())
    assert after.form == SNAPSHOT and after.a > xid  # its snapshot sees the commit
    assert len(inside) == 28 and inside.replace("-", "").replace("_", "").isalnum()


def test_writers_may_call_it_and_only_freshline_api_reads_the_key(engine: Engine) -> None:
    with engine.connect() as conn:
        checks = conn.execute(
            sa.text(
                "SELECT has_schema_privilege('public', 'freshline', 'USAGE'), "
                "has_function_privilege('public', 'freshline.token()', 'EXECUTE'), "
                "has_table_privilege('public', 'freshline.token_key', 'SELECT'), "
                "has_column_privilege('freshline_api', 'freshline.token_key', 'key', 'SELECT'), "
                "has_table_privilege('freshline_consumer', 'freshline.token_key', 'SELECT')"
            )
        ).one()
    assert tuple(checks) == (True, True, False, True, False)


def test_the_helper_takes_sqlalchemy_and_psycopg_connections(engine: Engine, tenant: str) -> None:
    key = key_of(engine)
    with engine.connect() as conn:
        bump(conn, tenant, 2)
        assert decode(key, freshline_token(conn)).form == TRANSACTION
        conn.commit()
        assert decode(key, freshline_token(conn)).form == SNAPSHOT
        assert not conn.in_transaction()  # the transaction it opened to ask has ended
    assert decode(key, freshline_token(engine)).form == SNAPSHOT

    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url) as pg:
        pg.execute(
            "UPDATE transactions SET amount = amount + 1 WHERE tenant_id = %s AND user_id = 2",
            (tenant,),
        )
        assert decode(key, freshline_token(pg)).form == TRANSACTION
        pg.commit()
        assert decode(key, freshline_token(pg)).form == SNAPSHOT
        assert pg.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


# -- reads after a token --------------------------------------------------------------


@pytest.mark.parametrize("inside", [False, True], ids=["after-commit", "in-transaction"])
@pytest.mark.parametrize("tier", [False, True], ids=["redis", "tier"])
def test_a_token_read_never_returns_a_pre_commit_value(
    fresh_settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    inside: bool,
    tier: bool,
) -> None:
    size = 100 if tier else 0
    settings = fresh_settings.model_copy(update={"local_cache_size": size})
    with api_for(settings, engine, redis_client, tenant) as api:
        before = api.get("/v1/features/txn_90d/3").json()
        assert before["source"] == "computed"
        if tier:
            local: LocalTier = api.app.state.services.reader.local
            assert wait_until(lambda: len(local) == 1)  # the tier holds the old entry
            assert api.get("/v1/features/txn_90d/3").json()["source"] == "local"
        token = write(engine, tenant, 3, inside=inside)
        new = truth(engine, tenant, 3)
        assert new != before["values"]
        assert api.get("/v1/features/txn_90d/3").json()["values"] == before["values"]  # stale

        fresh = api.get(f"/v1/features/txn_90d/3?after={token}&wait_ms=20")
        assert fresh.status_code == 200, fresh.text
        body = fresh.json()
        assert body["values"] == new
        assert body["source"] == "computed" and body["hit"] is False
        assert body["took_ms"] >= 0
        # The computed entry reaches the token: the next token read is served from cache.
        again = api.get(f"/v1/features/txn_90d/3?after={token}").json()
        assert again["values"] == new and again["source"] in ("hit", "local")


def test_a_token_read_waits_for_the_consumers_write(
    fresh_settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    settings = fresh_settings.model_copy(update={"token_wait_max_ms": 60_000})
    with api_for(settings, engine, redis_client, tenant) as api:
        old = api.get("/v1/features/txn_90d/4").json()["values"]
        token = write(engine, tenant, 4, inside=False)
        arrivals = api.app.state.services.reader.arrivals
        watched = arrivals.watches
        answers: list[httpx.Response] = []
        path = f"/v1/features/txn_90d/4?after={token}&wait_ms=30000"
        reader = threading.Thread(target=lambda: answers.append(api.get(path)))
        reader.start()
        try:
            assert wait_until(lambda: arrivals.watches > watched, 10)  # it waits for a write
            # The consumer's side, as it runs: recompute, write, publish the invalidation.
            event = ChangeEvent("transactions", "u", tenant, {"tenant_id": tenant, "user_id": 4})
            Processor(
                engine, redis_client, versions=lambda: [settings.schema_version], registry=REGISTRY
            ).apply([event])
        finally:
            reader.join(60)
    [response] = answers
    body = response.json()
    assert body["source"] == "waited" and body["hit"] is True
    assert body["values"] == truth(engine, tenant, 4) != old


@pytest.mark.parametrize("inside", [False, True], ids=["after-commit", "in-transaction"])
def test_an_entry_that_reaches_the_token_is_served_from_cache(
    api: Api, engine: Engine, redis_client: redis.Redis, tenant: str, inside: bool
) -> None:
    computed: list[list[EntityRef]] = []
    api.app.state.services.reader.readthrough.hooks.before_compute = computed.append
    token = write(engine, tenant, 5, inside=inside)
    if inside:
        # A transaction token is ranked when first read, by a snapshot then: an entry
        # computed before that is refused once (module docstring of
        # freshline.pipeline.cache.tokens).
        first = api.get(f"/v1/features/txn_90d/5?after={token}&wait_ms=0").json()
        assert first["source"] == "computed"
    else:
        store = EntryStore(
            redis_client, api.app.state.services.reader.schema_version, registry=REGISTRY
        )
        for fs in ("txn_90d", "geo"):
            store.write(compute(engine, REGISTRY[fs], [(tenant, "5")]))  # the consumer's
    computed.clear()
    single = api.get(f"/v1/features/txn_90d/5?after={token}").json()
    assert single["source"] == "hit" and single["values"] == truth(engine, tenant, 5)
    assert single["took_ms"] >= 0
    if not inside:
        batch = api.post(
            "/v1/features/batch",
            json={"feature_sets": ["txn_90d", "geo"], "entities": [5], "after": token},
        ).json()
        assert [i["source"] for i in batch["items"]] == ["hit", "hit"]
    assert computed == []


def test_the_tier_serves_an_entry_only_if_it_reaches_the_token(
    fresh_settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    settings = fresh_settings.model_copy(update={"local_cache_size": 100})
    with api_for(settings, engine, redis_client, tenant) as api:
        local: LocalTier = api.app.state.services.reader.local
        assert local.wait_live(5)
        before = freshline_token(engine)  # a token the entry computed next reaches
        assert api.get("/v1/features/geo/6").json()["source"] == "computed"
        assert wait_until(lambda: len(local) == 1)
        assert api.get(f"/v1/features/geo/6?after={before}").json()["source"] == "local"
        later = write(engine, tenant, 6, inside=False)
        body = api.get(f"/v1/features/geo/6?after={later}&wait_ms=0").json()
        assert body["source"] == "computed"
        assert body["values"] == truth(engine, tenant, 6, "geo")


def test_the_wait_is_bounded_then_the_read_computes(api: Api, engine: Engine, tenant: str) -> None:
    arrivals = api.app.state.services.reader.arrivals
    api.get("/v1/features/txn_90d/7")
    token = write(engine, tenant, 7, inside=False)
    watched = arrivals.watches
    # Beyond the server's maximum (500 ms here): cut to it, and then computed.
    body = api.get(f"/v1/features/txn_90d/7?after={token}&wait_ms=3600000").json()
    assert arrivals.watches == watched + 1  # it waited for a write, which never came
    assert body["source"] == "computed" and body["values"] == truth(engine, tenant, 7)
    batch = api.post(
        "/v1/features/batch",
        json={"feature_sets": ["txn_90d"], "entities": [7, 8], "after": token, "wait_ms": 10},
    ).json()
    # 7 was stored by the read above; 8 was never read, so it is computed after the wait.
    assert [(i["entity"], i["source"]) for i in batch["items"]] == [("7", "hit"), ("8", "computed")]


def test_cache_only_waits_and_then_reports_a_miss(api: Api, engine: Engine, tenant: str) -> None:
    api.get("/v1/features/txn_90d/9")
    token = write(engine, tenant, 9, inside=False)
    miss = api.get(f"/v1/features/txn_90d/9?mode=cache-only&after={token}&wait_ms=10")
    assert_error(miss, 404, "miss")


def test_a_token_of_a_transaction_still_open_is_409_until_it_commits(
    api: Api, engine: Engine, tenant: str
) -> None:
    with engine.connect() as conn:
        bump(conn, tenant, 10)
        token = freshline_token(conn)
        pending = api.get(f"/v1/features/txn_90d/10?after={token}&wait_ms=10")
        assert_error(pending, 409, "token_pending")
        conn.commit()
    body = api.get(f"/v1/features/txn_90d/10?after={token}").json()
    assert body["values"] == truth(engine, tenant, 10)


def test_a_token_ahead_of_the_database_is_400(api: Api, engine: Engine) -> None:
    key = key_of(engine)
    with engine.connect() as conn:
        xmax = int(
            conn.execute(
                sa.text("SELECT pg_snapshot_xmax(pg_current_snapshot())::text")
            ).scalar_one()
        )
    for token in (encode(key, SNAPSHOT, xmax + 10**6, 0), encode(key, TRANSACTION, xmax + 10**6)):
        assert_error(api.get(f"/v1/features/txn_90d/1?after={token}&wait_ms=0"), 400, "token_ahead")


def test_a_reader_without_an_asyncio_client_reads_fresh_in_the_thread_pool(
    redis_client: redis.Redis, engine: Engine, tenant: str
) -> None:
    version = fresh_version()
    reader = FeatureReader(
        ReadThrough(EntryStore(redis_client, version, registry=REGISTRY), engine)
    )
    token = write(engine, tenant, 12, inside=False)
    demand = Demand(token, None, 10)
    try:
        cases: tuple[tuple[Mode, str], ...] = (("cache-only", "miss"), ("read-through", "computed"))
        for mode, source in cases:
            lookup = Lookup(tenant, ("txn_90d",), ("12",))
            read = api_freshness.read(reader, lookup, mode, demand, run_in_threadpool)
            [found] = asyncio.run(read)
            assert found["source"] == source and found["took_ms"] >= 0
        assert found["values"] == truth(engine, tenant, 12)
    finally:
        reader.close()


# -- staleness bounds ------------------------------------------------------------------


def test_max_staleness_zero_recomputes_and_a_loose_bound_serves_the_cache(api: Api) -> None:
    computed: list[list[EntityRef]] = []
    api.app.state.services.reader.readthrough.hooks.before_compute = computed.append
    assert api.get("/v1/features/device_risk/2").json()["source"] == "computed"
    assert api.get("/v1/features/device_risk/2").json()["source"] == "hit"
    zero = api.get("/v1/features/device_risk/2?max_staleness_ms=0").json()
    assert zero["source"] == "computed" and "took_ms" in zero
    loose = api.get("/v1/features/device_risk/2?max_staleness_ms=600000").json()
    assert loose["source"] == "hit"
    batch = api.post(
        "/v1/features/batch",
        json={"feature_sets": ["device_risk"], "entities": [2, 3], "max_staleness_ms": 0},
    ).json()
    assert [i["source"] for i in batch["items"]] == ["computed", "computed"]
    assert [len(g) for g in computed] == [1, 1, 2]


def bounded(**bounds: int) -> Registry:
    """The example's feature sets, ``bounds`` declaring their ``max_staleness_ms``."""
    return Registry(
        dataclasses.replace(fs, max_staleness_ms=bounds[fs.name]) if fs.name in bounds else fs
        for fs in REGISTRY
    )


def test_a_declared_bound_applies_to_plain_reads_and_a_given_one_wins(
    fresh_settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    registry = bounded(device_risk=0, geo=600_000)
    with api_for(fresh_settings, engine, redis_client, tenant, registry=registry) as api:
        computed: list[list[EntityRef]] = []
        api.app.state.services.reader.readthrough.hooks.before_compute = computed.append
        # device_risk declares 0: every plain read recomputes, as max_staleness_ms=0 does.
        assert api.get("/v1/features/device_risk/2").json()["source"] == "computed"
        again = api.get("/v1/features/device_risk/2").json()
        assert again["source"] == "computed" and "took_ms" in again
        # A bound the request gives wins over the declared one.
        assert (
            api.get("/v1/features/device_risk/2?max_staleness_ms=600000").json()["source"] == "hit"
        )
        # geo declares a loose bound: its cached entry is served.
        assert api.get("/v1/features/geo/2").json()["source"] == "computed"
        assert api.get("/v1/features/geo/2").json()["source"] == "hit"
        # A batch takes its sets' smallest bound.
        batch = api.post(
            "/v1/features/batch", json={"feature_sets": ["geo", "device_risk"], "entities": [2]}
        ).json()
        assert [i["source"] for i in batch["items"]] == ["computed", "computed"]
        # txn_90d declares none: a plain read is the plain path.
        api.get("/v1/features/txn_90d/2")
        assert "took_ms" not in api.get("/v1/features/txn_90d/2").json()


def test_the_client_honours_a_declared_bound(
    fresh_settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    registry = bounded(device_risk=0)
    store = EntryStore(redis_client, fresh_settings.schema_version, registry=registry)
    batch = compute(engine, registry["device_risk"], [(tenant, "2")])
    store.write(batch)
    plain = FeatureClient(redis_client, fresh_settings.schema_version, registry=REGISTRY)
    assert plain.get("device_risk", tenant, 2) is not None
    # Declared 0 and nothing to recompute with: the cached entry is a miss.
    bounded_client = FeatureClient(redis_client, fresh_settings.schema_version, registry=registry)
    assert bounded_client.get("device_risk", tenant, 2) is None
    # With a read-through it recomputes instead.
    rt, counted = counting_readthrough(store, engine)
    through = FeatureClient(
        redis_client, fresh_settings.schema_version, registry=registry, readthrough=rt
    )
    found = through.get("device_risk", tenant, 2)
    assert found is not None and found.values == batch.values[(tenant, "2")]
    assert counted


# -- bad tokens and parameters ---------------------------------------------------------


def _flip(token: str) -> str:
    raw = bytearray(base64.urlsafe_b64decode(token))
    raw[3] ^= 1
    return base64.urlsafe_b64encode(bytes(raw)).decode()


BAD_TOKENS: dict[str, Callable[[bytes, str], str]] = {
    "empty": lambda key, good: "",
    "short": lambda key, good: good[:-1],
    "long": lambda key, good: good + "A",
    "padded": lambda key, good: good[:-1] + "=",
    "not-base64url": lambda key, good: good[:-1] + "+",
    "altered": lambda key, good: _flip(good),
    "forged": lambda key, good: "A" * 28,
    "foreign": lambda key, good: encode(bytes(32), SNAPSHOT, 10, 0),
    "unknown-form": lambda key, good: encode(key, 3, 10, 0),
    "transaction-with-count": lambda key, good: encode(key, TRANSACTION, 10, 1),
}


# Of the right shape, but not signed by this database (or of a form it does not know):
# refused as not the caller's to use, 403. A malformed one is a bad request, 400: the
# OpenAPI document's pattern says which is which, and no schema can check a signature.
NOT_SIGNED_HERE = {"altered", "forged", "foreign", "unknown-form", "transaction-with-count"}


@pytest.mark.parametrize("bad", list(BAD_TOKENS))
def test_a_malformed_forged_or_foreign_token_is_refused(api: Api, engine: Engine, bad: str) -> None:
    token = BAD_TOKENS[bad](key_of(engine), freshline_token(engine))
    status, code = (403, "foreign_token") if bad in NOT_SIGNED_HERE else (400, "invalid_token")
    single = api.get("/v1/features/txn_90d/1", params={"after": token})
    assert_error(single, status, code)
    batch = api.post(
        "/v1/features/batch", json={"feature_sets": ["txn_90d"], "entities": [1], "after": token}
    )
    assert_error(batch, status, code)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("GET", "/v1/features/txn_90d/1?max_staleness_ms=-1", None, 400, "invalid_parameter"),
        ("GET", "/v1/features/txn_90d/1?max_staleness_ms=1.5", None, 400, "invalid_parameter"),
        (
            "GET",
            "/v1/features/txn_90d/1?max_staleness_ms=0&wait_ms=x",
            None,
            400,
            "invalid_parameter",
        ),
        ("GET", "/v1/features/txn_90d/1?wait_ms=" + "9" * 20, None, 400, "invalid_parameter"),
        ("POST", "/v1/features/batch", {"after": 7}, 400, "invalid_token"),
        ("POST", "/v1/features/batch", {"max_staleness_ms": "0"}, 422, "invalid_request"),
        ("POST", "/v1/features/batch", {"max_staleness_ms": True}, 422, "invalid_request"),
        ("POST", "/v1/features/batch", {"max_staleness_ms": -1}, 422, "invalid_request"),
        (
            "POST",
            "/v1/features/batch",
            {"max_staleness_ms": 0, "wait_ms": 0.5},
            422,
            "invalid_request",
        ),
        ("POST", "/v1/features/batch?max_staleness_ms=0", {}, 400, "invalid_parameter"),
    ],
)
def test_bad_freshness_parameters_get_a_json_4xx(
    api: Api, method: str, path: str, body: dict[str, Any] | None, status: int, code: str
) -> None:
    if body is None:
        response = api.get(path)
    else:
        response = api.post(path, json={"feature_sets": ["txn_90d"], "entities": [1], **body})
    assert_error(response, status, code)


def test_the_openapi_document_describes_the_parameters(api: Api) -> None:
    spec = api.get("/openapi.json", key=None).json()
    get = spec["paths"]["/v1/features/{feature_set}/{entity_id}"]["get"]
    names = {p["name"] for p in get["parameters"]}
    assert {"after", "wait_ms", "max_staleness_ms"} <= names
    assert "409" in get["responses"] and "invalid_token" in get["responses"]["400"]["description"]
    batch = spec["components"]["schemas"]["BatchRequest"]["properties"]
    assert {"after", "wait_ms", "max_staleness_ms"} <= set(batch)
    assert "took_ms" in spec["components"]["schemas"]["Features"]["properties"]


# -- least-privilege logins -------------------------------------------------------------


def test_the_service_logins_take_tokens_and_serve_reads_after_them(
    settings: Settings, engine: Engine, tenant: str
) -> None:
    """The API's Postgres role and Redis user serve reads after both token forms; a role
    that is neither the owner nor the API's (the consumer's) may take tokens. Under an
    ACL without ``rank:*`` the transaction token's rank stays in the worker: still served."""
    api_user = as_user(
        settings, need("FRESHLINE_STACK_REDIS_API_USER"), need("FRESHLINE_STACK_REDIS_API_PASSWORD")
    )
    api_role = role_engine(settings, "FRESHLINE_STACK_POSTGRES_API_URL")
    writer_role = role_engine(settings, "FRESHLINE_STACK_POSTGRES_CONSUMER_URL")
    key = key_of(engine)
    local = api_user.model_copy(update={"schema_version": fresh_version(), "local_cache_size": 0})
    app = create_app(local, engine=api_role, follow_deploys=False, registry=REGISTRY)
    try:
        with writer_role.begin() as conn:
            conn.execute(sa.text("SELECT pg_current_xact_id()"))  # a transaction id, as a write
            inside = freshline_token(conn)
        after = freshline_token(writer_role)
        assert [decode(key, t).form for t in (inside, after)] == [TRANSACTION, SNAPSHOT]
        with running(app, create_api_key(engine, tenant)) as api:
            for token in (inside, after):
                body = api.get(f"/v1/features/txn_90d/1?after={token}&wait_ms=0").json()
                assert body["values"] == truth(engine, tenant, 1), body
    finally:
        api_role.dispose()
        writer_role.dispose()


# -- the Python client -----------------------------------------------------------------


def test_the_client_honours_tokens_and_staleness_bounds(
    engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    version = fresh_version()
    rt, computed = counting_readthrough(
        EntryStore(redis_client, version, registry=REGISTRY), engine
    )
    client = FeatureClient(redis_client, version, readthrough=rt, registry=REGISTRY)
    tier = LocalTier(redis_client, max_entries=100, registry=REGISTRY).start()
    tiered = FeatureClient(redis_client, version, readthrough=rt, local=tier, registry=REGISTRY)
    try:
        assert tier.wait_live(5)
        rt.get(EntityRef("txn_90d", tenant, "11"))
        assert tiered.get("txn_90d", tenant, 11) is not None  # the tier holds the old entry
        assert wait_until(lambda: len(tier) == 1)
        hits = tier.stats.hits
        old = tiered.get("txn_90d", tenant, 11)
        assert old is not None and tier.stats.hits == hits + 1  # served by the tier

        token = write(engine, tenant, 11, inside=True)
        for reader in (tiered, client):
            got = reader.get("txn_90d", tenant, 11, after=token, wait_ms=10)
            assert got is not None
            assert got.values == truth(engine, tenant, 11) != old.values
        # The first read computed and stored; the second, in a client of its own, ranked
        # the token alike (shared in Redis) and took that entry.
        assert [len(g) for g in computed] == [1, 1]
        assert rt.counters.hits == 0  # the old entry in Redis was never served

        zero = client.get_many(
            [("txn_90d", tenant, 11), ("txn_90d", tenant, 12)], max_staleness_ms=0
        )
        assert all(f is not None for f in zero)
        assert [len(g) for g in computed] == [1, 1, 2]
        # The client without a tier reads first after another write: the entry in Redis
        # predates the token, so it is not served but computed anew.
        before = client.get("txn_90d", tenant, 11)
        token = write(engine, tenant, 11, inside=False)
        got = client.get("txn_90d", tenant, 11, after=token, wait_ms=10)
        assert got is not None and before is not None
        assert got.values == truth(engine, tenant, 11) != before.values
        assert [len(g) for g in computed] == [1, 1, 2, 1]
        with pytest.raises(ConfigError, match="readthrough"):
            FeatureClient(redis_client, version, registry=REGISTRY).get(
                "txn_90d", tenant, 11, after=token
            )
    finally:
        client.close()
        tiered.close()
        tier.close()


def test_a_token_sent_again_is_checked_once_and_a_forged_one_every_time(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import freshline.pipeline.cache.tokens as tokens_module

    checked: list[object] = []
    real = tokens_module.decode

    def decode(key: bytes, text: object) -> Token:
        checked.append(text)
        return real(key, text)

    monkeypatch.setattr(tokens_module, "decode", decode)
    tokens = tokens_module.Tokens(engine)
    text = freshline_token(engine)
    assert tokens.parse(text) == tokens.parse(text) == real(key_of(engine), text)
    assert checked == [text]
    forged = BAD_TOKENS["forged"](key_of(engine), text)
    for _ in range(2):
        with pytest.raises(tokens_module.InvalidToken):
            tokens.parse(forged)
    assert checked == [text, forged, forged]


@pytest.mark.parametrize(
    "query",
    [
        b"after=AbC-_9",
        b"after=a&after=b",
        b"mode=cache-only&after=x&wait_ms=5",
        b"after",
        b"after=&wait_ms=",
        b"a=b=c&&d=e",
        b"after=%41b",
        b"after=a+b",
        b"x=\xe9",
    ],
)
def test_a_query_is_split_as_starlette_parses_it(query: bytes) -> None:
    from starlette.requests import Request

    from freshline.pipeline.api.routes import query_of

    request = Request({"type": "http", "query_string": query})
    assert dict(query_of(request)) == dict(request.query_params)


def test_a_query_parsed_once_reads_as_one_parsed_each_time(api: Api, engine: Engine) -> None:
    """The feature route keeps each good query string's parse (a reader sends one token
    with each of its reads): the kept answer is the fresh one, a refused query is not
    kept, the kept ones are bounded, and a token kept this way is still checked."""
    from starlette.requests import Request

    from freshline.pipeline.api.routes import QUERIES_KEPT, read_options

    settings = Settings()
    kept: dict[bytes, Any] = {}

    def options(query: bytes) -> Any:
        return read_options(Request({"type": "http", "query_string": query}), settings, kept)

    token = freshline_token(engine)
    query = f"after={token}&wait_ms=7&mode=cache-only".encode()
    assert options(query) == read_options(
        Request({"type": "http", "query_string": query}), settings
    )
    assert options(query) == ("cache-only", Demand(token, None, 7, True)) and list(kept) == [query]
    for _ in range(2):
        with pytest.raises(ApiError):
            options(b"max_staleness_ms=-1")
    assert list(kept) == [query]
    for n in range(QUERIES_KEPT + 5):
        options(f"max_staleness_ms={n}".encode())
    assert len(kept) == QUERIES_KEPT and query not in kept  # the oldest went first
    assert options(b"max_staleness_ms=1") == (
        "read-through",
        Demand(None, 1, settings.token_wait_ms),
    )

    forged = BAD_TOKENS["forged"](key_of(engine), token)
    for _ in range(2):  # the second from the kept parse: the token is checked again
        assert_error(
            api.get("/v1/features/txn_90d/1", params={"after": forged}), 403, "foreign_token"
        )


def test_default_waits_stop_while_they_do_not_pay_and_a_sized_one_still_waits(
    fresh_settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    settings = fresh_settings.model_copy(update={"token_wait_ms": 20})
    with api_for(settings, engine, redis_client, tenant) as api:
        reader = api.app.state.services.reader
        reader.waits.probe_s = 3600.0  # no probe within the test
        arrivals = reader.arrivals

        def token_read(user: int, query: str = "") -> dict[str, Any]:
            api.get(f"/v1/features/txn_90d/{user}")  # cached before the write
            token = write(engine, tenant, user, inside=False)
            body: dict[str, Any] = api.get(
                f"/v1/features/txn_90d/{user}?after={token}{query}"
            ).json()
            assert body["source"] == "computed" and body["values"] == truth(engine, tenant, user)
            return body

        for user in range(6, 6 + reader.waits.misses):
            # No consumer runs: each wait ends without the write it waits for.
            watches = arrivals.watches
            token_read(user)
            assert arrivals.watches == watches + 1
        assert reader.waits.missed == reader.waits.misses and reader.waits.skipped == 0
        # Waiting no longer pays: the next read goes straight to the recompute.
        watches = arrivals.watches
        token_read(10)
        assert arrivals.watches == watches and reader.waits.skipped == 1
        # A read that sizes its own wait is waited in full.
        token_read(11, "&wait_ms=20")
        assert arrivals.watches == watches + 1 and reader.waits.skipped == 1


def test_a_wait_history_probes_while_waits_miss_and_resumes_on_an_arrival() -> None:
    from freshline.pipeline.cache.arrivals import WaitHistory

    now = [0.0]
    history = WaitHistory(misses=2, probe_s=10.0, clock=lambda: now[0])
    assert history.worth()
    history.record(False)
    assert history.worth()
    now[0] = 1.0
    history.record(False)  # two in a row
    assert not history.worth() and not history.worth()
    assert history.skipped == 2
    now[0] = 11.0
    assert history.worth()  # a probe, 10 s after the last miss
    assert not history.worth()  # one per period
    history.record(True)  # it got its write: waiting pays again
    assert history.worth() and history.worth() and history.skipped == 3
