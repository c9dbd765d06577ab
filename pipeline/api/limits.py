"""Abuse limits: how often a tenant may call ``/v1``, how much of the thread pool it may
owe, how many rows it may ask for, and how often an address may probe.

:class:`Limits` is ASGI middleware after authentication
(:mod:`freshline.pipeline.api.authentication`). For each request, in order:

1. the key's tenant takes a token from its bucket (``FRESHLINE_API_RATE_PER_S``,
   ``_BURST``, or the tenant's own: ``freshline tenants limits``), one bucket for all
   its keys: a request a little over the rate waits its turn (up to
   ``FRESHLINE_API_RATE_HOLD_S``); further over, it is held that long and answered 429
   with ``Retry-After`` (one refusal per hold and connection, not a flood);
2. the tenant must not owe more thread-pool time than it may wait for
   (:class:`PoolBudget`, ``FRESHLINE_API_TENANT_POOL_*``), or it is held
   ``FRESHLINE_API_TENANT_POOL_WAIT_S``, then answered 429 ``tenant_over_budget``;
3. a batch read's or a prediction's rows (:class:`RowBudget`,
   ``FRESHLINE_API_ROWS_PER_S``, or its own) must be due within the hold: held, then 429
   ``rows_limited``, 413 ``over_rows_burst`` past the burst (the routes ask,
   :func:`freshline.pipeline.api.tenancy.admit_rows`).

The probes on the API port (``/healthz``, ``/readyz``: no key) take a token from their
client address's bucket (``FRESHLINE_API_PROBE_RATE_PER_S``, ``_BURST``), or get 429;
load balancers should probe the ops port (``FRESHLINE_OPS_PORT``), which no client can
reach. Refusals are audited and counted in ``freshline_api_refused_total{reason}``.
Buckets live in the worker process (one event loop, no lock): with ``N`` workers a
tenant can reach ``N`` times its rate. The reasoning: docs/security.md.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from freshline.pipeline.api import audit_log, metrics
from freshline.pipeline.api.addresses import address_group, client_address
from freshline.pipeline.api.auth import Principal
from freshline.pipeline.api.buckets import TokenBuckets
from freshline.pipeline.api.errors import ApiError, error_response
from freshline.pipeline.core.settings import Settings

PROBES = frozenset({"/healthz", "/readyz"})


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
    second, ``burst_s`` at once, charged by what each job took. A tenant with a share of
    its own has a burst in proportion (``burst_s`` x its share / ``share``): every
    tenant's bucket fills in the same ``burst_s / share`` seconds, so a share of 0.01 is
    not 5 s of work at once after an idle spell.

    The work that reaches the pool (read-through misses, predictions, semantic cache
    calls) costs what it costs: a batch of a hundred ids with no source row, or a
    hundred rows never predicted, weighs a hundred times one hit's miss, where a rate
    of requests counts each as one. A job is charged its wall time in a thread when it
    ends, so a tenant may run into debt; its next job waits on the event loop, holding
    no thread, until the debt is paid. A request of a tenant that owes more than
    ``max_wait_s`` is held that long, then refused (:class:`TenantOverBudget`, 429)
    before its body is read (:class:`Limits`): a flood of expensive requests costs
    its sender waits and refusals, not the worker its CPU, and a sender that asks again
    at once cannot turn the refusals themselves into the flood. ``share`` 0 means no
    limit; each method may be given the tenant's own share (its
    :class:`freshline.pipeline.api.accounts.TenantLimits`), over ``share``.
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
        self.burst_s = burst_s
        self.max_wait_s = max_wait_s
        self._spent = TokenBuckets(share, burst_s, clock=clock)

    def _burst(self, share: float | None) -> float | None:
        """The burst of a tenant of ``share`` (``None``: the server's)."""
        if share is None:
            return None
        return self.burst_s * share / (self.share if self.share > 0 else 1.0)

    @classmethod
    def from_settings(cls, settings: Settings) -> PoolBudget:
        return cls(
            settings.api_tenant_pool_share,
            settings.api_tenant_pool_burst_s,
            settings.api_tenant_pool_wait_s,
        )

    def owed(self, tenant: str, share: float | None = None) -> float:
        """Seconds until ``tenant`` is out of debt."""
        return self._spent.owed(tenant, share, self._burst(share))

    def left(self, tenant: str, share: float | None = None) -> float:
        """Seconds of pool time ``tenant`` may spend now (negative: in debt)."""
        return self._spent.level(tenant, share, self._burst(share))

    def over(self, tenant: str, share: float | None = None) -> bool:
        """Whether ``tenant`` owes more than it may wait for (:meth:`check` refuses it)."""
        return self.owed(tenant, share) > self.max_wait_s

    async def check(self, tenant: str, share: float | None = None) -> None:
        """Raise :class:`TenantOverBudget` if ``tenant`` owes more than it may wait, once
        ``max_wait_s`` has passed: refused at once, a flood's sender would ask again at
        once, and the refusals would take the worker in the work's place."""
        if self.over(tenant, share):
            await asyncio.sleep(self.max_wait_s)
            raise TenantOverBudget(self.owed(tenant, share))

    async def paid(self, tenant: str, share: float | None = None) -> None:
        """Return once ``tenant`` is out of debt (others' jobs may add to it meanwhile)."""
        while (owed := self.owed(tenant, share)) > 0:
            await asyncio.sleep(owed)

    def charge(self, tenant: str, seconds: float, share: float | None = None) -> None:
        self._spent.charge(tenant, seconds, share, self._burst(share))


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


def _limited(reason: str, event: str, principal: Principal, scope: Scope) -> None:
    """Count and audit a request refused after its key was known: ``reason`` labels the
    refusals counter, ``event`` names the audit record."""
    metrics.REFUSED.labels(reason).inc()
    audit_log.record(
        event,
        key_id=principal.key_id,
        tenant=principal.tenant,
        client=client_address(scope),
        path=scope["path"],
    )


class Limits:
    """ASGI middleware: each authenticated request within its tenant's rate and pool
    time, each probe within its address's rate; see the module docstring."""

    def __init__(self, app: ASGIApp, *, settings: Settings, pool: PoolBudget | None = None) -> None:
        self.app = app
        self.pool = pool
        self.per_tenant = TokenBuckets(settings.api_rate_per_s, settings.api_rate_burst)
        self.rate_hold_s = settings.api_rate_hold_s
        self.probes = TokenBuckets(settings.api_probe_rate_per_s, settings.api_probe_burst)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = None
        if scope["type"] == "http":
            user = scope.get("user")
            if isinstance(user, Principal):
                wait = self._reserve(user)
                # The usual request, within its limits, awaits nothing here.
                if wait != 0.0 or self._over_budget(user):
                    refused = await self._held(scope, user, wait)
            elif scope["path"] in PROBES:
                refused = self._probe(scope)
        if refused is None:
            await self.app(scope, receive, send)
        else:
            await refused(scope, receive, send)

    def _reserve(self, principal: Principal) -> float | None:
        """Take ``principal``'s tenant's token: the seconds until it is due, or ``None``
        (nothing taken) if that is past the hold."""
        own = principal.limits
        return self.per_tenant.reserve(
            principal.tenant, self.rate_hold_s, own.rate_per_s, own.rate_burst
        )

    def _over_budget(self, principal: Principal) -> bool:
        return self.pool is not None and self.pool.over(
            principal.tenant, principal.limits.pool_share
        )

    async def _held(
        self, scope: Scope, principal: Principal, wait: float | None
    ) -> Response | None:
        """None once ``principal``'s request may go on, its token due in ``wait`` s;
        else its refusal, after the hold (``wait`` ``None``: over the rate)."""
        own = principal.limits
        tenant = principal.tenant
        if wait is None:
            await asyncio.sleep(self.rate_hold_s)
            _limited("rate_limited", "rate.limited", principal, scope)
            rate = self.per_tenant.rate if own.rate_per_s is None else own.rate_per_s
            retry = max(1, math.ceil(self.per_tenant.wait(tenant, own.rate_per_s, own.rate_burst)))
            return error_response(
                429,
                "rate_limited",
                f"over {rate:g} requests/s for this tenant (all its API keys); retry in {retry} s",
                {"Retry-After": str(retry)},
            )
        if wait > 0:
            await asyncio.sleep(wait)  # its token is taken: later arrivals queue behind it
        if self.pool is None:
            return None
        try:
            await self.pool.check(tenant, own.pool_share)
        except TenantOverBudget as over:
            _limited("tenant_over_budget", "tenant.over_budget", principal, scope)
            return error_response(429, over.code, str(over), {"Retry-After": str(over.retry_after)})
        return None

    def _probe(self, scope: Scope) -> Response | None:
        """None if the probe is within its address's rate; else its 429."""
        wait = self.probes.take(address_group(client_address(scope)))
        if wait <= 0:
            return None
        metrics.REFUSED.labels("probe_rate_limited").inc()
        retry = max(1, math.ceil(wait))
        return error_response(
            429,
            "rate_limited",
            f"over {self.probes.rate:g} probes/s from this address; retry in {retry} s "
            "(probe the ops port, FRESHLINE_OPS_PORT, for no limit)",
            {"Retry-After": str(retry)},
        )
