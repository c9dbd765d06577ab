"""Shared helpers for the benchmarks: timing, interleaved rounds, an isolated world.

Every figure is reported next to a reference measured in the same run, with the two
interleaved round by round (:func:`measure`), so the noise of a shared machine hits
both alike; the ratio is the figure to read, the absolute times are context.

:class:`Context` isolates a run from everything else on the machine: its own Postgres
database (``freshline_bench_<pid>``, created and migrated at the start, dropped at
the end), a Redis logical database of its own (``FRESHLINE_BENCH_REDIS_DB``, 3 by
default) inside which each benchmark takes unique schema versions, and a unique Kafka
topic prefix and consumer group. The seeded data set lives in its own tenants and is
created once per run, then reused by every benchmark that needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TypeVar, overload
from urllib.parse import quote

import numpy as np
import orjson
import psycopg
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.pool import PoolProxiedConnection

from bench import pacing
from freshline.pipeline.cache.invalidation import Invalidation
from freshline.pipeline.cache.recompute import unpack_watermark
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.keys import INVALIDATION_CHANNEL
from freshline.pipeline.core.services import redis_client

paced = pacing.paced
"""Open-loop pacing (:mod:`bench.pacing`, which the writer process imports alone)."""

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
# The benchmarks run on the fraud example unless FRESHLINE_REPO names another repository.
os.environ.setdefault("FRESHLINE_REPO", str(REPO / "examples" / "fraud"))
# Its own package (fraud.seed, fraud.simulator), as the tests have it (pytest's pythonpath).
sys.path.insert(0, str(REPO / "examples" / "fraud"))
ANCHOR = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
FRESHLINE = str(Path(sys.executable).with_name("freshline"))
"""The CLI of the interpreter running the benchmarks."""

now_ns = time.perf_counter_ns
T = TypeVar("T")


# -- statistics -------------------------------------------------------------------------


def stats_ns(samples: Sequence[int] | np.ndarray) -> dict[str, float]:
    """Median, p90, p99, mean and max of nanosecond samples, in microseconds."""
    arr = np.asarray(samples, dtype=np.float64) / 1000.0
    if arr.size == 0:
        return {"n": 0}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "n": int(arr.size),
        "p50_us": round(float(p50), 2),
        "p90_us": round(float(p90), 2),
        "p99_us": round(float(p99), 2),
        "mean_us": round(float(arr.mean()), 2),
        "max_us": round(float(arr.max()), 2),
    }


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def target(name: str, value: float | None, op: str, limit: float, unit: str = "") -> dict[str, Any]:
    """A target and whether this run met it: ``target("x", 1.2, "<=", 1.5, "x")``."""
    met = (
        None
        if value is None
        else (
            value <= limit
            if op == "<="
            else value < limit
            if op == "<"
            else value >= limit
            if op == ">="
            else value > limit
        )
    )
    return {"name": name, "value": value, "op": op, "limit": limit, "unit": unit, "met": met}


# -- measuring ------------------------------------------------------------------------


@dataclass
class Series:
    """Latency samples (ns) and per-round throughput of one candidate."""

    latencies: list[int] = field(default_factory=list)
    round_rates: list[float] = field(default_factory=list)
    items_per_call: int = 1

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = stats_ns(self.latencies)
        rates = self.round_rates
        out["ops_per_s"] = round(float(np.median(rates)), 1) if rates else None
        out["items_per_s"] = round(out["ops_per_s"] * self.items_per_call, 1) if rates else None
        out["items_per_call"] = self.items_per_call
        return out


def _run_serial(fn: Callable[[], Any], calls: int, series: Series) -> None:
    lat = series.latencies
    started = now_ns()
    for _ in range(calls):
        t0 = now_ns()
        fn()
        lat.append(now_ns() - t0)
    series.round_rates.append(calls / ((now_ns() - started) / 1e9))


def _run_concurrent(
    fn: Callable[[], Any], calls: int, series: Series, pool: ThreadPoolExecutor, concurrency: int
) -> None:
    per_thread = max(1, calls // concurrency)
    barrier = threading.Barrier(concurrency)

    def worker() -> list[int]:
        mine: list[int] = []
        barrier.wait()
        for _ in range(per_thread):
            t0 = now_ns()
            fn()
            mine.append(now_ns() - t0)
        return mine

    started = now_ns()
    futures = [pool.submit(worker) for _ in range(concurrency)]
    for f in futures:
        series.latencies.extend(f.result())
    series.round_rates.append(per_thread * concurrency / ((now_ns() - started) / 1e9))


def measure(
    candidates: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    calls: int,
    concurrency: int = 1,
    warmup: int = 20,
    items: dict[str, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Time each candidate in interleaved rounds; returns a summary per candidate.

    Each round runs every candidate for ``calls`` calls (split over ``concurrency``
    threads), in an order that rotates from round to round, so drift and bursts of
    load from other processes land on all of them alike. Latency is per call;
    ``ops_per_s`` is the median over rounds of calls per second of wall time.
    ``items`` gives the items per call (a batch of 100 is 100 items) for items/s.
    """
    names = list(candidates)
    series = {n: Series(items_per_call=(items or {}).get(n, 1)) for n in names}
    for fn in candidates.values():
        for _ in range(0 if quick() else warmup):  # a smoke run's figures are not read
            fn()
    pool = ThreadPoolExecutor(concurrency) if concurrency > 1 else None
    try:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                if pool is None:
                    _run_serial(candidates[name], calls, series[name])
                else:
                    _run_concurrent(candidates[name], calls, series[name], pool, concurrency)
    finally:
        if pool is not None:
            pool.shutdown()
    return {n: s.summary() for n, s in series.items()}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` once; its result and the seconds it took."""
    t0 = now_ns()
    out = fn()
    return out, (now_ns() - t0) / 1e9


# -- the isolated world -----------------------------------------------------------------


_counter = itertools.count(1)


@dataclass
class Dataset:
    tenant: str
    users: int
    transactions: int
    seeded_in_s: float | None = None


class Context:
    """The run's isolated services and its one seeded data set.

    Build with :meth:`open`, release with :meth:`close` (the harness does both).
    """

    def __init__(self, quick: bool) -> None:
        from freshline.pipeline.core.settings import Settings

        self.quick = quick
        self.tag = uuid.uuid4().hex[:8]
        base = Settings()
        self.base = base
        self.db_name = f"freshline_bench_{os.getpid()}"
        self.redis_db = int(os.environ.get("FRESHLINE_BENCH_REDIS_DB", "3"))
        head, _, _ = base.redis_url.rpartition("/")
        redis_url = f"{head}/{self.redis_db}"
        user, password = base.redis_username, base.redis_password.get_secret_value()
        if user and "@" not in redis_url:  # the login in the URL reaches child processes
            scheme, _, rest = redis_url.partition("://")
            redis_url = f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{rest}"
        # A database of its own, made and seeded as the owner.
        # Both URLs name it: owner-only work (migrations, the CDC connector's database)
        # reads ``migration_url``, which would otherwise name the operator's database.
        pg_url = make_url(base.migration_url).set(database=self.db_name)
        self.settings = base.model_copy(
            update={
                "postgres_url": pg_url.render_as_string(hide_password=False),
                "postgres_admin_url": pg_url.render_as_string(hide_password=False),
                "redis_url": redis_url,
                "schema_version": self.new_schema_version(),
                "topic_prefix": f"bench{self.tag}.",
                "consumer_group": f"bench-{self.tag}",
                "consumer_metrics_port": 0,
            }
        )
        self._engine: Engine | None = None
        self._redis: redis.Redis | None = None
        self._dataset: Dataset | None = None
        self.versions_used: list[int] = []
        self.topics: list[str] = []
        self.own_topics: list[str] = []

    @staticmethod
    def new_schema_version() -> int:
        """A schema version no one else is likely to use: its own Redis namespace."""
        return 5000 + uuid.uuid4().int % 4900

    def schema_version(self) -> int:
        v = self.new_schema_version()
        self.versions_used.append(v)
        return v

    def settings_for(self, **update: Any) -> Any:
        return self.settings.model_copy(update=update)

    def open(self) -> Context:
        from freshline import migrations

        admin = self._admin()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
            conn.execute(sa.text(f'CREATE DATABASE "{self.db_name}"'))
        admin.dispose()
        from freshline.pipeline.core.repository import active

        repo = active()  # the fraud example, whose tables the benchmarks seed
        migrations.upgrade(self.settings.postgres_url, repo=migrations.Chain.of_repository(repo))
        from freshline.pipeline.core.maintenance import install_missing

        with self.engine.begin() as conn:  # what apply --alter-tables installs
            install_missing(conn, repo.registry.maintenances())
        return self

    def _admin(self) -> Engine:
        # Creating a database takes the owner's login (FRESHLINE_POSTGRES_ADMIN_URL).
        url = make_url(self.base.migration_url).set(database="postgres")
        return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            from freshline.pipeline.core.db import make_engine

            self._engine = make_engine(self.settings, pool_size=20)
        return self._engine

    # Before the ``redis`` property: in the class body after it, ``redis`` names the
    # property, not the module.
    def new_redis(self) -> redis.Redis:
        return redis_client(self.settings)

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis_client(self.settings)
        return self._redis

    def tenant_prefix(self) -> str:
        return f"b{self.tag}{next(_counter)}-"

    def dataset(self) -> Dataset:
        """The run's seeded tenant, created on first use (or adopted from ``seed``)."""
        if self._dataset is None:
            from fraud.seed import seed

            users, txns = (2_000, 40_000) if self.quick else (20_000, 400_000)
            t0 = now_ns()
            summary = seed(
                self.engine,
                users=users,
                transactions=txns,
                tenant_prefix=self.tenant_prefix(),
                anchor=ANCHOR,
            )
            self._dataset = Dataset(summary.tenants[0], users, txns, (now_ns() - t0) / 1e9)
        return self._dataset

    def adopt_dataset(self, data: Dataset) -> None:
        if self._dataset is None:
            self._dataset = data

    def kafka_topics(self) -> list[str]:
        """Create the run's prefixed topics (once) and return their names."""
        if not self.topics:
            from freshline.consumers.topics import ensure_from_settings, managed_topics

            ensure_from_settings(self.settings)
            self.topics = managed_topics(self.settings)
        return self.topics

    def settings_with_own_topics(self, name: str) -> Any:
        """The run's settings with a topic prefix of ``name``'s alone, its topics
        created (and deleted at :meth:`close`): a benchmark that reads a topic from its
        start meets no event another benchmark of the run produced."""
        from freshline.consumers.topics import ensure_from_settings, managed_topics

        settings = self.settings_for(topic_prefix=f"{self.settings.topic_prefix}{name}.")
        ensure_from_settings(settings)
        self.own_topics += managed_topics(settings)
        return settings

    def close(self) -> None:
        if self._redis is not None:
            for version in [self.settings.schema_version, *self.versions_used]:
                for pattern in (f"feat:{version}:*", f"lease:{version}:*", f"hot:{version}:*"):
                    _unlink_matching(self._redis, pattern)
            _unlink_matching(self._redis, f"infer:bench{self.tag}*")
            self._redis.close()
        if self.topics or self.own_topics:
            from freshline.consumers.kafka import admin_client

            kafka_admin = admin_client(self.settings)  # alive until the futures resolve
            futures = kafka_admin.delete_topics(
                [*self.topics, *self.own_topics], operation_timeout=10
            )
            for future in futures.values():
                with contextlib.suppress(Exception):  # best effort clean-up
                    future.result(timeout=30)
        if self._engine is not None:
            self._engine.dispose()
        admin = self._admin()
        with admin.connect() as conn:
            _drop_database(conn, self.db_name)
        admin.dispose()


def _drop_database(conn: sa.Connection, name: str, tries: int = 10) -> None:
    """``DROP DATABASE ... WITH (FORCE)``, as the owner. Postgres 15's FORCE refuses to
    end an autovacuum worker (it checks the worker's role, and the owner is not a
    member of none: "must be a member of the role whose process is being terminated"),
    and a benchmark that wrote much leaves one analysing; a plain DROP asks autovacuum
    to leave and waits up to 5 s for it, so each refusal is followed by one."""
    force = sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    for _ in range(tries - 1):
        try:
            conn.execute(force)
            return
        except sa.exc.ProgrammingError:
            try:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
                return
            except sa.exc.OperationalError:  # other sessions: FORCE again
                continue
    conn.execute(force)


def psycopg_of(conn: PoolProxiedConnection) -> psycopg.Connection[Any]:
    """The psycopg connection under a pooled SQLAlchemy one (for COPY and prepared
    statements): the engines are psycopg 3's (``make_engine``)."""
    raw = conn.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw


def _unlink_matching(client: redis.Redis, pattern: str) -> None:
    batch: list[bytes] = []
    for key in client.scan_iter(match=pattern, count=1000):
        batch.append(key)
        if len(batch) >= 500:
            client.unlink(*batch)
            batch.clear()
    if batch:
        client.unlink(*batch)


# -- formatting -------------------------------------------------------------------------


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def targets_table(targets: Sequence[dict[str, Any]]) -> str:
    rows = [
        (
            t["name"],
            f"{fmt(t['value'], 2)} {t['unit']}".strip(),
            f"{t['op']} {fmt(t['limit'])} {t['unit']}".strip(),
            "met" if t["met"] else ("**missed**" if t["met"] is False else "-"),
        )
        for t in targets
    ]
    return table(["target", "this run", "goal", ""], rows)


@overload
def chunks(seq: np.ndarray[Any, Any], size: int) -> Iterator[np.ndarray[Any, Any]]: ...
@overload
def chunks(seq: Sequence[T], size: int) -> Iterator[Sequence[T]]: ...
def chunks(
    seq: Sequence[T] | np.ndarray[Any, Any], size: int
) -> Iterator[Sequence[T] | np.ndarray[Any, Any]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


# -- the run's shared state -------------------------------------------------------------

_state: dict[str, Any] = {"context": None, "out": BENCH_DIR, "quick": False, "plots": True}


def configure(out: Path, quick: bool, *, plots: bool = True) -> None:
    _state.update(out=out, quick=quick, plots=plots)


def context(quick: bool | None = None) -> Context:
    """The run's :class:`Context`; opened on first use (closed at exit if not by the harness)."""
    if _state["context"] is None:
        import atexit

        ctx = Context(_state["quick"] if quick is None else quick).open()
        _state["context"] = ctx
        atexit.register(close_context)
    return _state["context"]  # type: ignore[no-any-return]


def close_context() -> None:
    ctx = _state["context"]
    _state["context"] = None
    if ctx is not None:
        ctx.close()


def out_dir() -> Path:
    return _state["out"]  # type: ignore[no-any-return]


def quick() -> bool:
    """Whether this is a smoke run (``--quick``): smallest sizes, figures not to quote."""
    return bool(_state["quick"])


def plots() -> bool:
    return bool(_state["plots"])


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None when plots are off or unavailable."""
    if not _state["plots"]:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_plot(fig: Any, name: str) -> str:
    """Save ``fig`` as ``<out>/<name>.png``; returns the file name (relative to the out dir)."""
    path = out_dir() / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def note(message: str) -> None:
    """A progress line on stderr."""
    import sys

    print(f"bench:   {message}", file=sys.stderr, flush=True)


class InvalidationWatcher:
    """Receipt times of the invalidations of one tenant and schema version.

    ``seen[(feature_set, entity)]`` lists ``(watermark clock µs, receipt time)``: when
    an entry computed from a snapshot at that clock reached Redis, as readers learn it.
    """

    def __init__(self, client: redis.Redis, version: int, tenant: str) -> None:
        self.seen: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
        self.version, self.tenant = version, tenant
        self.client = client  # the pubsub's connection pool lives as long as the client
        self.reconnects = 0
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(INVALIDATION_CHANNEL)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="invalidation-watcher", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.pubsub.get_message(timeout=0.1)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                # A dropped subscription: take a new one; writes in the gap count as
                # "never fresh", never as fast.
                self.reconnects += 1
                self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                self.pubsub.subscribe(INVALIDATION_CHANNEL)
                continue
            if msg is None:
                continue
            at = time.time()
            try:
                inv = Invalidation.decode(msg["data"])
            except FreshlineError:
                continue  # someone else's message on the shared channel
            if inv.tenant == self.tenant and inv.schema_version == self.version:
                _, clock_us = unpack_watermark(inv.watermark)
                self.seen[(inv.feature_set, inv.entity)].append((clock_us, at))

    def fresh_at(self, feature_set: str, entity: str, produced: float) -> float | None:
        """Receipt time of the first invalidation computed after ``produced``."""
        rows = self.seen.get((feature_set, entity), [])
        want = int(produced * 1e6)
        best: float | None = None
        for clock_us, at in rows:
            if clock_us >= want and (best is None or at < best):
                best = at
        return best

    def sort(self) -> None:
        for rows in list(self.seen.values()):
            rows.sort()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.pubsub.close()


def start_consumer(
    env: dict[str, str], topic: str, group: str, log: IO[bytes]
) -> subprocess.Popen[bytes]:
    """``freshline consume`` of ``topic`` in ``group``, its output to ``log``, in its own
    session (:func:`stop_process` ends it)."""
    return subprocess.Popen(
        [FRESHLINE, "consume", "--topics", topic, "--group", group, "--metrics-port", "0"],
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM a child started with ``start_new_session``; SIGKILL its group after grace."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def run_standalone(
    run: Callable[[bool], dict[str, Any]],
    quick: bool,
    *,
    users: int | None = None,
    transactions: int | None = None,
) -> dict[str, Any]:
    """One benchmark run outside the harness (``python -m bench.NAME``), on its own
    seeded data set of ``users`` and ``transactions`` when both are given."""
    configure(out_dir(), quick, plots=False)
    try:
        if users and transactions:
            from fraud.seed import seed

            ctx = context(quick)
            summary, took = timed(
                lambda: seed(
                    ctx.engine,
                    users=users,
                    transactions=transactions,
                    tenant_prefix=ctx.tenant_prefix(),
                    anchor=ANCHOR,
                )
            )
            ctx.adopt_dataset(Dataset(summary.tenants[0], users, transactions, took))
        return run(quick)
    finally:
        close_context()


def seeded_main(
    module: str,
    doc: str,
    run: Callable[[bool], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    *,
    quick_help: str | None = None,
    users_help: str = "seed this many users (with --transactions)",
) -> int:
    """``python -m bench.<module>``: options ``--quick``, ``--json``, ``--users`` and
    ``--transactions``; one :func:`run_standalone`, printed as Markdown or JSON."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench.{module}", description=doc.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--users", type=int, help=users_help)
    parser.add_argument("--transactions", type=int)
    args = parser.parse_args()
    res = run_standalone(run, args.quick, users=args.users, transactions=args.transactions)
    print(orjson.dumps(res, option=orjson.OPT_INDENT_2).decode() if args.json else markdown(res))
    return 0


def batching(params: dict[str, Any]) -> str:
    """How the run's consumer batched, as its parameters say: runs since batches take
    what is fetched record ``batches_as_fetched``; earlier ones waited to fill."""
    wait = params["batch_max_wait_ms"]
    if params.get("batches_as_fetched"):
        return f"a batch takes the records fetched, an idle consumer waits up to {wait} ms"
    return f"batches wait at most {wait} ms"
