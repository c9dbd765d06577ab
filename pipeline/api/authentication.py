"""Who is calling ``/v1``: Starlette's ``AuthenticationMiddleware`` with
:class:`ApiKeyBackend`, which resolves the bearer key to a
:class:`freshline.pipeline.api.auth.Principal` (``request.user``) or refuses it.

A key the worker's cache knows costs no query. One it does not know costs one Postgres
query, unless its client address has spent its budget of failed authentications (a
token bucket per address, per /64 for IPv6:
:func:`freshline.pipeline.api.addresses.address_group`; a lookup takes its token before
it runs, and a valid key gives it back, so guesses sent at once cannot each find the
budget unspent): then only a key whose hash is
in the worker's :class:`KeyIndex` is looked up, and any other gets 401 with no query,
so random keys cannot drive the database while a valid key is never refused for
someone else's failures. Refusals are JSON (:func:`refusal`), written to the audit log
and counted in ``freshline_api_refused_total{reason}``; Postgres down while a key is
checked is a 503. docs/security.md has the reasoning.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    BaseUser,
)
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import Scope

from freshline.pipeline.api import audit_log, metrics
from freshline.pipeline.api.accounts import MAX_KEY_LENGTH, hash_key
from freshline.pipeline.api.addresses import address_group, client_address
from freshline.pipeline.api.auth import Authenticator, Principal, Unauthorized, bearer_token
from freshline.pipeline.api.buckets import TokenBuckets
from freshline.pipeline.api.errors import error_response
from freshline.pipeline.core.db import api_keys
from freshline.pipeline.core.settings import Settings, redact_text

log = logging.getLogger(__name__)

GUARDED_PREFIX = "/v1/"
"""The paths that need a key."""

CREDENTIALS = AuthCredentials(["api_key"])
"""What every authenticated request holds: one, shared (nothing writes to it)."""


class Refused(AuthenticationError):
    """A request refused before it reached its route: the answer's status, code and
    headers (:func:`refusal` renders it)."""

    def __init__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        self.status = status
        self.code = code
        self.headers = headers
        super().__init__(message)


def refusal(conn: HTTPConnection, exc: AuthenticationError) -> Response:
    """``AuthenticationMiddleware``'s ``on_error``: the refusal as the API's JSON error."""
    if isinstance(exc, Refused):
        return error_response(exc.status, exc.code, str(exc), exc.headers)
    return error_response(401, "unauthorized", str(exc), {"WWW-Authenticate": "Bearer"})


class ApiKeyBackend(AuthenticationBackend):
    """The bearer key of each ``/v1`` request as its :class:`Principal`, within the
    failed-authentication limit of its client address; see the module docstring.
    Other paths are not authenticated here (``request.user`` is anonymous)."""

    def __init__(self, auth: Authenticator, settings: Settings) -> None:
        self.auth = auth
        self.keys = KeyIndex(auth.engine, refresh_s=settings.api_key_index_refresh_s)
        self.failures = TokenBuckets(
            settings.api_auth_failures_per_min / 60, settings.api_auth_failures_burst
        )
        self._throttle_logged: OrderedDict[str, float] = OrderedDict()

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        scope = conn.scope
        if not scope["path"].startswith(GUARDED_PREFIX):
            return None
        try:
            key = bearer_token(_authorization(scope))
            known, principal = self.auth.cached(key)
            if principal is None:  # not cached (the usual request is), or refused
                principal = await self._looked_up(key, known, client_address(scope))
        except Unauthorized as exc:
            self._refused(exc.reason, client_address(scope), exc.key_id)
            raise Refused(401, "unauthorized", str(exc), {"WWW-Authenticate": "Bearer"}) from exc
        except sa.exc.OperationalError as exc:
            # Outside the app's exception handlers: answered here, as they would.
            log.warning("%s: keys cannot be checked: %s", scope["path"], redact_text(str(exc.orig)))
            raise Refused(
                503, "service_unavailable", "Postgres did not answer; retry later"
            ) from exc
        return CREDENTIALS, principal

    async def _looked_up(self, key: str, known: bool, address: str) -> Principal:
        """``key``'s principal from Postgres (``known``: the cache has refused it), unless
        ``address`` is locked out and ``key`` cannot be valid."""
        group = address_group(address)
        # A lookup takes its failure token before it runs, so guesses sent at once
        # cannot each find the budget unspent; a key that turns out valid gives it back.
        taken = not known and self.failures.take(group) == 0
        # Locked out: the key is looked up only if it may be valid. That check comes
        # first, so others' failures from this address never refuse a valid key.
        if not known and not taken and not await self.keys.admits(key):
            raise Unauthorized(
                "too many failed authentications from this address; retry later",
                reason="throttled",
            )
        try:
            # A cached refusal raises again from the cache; the thread keeps a lookup,
            # should the entry expire meanwhile, off the event loop.
            principal = await run_in_threadpool(self.auth.principal, key)
        except Unauthorized:
            if not taken:
                self.failures.take(group)
            raise
        except BaseException:  # Postgres away: not a failed authentication
            if taken:
                self.failures.give(group)
            raise
        if taken:
            self.failures.give(group)
        return principal

    def _refused(self, reason: str, address: str, key_id: str | None) -> None:
        metrics.REFUSED.labels(reason).inc()
        if reason == "throttled":
            # Once a minute per address: a flood of refusals must not flood the log.
            now = time.monotonic()
            group = address_group(address)
            if self._throttle_logged.get(group, -math.inf) > now - 60:
                return
            self._throttle_logged[group] = now
            self._throttle_logged.move_to_end(group)
            while len(self._throttle_logged) > 10_000:
                self._throttle_logged.popitem(last=False)
        audit_log.record("auth.refused", reason=reason, key_id=key_id, client=address)


def _authorization(scope: Scope) -> str | None:
    """The request's ``Authorization`` header (no ``Headers`` object made for it)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return None


class KeyIndex:
    """The hashes of the keys that may be valid, in the worker: what lets a valid key
    through from an address locked out by others' failures, without a query per guess.

    A key whose hash it does not hold waits for the next top-up that starts after it
    arrived, then is checked again: a key made before the request is never refused.
    Top-ups run at most once per ``refresh_s``, however many requests wait for them
    (one small query a second under a flood of guesses, each guess held until then).
    The first loads the keys neither revoked nor expired, later ones those created
    since. It only admits a key to the usual lookup, so a key revoked since it was
    loaded costs that lookup and is refused there. About 150 bytes per key.
    """

    CLOCK_SKEW_S = 600.0
    """Keys' ``created_at`` comes from the clock of whoever made them: each top-up
    reads back this far before the newest one seen."""

    def __init__(self, engine: Engine, *, refresh_s: float = 1.0) -> None:
        self.engine = engine
        self.refresh_s = refresh_s
        self._hashes: set[str] = set()
        self._newest: datetime | None = None
        self._started = -math.inf  # time.monotonic() the last top-up began
        self._next: asyncio.Future[None] | None = None
        self._running: asyncio.Future[None] | None = None
        self.top_ups = 0

    async def admits(self, key: str) -> bool:
        """Whether ``key`` may be valid: its hash is held, now or after the next top-up."""
        if len(key) > MAX_KEY_LENGTH:
            return False
        digest = hash_key(key)
        if digest in self._hashes:
            return True
        if self._next is None:
            self._next = asyncio.ensure_future(self._top_up())
        await asyncio.shield(self._next)  # one waiter's disconnect stops no one's top-up
        return digest in self._hashes

    async def _top_up(self) -> None:
        await asyncio.sleep(max(0.0, self._started + self.refresh_s - time.monotonic()))
        # From here on, arrivals wait for the next one (kept referenced while it runs).
        self._running, self._next = self._next, None
        self._started = time.monotonic()
        try:
            rows = await run_in_threadpool(self._query)
        except Exception as exc:  # Postgres away: guesses are refused as before, not 500
            log.warning(
                "could not read API key hashes (%s); unknown keys are refused",
                redact_text(str(exc)),
            )
            return
        self.top_ups += 1
        self._hashes.update(digest for digest, _ in rows)
        newest = max((created for _, created in rows), default=None)
        if newest is not None and (self._newest is None or newest > self._newest):
            self._newest = newest

    def _query(self) -> list[tuple[str, datetime]]:
        c = api_keys.c
        query = sa.select(c.key_hash, c.created_at)
        if self._newest is None:
            query = query.where(
                c.revoked_at.is_(None), sa.or_(c.expires_at.is_(None), c.expires_at > sa.func.now())
            )
        else:
            query = query.where(c.created_at > self._newest - timedelta(seconds=self.CLOCK_SKEW_S))
        with self.engine.connect() as conn:
            return [(row.key_hash, row.created_at) for row in conn.execute(query)]
