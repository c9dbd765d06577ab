"""Each tenant's share of a worker's thread pool.

Blocking work (read-through misses that reach Postgres, predictions, the semantic
cache) runs in Starlette's thread pool, 40 threads per worker shared by every
tenant. Without a bound, one tenant's flood of such requests (ids with no source row,
distinct prediction rows) holds every thread, and every other tenant's misses queue
behind it. :class:`TenantSlots` lets each tenant run at most
``FRESHLINE_API_TENANT_CONCURRENCY`` jobs at once per worker; its other requests
wait on the event loop, holding no thread, in arrival order. Hits answered on the
event loop never take a slot. Slots bound threads, not time: each job is also charged
its time against the tenant's :class:`freshline.pipeline.api.limits.PoolBudget`, and a tenant
in debt waits, still holding no thread, before its next job runs.

A tenant's own limits (``freshline tenants limits``: ``concurrency``, ``pool_share``),
read with its key, replace the settings for it; a change reaches requests that arrive
after it, while those already waiting finish under the old bound.

Both bounds are per worker process, and nothing adds them up across workers: a tenant
whose requests reach each of ``N`` workers may run ``N`` times its concurrency at once
and spend ``N`` times its share per second, out of ``N`` times 40 threads that all run
on the host's CPUs. ``freshline check --workers N`` warns when that can take every
CPU (:func:`freshline.pipeline.cli.deploy.share_problem`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from freshline.pipeline.api.accounts import SERVER_DEFAULTS, TenantLimits
from freshline.pipeline.api.auth import Principal
from freshline.pipeline.api.limits import PoolBudget, RowBudget

T = TypeVar("T")


class TenantSlots:
    """Per-tenant semaphores over the thread pool, made on first use and dropped when
    their tenant has nothing running or waiting (one event loop: no lock)."""

    def __init__(self, per_tenant: int, budget: PoolBudget | None = None) -> None:
        self.per_tenant = per_tenant
        self.budget = budget
        # tenant -> (its semaphore, [requests running or waiting on it], its size)
        self._slots: dict[str, tuple[asyncio.Semaphore, list[int], int]] = {}

    async def run(
        self,
        tenant: str,
        fn: Callable[..., T],
        *args: Any,
        limits: TenantLimits = SERVER_DEFAULTS,
    ) -> T:
        """``fn(*args)`` in the thread pool, once ``tenant`` has a free slot and owes
        no pool time (:class:`freshline.pipeline.api.limits.PoolBudget`), under ``limits`` where
        they are set."""
        share = limits.pool_share
        if self.budget is not None:
            await self.budget.check(tenant, share)
        size = self.per_tenant if limits.concurrency is None else limits.concurrency
        if size <= 0:
            return await self._timed(tenant, share, fn, *args)
        slot = self._slots.get(tenant)
        if slot is None or slot[2] != size:  # new, or its tenant's limit changed
            slot = self._slots[tenant] = (asyncio.Semaphore(size), [0], size)
        semaphore, users, _ = slot
        users[0] += 1
        try:
            async with semaphore:
                return await self._timed(tenant, share, fn, *args)
        finally:
            users[0] -= 1
            if users[0] == 0 and self._slots.get(tenant) is slot:
                del self._slots[tenant]

    async def _timed(self, tenant: str, share: float | None, fn: Callable[..., T], *args: Any) -> T:
        if self.budget is None:
            return await run_in_threadpool(fn, *args)
        await self.budget.paid(tenant, share)
        started = time.monotonic()
        try:
            return await run_in_threadpool(fn, *args)
        finally:
            self.budget.charge(tenant, time.monotonic() - started, share)

    def busy(self, tenant: str) -> int:
        """``tenant``'s requests running or waiting for a slot in this worker."""
        slot = self._slots.get(tenant)
        return slot[1][0] if slot else 0


def own_limits(request: Request, tenant: str) -> TenantLimits:
    """``tenant``'s own limits, as read with the request's key (``request.user``); the
    settings' if the request is not the tenant's."""
    principal = request.scope.get("user")
    if isinstance(principal, Principal) and principal.tenant == tenant:
        return principal.limits
    return SERVER_DEFAULTS


async def admit_rows(request: Request, tenant: str, rows: int) -> None:
    """Return once ``tenant`` may ask for ``rows`` rows (:class:`RowBudget`, under its
    own limits where set); an app that :func:`freshline.pipeline.api.create_app` did not build
    has no such budget."""
    budget: RowBudget | None = getattr(request.app.state, "rows", None)
    if budget is None:
        return
    own = own_limits(request, tenant)
    await budget.admit(tenant, rows, own.rows_per_s, own.rows_burst)


class Pool(Protocol):
    """Runs a blocking call in the thread pool (as someone's share of it), off the loop."""

    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


def tenant_pool(request: Request, tenant: str) -> Pool:
    """:func:`in_pool` for ``tenant``'s calls of ``request``, as a :class:`Pool` to hand
    to the code that makes them (:func:`freshline.pipeline.api.freshness.read`)."""

    def run(fn: Callable[..., T], /, *args: Any) -> Awaitable[T]:
        return in_pool(request, tenant, fn, *args)

    return run


async def in_pool(request: Request, tenant: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in the thread pool within ``tenant``'s share of it (an app that
    :func:`freshline.pipeline.api.create_app` did not build has no shares)."""
    slots: TenantSlots | None = getattr(request.app.state, "tenant_slots", None)
    if slots is None:
        return await run_in_threadpool(fn, *args)
    return await slots.run(tenant, fn, *args, limits=own_limits(request, tenant))
