"""Abuse limits: who may call ``/v1``, how often, and how slowly they may send.

:class:`AccessGuard` is ASGI middleware in front of every ``/v1`` route. For each
request, in order:

1. the bearer key is resolved to a :class:`freshline.pipeline.api.auth.Principal`, from the
   worker's cache when it can be. A key the cache does not know costs one Postgres
   query, unless its client address has spent its budget of failed authentications
   (a token bucket per address, per /64 for IPv6): then only a key whose hash is in
   the worker's :class:`KeyIndex` is looked up, and any other gets 401 with no
   query, so random keys cannot drive the database while a valid key is never
   refused for someone else's failures;
2. the key's tenant takes a token from its bucket (``FRESHLINE_API_RATE_PER_S``,
   ``FRESHLINE_API_RATE_BURST``, or the tenant's own: ``freshline tenants limits``),
   one bucket for all its keys, so more keys buy no more rate: a request a little over
   the rate waits its turn (up to ``FRESHLINE_API_RATE_HOLD_S``) and is served;
   further over, it is held that long and answered 429 with ``Retry-After``, so a
   sender that asks again at once gets one refusal per hold and connection, not a
   flood of them;
3. the key's tenant must not owe more thread-pool time than it may wait for
   (:class:`PoolBudget`, ``FRESHLINE_API_TENANT_POOL_*``), or the request is held
   ``FRESHLINE_API_TENANT_POOL_WAIT_S``, then answered 429 ``tenant_over_budget``;
4. once a batch read's or a prediction's body is read, its tenant's rows
   (:class:`RowBudget`, ``FRESHLINE_API_ROWS_PER_S``, or its own) must be due within
   ``FRESHLINE_API_RATE_HOLD_S``: a request that asks for a hundred rows counts a
   hundred; held, then 429 ``rows_limited`` past the rate, 413 ``over_rows_burst``
   past the burst (the routes ask, :func:`freshline.pipeline.api.tenancy.admit_rows`);
5. the request body must arrive within ``FRESHLINE_API_BODY_TIMEOUT_S`` (408
   otherwise; checked every tenth of it, :class:`freshline.pipeline.api.deadlines.Deadlines`,
   so the answer comes within 1.1 times the limit), and a client that goes away
   mid-body ends the request as 499 ("client closed request"): neither is a server
   error.

The probes on the API port (``/healthz``, ``/readyz``: no key) take a token from their
client address's bucket (``FRESHLINE_API_PROBE_RATE_PER_S``, ``_BURST``), or get 429:
an anonymous flood costs an answer from memory each, never a check (``/readyz``
reuses one, :mod:`freshline.pipeline.api.ops`). Load balancers and orchestrators should probe the
ops port (``FRESHLINE_OPS_PORT``), whose probes are not limited: there, no client can
spend them.

Refusals are written to the audit log (:mod:`freshline.pipeline.api.audit_log`) and counted in
``freshline_api_refused_total{reason}``. Buckets live in the worker process (one event
loop, so no lock): with ``N`` workers a tenant can reach ``N`` times its rate.

The client address is the TCP peer's, or, when the peer is one of
``FRESHLINE_API_TRUSTED_PROXIES``, the right-most address in ``X-Forwarded-For`` that
is not (granian's ``wrap_asgi_with_proxy_headers`` does the rewriting).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import cast

import sqlalchemy as sa
from granian.utils.proxies import wrap_asgi_with_proxy_headers
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freshline.pipeline.api import audit_log, metrics
from freshline.pipeline.api.auth import (
    MAX_KEY_LENGTH,
    Authenticator,
    Principal,
    Unauthorized,
    bearer_token,
    hash_key,
)
from freshline.pipeline.api.deadlines import Deadlines
from freshline.pipeline.api.errors import ApiError, error_response
from freshline.pipeline.core.db import api_keys
from freshline.pipeline.core.settings import Settings, redact_text

log = logging.getLogger(__name__)

GUARDED_PREFIX = "/v1/"
PROBES = frozenset({"/healthz", "/readyz"})


class ClientClosed(ApiError):
    """The client went away before sending the whole body (logged as nothing worse)."""

    def __init__(self) -> None:
        super().__init__(499, "client_closed", "the client closed the connection mid-request")


class TokenBuckets:
    """A token bucket per name: ``burst`` tokens, refilled at ``rate_per_s``.

    At most ``max_entries`` names are tracked (least recently used are forgotten, which
    only ever forgives). ``rate_per_s`` 0 means no limit. Each method may be given a
    name's own ``rate`` and ``burst`` (a tenant's limits), over the bucket's.
    """

    def __init__(
        self,
        rate_per_s: float,
        burst: float,
        *,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate_per_s
        self.burst = float(burst)
        self.max_entries = max_entries
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _level(self, name: str, now: float, rate: float, burst: float) -> float:
        tokens, at = self._buckets.get(name, (burst, now))
        return min(burst, tokens + (now - at) * rate)

    def limits(self, rate: float | None, burst: float | None) -> tuple[float, float]:
        return (self.rate if rate is None else rate, self.burst if burst is None else burst)

    def wait(
        self, name: str, rate: float | None = None, burst: float | None = None, cost: float = 1.0
    ) -> float:
        """Seconds until ``name`` has ``cost`` tokens (0 if it has now); takes nothing."""
        rate, burst = self.limits(rate, burst)
        if rate <= 0:
            return 0.0
        tokens = self._level(name, self.clock(), rate, burst)
        return 0.0 if tokens >= cost else (cost - tokens) / rate

    def take(self, name: str) -> float:
        """Take a token: 0 if one was there, else the seconds until one will be."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        tokens = self._level(name, now, self.rate, self.burst)
        if tokens < 1:
            self._store(name, tokens, now)
            return (1 - tokens) / self.rate
        self._store(name, tokens - 1, now)
        return 0.0

    def reserve(
        self,
        name: str,
        max_wait_s: float,
        rate: float | None = None,
        burst: float | None = None,
        cost: float = 1.0,
    ) -> float | None:
        """Take ``cost`` tokens, into debt if need be: the seconds until they are due (0:
        now), or ``None``, taking nothing, if that is more than ``max_wait_s``."""
        rate, burst = self.limits(rate, burst)
        if rate <= 0:
            return 0.0
        now = self.clock()
        tokens = self._level(name, now, rate, burst)
        wait = 0.0 if tokens >= cost else (cost - tokens) / rate
        if wait > max_wait_s:
            return None
        self._store(name, tokens - cost, now)
        return wait

    def charge(self, name: str, cost: float, rate: float | None = None) -> None:
        """Take ``cost`` tokens for work already done: into debt, if need be."""
        rate, burst = self.limits(rate, None)
        if rate > 0:
            now = self.clock()
            self._store(name, self._level(name, now, rate, burst) - cost, now)

    def level(self, name: str, rate: float | None = None) -> float:
        """``name``'s tokens now (negative: in debt; infinite with no limit)."""
        rate, burst = self.limits(rate, None)
        return self._level(name, self.clock(), rate, burst) if rate > 0 else math.inf

    def owed(self, name: str, rate: float | None = None) -> float:
        """Seconds until ``name`` is out of debt (0 if it is not in debt)."""
        rate, burst = self.limits(rate, None)
        if rate <= 0:
            return 0.0
        return max(0.0, -self._level(name, self.clock(), rate, burst) / rate)

    def _store(self, name: str, tokens: float, now: float) -> None:
        self._buckets[name] = (tokens, now)
        self._buckets.move_to_end(name)
        while len(self._buckets) > self.max_entries:
            self._buckets.popitem(last=False)


class TenantOverBudget(ApiError):
    """A tenant owes more thread-pool time than it may wait to pay back."""

    def __init__(self, owed_s: float) -> None:
        retry = max(1, math.ceil(owed_s))
        super().__init__(
            429,
            "tenant_over_budget",
            "this tenant has used its share of the server's thread pool "
            f"(FRESHLINE_API_TENANT_POOL_SHARE); retry in {retry} s",
            retry_after=retry,
        )


class PoolBudget:
    """Each tenant's thread-pool time in a worker: ``share`` seconds of work per
    second, ``burst_s`` at once, charged by what each job took.

    The work that reaches the pool (read-through misses, predictions, semantic cache
    calls) costs what it costs: a batch of a hundred ids with no source row, or a
    hundred rows never predicted, weighs a hundred times one hit's miss, where a rate
    of requests counts each as one. A job is charged its wall time in a thread when it
    ends, so a tenant may run into debt; its next job waits on the event loop, holding
    no thread, until the debt is paid. A request of a tenant that owes more than
    ``max_wait_s`` is held that long, then refused (:class:`TenantOverBudget`, 429)
    before its body is read (:class:`AccessGuard`): a flood of expensive requests costs
    its sender waits and refusals, not the worker its CPU, and a sender that asks again
    at once cannot turn the refusals themselves into the flood. ``share`` 0 means no
    limit; each method may be given the tenant's own share (its
    :class:`freshline.pipeline.api.auth.TenantLimits`), over ``share``.
    """

    def __init__(
        self,
        share: float,
        burst_s: float,
        max_wait_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.share = share
        self.max_wait_s = max_wait_s
        self._spent = TokenBuckets(share, burst_s, clock=clock)

    @classmethod
    def from_settings(cls, settings: Settings) -> PoolBudget:
        return cls(
            settings.api_tenant_pool_share,
            settings.api_tenant_pool_burst_s,
            settings.api_tenant_pool_wait_s,
        )

    def owed(self, tenant: str, share: float | None = None) -> float:
        """Seconds until ``tenant`` is out of debt."""
        return self._spent.owed(tenant, share)

    def left(self, tenant: str, share: float | None = None) -> float:
        """Seconds of pool time ``tenant`` may spend now (negative: in debt)."""
        return self._spent.level(tenant, share)

    async def check(self, tenant: str, share: float | None = None) -> None:
        """Raise :class:`TenantOverBudget` if ``tenant`` owes more than it may wait, once
        ``max_wait_s`` has passed: refused at once, a flood's sender would ask again at
        once, and the refusals would take the worker in the work's place."""
        if self._spent.owed(tenant, share) > self.max_wait_s:
            await asyncio.sleep(self.max_wait_s)
            raise TenantOverBudget(self._spent.owed(tenant, share))

    async def paid(self, tenant: str, share: float | None = None) -> None:
        """Return once ``tenant`` is out of debt (others' jobs may add to it meanwhile)."""
        while (owed := self._spent.owed(tenant, share)) > 0:
            await asyncio.sleep(owed)

    def charge(self, tenant: str, seconds: float, share: float | None = None) -> None:
        self._spent.charge(tenant, seconds, share)


class RowBudget:
    """Each tenant's rows in a worker: the entities (times feature sets) its reads and
    the rows its predictions ask for, ``rate_per_s`` a second and ``burst`` at once
    (``FRESHLINE_API_ROWS_PER_S``; a tenant's own, over it).

    A request's rate counts it once; a batch of a hundred ids with no source row, or a
    prediction of a hundred new rows, costs the servers (Postgres, Redis, the model)
    about a hundred times one, before any thread-pool time is charged. A request whose
    rows are due within ``hold_s`` waits for them; a later one is held ``hold_s`` and
    refused (429 ``rows_limited``), one asking for more than the burst is held and
    refused too (413 ``over_rows_burst``): refused at once, a sender would only ask
    again at once."""

    def __init__(self, rate_per_s: float, burst: int, hold_s: float) -> None:
        self.hold_s = hold_s
        self._buckets = TokenBuckets(rate_per_s, burst)

    @classmethod
    def from_settings(cls, settings: Settings) -> RowBudget:
        return cls(settings.api_rows_per_s, settings.api_rows_burst, settings.api_rate_hold_s)

    async def admit(
        self, tenant: str, rows: int, rate: float | None = None, burst: int | None = None
    ) -> None:
        """Return once ``tenant`` may ask for ``rows`` more rows; raise :class:`ApiError`
        (after ``hold_s``) if it may not soon."""
        rate, most = self._buckets.limits(rate, burst)
        if rate <= 0 or rows <= 0:
            return
        if rows > most:
            await asyncio.sleep(self.hold_s)
            metrics.REFUSED.labels("over_rows_burst").inc()
            raise ApiError(
                413,
                "over_rows_burst",
                f"this request asks for {rows} rows (entities times feature sets, or "
                f"prediction rows), more than this tenant's {most:g} at once "
                "(FRESHLINE_API_ROWS_BURST); split it",
            )
        wait = self._buckets.reserve(tenant, self.hold_s, rate, most, cost=rows)
        if wait is None:
            await asyncio.sleep(self.hold_s)
            due = max(1, math.ceil(self._buckets.wait(tenant, rate, most, cost=rows)))
            metrics.REFUSED.labels("rows_limited").inc()
            raise ApiError(
                429,
                "rows_limited",
                f"over {rate:g} rows/s for this tenant (FRESHLINE_API_ROWS_PER_S); "
                f"retry in {due} s",
                retry_after=due,
            )
        if wait > 0:
            await asyncio.sleep(wait)


def address_group(address: str) -> str:
    """The name an address's failed authentications are counted under: the address,
    or its /64 for IPv6 (one host's usual allocation, so rotating within it gains
    nothing); an IPv4-mapped IPv6 address counts as its IPv4 address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address  # not an IP (a Unix socket's peer, say): counted as itself
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return address


def _limited(reason: str, event: str, principal: Principal, address: str, path: str) -> None:
    """Count and audit a request refused after its key was known: ``reason`` labels the
    refusals counter, ``event`` names the audit record."""
    metrics.REFUSED.labels(reason).inc()
    audit_log.record(
        event, key_id=principal.key_id, tenant=principal.tenant, client=address, path=path
    )


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


class AccessGuard:
    """ASGI middleware: authentication, per-tenant rate and per-address failure limits,
    and body timeouts for ``/v1``; see the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        auth: Authenticator,
        settings: Settings,
        pool: PoolBudget | None = None,
    ) -> None:
        self.app = app
        self.auth = auth
        self.pool = pool
        self.keys = KeyIndex(auth.engine, refresh_s=settings.api_key_index_refresh_s)
        self.per_tenant = TokenBuckets(settings.api_rate_per_s, settings.api_rate_burst)
        self.rate_hold_s = settings.api_rate_hold_s
        self.failures = TokenBuckets(
            settings.api_auth_failures_per_min / 60, settings.api_auth_failures_burst
        )
        self.probes = TokenBuckets(settings.api_probe_rate_per_s, settings.api_probe_burst)
        self.body_timeout_s = settings.api_body_timeout_s
        self._deadlines = Deadlines(tick_s=self.body_timeout_s / 10)
        self._throttle_logged: OrderedDict[str, float] = OrderedDict()
        self._entry: ASGIApp = self._guard
        if settings.api_trusted_proxies:
            self._entry = cast(
                ASGIApp, wrap_asgi_with_proxy_headers(self._guard, settings.api_trusted_proxies)
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._entry(scope, receive, send)

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        client = scope.get("client")
        address = str(client[0]) if client else "-"
        if path in PROBES:
            await self._probe(scope, receive, send, address)
            return
        if not path.startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            principal = await self._authenticate(scope, address)
        except Unauthorized as exc:
            self._refused(exc.reason, address, exc.key_id)
            response = error_response(401, "unauthorized", str(exc), {"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        except sa.exc.OperationalError as exc:
            # Outside the app's exception handlers: answered here, as they would.
            log.warning("%s: keys cannot be checked: %s", scope["path"], redact_text(str(exc.orig)))
            response = error_response(
                503, "service_unavailable", "Postgres did not answer; retry later"
            )
            await response(scope, receive, send)
            return
        own = principal.limits
        rate, burst = own.rate_per_s, own.rate_burst
        wait = self.per_tenant.reserve(principal.tenant, self.rate_hold_s, rate, burst)
        if wait is None:
            await asyncio.sleep(self.rate_hold_s)
            _limited("rate_limited", "rate.limited", principal, address, path)
            retry = max(1, math.ceil(self.per_tenant.wait(principal.tenant, rate, burst)))
            response = error_response(
                429,
                "rate_limited",
                f"over {self.per_tenant.rate if rate is None else rate:g} requests/s for this "
                f"tenant (all its API keys); retry in {retry} s",
                {"Retry-After": str(retry)},
            )
            await response(scope, receive, send)
            return
        if wait > 0:
            await asyncio.sleep(wait)  # its token is taken: later arrivals queue behind it
        try:
            if self.pool is not None:
                await self.pool.check(principal.tenant, own.pool_share)
        except TenantOverBudget as refusal:
            _limited("tenant_over_budget", "tenant.over_budget", principal, address, path)
            response = error_response(
                429, refusal.code, str(refusal), {"Retry-After": str(refusal.retry_after)}
            )
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, self._bounded(receive), send)

    async def _probe(self, scope: Scope, receive: Receive, send: Send, address: str) -> None:
        """A probe, within its address's rate; 429 past it."""
        wait = self.probes.take(address_group(address))
        if wait <= 0:
            await self.app(scope, receive, send)
            return
        metrics.REFUSED.labels("probe_rate_limited").inc()
        retry = max(1, math.ceil(wait))
        response = error_response(
            429,
            "rate_limited",
            f"over {self.probes.rate:g} probes/s from this address; retry in {retry} s "
            "(probe the ops port, FRESHLINE_OPS_PORT, for no limit)",
            {"Retry-After": str(retry)},
        )
        await response(scope, receive, send)

    async def _authenticate(self, scope: Scope, address: str) -> Principal:
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        key = bearer_token(header)
        known, principal = self.auth.cached(key)
        if known and principal is not None:
            return principal
        group = address_group(address)
        # Locked out: the key is looked up only if it may be valid. That check comes
        # first, so others' failures from this address never refuse a valid key.
        if not known and self.failures.wait(group) > 0 and not await self.keys.admits(key):
            raise Unauthorized(
                "too many failed authentications from this address; retry later",
                reason="throttled",
            )
        try:
            # A cached refusal raises again from the cache; the thread keeps a lookup,
            # should the entry expire meanwhile, off the event loop.
            return await run_in_threadpool(self.auth.principal, key)
        except Unauthorized:
            self.failures.take(group)
            raise

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

    def _bounded(self, receive: Receive) -> Receive:
        """``receive`` with the body due within the timeout, and a disconnect mid-body
        turned into :class:`ClientClosed` rather than an unexpected exception."""
        deadline = time.monotonic() + self.body_timeout_s
        done = False

        async def bounded() -> Message:
            nonlocal done
            if done:
                return await receive()
            try:
                # One check per loop, not a timer per call (anyio's cancel scope or
                # asyncio.timeout): the API runs on asyncio (its Redis client is
                # redis.asyncio).
                message = await self._deadlines.bound(
                    receive(), max(0.0, deadline - time.monotonic())
                )
            except TimeoutError:
                raise ApiError(
                    408,
                    "body_timeout",
                    f"the request body did not arrive within {self.body_timeout_s:g} s",
                ) from None
            if message["type"] == "http.disconnect":
                raise ClientClosed()
            if not message.get("more_body", False):
                done = True
            return message

        return bounded
