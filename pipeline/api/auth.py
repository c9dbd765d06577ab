"""API keys: created once, stored hashed, resolved to a tenant, revoked everywhere at once.

A key is ``fl_`` followed by 32 random bytes in URL-safe base64 (``secrets``). Only
its SHA-256 is stored, in ``api_keys.key_hash``; the plaintext is shown once, when it
is created, and never written anywhere. Each key also has a public ``id`` (12 hex
digits) that names it in ``freshline apikey list|revoke``, the audit log and the
revocation channel, a ``label``, and its created, expiry, last-use and revocation times.

The caller's tenant comes from its key and from nothing else: the read API never
takes a tenant from a path, query or body.

Revocation reaches every API worker at once: :func:`revoke_api_key` marks the row,
then publishes the key's id on :data:`freshline.pipeline.core.keys.APIKEY_CHANNEL`; each
worker's :class:`Authenticator` drops the key from its cache when the message
arrives, and trusts its cache only while that subscription is confirmed live
(:class:`freshline.pipeline.cache.subscription.Subscription`, bounded by
``FRESHLINE_SUBSCRIPTION_SILENCE_MS``). A lost message therefore keeps a revoked key
working for that bound at most: a message published while the subscription is down
is lost, so the cache is dropped when it goes down and again when it is back, and
only a lookup begun after the subscription was confirmed may be cached. A revoke
whose message could not be published raises :class:`RevocationUnannounced`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
import redis
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.engine import Engine

from freshline.pipeline.api import audit_log
from freshline.pipeline.cache.subscription import Subscription
from freshline.pipeline.core.cluster import is_cluster, publish
from freshline.pipeline.core.db import api_keys, tenants
from freshline.pipeline.core.errors import ConfigError, FreshlineError
from freshline.pipeline.core.keys import APIKEY_CHANNEL, validate_id
from freshline.pipeline.core.settings import redact_text

log = logging.getLogger(__name__)

KEY_PREFIX = "fl_"
KEY_BYTES = 32
MAX_KEY_LENGTH = 128
KEY_ID_HEX = 12
MAX_LABEL_LENGTH = 200


class Unauthorized(FreshlineError):
    """A request without an API key, or with one that is unknown, revoked or expired.

    ``key_id`` names the key when it is known (revoked or expired), for the audit log.
    """

    def __init__(
        self, message: str, *, key_id: str | None = None, reason: str = "unknown_key"
    ) -> None:
        self.key_id = key_id
        self.reason = reason
        super().__init__(message)


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
class Principal:
    """Who a request is: the key's id and its tenant (and when the key expires), and
    the tenant's own limits."""

    key_id: str
    tenant: str
    expires_at: datetime | None = None
    limits: TenantLimits = SERVER_DEFAULTS


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


def bearer_token(header: str | None) -> str:
    """The key in an ``Authorization: Bearer <key>`` header, or :class:`Unauthorized`."""
    if not header:
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <api key>'", reason="missing_key"
        )
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized(
            "malformed Authorization header: expected 'Bearer <api key>'", reason="malformed_header"
        )
    return token


@dataclass(frozen=True, slots=True)
class _Cached:
    principal: Principal | None
    refusal: Unauthorized | None
    until: float  # time.monotonic()
    expires: float  # the key's expiry as time.time(), inf if none


class Authenticator:
    """Resolves API keys to a :class:`Principal`, caching answers in process.

    Known keys are cached for ``ttl_s`` and refused ones for ``negative_ttl_s``, so a
    request costs no database round trip once its key has been seen. The cache holds
    at most ``max_entries`` keys (least recently used are dropped). It is keyed by
    the presented key itself, so a cached request computes no hash: only Postgres,
    which holds hashes, needs one (compared there in constant time). The dict's own
    lookup leaks no timing worth having: a candidate must first match the key's
    string hash, which is keyed by the process's random seed.

    With ``redis_client`` and :meth:`start`, revocations published on
    :data:`APIKEY_CHANNEL` drop the key at once, and the cache is trusted only while
    that subscription is confirmed live (``silence_s``); without it a revoked key
    keeps working for ``ttl_s``. Every loss and every confirmation of the
    subscription drops the whole cache, so an answer read from Postgres before a
    revocation that the subscription missed is never cached after it comes back.
    Last-use times are gathered in memory and written in one statement every
    ``last_used_interval_s`` (and on :meth:`close`), never one write per request.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        redis_client: redis.Redis | None = None,
        ttl_s: float = 60.0,
        negative_ttl_s: float = 5.0,
        max_entries: int = 10_000,
        silence_s: float = 1.0,
        last_used_interval_s: float = 60.0,
    ) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self.last_used_interval_s = last_used_interval_s
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        self._lock = threading.Lock()
        self._generation = 0  # bumped by every revocation, outage and resubscription
        self._used: dict[str, float] = {}  # key id -> time.time() of its last use
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._subscription = (
            None
            if redis_client is None
            else Subscription(
                redis_client,
                [APIKEY_CHANNEL],
                on_message=self._on_revoked,
                # A revocation published while the subscription was down is lost: an
                # answer read before it must not be cached once it is back (_lookup).
                on_live=self.clear,
                on_dark=self.clear,
                silence_s=silence_s,
                name="freshline-apikeys",
            )
        )
        self.lookups = 0
        self._limits_stored = True  # until the schema shows it has no limit columns

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Authenticator:
        """Subscribe to revocations and start writing last-use times."""
        if self._subscription is not None:
            self._subscription.start()
        if self._flusher is None:
            self._flusher = threading.Thread(
                target=self._flush_loop, daemon=True, name="freshline-apikey-usage"
            )
            self._flusher.start()
        return self

    def wait_live(self, timeout: float) -> bool:
        """Block until the revocation subscription is confirmed (True without Redis)."""
        return self._subscription is None or self._subscription.wait_live(timeout)

    def close(self) -> None:
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(5)
            self._flusher = None
        if self._subscription is not None:
            self._subscription.close()
        self.flush_usage()

    # -- the cache ---------------------------------------------------------------------

    def _trusted(self) -> bool:
        return self._subscription is None or self._subscription.live

    def cached(self, key: str) -> tuple[bool, Principal | None]:
        """``(known, principal)`` from the cache alone: ``known`` False means ask
        :meth:`principal`; ``(True, None)`` is a refused key."""
        found = self._cached(key)
        if found is None:
            return False, None
        if found.principal is not None:
            self._note_use(found.principal.key_id)
        return True, found.principal

    def _cached(self, key: str) -> _Cached | None:
        if len(key) > MAX_KEY_LENGTH or not self._trusted():
            return None
        with self._lock:
            hit = self._cache.get(key)
            if hit is None or hit.until < time.monotonic():
                return None
            self._cache.move_to_end(key)
        if hit.expires <= time.time():
            return None  # expired since cached: look it up, to refuse it with its reason
        return hit

    def principal(self, key: str) -> Principal:
        """Who ``key`` is; :class:`Unauthorized` if it is unknown, revoked or expired."""
        if len(key) > MAX_KEY_LENGTH:
            raise Unauthorized("unknown API key")
        found = self._cached(key) or self._lookup(key)
        if found.principal is None:
            raise found.refusal or Unauthorized("unknown API key")
        self._note_use(found.principal.key_id)
        return found.principal

    def tenant(self, key: str) -> str:
        """The tenant of ``key``; :class:`Unauthorized` if it may not be used."""
        return self.principal(key).tenant

    def forget(self, key_id: str) -> None:
        """Drop every cached answer for the key ``key_id``."""
        with self._lock:
            self._generation += 1
            stale = [
                k
                for k, c in self._cache.items()
                if (c.principal and c.principal.key_id == key_id)
                or (c.refusal and c.refusal.key_id == key_id)
            ]
            for key in stale:
                del self._cache[key]

    def clear(self) -> None:
        with self._lock:
            self._generation += 1
            self._cache.clear()

    def _on_revoked(self, channel: str, data: bytes | str) -> None:
        self.forget(data.decode() if isinstance(data, bytes) else data)

    def _key_row(self, digest: str) -> sa.Row[Any] | None:
        """The key's row, with its tenant's limits while the schema has them.

        An API upgraded before ``freshline db upgrade`` ran finds no limit columns
        (revisions 0004, 0005): it then reads keys without them, every tenant at the settings,
        and says so once, rather than refusing every key."""
        c, t = api_keys.c, tenants.c
        columns = [c.key_hash, c.id, c.tenant_id, c.expires_at, c.revoked_at]
        query = sa.select(*columns).where(c.key_hash == digest)
        if self._limits_stored:
            limited = (
                sa.select(*columns, *(t[name] for name in LIMIT_NAMES))
                .join_from(api_keys, tenants, c.tenant_id == t.id)
                .where(c.key_hash == digest)
            )
            try:
                with self.engine.connect() as conn:
                    return conn.execute(limited).first()
            except sa.exc.ProgrammingError as exc:
                if not isinstance(exc.orig, psycopg.errors.UndefinedColumn):
                    raise
                self._limits_stored = False
                log.warning(
                    "freshline.tenants lacks limit columns (schema before revision 0005): "
                    "every tenant gets the settings' limits; run freshline db upgrade"
                )
        with self.engine.connect() as conn:
            return conn.execute(query).first()

    def _lookup(self, key: str) -> _Cached:
        digest = hash_key(key)
        with self._lock:
            generation = self._generation
        row = self._key_row(digest)
        self.lookups += 1
        principal: Principal | None = None
        refusal: Unauthorized | None = None
        # The index found the row by hash; the final comparison takes constant time.
        if row is None or not hmac.compare_digest(row.key_hash, digest):
            refusal = Unauthorized("unknown API key")
        elif row.revoked_at is not None:
            refusal = Unauthorized("API key revoked", key_id=row.id, reason="revoked_key")
        elif row.expires_at is not None and row.expires_at <= datetime.now(UTC):
            refusal = Unauthorized("API key expired", key_id=row.id, reason="expired_key")
        else:
            limits = TenantLimits(*(getattr(row, name, None) for name in LIMIT_NAMES))
            principal = Principal(row.id, row.tenant_id, row.expires_at, limits)
        ttl = self.ttl_s if principal is not None else self.negative_ttl_s
        expires = (
            principal.expires_at.timestamp()
            if principal is not None and principal.expires_at is not None
            else math.inf
        )
        found = _Cached(principal, refusal, time.monotonic() + ttl, expires)
        with self._lock:
            # A revocation, an outage or a resubscription (after which a revocation
            # may have been missed) during the query: answer with it, cache nothing.
            if generation == self._generation and self._trusted():
                self._cache[key] = found
                self._cache.move_to_end(key)
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
        return found

    # -- last use ----------------------------------------------------------------------

    def _note_use(self, key_id: str) -> None:
        self._used[key_id] = time.time()  # one dict store: atomic under the GIL

    def pending_usage(self) -> dict[str, datetime]:
        """Last-use times gathered since the last flush, by key id."""
        return {k: datetime.fromtimestamp(t, UTC) for k, t in list(self._used.items())}

    def flush_usage(self) -> int:
        """Write the gathered last-use times in one statement; the number of keys."""
        with self._lock:
            taken, self._used = self._used, {}
        if not taken:
            return 0
        used = {k: datetime.fromtimestamp(t, UTC) for k, t in taken.items()}
        statement = sa.text(
            "UPDATE freshline.api_keys SET last_used_at = u.at "
            "FROM unnest(CAST(:ids AS text[]), CAST(:ats AS timestamptz[])) AS u(id, at) "
            "WHERE api_keys.id = u.id "
            "AND (api_keys.last_used_at IS NULL OR api_keys.last_used_at < u.at)"
        )
        with self.engine.begin() as conn:
            conn.execute(statement, {"ids": list(used), "ats": list(used.values())})
        return len(used)

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.last_used_interval_s):
            try:
                self.flush_usage()
            except Exception as exc:  # Postgres away: keep serving, try again next time
                log.warning("could not record API key last-use times: %s", exc)
