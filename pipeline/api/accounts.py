"""Tenants and their API keys as an operator administers them: created, listed,
revoked, and each tenant's own limits stored (``freshline tenants``, ``freshline apikey``).

A key is ``fl_`` followed by 32 random bytes in URL-safe base64 (``secrets``). Only
its SHA-256 is stored, in ``api_keys.key_hash``; the plaintext is shown once, when it
is created, and never written anywhere. Each key also has a public ``id`` (12 hex
digits) that names it in ``freshline apikey list|revoke``, the audit log and the
revocation channel, a ``label``, and its created, expiry, last-use and revocation times.

:func:`revoke_api_key` and :func:`set_tenant_limits` mark the rows, then publish the
keys' ids on :data:`freshline.pipeline.core.keys.APIKEY_CHANNEL`, which every API
worker's key cache (:class:`freshline.pipeline.api.auth.Authenticator`) listens to.
Request-time authentication is :mod:`freshline.pipeline.api.auth` and
:mod:`freshline.pipeline.api.authentication`; [Security](../docs/security.md) has the reasoning.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg
import redis
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.engine import Engine

from freshline.pipeline.api import audit_log
from freshline.pipeline.core.cluster import is_cluster, publish
from freshline.pipeline.core.db import api_keys, tenants
from freshline.pipeline.core.errors import ConfigError, FreshlineError
from freshline.pipeline.core.keys import APIKEY_CHANNEL, validate_id
from freshline.pipeline.core.settings import redact_text

KEY_PREFIX = "fl_"
KEY_BYTES = 32
MAX_KEY_LENGTH = 128
KEY_ID_HEX = 12
MAX_LABEL_LENGTH = 200


class TenantExists(FreshlineError):
    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        super().__init__(f"tenant {tenant!r} already exists")


class UnknownTenant(FreshlineError):
    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        super().__init__(f"unknown tenant {tenant!r}; create it with: freshline tenants create")


class UnknownKey(FreshlineError):
    def __init__(self, key_id: str) -> None:
        self.key_id = key_id
        super().__init__(f"no API key with id {key_id!r}; see: freshline apikey list")


class RevocationUnannounced(FreshlineError):
    """A key revoked in Postgres whose revocation could not be published on Redis.

    API workers with a live subscription keep serving it from their caches (for up to
    ``FRESHLINE_API_KEY_CACHE_S``) until they look it up again: revoke it again once
    Redis answers.
    """

    def __init__(self, key_id: str, tenant: str, detail: str) -> None:
        self.key_id = key_id
        self.tenant = tenant
        super().__init__(
            f"API key {key_id} of tenant {tenant} is revoked in Postgres, but the "
            f"revocation was not published on Redis ({detail}): API workers may accept "
            f"it from their caches for up to FRESHLINE_API_KEY_CACHE_S; run `freshline "
            f"apikey revoke {key_id}` again once Redis answers"
        )


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's own API limits (``freshline tenants limits``), each ``None`` where the
    server's setting applies; 0 is no limit, as for the settings."""

    rate_per_s: float | None = None
    rate_burst: int | None = None
    concurrency: int | None = None
    pool_share: float | None = None
    rows_per_s: float | None = None
    rows_burst: int | None = None

    def items(self) -> list[tuple[str, float | int]]:
        """The limits set, by name (for listings and the audit log)."""
        return [(n, v) for n in LIMIT_NAMES if (v := getattr(self, n)) is not None]


LIMIT_NAMES = (
    "rate_per_s",
    "rate_burst",
    "concurrency",
    "pool_share",
    "rows_per_s",
    "rows_burst",
)
SERVER_DEFAULTS = TenantLimits()


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A new key as created: its id and the key itself (shown once)."""

    key_id: str
    key: str
    tenant: str


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One key as ``freshline apikey list`` shows it: everything but the key."""

    key_id: str
    tenant: str
    label: str
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None

    def state(self, now: datetime | None = None) -> str:
        """``active``, ``expired`` or ``revoked``."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= (now or datetime.now(UTC)):
            return "expired"
        return "active"


def generate_key() -> str:
    """A new random API key (256 bits of entropy)."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def hash_key(key: str) -> str:
    """The stored form of a key.

    A plain SHA-256 is enough here, and a slow password hash would be the wrong tool:
    bcrypt or argon2 protect low-entropy secrets chosen by people against guessing,
    while these keys are 256 random bits that no dictionary or brute force can reach.
    A fast hash also keeps an uncached key lookup to one indexed query.
    """
    return hashlib.sha256(key.encode()).hexdigest()


def create_tenant(engine: Engine, tenant: str, name: str | None = None) -> str:
    """Create the tenant row and its first API key; return the key (shown once)."""
    return register_tenant(engine, tenant, name).key


def register_tenant(
    engine: Engine,
    tenant: str,
    name: str | None = None,
    *,
    label: str = "",
    expires_at: datetime | None = None,
) -> IssuedKey:
    """Create the tenant row and its first API key (audited)."""
    tenant = validate_id("tenant", tenant)
    with engine.begin() as conn:
        inserted = conn.execute(
            pg.insert(tenants)
            .values(id=tenant, name=name or tenant, created_at=datetime.now(UTC))
            .on_conflict_do_nothing(index_elements=[tenants.c.id])
            .returning(tenants.c.id)
        ).first()
        if inserted is None:
            raise TenantExists(tenant)
        issued = _insert_key(conn, tenant, label, expires_at)
    audit_log.record("tenant.create", tenant=tenant, key_id=issued.key_id)
    audit_log.record(
        "apikey.create", tenant=tenant, key_id=issued.key_id, label=label, expires_at=expires_at
    )
    return issued


def create_api_key(
    engine: Engine, tenant: str, *, label: str = "", expires_at: datetime | None = None
) -> str:
    """Add an API key for an existing tenant; return it (shown once)."""
    return issue_api_key(engine, tenant, label=label, expires_at=expires_at).key


def issue_api_key(
    engine: Engine, tenant: str, *, label: str = "", expires_at: datetime | None = None
) -> IssuedKey:
    """Add an API key for an existing tenant (audited)."""
    tenant = validate_id("tenant", tenant)
    with engine.begin() as conn:
        exists = conn.execute(sa.select(tenants.c.id).where(tenants.c.id == tenant)).first()
        if exists is None:
            raise UnknownTenant(tenant)
        issued = _insert_key(conn, tenant, label, expires_at)
    audit_log.record(
        "apikey.create", tenant=tenant, key_id=issued.key_id, label=label, expires_at=expires_at
    )
    return issued


def _insert_key(
    conn: sa.Connection, tenant: str, label: str, expires_at: datetime | None
) -> IssuedKey:
    if len(label) > MAX_LABEL_LENGTH or not label.isprintable():
        raise ValueError(f"a label is printable text of at most {MAX_LABEL_LENGTH} characters")
    if expires_at is not None and expires_at.tzinfo is None:
        raise ValueError("expires_at must carry a time zone")
    key = generate_key()
    key_id = secrets.token_hex(KEY_ID_HEX // 2)
    conn.execute(
        sa.insert(api_keys).values(
            key_hash=hash_key(key),
            tenant_id=tenant,
            id=key_id,
            label=label,
            created_at=datetime.now(UTC),
            expires_at=expires_at,
        )
    )
    return IssuedKey(key_id, key, tenant)


def list_api_keys(engine: Engine, tenant: str | None = None) -> list[KeyInfo]:
    """Every key (of ``tenant`` if given), oldest first; never the key or its hash."""
    c = api_keys.c
    query = sa.select(
        c.id, c.tenant_id, c.label, c.created_at, c.expires_at, c.last_used_at, c.revoked_at
    ).order_by(c.created_at, c.id)
    if tenant is not None:
        query = query.where(c.tenant_id == validate_id("tenant", tenant))
    with engine.connect() as conn:
        return [KeyInfo(*row) for row in conn.execute(query)]


def revoke_api_key(engine: Engine, redis_client: redis.Redis | None, key_id: str) -> KeyInfo:
    """Revoke a key: mark its row, then tell every API worker (audited).

    The order matters: a worker that drops the key on the message and looks it up
    again must find it revoked. Revoking twice keeps the first time and publishes
    again. If the message cannot be published the row is revoked all the same, and
    :class:`RevocationUnannounced` is raised: a worker whose own subscription is live
    would not hear of it before its cached answer expires. ``redis_client`` None
    publishes nothing.
    """
    c = api_keys.c
    with engine.begin() as conn:
        conn.execute(
            sa.update(api_keys)
            .where(c.id == key_id, c.revoked_at.is_(None))
            .values(revoked_at=datetime.now(UTC))
        )
        row = conn.execute(
            sa.select(
                c.id, c.tenant_id, c.label, c.created_at, c.expires_at, c.last_used_at, c.revoked_at
            ).where(c.id == key_id)
        ).first()
    if row is None:
        raise UnknownKey(key_id)
    info = KeyInfo(*row)
    audit_log.record("apikey.revoke", tenant=info.tenant, key_id=key_id)
    if redis_client is not None:
        try:
            publish(redis_client, APIKEY_CHANNEL, key_id, cluster=is_cluster(redis_client))
        except (redis.exceptions.RedisError, OSError) as exc:
            raise RevocationUnannounced(key_id, info.tenant, redact_text(str(exc))) from exc
    return info


class LimitsUnannounced(FreshlineError):
    """A tenant's limits stored in Postgres whose change could not be published on Redis:
    API workers keep their cached keys, with the old limits, for up to
    ``FRESHLINE_API_KEY_CACHE_S``."""

    def __init__(self, tenant: str, detail: str) -> None:
        self.tenant = tenant
        super().__init__(
            f"tenant {tenant}'s limits are stored in Postgres, but the change was not "
            f"published on Redis ({detail}): API workers apply them when their cached keys "
            f"expire (FRESHLINE_API_KEY_CACHE_S); run the command again once Redis answers"
        )


@contextlib.contextmanager
def _limits_schema() -> Iterator[None]:
    """Turn a query of the limit columns on a schema before revision 0004 into a
    :class:`ConfigError` that says what to run."""
    try:
        yield
    except sa.exc.ProgrammingError as exc:
        if isinstance(exc.orig, psycopg.errors.UndefinedColumn):
            raise ConfigError(
                "freshline's schema has no tenant limits yet (revision 0004): run "
                "freshline db upgrade"
            ) from None
        raise


def tenant_limits(engine: Engine, tenant: str) -> TenantLimits:
    """``tenant``'s own limits; :class:`UnknownTenant` if there is no such tenant."""
    t = tenants.c
    with _limits_schema(), engine.connect() as conn:
        row = conn.execute(
            sa.select(*(t[name] for name in LIMIT_NAMES)).where(t.id == tenant)
        ).first()
    if row is None:
        raise UnknownTenant(tenant)
    return TenantLimits(*row)


def set_tenant_limits(
    engine: Engine,
    redis_client: redis.Redis | None,
    tenant: str,
    changes: dict[str, float | int | None],
) -> TenantLimits:
    """Set (a value) or clear (``None``: the server's setting again) some of ``tenant``'s
    limits, named as in :data:`LIMIT_NAMES`; return them all (audited).

    Then each of the tenant's key ids is published on :data:`APIKEY_CHANNEL`, so every
    worker drops its cached answer and reads the new limits with the key on its next
    request. If that cannot be published the limits are stored all the same and
    :class:`LimitsUnannounced` is raised. ``redis_client`` None publishes nothing.
    """
    unknown = set(changes) - set(LIMIT_NAMES)
    if unknown:
        raise ValueError(f"no such limit: {', '.join(sorted(unknown))}")
    t, c = tenants.c, api_keys.c
    with _limits_schema(), engine.begin() as conn:
        row = conn.execute(
            sa.update(tenants)
            .where(t.id == tenant)
            .values(**changes)
            .returning(*(t[name] for name in LIMIT_NAMES))
            if changes
            else sa.select(*(t[name] for name in LIMIT_NAMES)).where(t.id == tenant)
        ).first()
        if row is None:
            raise UnknownTenant(tenant)
        key_ids = list(conn.execute(sa.select(c.id).where(c.tenant_id == tenant)).scalars())
    limits = TenantLimits(*row)
    if not changes:
        return limits
    audit_log.record("tenant.limits", tenant=tenant, **dict(limits.items()))
    if redis_client is not None:
        try:
            cluster = is_cluster(redis_client)
            for key_id in key_ids:
                publish(redis_client, APIKEY_CHANNEL, key_id, cluster=cluster)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise LimitsUnannounced(tenant, redact_text(str(exc))) from exc
    return limits
