"""The operator's endpoints: ``/metrics``, ``/status``, ``/status.json`` and the probes.

The first three show every tenant's traffic in aggregate and cost a sample of Redis (a
SCAN) and of the broker, so the API port does not serve them to anyone who asks:
``freshline serve`` serves them on an ops port of their own (``FRESHLINE_OPS_HOST`` and
``_PORT``, loopback by default; :func:`ops_app`), and the API port serves them only to
the operator key (``FRESHLINE_OPS_KEY``), if one is set.

What they sample (staleness from Redis, consumer-group lag from the broker, the semantic
cache's namespaces) is taken at most once per ``FRESHLINE_OPS_CACHE_S`` whoever asks
(:class:`SharedObserver`): any number of requests drive at most one SCAN of Redis per
period. Counters are read fresh on every request. ``/readyz`` reuses its Redis and
Postgres check for ``FRESHLINE_API_READY_CACHE_S``, one check at a time
(:class:`Recent`), so probes cost no round trip each; on the API port they are limited
per client address too (:class:`freshline.pipeline.api.limits.Limits`).
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import redis
from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Lifespan

from freshline.pipeline.api import metrics
from freshline.pipeline.api.errors import HANDLERS, JSONResponse, error_response
from freshline.pipeline.api.status_page import page as render_status_page
from freshline.pipeline.core.db import ping
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.observe.staleness import Staleness
from freshline.pipeline.observe.status import Observer, SampledMetrics, StatusBoard

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


class Shared(Generic[T]):
    """``compute()``, called at most once per ``max_age_s`` by threads: one computes
    while the others wait for its value (0: every call computes, one at a time)."""

    def __init__(self, compute: Callable[[], T], max_age_s: float) -> None:
        self.compute = compute
        self.max_age_s = max_age_s
        self.computed = 0
        self._lock = threading.Lock()
        self._value: tuple[float, T] | None = None

    def get(self) -> T:
        with self._lock:
            now = time.monotonic()
            if self._value is None or now - self._value[0] >= self.max_age_s:
                self._value = (now, self.compute())
                self.computed += 1
            return self._value[1]


class Recent(Generic[T]):
    """``compute()`` (blocking, run in the thread pool), at most once per ``max_age_s``
    for callers on the event loop: a fresh value is answered without a thread, and
    callers that arrive while it is computed wait for that computation, holding no
    thread. A computation is shared by the callers of one event loop (an app served on
    two loops in one process computes on each)."""

    def __init__(self, compute: Callable[[], T], max_age_s: float) -> None:
        self.compute = compute
        self.max_age_s = max_age_s
        self.computed = 0
        self._value: tuple[float, T] | None = None
        self._running: dict[asyncio.AbstractEventLoop, asyncio.Future[T]] = {}

    async def get(self) -> T:
        value = self._value
        if value is not None and time.monotonic() - value[0] < self.max_age_s:
            return value[1]
        loop = asyncio.get_running_loop()
        running = self._running.get(loop)
        if running is None:
            running = self._running[loop] = loop.create_task(self._refresh(loop))
        return await asyncio.shield(running)  # one caller's disconnect stops no one

    async def _refresh(self, loop: asyncio.AbstractEventLoop) -> T:
        try:
            value = await run_in_threadpool(self.compute)
            self._value = (time.monotonic(), value)
            self.computed += 1
            return value
        finally:
            del self._running[loop]


class SharedObserver(Observer):
    """An :class:`Observer` whose Redis sample, broker lag and semantic namespaces are
    taken at most once per ``sample_max_age_s``, whoever asks: ``/metrics``,
    ``/status`` and the status board's own thread share them."""

    def __init__(self, *args: Any, sample_max_age_s: float, **kwargs: Any) -> None:
        super().__init__(*args, max_age_s=sample_max_age_s, **kwargs)
        self._staleness = Shared(super().staleness, sample_max_age_s)
        self._lag = Shared(super().lag, sample_max_age_s)
        self._namespaces = Shared(super().namespaces, sample_max_age_s)

    @property
    def samples(self) -> int:
        """Redis samples taken so far."""
        return self._staleness.computed

    def staleness(self) -> dict[str, Staleness]:
        return self._staleness.get()

    def lag(self) -> dict[str, int] | None:
        return self._lag.get()

    def namespaces(self) -> dict[str, Any] | None:
        return self._namespaces.get()


@dataclass(slots=True)
class Ops:
    """What the operator's endpoints read, one per app (both ports share it)."""

    board: StatusBoard
    sampled: SampledMetrics
    readiness: Recent[dict[str, str]]
    key: str = field(repr=False)
    """The operator key; empty: the API port serves none of these to anyone."""


def readiness_check(client: redis.Redis, engine: Engine) -> Callable[[], dict[str, str]]:
    """The check ``/readyz`` makes: Redis and Postgres answer."""

    def check() -> dict[str, str]:
        checks: dict[str, str] = {}
        try:
            client.ping()
            checks["redis"] = "ok"
        except (redis.exceptions.RedisError, OSError) as exc:
            checks["redis"] = f"unavailable: {type(exc).__name__}"
        try:
            ping(engine)
            checks["postgres"] = "ok"
        except FreshlineError as exc:
            checks["postgres"] = f"unavailable: {exc.__class__.__name__}"
        return checks

    return check


def ops(request: Request) -> Ops:
    return cast(Ops, request.app.state.ops)


async def healthz(request: Request) -> Response:
    """The process is up."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Redis and Postgres answer (checked at most once per ``api_ready_cache_s``)."""
    checks = await ops(request).readiness.get()
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse(
        {"status": "ready" if ready else "unavailable", "checks": checks},
        status_code=200 if ready else 503,
    )


async def metrics_text(request: Request) -> Response:
    """Prometheus metrics."""
    body, content_type = await run_in_threadpool(metrics.render, ops(request).sampled)
    return Response(body, headers={"Content-Type": content_type})


async def status_page(request: Request) -> Response:
    """The status page: hit rate, staleness and lag per feature set over the last hour."""
    report = await run_in_threadpool(ops(request).board.report)
    return Response(
        render_status_page(report),
        media_type="text/html; charset=utf-8",
        headers={"Cache-Control": "no-store"},
    )


async def status_json(request: Request) -> Response:
    """The status page's data, as JSON."""
    report = await run_in_threadpool(ops(request).board.report)
    return JSONResponse(report, headers={"Cache-Control": "no-store"})


def operator_only(handler: Handler) -> Handler:
    """``handler`` for the operator key's bearer only; 401 for anyone else."""

    async def run(request: Request) -> Response:
        key = ops(request).key
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not (
            key
            and scheme.lower() == "bearer"
            and hmac.compare_digest(token.strip().encode(), key.encode())
        ):
            return error_response(
                401,
                "unauthorized",
                "this endpoint is for the operator key (FRESHLINE_OPS_KEY) only; "
                "or read it on the ops port (FRESHLINE_OPS_PORT)",
                {"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    run.__name__ = handler.__name__
    run.__doc__ = handler.__doc__
    return run


OPS_ROUTES = [
    Route("/metrics", metrics_text, methods=["GET"]),
    Route("/status", status_page, methods=["GET"]),
    Route("/status.json", status_json, methods=["GET"]),
]
PROBE_ROUTES = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
]


def api_routes(state: Ops) -> list[Route]:
    """What the API port serves of these: the probes, and with an operator key the
    operator's pages for that key only."""
    guarded = [
        Route(r.path, operator_only(cast(Handler, r.endpoint)), methods=["GET"]) for r in OPS_ROUTES
    ]
    return [*PROBE_ROUTES, *(guarded if state.key else [])]


def ops_app(state: Ops, lifespan: Lifespan[Starlette] | None = None) -> Starlette:
    """The ops port's app: the operator's pages and the probes, with no key (its
    address is the protection: loopback by default)."""
    app = Starlette(
        routes=[*OPS_ROUTES, *PROBE_ROUTES], exception_handlers=HANDLERS, lifespan=lifespan
    )
    app.state.ops = state
    return app
