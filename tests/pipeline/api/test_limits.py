"""Least privilege and abuse resistance of the read API (issue 14), on the real services:
the key lifecycle, revocation across workers, the per-tenant rate limit, the failed-auth
limit per address, the audit log, disconnects mid-body, unknown entities, non-finite
predictions and the OpenAPI document's limits."""

from __future__ import annotations

import hmac
import json
import logging
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event
from sqlalchemy.engine import Engine

import freshline.pipeline.api.auth as auth_module
from fraud.seed import SeedSummary
from freshline.pipeline.api import accounts, metrics
from freshline.pipeline.api.accounts import (
    UnknownKey,
    create_api_key,
    create_tenant,
    issue_api_key,
    list_api_keys,
    revoke_api_key,
)
from freshline.pipeline.api.auth import Authenticator, Unauthorized
from freshline.pipeline.api.buckets import TokenBuckets
from freshline.pipeline.api.openapi import document
from freshline.pipeline.api.reader import parse_entity
from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.keys import feature_pattern
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.inference.models import LogisticModel, ModelRegistry
from tests.helpers import (
    REGISTRY,
    api_app,
    cli,
    fresh_version,
    running,
    serving,
    wait_until,
)


def fresh_tenant() -> str:
    return f"lim-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def tenant(engine: Engine) -> str:
    """A new tenant, with its first key."""
    name = fresh_tenant()
    create_tenant(engine, name)
    return name


def assert_refused(auth: Authenticator, key: str, reason: str, key_id: str) -> None:
    """``auth`` refuses ``key`` for ``reason``, naming the key's id."""
    with pytest.raises(Unauthorized) as refused:
        auth.principal(key)
    assert refused.value.reason == reason and refused.value.key_id == key_id


class Queries:
    """Counts the statements an engine runs (SQLAlchemy's cursor events)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.statements: list[str] = []

    def _seen(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.statements.append(statement)

    def __enter__(self) -> Queries:
        event.listen(self.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._seen)

    def count(self, needle: str) -> int:
        return sum(needle in s for s in self.statements)


# -- the key lifecycle (finding 4) ------------------------------------------------------


def test_keys_have_an_id_label_and_times_and_list_never_shows_them(engine: Engine) -> None:
    tenant = fresh_tenant()
    first = create_tenant(engine, tenant)
    later = datetime.now(UTC) + timedelta(days=30)
    issued = issue_api_key(engine, tenant, label="scoring service", expires_at=later)
    keys = {k.key_id: k for k in list_api_keys(engine, tenant)}
    assert issued.key_id in keys and len(keys) == 2
    info = keys[issued.key_id]
    assert info.label == "scoring service" and info.tenant == tenant
    assert info.expires_at == later and info.last_used_at is None and info.revoked_at is None
    assert info.state() == "active"
    assert first not in repr(keys) and issued.key not in repr(keys)


def test_revocation_reaches_every_worker_through_the_channel(
    engine: Engine, redis_client: redis.Redis
) -> None:
    key = create_tenant(engine, fresh_tenant())
    # Two workers, each with its own cache and subscription. A minute-long cache
    # lifetime: only the channel can make the second one forget within the bound.
    one = Authenticator(engine, redis_client=redis_client, ttl_s=60).start()
    two = Authenticator(engine, redis_client=redis_client, ttl_s=60).start()
    try:
        assert one.wait_live(5) and two.wait_live(5)
        principal = two.principal(key)
        assert one.principal(key) == principal
        assert two.cached(key) == (True, principal)

        revoke_api_key(engine, redis_client, principal.key_id)
        assert wait_until(lambda: two.cached(key) == (False, None), timeout=1.0)
        assert_refused(two, key, "revoked_key", principal.key_id)
        with pytest.raises(Unauthorized):
            one.principal(key)
    finally:
        one.close()
        two.close()


def test_a_worker_cut_off_from_the_channel_trusts_no_cached_key(
    engine: Engine, private_redis: tuple[str, Callable[[], None], Callable[[], None]]
) -> None:
    url, stop, _start = private_redis
    client = redis.Redis.from_url(url)
    key = create_tenant(engine, fresh_tenant())
    worker = Authenticator(engine, redis_client=client, ttl_s=60, silence_s=0.2).start()
    try:
        assert worker.wait_live(5)
        worker.principal(key)
        assert worker.cached(key)[0]
        stop()  # the revocation could not be delivered now
        assert wait_until(lambda: not worker.cached(key)[0], timeout=5)
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE freshline.api_keys SET revoked_at = now() WHERE key_hash = :h"),
                {"h": accounts.hash_key(key)},
            )
        with pytest.raises(Unauthorized):
            worker.principal(key)
    finally:
        worker.close()
        client.close()


def test_keys_are_compared_in_constant_time_and_cached_keys_hash_nothing(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = create_tenant(engine, fresh_tenant())
    compared: list[tuple[str, str]] = []
    hashed: list[str] = []
    real_compare, real_hash = hmac.compare_digest, accounts.hash_key

    def compare(a: str, b: str) -> bool:
        compared.append((a, b))
        return real_compare(a, b)

    def hash_key(k: str) -> str:
        hashed.append(k)
        return real_hash(k)

    monkeypatch.setattr(hmac, "compare_digest", compare)  # the module auth calls it from
    monkeypatch.setattr(auth_module, "hash_key", hash_key)
    auth = Authenticator(engine)
    principal = auth.principal(key)  # from Postgres: the stored hash, compared
    assert auth.principal(key) == principal  # from the cache, keyed by the key
    assert auth.cached(key) == (True, principal)
    digest = real_hash(key)
    assert compared == [(digest, digest)]
    assert hashed == [key] and auth.lookups == 1
    with pytest.raises(Unauthorized):  # a key one character off is not the cached one
        auth.principal(key[:-1] + ("A" if key[-1] != "A" else "B"))


def test_a_key_that_expires_while_cached_is_refused_as_expired(engine: Engine, tenant: str) -> None:
    soon = issue_api_key(engine, tenant, expires_at=datetime.now(UTC) + timedelta(seconds=1))
    auth = Authenticator(engine, ttl_s=600)
    principal = auth.principal(soon.key)
    assert auth.cached(soon.key) == (True, principal)
    # The cache keeps it for ten minutes, but not past the key's own expiry.
    assert wait_until(lambda: auth.cached(soon.key) == (False, None), timeout=10)
    assert_refused(auth, soon.key, "expired_key", soon.key_id)


def test_expired_keys_are_refused(engine: Engine, tenant: str) -> None:
    soon = issue_api_key(engine, tenant, expires_at=datetime.now(UTC) + timedelta(hours=1))
    past = issue_api_key(engine, tenant, expires_at=datetime.now(UTC) - timedelta(seconds=1))
    auth = Authenticator(engine)
    assert auth.principal(soon.key).key_id == soon.key_id
    assert_refused(auth, past.key, "expired_key", past.key_id)


def test_last_use_is_written_in_batches_not_per_request(engine: Engine, tenant: str) -> None:
    issued = issue_api_key(engine, tenant)
    auth = Authenticator(engine, last_used_interval_s=3600)
    with Queries(engine) as queries:
        for _ in range(50):
            auth.principal(issued.key)
        assert queries.count("UPDATE freshline.api_keys") == 0
        assert auth.flush_usage() == 1
        assert queries.count("UPDATE freshline.api_keys") == 1
    [info] = [k for k in list_api_keys(engine, tenant) if k.key_id == issued.key_id]
    assert info.last_used_at is not None
    assert datetime.now(UTC) - info.last_used_at < timedelta(minutes=5)


def test_revoking_an_unknown_id_is_an_error(engine: Engine) -> None:
    with pytest.raises(UnknownKey):
        revoke_api_key(engine, None, "000000000000")


def test_cli_creates_lists_and_revokes_keys_and_audits_them(
    settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    tenant = fresh_tenant()
    audit_file = tmp_path / "audit.jsonl"
    env = {
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_AUDIT_LOG": str(audit_file),
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return cli(*args, **env)

    created = run("tenants", "create", tenant)
    assert created.returncode == 0, created.stderr
    added = run(
        "apikey", "create", "--tenant", tenant, "--label", "batch scorer", "--expires-in", "90d"
    )
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    listed = run("apikey", "list", "--tenant", tenant)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert len(rows) == 2 and {r[2] for r in rows} == {"active"}
    [labelled] = [r for r in rows if r[-2:] == ["batch", "scorer"]]
    key_id = labelled[0]
    assert key not in listed.stdout

    revoked = run("apikey", "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises(Unauthorized):
        Authenticator(engine).principal(key)
    relisted = run("apikey", "list", "--tenant", tenant)
    assert "revoked" in relisted.stdout

    bad = run("apikey", "revoke", "nosuchkey000")
    assert bad.returncode == 1 and "no API key" in bad.stderr + bad.stdout
    assert "Traceback" not in bad.stderr
    usage = run("apikey", "create", "--tenant", tenant, "--expires-in", "soon")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr

    lines = [json.loads(line) for line in audit_file.read_text().splitlines()]
    events = [(line["event"], line.get("key_id")) for line in lines]
    assert events[0][0] == "tenant.create" and events[1] == ("apikey.create", events[0][1])
    assert ("apikey.create", key_id) in events and ("apikey.revoke", key_id) in events
    assert all(key not in line for line in audit_file.read_text().splitlines())


# -- abuse limits (findings 4, 6) -------------------------------------------------------


@pytest.fixture(scope="module")
def tenant_module(tenant_factory_module: Callable[..., SeedSummary]) -> str:
    return tenant_factory_module(users=10, transactions=200).tenants[0]


def test_failed_authentications_past_the_limit_cost_no_query(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant_module: str,
    audit: Callable[[], list[dict[str, Any]]],
) -> None:
    app = api_app(
        settings,
        engine,
        redis_client,
        api_auth_failures_burst=3,
        api_auth_failures_per_min=0.001,
        api_key_index_refresh_s=0.01,  # how long each throttled guess is held
    )
    good = create_api_key(engine, tenant_module)
    lookup = "api_keys.key_hash ="  # not the key index's reads (test_abuse_auth.py)
    with running(app, good) as api, Queries(engine) as queries:
        assert api.get("/v1/features/txn_90d/1").status_code == 200  # looks the key up
        before = queries.count(lookup)
        statuses = [
            api.get("/v1/features/txn_90d/1", key=f"fl_guess{i}").status_code for i in range(10)
        ]
        assert statuses == [401] * 10
        assert queries.count(lookup) - before == 3  # the budget, then no lookup
        # A key the worker already knows still works from the throttled address.
        assert api.get("/v1/features/txn_90d/1").status_code == 200
    refused = [line for line in audit() if line["event"] == "auth.refused"]
    assert [r["reason"] for r in refused] == ["unknown_key"] * 3 + ["throttled"]
    assert all(r["client"] == "127.0.0.1" for r in refused)


def test_a_tenant_over_its_rate_gets_429_with_retry_after_on_every_key(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant_module: str,
    audit: Callable[[], list[dict[str, Any]]],
) -> None:
    hold_s = 0.2
    app = api_app(
        settings,
        engine,
        redis_client,
        api_rate_per_s=0.01,
        api_rate_burst=3,
        api_rate_hold_s=hold_s,
    )
    tenant = tenant_module
    greedy = issue_api_key(engine, tenant)
    other = create_api_key(engine, tenant)
    with running(app, greedy.key) as api:
        answers = [api.get("/v1/features/txn_90d/1") for _ in range(3)]
        started = time.monotonic()
        answers += [api.get("/v1/features/txn_90d/1") for _ in range(2)]
        # Each refusal was held before it was sent: a sender that asks again at once
        # gets one refusal per hold, not a flood of them.
        assert time.monotonic() - started >= 2 * hold_s
        assert [a.status_code for a in answers] == [200, 200, 200, 429, 429]
        refused = answers[-1]
        assert refused.json()["error"]["code"] == "rate_limited"
        assert int(refused.headers["Retry-After"]) >= 1
        # The bucket is the tenant's: another key of the same tenant is refused too
        # (tests/pipeline/api/test_read_limits.py holds three keys to one rate).
        assert api.get("/v1/features/txn_90d/1", key=other).status_code == 429
    limited = [line for line in audit() if line["event"] == "rate.limited"]
    assert [line["key_id"] for line in limited][:2] == [greedy.key_id] * 2
    assert len(limited) == 3 and {line["tenant"] for line in limited} == {tenant}
    assert all(greedy.key not in json.dumps(line) for line in audit())


def test_a_request_a_little_over_its_rate_waits_its_turn_and_is_served(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant_module: str
) -> None:
    # 5/s with a burst of 1: back to back, each request after the first is 0.2 s early,
    # within the hold, so it waits for its token rather than being refused.
    app = api_app(
        settings, engine, redis_client, api_rate_per_s=5, api_rate_burst=1, api_rate_hold_s=1
    )
    key = issue_api_key(engine, tenant_module)
    with running(app, key.key) as api:
        started = time.monotonic()
        statuses = [api.get("/v1/features/txn_90d/1").status_code for _ in range(3)]
        assert statuses == [200, 200, 200]
        assert time.monotonic() - started >= 2 / 5 * 0.9  # two of them waited their turn


def test_token_buckets_reserve_a_turn_within_the_wait_they_allow() -> None:
    now = [0.0]
    buckets = TokenBuckets(2.0, 1, clock=lambda: now[0])
    assert buckets.reserve("k", 1.0) == 0.0
    assert buckets.reserve("k", 1.0) == pytest.approx(0.5)  # queued behind the first
    assert buckets.reserve("k", 1.0) == pytest.approx(1.0)
    assert buckets.reserve("k", 1.0) is None  # 1.5 s away: refused, nothing taken
    now[0] += 0.5
    assert buckets.reserve("k", 1.0) == pytest.approx(1.0)
    assert TokenBuckets(0, 1).reserve("k", 0) == 0.0  # rate 0: no limit


def test_token_buckets_refill_at_their_rate() -> None:
    now = [0.0]
    buckets = TokenBuckets(2.0, 2, clock=lambda: now[0])
    assert [buckets.take("k") for _ in range(2)] == [0.0, 0.0]
    assert buckets.take("k") == pytest.approx(0.5)
    now[0] += 0.5
    assert buckets.take("k") == 0.0
    assert TokenBuckets(0, 1).take("k") == 0.0  # rate 0: no limit


def test_a_revoked_key_is_refused_by_the_api(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant_module: str,
    audit: Callable[[], list[dict[str, Any]]],
) -> None:
    app = api_app(settings, engine, redis_client)
    issued = issue_api_key(engine, tenant_module)
    with running(app, issued.key) as api:
        assert app.state.services.auth.wait_live(5)
        assert api.get("/v1/features/txn_90d/1").status_code == 200
        revoke_api_key(engine, redis_client, issued.key_id)
        assert wait_until(lambda: api.get("/v1/features/txn_90d/1").status_code == 401, timeout=1.0)
    refused = [line for line in audit() if line["event"] == "auth.refused"]
    assert refused[-1]["reason"] == "revoked_key" and refused[-1]["key_id"] == issued.key_id


# -- resource bounds (findings 2, 8) ----------------------------------------------------


def test_reads_of_entities_without_source_rows_store_nothing(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant_module: str
) -> None:
    version = fresh_version()
    app = api_app(settings, engine, redis_client, schema_version=version)
    with running(app, create_api_key(engine, tenant_module)) as api:
        known = api.get("/v1/features/txn_90d/3").json()
        assert known["source"] == "computed"
        ghost = api.get("/v1/features/txn_90d/424242").json()
        assert ghost["source"] == "uncached" and ghost["values"]["txn_count"] == 0
        body = {"feature_sets": list(REGISTRY.names()), "entities": list(range(900_000, 900_100))}
        batch = api.post("/v1/features/batch", json=body)
        assert batch.status_code == 200, batch.text
        assert {i["source"] for i in batch.json()["items"]} == {"uncached"}
    stored = list(redis_client.scan_iter(match=feature_pattern(version), count=1000))
    assert len(stored) == 1 and b"txn_90d" in stored[0] and stored[0].endswith(b":3}")


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_non_finite_predictions_are_refused_and_not_cached(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant_module: str,
    tmp_path: Path,
) -> None:
    name = f"m_{uuid.uuid4().hex[:10]}"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 2))
    model = LogisticModel.fit(
        x,
        (x[:, 0] + x[:, 1] > 0).astype(float),
        version="v1",
        feature_names=("a", "b"),
        name=name,
        epochs=50,
        seed=0,
    )
    ModelRegistry(redis_client).register(model.save(tmp_path / "v1.json"))
    app = api_app(settings, engine, redis_client)
    with running(app, create_api_key(engine, tenant_module)) as api:
        # inf - inf inside the model: a NaN prediction.
        candidates = [[1e308, -1e308], [-1e308, 1e308]]
        nan_row = next(c for c in candidates if np.isnan(model.predict(np.array([c]))).any())
        body = {"inputs": [nan_row, [0.5, 0.5]]}
        for _ in range(2):
            out = api.post(f"/v1/models/{name}/predict", json=body)
            assert out.status_code == 422, out.text
            assert out.json()["error"]["code"] == "non_finite_prediction"
        fine = api.post(f"/v1/models/{name}/predict", json={"inputs": [[0.5, 0.5]]})
        assert fine.status_code == 200 and fine.json()["predictions"][0]["hit"] is True


# -- a client that goes away mid-body (finding 5) -----------------------------------------


def _count(name: str, **labels: str) -> float:
    text = metrics.render()[0].decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_a_disconnect_mid_body_is_no_error_log_and_no_500(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant_module: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = api_app(settings, engine, redis_client)
    issued = issue_api_key(engine, tenant_module)
    key = issued.key
    with serving(app) as port:
        before_500 = _count("freshline_api_request_seconds_count", endpoint="batch", status="500")
        before_499 = _count("freshline_api_request_seconds_count", endpoint="batch", status="499")
        caplog.set_level(logging.INFO)
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /v1/features/batch HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer " + key.encode() + b"\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                b'{"feature_sets": ["txn_90d"], "enti'
            )
            # Hang up once the guard has let the request through to the endpoint.
            auth = app.state.services.auth
            assert wait_until(lambda: issued.key_id in auth.pending_usage(), timeout=10)
        assert wait_until(
            lambda: (
                _count("freshline_api_request_seconds_count", endpoint="batch", status="499")
                > before_499
            ),
            timeout=10,
        )
        assert (
            _count("freshline_api_request_seconds_count", endpoint="batch", status="500")
            == before_500
        )
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
        assert not any(r.exc_info for r in caplog.records)


def test_a_body_that_does_not_arrive_in_time_is_a_408(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant_module: str
) -> None:
    app = api_app(settings, engine, redis_client, api_body_timeout_s=0.3)
    key = create_api_key(engine, tenant_module)
    with serving(app) as port:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(30)  # a deadline on the test: a missing bound would hang it
            sock.sendall(
                b"POST /v1/features/batch HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer " + key.encode() + b"\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                b'{"feature_sets": ["txn_90d"], "enti'
            )
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply[:300]
        assert json.loads(body)["error"]["code"] == "body_timeout"
        # The worker still serves: the cut-off request left nothing behind.
        with running(app, key) as api:
            assert api.get("/v1/features/txn_90d/1").status_code == 200


# -- the OpenAPI document states the limits (finding 7) ---------------------------------


def _entity_schemas(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    [param] = [
        p
        for p in doc["paths"]["/v1/features/{feature_set}/{entity_id}"]["get"]["parameters"]
        if p["name"] == "entity_id"
    ]
    items = doc["components"]["schemas"]["BatchRequest"]["properties"]["entities"]["items"]
    return param["schema"], items


@pytest.mark.parametrize(
    "entity",
    ["0", "7", "999999999999999999", "1000000000000000000", "0123", "1" * 65, "-1", "1.5", "abc"],
)
def test_the_documented_id_rule_is_the_servers(entity: str) -> None:
    import re

    path_schema, _ = _entity_schemas(document(REGISTRY.names()))
    documented = (
        len(entity) <= path_schema["maxLength"]
        and re.fullmatch(path_schema["pattern"].strip("^$"), entity) is not None
    )
    try:
        parse_entity(entity)
        served = True
    except InvalidId:
        served = False
    assert documented == served


def test_the_document_states_the_batch_body_and_arm_limits(settings: Settings) -> None:
    doc = document(
        REGISTRY.names(),
        batch_limit=settings.api_batch_limit,
        body_limit=settings.api_body_limit_bytes,
    )
    _, items = _entity_schemas(doc)
    [as_int] = [s for s in items["oneOf"] if s["type"] == "integer"]
    assert as_int["maximum"] == 10**18 - 1 and as_int["minimum"] == 0
    batch = doc["components"]["schemas"]["BatchRequest"]
    assert batch["properties"]["entities"]["maxItems"] == settings.api_batch_limit
    assert str(settings.api_batch_limit) in batch["description"]
    arm = doc["components"]["schemas"]["PredictRequest"]["properties"]["arm"]
    [text, null] = arm["anyOf"]
    assert null == {"type": "null"} and text["type"] == "string"
    assert text["maxLength"] == 64 and "pattern" in text
    assert str(settings.api_body_limit_bytes) in json.dumps(doc["paths"]["/v1/features/batch"])


def test_an_integer_arm_is_refused_as_documented(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant_module: str,
    tmp_path: Path,
) -> None:
    app = api_app(settings, engine, redis_client)
    with running(app, create_api_key(engine, tenant_module)) as api:
        out = api.post("/v1/models/anything/predict", json={"inputs": [[1.0]], "arm": 7})
        assert out.status_code == 422 and "arm" in out.json()["error"]["message"]


def test_a_batch_names_each_feature_set_once_and_takes_integral_numbers(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant_module: str
) -> None:
    app = api_app(settings, engine, redis_client)
    with running(app, create_api_key(engine, tenant_module)) as api:
        twice = api.post(
            "/v1/features/batch", json={"feature_sets": ["geo", "geo"], "entities": [1]}
        )
        assert twice.status_code == 422 and "twice" in twice.json()["error"]["message"]
        integral = api.post(
            "/v1/features/batch", json={"feature_sets": ["geo"], "entities": [2.0, "2"]}
        )
        assert integral.status_code == 200, integral.text
        assert [i["entity"] for i in integral.json()["items"]] == ["2", "2"]
        fraction = api.post("/v1/features/batch", json={"feature_sets": ["geo"], "entities": [2.5]})
        assert fraction.status_code == 400
