"""API keys resolved to who is calling: a :class:`Principal`, from the worker's cache.

The caller's tenant comes from its key and from nothing else: the read API never
takes a tenant from a path, query or body. :mod:`freshline.pipeline.api.authentication`
asks :class:`Authenticator` for every ``/v1`` request; keys are made and revoked in
:mod:`freshline.pipeline.api.accounts`.

Revocation reaches every API worker at once: ``revoke_api_key`` marks the row, then
publishes the key's id on :data:`freshline.pipeline.core.keys.APIKEY_CHANNEL`; each
worker's :class:`Authenticator` drops the key from its cache when the message
arrives, and trusts its cache only while that subscription is confirmed live
(:class:`freshline.pipeline.cache.subscription.Subscription`, bounded by
``FRESHLINE_SUBSCRIPTION_SILENCE_MS``). A lost message therefore keeps a revoked key
working for that bound at most: a message published while the subscription is down
is lost, so the cache is dropped when it goes down and again when it is back, and
only a lookup begun after the subscription was confirmed may be cached.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from starlette.authentication import BaseUser

from freshline.pipeline.api.accounts import (
    LIMIT_NAMES,
    MAX_KEY_LENGTH,
    SERVER_DEFAULTS,
    TenantLimits,
    hash_key,
)
from freshline.pipeline.cache.subscription import Subscription
from freshline.pipeline.core.db import api_keys, tenants
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.keys import APIKEY_CHANNEL

log = logging.getLogger(__name__)


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


@dataclass(frozen=True, slots=True)
class Principal(BaseUser):
    """Who a request is: the key's id and its tenant (and when the key expires), and
    the tenant's own limits. Starlette's ``request.user`` on every ``/v1`` request."""

    key_id: str
    tenant: str
    expires_at: datetime | None = None
    limits: TenantLimits = SERVER_DEFAULTS

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.tenant

    @property
    def identity(self) -> str:
        return self.key_id


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
