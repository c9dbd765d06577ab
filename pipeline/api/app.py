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


# long: its docstring is the manual of its keywords; the body makes the parts in order
def create_app(  # noqa: PLR0913 (a keyword per collaborator a test or FeatureStore.app gives)
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
    parts = _Parts.of(settings, registry, pointer, engine, redis_client, local)
    parts.read_path(follow_deploys=follow_deploys, lock=lock, keep_snapshots=keep_snapshots)
    if consumer_metrics is None:
        port = settings.consumer_metrics_port
        consumer_metrics = [f"http://127.0.0.1:{port}/metrics"] if port else []
    if semantic_figures is None:
        semantic_figures = settings.semantic_enabled
    operator = parts.operator(
        consumer_metrics, semantic_figures, status_interval_s, keep_snapshots=keep_snapshots
    )
    parts.semantic, semantic_routes = semantic_service(settings, parts.client)

    audit_log.configure(settings.audit_log)
    pool = PoolBudget.from_settings(settings)
    app = Starlette(
        routes=[*ROUTES, *ops.api_routes(operator), *semantic_routes],
        exception_handlers=HANDLERS,
        lifespan=parts.lifespan,
        middleware=middleware(parts.services.auth, settings, pool),
    )
    app.state.services = parts.services
    app.state.tenant_slots = TenantSlots(settings.api_tenant_concurrency, pool)
    app.state.rows = RowBudget.from_settings(settings)
    app.state.openapi = document(
        registry.names(),
        batch_limit=settings.api_batch_limit,
        body_limit=settings.api_body_limit_bytes,
        prompt_limit=settings.semantic_max_prompt_chars,
        semantic=parts.semantic is not None,
        key_types={fs.entity.type for fs in registry},
        token_wait_ms=settings.token_wait_ms,
        token_wait_max_ms=settings.token_wait_max_ms,
        operator_pages=bool(operator.key),
    )
    app.state.ops = operator
    app.state.ops_app = ops.ops_app(operator)
    app.state.status = parts.board
    app.state.sampled_metrics = operator.sampled
    app.state.semantic = parts.semantic
    return app


@dataclasses.dataclass
class _Parts:
    """What one app is made of, made in :func:`create_app`'s order, and what its lifespan
    starts and then closes. ``owned``: the clients made here rather than passed in."""

    settings: Settings
    registry: Registry
    pointer: Pointer
    engine: Engine
    client: redis.Redis
    local: LocalTier | None
    owned: frozenset[str]
    versions: VersionResolver | None = None
    hot: HotReads | None = None
    replica: Engine | None = None
    readthrough: ReadThrough | None = None
    services: routes.Services = dataclasses.field(init=False)
    board: StatusBoard = dataclasses.field(init=False)
    semantic: SemanticService | None = None

    @classmethod
    def of(
        cls,
        settings: Settings,
        registry: Registry,
        pointer: Pointer,
        engine: Engine | None,
        client: redis.Redis | None,
        local: LocalTier | None,
    ) -> _Parts:
        """The clients: those passed in, else made from ``settings``; the in-process
        tier when ``settings.local_cache_size > 0`` and none is passed."""
        owned = {
            name
            for name, given in (("engine", engine), ("redis", client), ("local", local))
            if given is None
        }
        client = client or make_redis_client(
            settings,
            socket_connect_timeout=settings.api_redis_connect_timeout_s,
            socket_timeout=settings.api_redis_timeout_s,
        )
        if local is None and settings.local_cache_size > 0:
            local = LocalTier(
                client,
                max_entries=settings.local_cache_size,
                registry=registry,
                silence_s=settings.subscription_silence_ms / 1000,
            )
        else:
            owned.discard("local")
        return cls(
            settings,
            registry,
            pointer,
            engine or make_engine(settings, pool_size=10),
            client,
            local,
            frozenset(owned),
        )

    def read_path(self, *, follow_deploys: bool, lock: Lock | None, keep_snapshots: bool) -> None:
        """The read-through and the services the routes read with."""
        settings, client, engine = self.settings, self.client, self.engine
        store = EntryStore(
            client,
            settings.schema_version,
            registry=self.registry,
            tombstone_ttl_s=settings.tombstone_ttl_s,
        )
        if follow_deploys:
            self.versions = VersionResolver(client, settings, pointer=self.pointer, lock=lock)
            # Sampled reads gather in memory and are flushed in the background.
            self.hot = HotReads(client, flush_s=HOT_FLUSH_S)
        # With a replica, the feature queries run there and the primary gates the writes.
        if settings.postgres_replica_url:
            self.replica = make_engine(settings, pool_size=10, url=settings.postgres_replica_url)
        self.readthrough = ReadThrough(
            store,
            self.replica or engine,
            lease_ms=settings.lease_ms,
            wait_ms=settings.read_wait_ms,
            versions=self.versions,
            hot=self.hot,
            primary=engine if self.replica is not None else None,
            hooks=Hooks(on_computed=keeper(engine)) if keep_snapshots else None,
        )
        silence_s = settings.subscription_silence_ms / 1000
        self.services = routes.Services(
            settings=settings,
            redis=client,
            engine=engine,
            registry=self.registry,
            reader=FeatureReader(
                self.readthrough,
                self.local,
                timeout_s=settings.api_redis_timeout_s,
                tokens=Tokens(engine, client),
                arrivals=Arrivals(client, silence_s=silence_s),
            ),
            auth=Authenticator(
                engine,
                redis_client=client,
                ttl_s=settings.api_key_cache_s,
                silence_s=silence_s,
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

    def operator(
        self,
        consumer_metrics: list[str],
        semantic_figures: bool,
        status_interval_s: float,
        *,
        keep_snapshots: bool,
    ) -> ops.Ops:
        """The status board and the operator's pages."""
        settings, client, engine, readthrough = (
            self.settings,
            self.client,
            self.engine,
            self.readthrough,
        )
        assert readthrough is not None  # read_path first
        observer = ops.SharedObserver(
            client,
            self.registry,
            settings,
            version=lambda: self.services.reader.schema_version,
            counters=metrics.process_registry,
            consumer_metrics=consumer_metrics,
            lag=GroupLag(settings),
            semantic_namespaces=(
                semantic_reader(settings, client, engine) if semantic_figures else None
            ),
            deploy=lambda: deploy_report(client, self.pointer, readthrough),
            sample_max_age_s=settings.ops_cache_s,
        )
        self.board = StatusBoard(
            observer,
            interval_s=status_interval_s,
            history=(lambda: history_rows(engine)) if keep_snapshots else None,
        )
        return ops.Ops(
            board=self.board,
            sampled=SampledMetrics(observer),
            readiness=ops.Recent(
                ops.readiness_check(client, engine), max_age_s=settings.api_ready_cache_s
            ),
            key=settings.ops_key.get_secret_value(),
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Start what serves; on the way out close it in the reverse order, the status
        board and the subscriptions first, the clients last. A close that raises skips
        none of those after it; the last failure is raised, chained to any before it."""
        async with contextlib.AsyncExitStack() as stack:
            self._clients(stack)
            self._subscriptions(stack)
            reader, auth = self.services.reader, self.services.auth
            # Made here, on the loop that serves: an asyncio client belongs to one loop.
            reader.aredis = async_client(self.settings)
            stack.push_async_callback(_close_async_client, reader)
            stack.callback(reader.close)
            auth.start()
            stack.callback(auth.close)
            self.board.start()
            stack.callback(self.board.close)
            if self.services.served is not None:
                stack.callback(self.services.served.close)
            yield

    def _clients(self, stack: contextlib.AsyncExitStack) -> None:
        """The clients' closes, last on the way out; Redis's eviction policy checked."""
        if self.replica is not None:
            stack.callback(self.replica.dispose)
        if "engine" in self.owned:
            stack.callback(self.engine.dispose)
        if "redis" in self.owned:
            stack.callback(self.client.close)
        try:
            check_eviction_policy(self.client)  # read-through fills are writes too
        except redis.exceptions.ConnectionError as exc:
            # Not ready yet (/readyz says so); the API still starts and serves health.
            log.warning(
                "Redis not reachable at start-up (%s); its eviction policy was not checked",
                exc,
            )

    def _subscriptions(self, stack: contextlib.AsyncExitStack) -> None:
        """The in-process tier, the deploy listener and this worker's registration, the
        metrics' flush, the semantic cache and the hot reads' flush."""
        if "local" in self.owned and self.local is not None:
            self.local.start()
            stack.callback(self.local.close)
        if self.versions is not None:
            self.versions.listen()
            stack.callback(self.versions.close)
            proc = Proc.of("serve", self.versions.lock, self.registry, pointer=self.pointer)
            serving = Registration(
                self.client,
                proc,
                pointer=self.pointer,
                serving=lambda: self.services.reader.schema_version,
            )
            stack.callback(serving.start().close)
        stack.callback(metrics.flush)  # what this worker gathered since the last tick
        stack.callback(metrics.time_feature_queries(self.engine, self.registry))
        if self.semantic is not None:
            self.semantic.start()
            stack.callback(self.semantic.close)
        if self.hot is not None:
            stack.callback(self.hot.close)


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
