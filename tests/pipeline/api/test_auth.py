"""API keys: stored hashed, resolved to their tenant only, cached in process."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.api.accounts import (
    TenantExists,
    UnknownTenant,
    create_api_key,
    create_tenant,
)
from freshline.pipeline.api.auth import Authenticator, Unauthorized, bearer_token
from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.settings import Settings
from tests.helpers import cli


def fresh_tenant() -> str:
    return f"auth-{uuid.uuid4().hex[:10]}"


def test_keys_are_stored_hashed_never_in_plaintext(engine: Engine) -> None:
    tenant = fresh_tenant()
    first = create_tenant(engine, tenant, "Auth Test")
    second = create_api_key(engine, tenant)
    assert first != second and first.startswith("fl_") and len(first) > 40
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT key_hash, tenant_id, created_at::text FROM freshline.api_keys "
                "WHERE tenant_id = :t"
            ),
            {"t": tenant},
        ).all()
        name = conn.execute(
            sa.text("SELECT name FROM freshline.tenants WHERE id = :t"), {"t": tenant}
        ).scalar_one()
    assert name == "Auth Test"
    assert {r[0] for r in rows} == {hashlib.sha256(k.encode()).hexdigest() for k in (first, second)}
    dump = repr(rows)
    assert first not in dump and second not in dump
    assert first[3:] not in dump


def test_a_key_resolves_to_its_own_tenant(engine: Engine) -> None:
    a, b = fresh_tenant(), fresh_tenant()
    key_a, key_b = create_tenant(engine, a), create_tenant(engine, b)
    auth = Authenticator(engine)
    assert auth.tenant(key_a) == a
    assert auth.tenant(key_b) == b
    with pytest.raises(Unauthorized):
        auth.tenant(key_a + "x")


def test_lookups_are_cached_for_known_and_unknown_keys(engine: Engine) -> None:
    key = create_tenant(engine, fresh_tenant())
    auth = Authenticator(engine)
    for _ in range(3):
        auth.tenant(key)
        with pytest.raises(Unauthorized):
            auth.tenant("fl_unknown")
    assert auth.lookups == 2


def test_cached_answers_expire(engine: Engine) -> None:
    key = create_tenant(engine, fresh_tenant())
    auth = Authenticator(engine, ttl_s=0.0)
    auth.tenant(key)
    auth.tenant(key)
    assert auth.lookups == 2


def test_the_cache_is_bounded(engine: Engine) -> None:
    auth = Authenticator(engine, max_entries=3)
    for i in range(6):
        with pytest.raises(Unauthorized):
            auth.tenant(f"fl_unknown{i}")
    assert len(auth._cache) == 3


def test_tenant_and_key_creation_refuse_bad_input(engine: Engine) -> None:
    tenant = fresh_tenant()
    create_tenant(engine, tenant)
    with pytest.raises(TenantExists):
        create_tenant(engine, tenant)
    with pytest.raises(UnknownTenant):
        create_api_key(engine, fresh_tenant())
    with pytest.raises(InvalidId):
        create_tenant(engine, "a:{b}")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer   ", "Token abc"])
def test_malformed_headers_are_unauthorized(header: str | None) -> None:
    with pytest.raises(Unauthorized):
        bearer_token(header)


def test_bearer_token_is_case_insensitive_on_the_scheme() -> None:
    assert bearer_token("bearer fl_abc") == "fl_abc"


def test_cli_prints_the_key_once_and_it_works(settings: Settings, engine: Engine) -> None:
    tenant = fresh_tenant()
    env = {
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
    }
    created = cli("tenants", "create", tenant, "--name", "From CLI", **env)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    added = cli("apikey", "create", "--tenant", tenant, **env)
    assert added.returncode == 0, added.stderr
    auth = Authenticator(engine)
    assert auth.tenant(key) == tenant
    assert auth.tenant(added.stdout.strip()) == tenant
    missing = cli("apikey", "create", "--tenant", fresh_tenant(), **env)
    assert missing.returncode == 1
    assert "unknown tenant" in missing.stderr and "Traceback" not in missing.stderr
