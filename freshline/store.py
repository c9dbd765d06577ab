"""The entry object: one feature repository and its settings, and everything built on them.

``FeatureStore`` loads a repository and the settings once and hands out the rest: the
Python client, the read-through, the ASGI app, the consumer worker, plan and apply,
training sets. The command line is a thin layer over it, and two stores in one process
serve two repositories side by side (docs/reading.md).

Importing this module costs nothing past the definitions: Redis, Postgres, Starlette,
Kafka and pyarrow are imported by the method that first needs them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from freshline.pipeline.core.features import FeatureSet, Registry
from freshline.pipeline.core.incremental import IncrementalPath
from freshline.pipeline.core.repository import Repository, active, load
from freshline.pipeline.core.settings import Settings, load_settings

if TYPE_CHECKING:
    import pyarrow as pa
    import redis
    from sqlalchemy.engine import Connection, Engine
    from starlette.applications import Starlette

    from freshline.consumers.worker import Totals, Worker
    from freshline.pipeline.cache.client import FeatureClient
    from freshline.pipeline.cache.readthrough import ReadThrough
    from freshline.pipeline.cache.store import EntryStore
    from freshline.pipeline.core.lock import Lock
    from freshline.pipeline.core.types import FeatureValues
    from freshline.pipeline.deploy.plan import Plan
    from freshline.pipeline.history.evaluator import Captured


class FeatureStore:
    """One feature repository with its settings: the object a program starts from.

    >>> import freshline
    >>> with freshline.FeatureStore("examples/fraud") as store:
    ...     client = store.client()
    ...     client.get("txn_90d", "acme", 42)  # Features(values=..., ...) or None

    ``repo_path``: the repository's directory (``freshline.toml`` and the definitions),
    or a :class:`freshline.Repository` already loaded. ``settings``: the
    ``FRESHLINE_*`` settings (docs/settings.md); default: read from the environment
    now, with the repository's own ``project.schema_version`` unless
    ``FRESHLINE_SCHEMA_VERSION`` is set. :meth:`from_env` finds the repository as the
    command line does. Both stay readable as ``store.repository`` (entities, tables,
    feature sets, events, paths) and ``store.settings``.

    The store makes one Redis client and one Postgres engine, on first use, and shares
    them among the clients and read-throughs it hands out; :meth:`close` (or leaving a
    ``with`` block) closes them and every client it made. The app and the worker own
    their connections and close them themselves.
    """

    def __init__(self, repo_path: str | Path | Repository, settings: Settings | None = None):
        repository = repo_path if isinstance(repo_path, Repository) else load(repo_path)
        settings = settings or load_settings()
        if "schema_version" not in settings.model_fields_set:
            settings = settings.model_copy(update={"schema_version": repository.schema_version})
        self.repository: Repository = repository
        """The loaded repository: entities, tables, feature sets, events, paths."""
        self.settings: Settings = settings
        """The settings everything this store builds runs with."""
        self._redis: redis.Redis | None = None
        self._engine: Engine | None = None
        self._clients: list[FeatureClient] = []

    @classmethod
    def from_env(cls) -> FeatureStore:
        """The store of the active repository (``FRESHLINE_REPO``, else the current
        directory) with the settings of the environment: what the ``freshline`` command
        and the servers it starts use."""
        return cls(active(), load_settings())

    def __repr__(self) -> str:
        return (
            f"FeatureStore({str(self.repository.path)!r}, "
            f"schema_version={self.settings.schema_version})"
        )

    # -- what it knows ----------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """The repository's feature sets, by name (``store.registry["txn_90d"]``)."""
        return self.repository.registry

    def lock(self) -> Lock:
        """The repository's feature lock (``features.lock.json``), read now."""
        from freshline.pipeline.core.lock import Lock

        return Lock.load(self.repository.lock_path)

    @property
    def redis(self) -> redis.Redis:
        """The store's Redis client (made from the settings on first use, shared)."""
        if self._redis is None:
            from freshline.pipeline.core.services import redis_client

            self._redis = redis_client(self.settings)
        return self._redis

    @property
    def engine(self) -> Engine:
        """The store's Postgres engine, as ``FRESHLINE_POSTGRES_URL`` logs in (made on
        first use, shared)."""
        if self._engine is None:
            from freshline.pipeline.core.db import make_engine

            self._engine = make_engine(self.settings)
        return self._engine

    # -- reading ----------------------------------------------------------------------

    def client(
        self, local: bool = False, *, read_through: bool = False, follow_deploys: bool = True
    ) -> FeatureClient:
        """A :class:`~freshline.pipeline.cache.client.FeatureClient` on the store's
        Redis: ``get``/``get_many`` return ``Features`` (or ``None`` for a miss).

        With ``follow_deploys`` (the default) it reads the schema version the deploy
        pointer names and follows a ``deploy flip``; else the settings' version. With
        ``local`` it keeps an in-process tier (``FRESHLINE_LOCAL_CACHE_SIZE`` entries,
        10,000 if unset) in front of Redis, dropped on every invalidation. With
        ``read_through``, reads may ask for freshness (``get(..., after=token)``,
        ``max_staleness_ms=``; docs/freshness.md), computing what Redis cannot serve
        (:meth:`read_through`). The client is synchronous; the asyncio path is the ASGI
        app (:meth:`app`), whose reads run on the event loop. Closed by :meth:`close`.
        """
        from freshline.pipeline.cache.client import FeatureClient

        tier = None
        if local:
            from freshline.pipeline.cache.local import LocalTier

            tier = LocalTier(
                self.redis,
                max_entries=self.settings.local_cache_size or 10_000,
                registry=self.registry,
                silence_s=self.settings.subscription_silence_ms / 1000,
            ).start()
        through = self.read_through() if read_through else None
        if follow_deploys:
            client = FeatureClient.following(
                self.redis,
                self.settings,
                registry=self.registry,
                lock=self.lock(),
                local=tier,
                readthrough=through,
            )
        else:
            client = FeatureClient(
                self.redis,
                self.settings.schema_version,
                registry=self.registry,
                local=tier,
                readthrough=through,
            )
        self._clients.append(client)
        return client

    def entries(self, schema_version: int | None = None) -> EntryStore:
        """The :class:`~freshline.pipeline.cache.store.EntryStore` of ``schema_version``
        (default: the settings'): raw reads and conditional writes of entries."""
        from freshline.pipeline.cache.store import EntryStore

        return EntryStore(
            self.redis,
            schema_version or self.settings.schema_version,
            registry=self.registry,
            tombstone_ttl_s=self.settings.tombstone_ttl_s,
        )

    def read_through(self) -> ReadThrough:
        """A :class:`~freshline.pipeline.cache.readthrough.ReadThrough` on the store's
        Redis and Postgres: ``get(feature_set, tenant, entity)`` returns the entry,
        computing and storing a miss under a lease. ``client(read_through=True)``
        reads through one, for freshness on request (docs/freshness.md)."""
        from freshline.pipeline.cache.readthrough import Hooks, ReadThrough

        hooks = None
        if self.repository.history.enabled:
            from freshline.pipeline.history.snapshots import keeper

            hooks = Hooks(on_computed=keeper(self.engine))
        return ReadThrough(self.entries(), self.engine, hooks=hooks)

    def compute(
        self,
        feature_set: str | FeatureSet,
        refs: Sequence[tuple[str, str]],
        *,
        path: Literal["full", "incremental"] | None = None,
        db: Engine | Connection | None = None,
    ) -> dict[tuple[str, str], FeatureValues]:
        """``feature_set``'s values now for each ``(tenant, entity)`` of ``refs``,
        computed in Postgres in one statement (one snapshot), past Redis: ``{ref:
        values}``, a ref without rows left out. ``path``: ``"full"`` (the defining query
        over the source rows), ``"incremental"`` or, by default, the feature set's own.
        ``db``: the engine or connection to compute on (default: the store's engine)."""
        from freshline.pipeline.cache.recompute import compute

        fs = self.registry[feature_set] if isinstance(feature_set, str) else feature_set
        return compute(db if db is not None else self.engine, fs, refs, path=path).values

    def app(self, **options: Any) -> Starlette:
        """The read API as an ASGI app (Starlette) for this repository, to run under any
        ASGI server; ``freshline serve`` runs the same. ``options`` are
        :func:`freshline.pipeline.api.app.create_app`'s (``follow_deploys``,
        ``local``...). It makes and closes its own connections in its lifespan."""
        from freshline.pipeline.api.app import create_app, repository_options

        return create_app(self.settings, **{**repository_options(self.repository), **options})

    # -- consuming --------------------------------------------------------------------

    def worker(self, **options: Any) -> Worker:
        """A consumer-group member for this repository
        (:class:`freshline.consumers.worker.Worker`; ``options``: its ``topics``,
        ``group``...). Run it with ``worker.run(...)``; it closes itself when the run
        ends."""
        from freshline.consumers.worker import Worker

        return Worker(self.settings, repository=self.repository, **options)

    def consume(
        self,
        *,
        max_messages: int | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        **options: Any,
    ) -> Totals:
        """Run a :meth:`worker` until stopped, ``max_messages`` consumed, ``timeout``
        seconds passed or nothing arrived for ``idle_timeout`` seconds; returns its
        totals (``freshline consume`` without the signals and the metrics port)."""
        return self.worker(**options).run(
            max_messages=max_messages, timeout=timeout, idle_timeout=idle_timeout
        )

    @contextmanager
    def bulk_load(self, conn: Connection, table: str) -> Iterator[list[IncrementalPath]]:
        """Load many rows into ``table`` in ``conn``'s transaction without the per-row
        upkeep of the declared aggregations' incremental paths over it: inside the
        block their insert triggers are off (other writers of ``table`` wait for the
        transaction), and at its end they are as they were (ALWAYS, as ``apply``
        installs them). Yields the paths paused: call ``path.rebuild(conn, keys)``
        after the block, in the same transaction, for the keys loaded (building them
        from their rows is faster than folding the load)."""
        from freshline.pipeline.core.maintenance import paused_inserts

        with paused_inserts(conn, self.registry.maintenances(), table) as paths:
            yield list[IncrementalPath](paths)

    # -- deploying --------------------------------------------------------------------

    def plan(self, publication: str = "freshline") -> Plan:
        """What :meth:`apply` would change, checked against Postgres as the owner's
        login (``FRESHLINE_POSTGRES_ADMIN_URL``); changes nothing. Returns the
        :class:`~freshline.pipeline.deploy.plan.Plan` (``plan.ok``, ``plan.problems``)."""
        from freshline.pipeline.core.db import make_owner_engine, ping
        from freshline.pipeline.deploy.plan import plan as make_plan
        from freshline.pipeline.history.status import describe

        engine = make_owner_engine(self.settings)
        try:
            ping(engine)
            result = make_plan(self.repository, engine, self.settings.schema_version, publication)
            result.history = describe(engine, self.repository.history, result.tables)
            return result
        finally:
            engine.dispose()

    def apply(
        self,
        *,
        alter_tables: bool = False,
        cdc: bool = True,
        database_host: str | None = None,
        publication: str = "freshline",
    ) -> None:
        """Deploy the repository as ``freshline apply`` does, printing each step: topics,
        ACLs and freshline's own schema, then the publication, the lock and the CDC
        connector (``cdc``). Your tables change only with ``alter_tables``. Raises
        ``typer.Exit`` with the step that failed, after printing why."""
        from freshline.pipeline.cli.apply import apply_plan

        apply_plan(
            self,
            alter_tables=alter_tables,
            cdc=cdc,
            database_host=database_host,
            publication=publication,
        )

    # -- training ---------------------------------------------------------------------

    def training_set(self, spine: Any, features: list[str], **options: Any) -> pa.Table:
        """The spine with ``features`` (feature sets, or ``set:field``) as of each row's
        moment, from history, as a pyarrow Table; ``options`` are
        :func:`freshline.training_set`'s (``timestamp``, ``delay``, ``at``...), with
        the store's engine and settings unless given (docs/training.md)."""
        from freshline.pipeline.history.training import training_set

        options.setdefault("settings", self.settings)
        options.setdefault("engine", self.engine)
        return training_set(self.repository, spine, features, **options)

    def history(self, db: Engine | Connection | None = None) -> dict[str, Captured]:
        """The tables whose history is recorded, by name, each with what history answers
        for: from ``start`` (the backfill's moment) up to ``complete_to`` (what the
        recorder has read), before ``broken_from`` (a DDL change it could not follow),
        kept ``retention_s``; empty where history is not set up (docs/training.md).
        ``db``: the engine or connection to read with (default: the store's engine)."""
        from sqlalchemy.engine import Connection

        from freshline.pipeline.history.evaluator import captured

        target = db if db is not None else self.engine
        if isinstance(target, Connection):
            return captured(target)
        with target.connect() as conn:
            return captured(conn)

    def served_training_set(
        self, spine: Any, features: list[str], served: str | Path, **options: Any
    ) -> pa.Table:
        """The spine joined to the values the API actually served, from the served log
        in the directory ``served`` (what ``freshline served sink`` writes), as a pyarrow
        Table named and typed as :meth:`training_set`'s; ``options``: ``timestamp``,
        ``request_id``, ``tolerance`` (docs/training.md)."""
        from freshline.pipeline.observe.served_files import ParquetLog
        from freshline.pipeline.observe.served_training import from_logs

        return from_logs(self.repository, spine, features, ParquetLog(served), **options)

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Close every client this store handed out, then its Redis client and its
        Postgres engine. The store can be used again: they are made anew."""
        for client in self._clients:
            client.close()
            if client.local is not None:
                client.local.close()
        self._clients.clear()
        if self._redis is not None:
            self._redis.close()
            self._redis = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def freshline_token(conn: Any) -> str:
    """A freshness token for what ``conn`` (a SQLAlchemy connection or engine, or a
    psycopg connection) has written or seen committed: a read ``after`` it is answered
    with values computed from that state or a later one (docs/freshness.md)."""
    from freshline.pipeline.cache.tokens import freshline_token as token

    return token(conn)
