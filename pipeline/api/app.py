"""Building the app: the services it reads with, its routes and its error handlers."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypedDict

import redis
from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.routing import BaseRoute, Route

from freshline.pipeline.api import audit_log, metrics, ops, routes
from freshline.pipeline.api.addresses import proxy_headers
from freshline.pipeline.api.auth import Authenticator
from freshline.pipeline.api.authentication import GUARDED_PREFIX, ApiKeyBackend, refusal
from freshline.pipeline.api.bodies import BodyDeadline
from freshline.pipeline.api.errors import HANDLERS
from freshline.pipeline.api.fastpath import async_client
from freshline.pipeline.api.limits import Limits, PoolBudget, RowBudget
from freshline.pipeline.api.openapi import document
from freshline.pipeline.api.reader import FeatureReader
from freshline.pipeline.api.semantic_status import reader as semantic_reader
from freshline.pipeline.api.tenancy import TenantSlots
from freshline.pipeline.cache.arrivals import Arrivals
from freshline.pipeline.cache.hot import HotReads
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.readthrough import Hooks, ReadThrough
from freshline.pipeline.cache.roster import Proc, Registration, roster, strangers
from freshline.pipeline.cache.store import EntryStore, check_eviction_policy
from freshline.pipeline.cache.tokens import Tokens
from freshline.pipeline.cache.versions import DEFAULT_POINTER, Pointer, VersionResolver
from freshline.pipeline.core.budget import TenantBudget
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.lock import Lock
from freshline.pipeline.core.repository import Repository, active
from freshline.pipeline.core.services import redis_client as make_redis_client
from freshline.pipeline.core.settings import Settings, load_settings
from freshline.pipeline.history.snapshots import keeper
from freshline.pipeline.history.status import rows as history_rows
from freshline.pipeline.inference.models import ModelRegistry
from freshline.pipeline.inference.predictions import InferenceCache
from freshline.pipeline.observe.served import ServedLog
from freshline.pipeline.observe.staleness import GroupLag
from freshline.pipeline.observe.status import SampledMetrics, StatusBoard
from freshline.pipeline.semantic.extra import require_extra

if TYPE_CHECKING:
    from freshline.pipeline.api.llm import SemanticService

log = logging.getLogger(__name__)

HOT_FLUSH_S = 1.0

ROUTES = [
    Route("/v1/features/batch", routes.batch, methods=["POST"]),
    Route("/v1/features/{feature_set}/{entity_id}", routes.get_features, methods=["GET"]),
    Route("/v1/models/{name}/predict", routes.predict, methods=["POST"]),
    Route("/openapi.json", routes.openapi, methods=["GET"]),
]
"""The API's own routes; the probes and the operator's pages are
:mod:`freshline.pipeline.api.ops`'s."""


# long: wires every collaborator and route in one place; issue 59's middleware rewrite splits it
def create_app(
    settings: Settings,
    *,
    engine: Engine | None = None,
    redis_client: redis.Redis | None = None,
    local: LocalTier | None = None,
    registry: Registry,
    follow_deploys: bool = True,
    consumer_metrics: list[str] | None = None,
    status_interval_s: float = 60.0,
    semantic_figures: bool | None = None,
    pointer: Pointer = DEFAULT_POINTER,
    lock: Lock | None = None,
    keep_snapshots: bool = False,
) -> Starlette:
    """The read API. Clients not passed in are made from ``settings`` and closed on exit.

    The in-process tier is used when ``local`` is given, or made (and started at
    start-up) when ``settings.local_cache_size > 0``. With ``follow_deploys`` reads
    serve the active schema version named by the deploy pointer
    (:class:`freshline.pipeline.cache.versions.VersionResolver`; ``pointer``, ``lock``: whose and
    with which lock, the repository's by default) and are sampled for warming, and the
    worker registers itself (:mod:`freshline.pipeline.cache.roster`). Both subscriptions rely on
    Redis for ``settings.subscription_silence_ms`` at most without confirmed contact,
    and reconnect by themselves.

    ``/status`` keeps a snapshot every ``status_interval_s``
    (:mod:`freshline.pipeline.observe.status`);
    ``consumer_metrics`` are the consumers' ``/metrics`` URLs it reads freshness lag
    from (default: the local consumer's port, ``FRESHLINE_CONSUMER_METRICS_PORT``), and
    with ``semantic_figures`` (default: ``settings.semantic_enabled``) it shows the
    semantic cache's busiest namespaces (:mod:`freshline.pipeline.api.semantic_status`).
    With ``keep_snapshots`` (the repository's ``[history] enabled``; ``FeatureStore.app``
    passes it) a read-through fill keeps the snapshot its entries name
    (:mod:`freshline.pipeline.history.snapshots`).
    ``/metrics``, ``/status`` and ``/status.json`` are served by ``app.state.ops_app``
    (the ops port's app, :mod:`freshline.pipeline.api.ops`), and on this app only to the operator
    key (``settings.ops_key``), if one is set.

    The semantic cache's routes (``/v1/llm/cache/*``) mount only with
    ``settings.semantic_enabled``, which needs the ``freshline[semantic]`` extra
    (:class:`freshline.pipeline.semantic.extra.SemanticNotInstalled` otherwise); without it
    nothing of FAISS, ``tokenizers`` or ``safetensors`` is imported.
    """
    if settings.semantic_enabled:
        require_extra("FRESHLINE_SEMANTIC_ENABLED")  # before any client is made
    owned_engine = engine is None
    owned_redis = redis_client is None
    engine = engine or make_engine(settings, pool_size=10)
    client = redis_client or make_redis_client(
        settings,
        socket_connect_timeout=settings.api_redis_connect_timeout_s,
        socket_timeout=settings.api_redis_timeout_s,
    )
    owned_local = local is None and settings.local_cache_size > 0
    if owned_local:
        local = LocalTier(
            client,
            max_entries=settings.local_cache_size,
            registry=registry,
            silence_s=settings.subscription_silence_ms / 1000,
        )

    store = EntryStore(
        client, settings.schema_version, registry=registry, tombstone_ttl_s=settings.tombstone_ttl_s
    )
    versions = (
        VersionResolver(client, settings, pointer=pointer, lock=lock) if follow_deploys else None
    )
    # Sampled reads gather in memory and are flushed in the background: no round trip.
    hot = HotReads(client, flush_s=HOT_FLUSH_S) if follow_deploys else None
    # With a replica, the feature queries run there and the primary gates the writes.
    replica = (
        make_engine(settings, pool_size=10, url=settings.postgres_replica_url)
        if settings.postgres_replica_url
        else None
    )
    readthrough = ReadThrough(
        store,
        replica or engine,
        lease_ms=settings.lease_ms,
        wait_ms=settings.read_wait_ms,
        versions=versions,
        hot=hot,
        primary=engine if replica is not None else None,
        hooks=Hooks(on_computed=keeper(engine)) if keep_snapshots else None,
    )
    services = routes.Services(
        settings=settings,
        redis=client,
        engine=engine,
        registry=registry,
        reader=FeatureReader(
            readthrough,
            local,
            timeout_s=settings.api_redis_timeout_s,
            tokens=Tokens(engine, client),
            arrivals=Arrivals(client, silence_s=settings.subscription_silence_ms / 1000),
        ),
        auth=Authenticator(
            engine,
            redis_client=client,
            ttl_s=settings.api_key_cache_s,
            silence_s=settings.subscription_silence_ms / 1000,
            last_used_interval_s=settings.api_key_last_used_s,
        ),
        models=ModelRegistry(client),
        inference=InferenceCache(
            client,
            decimals=settings.inference_decimals,
            ttl_s=settings.inference_ttl_s,
            budget=TenantBudget(
                client,
                max_keys=settings.inference_tenant_max_keys,
                max_bytes=settings.inference_tenant_max_bytes,
            ),
        ),
        served=ServedLog(settings) if settings.served_log_buffer > 0 else None,
    )

    if consumer_metrics is None:
        port = settings.consumer_metrics_port
        consumer_metrics = [f"http://127.0.0.1:{port}/metrics"] if port else []
    if semantic_figures is None:
        semantic_figures = settings.semantic_enabled
    observer = ops.SharedObserver(
        client,
        registry,
        settings,
        version=lambda: services.reader.schema_version,
        counters=metrics.process_registry,
        consumer_metrics=consumer_metrics,
        lag=GroupLag(settings),
        semantic_namespaces=semantic_reader(settings, client, engine) if semantic_figures else None,
        deploy=lambda: deploy_report(client, pointer, readthrough),
        sample_max_age_s=settings.ops_cache_s,
    )
    board = StatusBoard(
        observer,
        interval_s=status_interval_s,
        history=(lambda: history_rows(engine)) if keep_snapshots else None,
    )
    operator = ops.Ops(
        board=board,
        sampled=SampledMetrics(observer),
        readiness=ops.Recent(
            ops.readiness_check(client, engine), max_age_s=settings.api_ready_cache_s
        ),
        key=settings.ops_key.get_secret_value(),
    )
    semantic, semantic_routes = semantic_service(settings, client)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        """Start what serves; on the way out close it in the reverse order, the status
        board and the subscriptions first, the clients last. A close that raises skips
        none of those after it; the last failure is raised, chained to any before it."""
        async with contextlib.AsyncExitStack() as stack:
            if replica is not None:
                stack.callback(replica.dispose)
            if owned_engine:
                stack.callback(engine.dispose)
            if owned_redis:
                stack.callback(client.close)
            try:
                check_eviction_policy(client)  # read-through fills are writes too
            except redis.exceptions.ConnectionError as exc:
                # Not ready yet (/readyz says so); the API still starts and serves health.
                log.warning(
                    "Redis not reachable at start-up (%s); its eviction policy was not checked",
                    exc,
                )
            if owned_local and local is not None:
                local.start()
                stack.callback(local.close)
            if versions is not None:
                versions.listen()
                stack.callback(versions.close)
                proc = Proc.of("serve", versions.lock, registry, pointer=pointer)
                serving = Registration(
                    client, proc, pointer=pointer, serving=lambda: services.reader.schema_version
                )
                stack.callback(serving.start().close)
            stack.callback(metrics.flush)  # what this worker gathered since the last tick
            stack.callback(metrics.time_feature_queries(engine, registry))
            if semantic is not None:
                semantic.start()
                stack.callback(semantic.close)
            if hot is not None:
                stack.callback(hot.close)
            # Made here, on the loop that serves: an asyncio client belongs to one loop.
            services.reader.aredis = async_client(settings)
            stack.push_async_callback(_close_async_client, services.reader)
            stack.callback(services.reader.close)
            services.auth.start()
            stack.callback(services.auth.close)
            board.start()
            stack.callback(board.close)
            if services.served is not None:
                stack.callback(services.served.close)
            yield

    audit_log.configure(settings.audit_log)
    pool = PoolBudget.from_settings(settings)
    app = Starlette(
        routes=[*ROUTES, *ops.api_routes(operator), *semantic_routes],
        exception_handlers=HANDLERS,
        lifespan=lifespan,
        middleware=middleware(services.auth, settings, pool),
    )
    app.state.services = services
    app.state.tenant_slots = TenantSlots(settings.api_tenant_concurrency, pool)
    app.state.rows = RowBudget.from_settings(settings)
    app.state.openapi = document(
        registry.names(),
        batch_limit=settings.api_batch_limit,
        body_limit=settings.api_body_limit_bytes,
        prompt_limit=settings.semantic_max_prompt_chars,
        semantic=semantic is not None,
        key_types={fs.entity.type for fs in registry},
        token_wait_ms=settings.token_wait_ms,
        token_wait_max_ms=settings.token_wait_max_ms,
        operator_pages=bool(operator.key),
    )
    app.state.ops = operator
    app.state.ops_app = ops.ops_app(operator)
    app.state.status = board
    app.state.sampled_metrics = operator.sampled
    app.state.semantic = semantic
    return app


def middleware(auth: Authenticator, settings: Settings, pool: PoolBudget) -> list[Middleware]:
    """In front of the routes, outermost first, one concern each: the client's address
    behind trusted proxies, who is calling (:mod:`freshline.pipeline.api.authentication`),
    the tenant's rate and pool time and the probes' rate
    (:mod:`freshline.pipeline.api.limits`), then the body's deadline. All pure ASGI:
    ``BaseHTTPMiddleware`` would cost every read a task and a stream."""
    return [
        Middleware(proxy_headers, settings.api_trusted_proxies),
        Middleware(AuthenticationMiddleware, ApiKeyBackend(auth, settings), on_error=refusal),
        Middleware(Limits, settings=settings, pool=pool),
        Middleware(BodyDeadline, timeout_s=settings.api_body_timeout_s, prefix=GUARDED_PREFIX),
    ]


def deploy_report(
    client: redis.Redis, pointer: Pointer, readthrough: ReadThrough
) -> dict[str, Any]:
    """The status page's deploy figures: the registered processes, and as problems this
    worker's with the active version, each process that does not compute it, and each
    consumer paused by a configuration failure (a feature set whose statement fails)."""
    procs = roster(client, pointer=pointer)
    problems: list[str] = []
    versions = readthrough.versions
    if versions is not None:
        active, own = versions.current(), readthrough.store.schema_version
        if not versions.computes(active, readthrough.store.registry):
            misses = (
                f"answered from version {own}"
                if versions.written(own)
                else "answered 503 schema_version_unknown"
            )
            problems.append(
                f"schema version {active} is active, which this API's code does not compute "
                f"(it computes {own}): its misses are {misses}"
            )
        problems += [f"running: {line}" for line in strangers(procs, active)]
    problems += [f"{p.name} is paused, nothing applied: {p.paused}" for p in procs if p.paused]
    return {"processes": [dataclasses.asdict(p) for p in procs], "problems": problems}


def semantic_service(
    settings: Settings, client: redis.Redis
) -> tuple[SemanticService | None, list[BaseRoute]]:
    """The semantic cache's service and routes, or none with ``semantic_enabled`` off.

    :mod:`freshline.pipeline.api.llm` is imported here rather than at the top: it imports FAISS
    and the embedding model's libraries, which a server without the cache never needs.
    """
    if not settings.semantic_enabled:
        return None, []
    from freshline.pipeline.api import llm

    return llm.SemanticService(settings, client), [
        Route("/v1/llm/cache/lookup", llm.lookup, methods=["POST"]),
        Route("/v1/llm/cache/store", llm.store, methods=["POST"]),
        Route("/v1/llm/cache/flag", llm.flag, methods=["POST"]),
    ]


async def _close_async_client(reader: FeatureReader) -> None:
    aredis, reader.aredis = reader.aredis, None
    if aredis is not None:
        await aredis.aclose()


class RepositoryOptions(TypedDict):
    registry: Registry
    lock: Lock
    keep_snapshots: bool


def repository_options(repo: Repository) -> RepositoryOptions:
    """What :func:`create_app` takes from a repository: its feature sets, its lock and
    whether it keeps history."""
    return RepositoryOptions(
        registry=repo.registry,
        lock=Lock.load(repo.lock_path),
        keep_snapshots=repo.history.enabled,
    )


def app_from_env() -> Starlette:
    """The app factory servers call (``granian --factory``, ``uvicorn --factory``), once
    per worker process, for the active repository (``FRESHLINE_REPO``, which ``freshline
    serve`` passes on to its workers).

    Everything made until now (modules, the registry, the clients, SQLAlchemy's and
    Starlette's machinery: about 100,000 objects) lives as long as the worker, so it
    leaves the garbage collector's generations (``gc.freeze``): a full collection
    no longer walks it. One took 20 to 40 ms here, a stall for every request in
    flight; the batch route's p99 at c=16 went from 25.9 to 10.4 ms with the freeze
    (medians of 5 wrk rounds, same run; README, read path).
    """
    app = create_app(load_settings(), **repository_options(active()))
    gc.collect()
    gc.freeze()
    return app


def ops_app_from_env() -> Starlette:
    """The ops port's app factory (``freshline serve`` runs it in a process of its own):
    ``/metrics``, ``/status``, ``/status.json`` and the probes, with no key.

    It starts what the API app starts (its clients, the status board; not the semantic
    cache nor an in-process tier, though it shows the cache's namespaces) and reads the
    workers' counters from ``PROMETHEUS_MULTIPROC_DIR``, which ``freshline serve`` sets
    for both.
    """
    loaded = load_settings()
    settings = loaded.model_copy(update={"semantic_enabled": False, "local_cache_size": 0})
    api = create_app(
        settings, semantic_figures=loaded.semantic_enabled, **repository_options(active())
    )
    return ops.ops_app(api.state.ops, lifespan=api.router.lifespan_context)
