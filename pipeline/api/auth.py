"""API keys: created once, stored hashed, resolved to a tenant with an in-process cache.

A key is ``fl_`` followed by 32 random bytes in URL-safe base64 (``secrets``). Only
its SHA-256 is stored, in ``api_keys.key_hash``; the plaintext is shown once, when it
is created, and never written anywhere.

The caller's tenant comes from its key and from nothing else: the read API never
takes a tenant from a path, query or body.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.engine import Engine

from pipeline.core.db import api_keys, tenants
from pipeline.core.errors import FreshlineError
from pipeline.core.keys import validate_id

KEY_PREFIX = "fl_"
KEY_BYTES = 32
MAX_KEY_LENGTH = 128


class Unauthorized(FreshlineError):
    """A request without an API key, or with one that is not known."""


class TenantExists(FreshlineError):
    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        super().__init__(f"tenant {tenant!r} already exists")


class UnknownTenant(FreshlineError):
    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        super().__init__(f"unknown tenant {tenant!r}; create it with: freshline tenants create")


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
        return _insert_key(conn, tenant)


def create_api_key(engine: Engine, tenant: str) -> str:
    """Add an API key for an existing tenant; return it (shown once)."""
    tenant = validate_id("tenant", tenant)
    with engine.begin() as conn:
        exists = conn.execute(sa.select(tenants.c.id).where(tenants.c.id == tenant)).first()
        if exists is None:
            raise UnknownTenant(tenant)
        return _insert_key(conn, tenant)


def _insert_key(conn: sa.Connection, tenant: str) -> str:
    key = generate_key()
    conn.execute(sa.insert(api_keys).values(key_hash=hash_key(key), tenant_id=tenant,
                                            created_at=datetime.now(UTC)))
    return key


def bearer_token(header: str | None) -> str:
    """The key in an ``Authorization: Bearer <key>`` header, or :class:`Unauthorized`."""
    if not header:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <api key>'")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("malformed Authorization header: expected 'Bearer <api key>'")
    return token


class Authenticator:
    """Resolves API keys to tenants, caching answers in process for ``ttl_s``.

    Known keys are cached for ``ttl_s`` and unknown ones for ``negative_ttl_s``, so a
    request costs no database round trip once its key has been seen, and a client
    retrying a bad key does not reach Postgres on every request. The cache holds at
    most ``max_entries`` hashes (least recently used are dropped). A deleted key stops
    working within ``ttl_s``.
    """

    def __init__(self, engine: Engine, *, ttl_s: float = 60.0, negative_ttl_s: float = 5.0,
                 max_entries: int = 10_000) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self._cache: OrderedDict[str, tuple[str | None, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.lookups = 0

    def cached(self, key: str) -> tuple[bool, str | None]:
        """``(known, tenant)`` from the cache alone: ``known`` False means ask :meth:`tenant`."""
        digest = hash_key(key)
        with self._lock:
            hit = self._cache.get(digest)
            if hit is None or hit[1] < time.monotonic():
                return False, None
            self._cache.move_to_end(digest)
            return True, hit[0]

    def tenant(self, key: str) -> str:
        """The tenant of ``key``; :class:`Unauthorized` if the key is unknown."""
        if len(key) > MAX_KEY_LENGTH:
            raise Unauthorized("unknown API key")
        known, tenant = self.cached(key)
        if not known:
            tenant = self._lookup(key)
        if tenant is None:
            raise Unauthorized("unknown API key")
        return tenant

    def _lookup(self, key: str) -> str | None:
        digest = hash_key(key)
        with self.engine.connect() as conn:
            tenant = conn.execute(
                sa.select(api_keys.c.tenant_id).where(api_keys.c.key_hash == digest)
            ).scalar_one_or_none()
        self.lookups += 1
        ttl = self.ttl_s if tenant is not None else self.negative_ttl_s
        with self._lock:
            self._cache[digest] = (tenant, time.monotonic() + ttl)
            self._cache.move_to_end(digest)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return tenant
