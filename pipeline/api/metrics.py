"""Prometheus metrics of the read API, per feature set and per endpoint.

With several worker processes set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory
before the workers start (``freshline serve --workers N`` does it for you):
prometheus_client then keeps each process's values in files there, and ``/metrics``
sums them across processes.

A feature request's metrics are gathered in the process (:class:`Pending`: a dict
update each, where a multiprocess counter or bucket update takes a lock and writes a
file-backed page) and written to prometheus_client every :data:`FLUSH_S` by a
background thread, and by :func:`process_registry` (every ``/metrics`` scrape and
status snapshot) for its own process: a scrape sees its own worker's requests at once
and the other workers' within :data:`FLUSH_S`.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, ExecutionContext
from sqlalchemy.sql.elements import TextClause

from freshline.pipeline.api.reader import Answer
from freshline.pipeline.cache.recompute import feature_statement
from freshline.pipeline.core.features import Registry
from freshline.pipeline.inference.predictions import Array, Model

log = logging.getLogger(__name__)

BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

REQUEST_SECONDS = Histogram(
    "freshline_api_request_seconds",
    "Request latency by endpoint and feature set ('*' for a batch, '' where none).",
    ["endpoint", "feature_set", "status"],
    buckets=BUCKETS,
)
HITS = Counter(
    "freshline_api_feature_hits_total",
    "Feature entries served from a cache, by tier (local or redis).",
    ["feature_set", "tier"],
)
MISSES = Counter(
    "freshline_api_feature_misses_total",
    "Feature entries not in any cache (read through, or answered 404 in cache-only mode).",
    ["feature_set"],
)
READ_THROUGHS = Counter(
    "freshline_api_feature_read_throughs_total",
    "Feature entries computed from Postgres on a miss.",
    ["feature_set"],
)
REFUSED = Counter(
    "freshline_api_refused_total",
    "Requests refused before their endpoint ran: 401 (missing_key, malformed_header, "
    "unknown_key, revoked_key, expired_key, throttled) or 429 (rate_limited, "
    "probe_rate_limited: /healthz or /readyz over FRESHLINE_API_PROBE_RATE_PER_S).",
    ["reason"],
)
SCHEMA_VERSION_UNKNOWN = Counter(
    "freshline_api_schema_version_unknown_total",
    "Reads answered 503 schema_version_unknown: the active schema version is one this "
    "worker's code does not compute and its own is no longer written (docs/deploys.md).",
)
PREDICTIONS = Counter(
    "freshline_api_predictions_total",
    "Predictions served, by model and outcome (hit or computed).",
    ["model", "outcome"],
)


# The caching decision (freshline.pipeline.observe.advisor) rests on these three per cache: the
# cost of a
# read the cache answers, of one it does not, and of the computation alone. ``cache`` is
# "feature" (``name`` a feature set) or "model" (``name`` a model).
CACHE_READ_SECONDS = Histogram(
    "freshline_cache_read_seconds",
    "Latency of a read answered wholly from the cache (the lookup cost).",
    ["cache", "name"],
    buckets=BUCKETS,
)
CACHE_MISS_SECONDS = Histogram(
    "freshline_cache_miss_seconds",
    "Latency of a read that computed: lookup, lease, computation and store.",
    ["cache", "name"],
    buckets=BUCKETS,
)
COMPUTE_SECONDS = Histogram(
    "freshline_compute_seconds",
    "The computation alone: the feature query in Postgres, or model.predict.",
    ["cache", "name"],
    buckets=BUCKETS,
)
MODEL_DETERMINISTIC = Gauge(
    "freshline_model_deterministic",
    "1 if the model's registered version is deterministic (cacheable), else 0.",
    ["model"],
    multiprocess_mode="livemax",
)


def _children(metric: Any) -> Callable[..., Any]:
    """``metric.labels(*values)``, each label set looked up once (its child is kept
    by prometheus_client anyway): a request then skips the lookup."""
    found: dict[tuple[str, ...], Any] = {}

    def child(*values: str) -> Any:
        got = found.get(values)
        if got is None:
            got = found[values] = metric.labels(*values)
        return got

    return child


FLUSH_S = 1.0


class Pending:
    """Counter increments and histogram observations gathered in process, then written
    to their prometheus_client children in one go by :meth:`flush`.

    One lock guards the tallies (the thread pool records too); a flush swaps them out
    under it and writes outside it. Flushing adds each counter's total once and each
    histogram's sum once and its bucket counts once, whatever the number of requests.
    """

    def __init__(self, interval_s: float = FLUSH_S) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # a flush returns once all it took is written
        self._counts: dict[Any, float] = {}
        self._observed: dict[Any, list[float]] = {}  # child -> [sum, count per bucket...]
        self._thread: threading.Thread | None = None

    def inc(self, child: Any, amount: float = 1) -> None:
        """``child.inc(amount)``, at the next flush."""
        with self._lock:
            counts = self._counts
            counts[child] = counts.get(child, 0) + amount
        if self._thread is None:
            self._start()

    def observe(self, child: Any, value: float) -> None:
        """``child.observe(value)`` (a histogram's), at the next flush."""
        bounds = child._upper_bounds
        with self._lock:
            tally = self._observed.get(child)
            if tally is None:
                tally = self._observed[child] = [0.0] * (len(bounds) + 1)
            tally[0] += value
            # prometheus_client counts a value in the first bucket it is <= to.
            tally[1 + bisect.bisect_left(bounds, value)] += 1
        if self._thread is None:
            self._start()

    def flush(self) -> None:
        """Write what was gathered to prometheus_client (its files, in multiprocess mode).

        Returns once everything gathered before the call is written, also when another
        thread's flush had taken it.
        """
        with self._flushing:
            with self._lock:
                counts, self._counts = self._counts, {}
                observed, self._observed = self._observed, {}
            for child, amount in counts.items():
                child.inc(amount)
            for child, tally in observed.items():
                # Histogram.observe's own steps (sum, then the bucket), in bulk.
                child._sum.inc(tally[0])
                for bucket, n in zip(child._buckets, tally[1:], strict=True):
                    if n:
                        bucket.inc(n)

    def _start(self) -> None:
        """The flushing thread, started by the first figure (in the process it is for)."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, daemon=True, name="freshline-metrics-flush"
            )
            self._thread.start()

    def forked(self) -> None:
        """In a forked child: no thread yet, and the parent's tallies are the parent's."""
        self._lock, self._flushing = threading.Lock(), threading.Lock()
        self._counts, self._observed = {}, {}
        self._thread = None

    def _run(self) -> None:
        tick = threading.Event()  # never set: a daemon thread (the app flushes at exit)
        while not tick.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # a full disk, say: keep the tallies' thread alive
                log.exception("could not write the API's metrics")


PENDING = Pending()
os.register_at_fork(after_in_child=PENDING.forked)
flush = PENDING.flush

_set_and_source = itemgetter("feature_set", "source")
_request_seconds = _children(REQUEST_SECONDS)
_hits = _children(HITS)
_misses = _children(MISSES)
_read_throughs = _children(READ_THROUGHS)
_cache_read_seconds = _children(CACHE_READ_SECONDS)
_cache_miss_seconds = _children(CACHE_MISS_SECONDS)


def record_answers(answers: Iterable[Answer]) -> None:
    """Count hits, misses and read-throughs, one counter update per label set."""
    for (fs, source), n in Tally(map(_set_and_source, answers)).items():
        _count(fs, source, n)


def record_hits(feature_set: str, n: int) -> None:
    """``n`` hits from Redis (a spliced batch: :mod:`freshline.pipeline.api.splice`)."""
    _count(feature_set, "hit", n)


def record_answer(answer: Answer, read_seconds: float) -> None:
    """One entity's read (a GET): its count, and its latency if it was answered from a
    cache or computed (not a cache-only miss)."""
    fs, source = answer["feature_set"], answer["source"]
    _count(fs, source, 1)
    if source in ("local", "hit", "computed"):
        observe_read("feature", fs, answer["hit"], read_seconds)


def _count(feature_set: str, source: str, n: int) -> None:
    inc = PENDING.inc
    if source == "local":
        inc(_hits(feature_set, "local"), n)
    elif source in ("hit", "waited"):
        inc(_hits(feature_set, "redis"), n)
    else:
        inc(_misses(feature_set), n)
        if source in ("computed", "uncached"):
            inc(_read_throughs(feature_set), n)


def record_predictions(model: str, hits: int, computed: int) -> None:
    if hits:
        PREDICTIONS.labels(model, "hit").inc(hits)
    if computed:
        PREDICTIONS.labels(model, "computed").inc(computed)


def observe(endpoint: str, feature_set: str, status: int, seconds: float) -> None:
    """One request's latency, by endpoint, feature set and status."""
    PENDING.observe(_request_seconds(endpoint, feature_set, str(status)), seconds)


def observe_read(cache: str, name: str, hit: bool, seconds: float) -> None:
    """One read's latency, as a cache read (every answer a hit) or a miss path."""
    PENDING.observe((_cache_read_seconds if hit else _cache_miss_seconds)(cache, name), seconds)


def process_registry() -> CollectorRegistry:
    """The counters of every API process: summed over processes in multiprocess mode.

    This process's pending figures are flushed first; other workers' arrive within
    :data:`FLUSH_S`.
    """
    PENDING.flush()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return registry
    return REGISTRY


def render(extra: Collector | None = None) -> tuple[bytes, str]:
    """The exposition text, summed over processes in multiprocess mode.

    ``extra`` is sampled on each call (staleness from Redis, lag from the broker): those
    figures are the same whichever process answers, so they are never summed.
    """
    body = generate_latest(process_registry())
    if extra is not None:
        sampled = CollectorRegistry(auto_describe=False)
        sampled.register(extra)
        body += generate_latest(sampled)
    return body, CONTENT_TYPE_LATEST


def time_feature_queries(engine: Engine, registry: Registry) -> Callable[[], None]:
    """Observe :data:`COMPUTE_SECONDS` for every feature-set query run on ``engine``.

    Returns the function that stops it. The queries are recognised by their text, so
    the read-through code needs no hook.
    """
    names = {feature_statement(registry[n]).text: n for n in registry.names()}
    key = "freshline_compute_started"

    def feature_set(context: ExecutionContext | None) -> str | None:
        stmt = getattr(getattr(context, "compiled", None), "statement", None)
        return names.get(stmt.text) if isinstance(stmt, TextClause) else None

    def before(conn: Connection, context: ExecutionContext | None, **_: Any) -> None:
        name = feature_set(context)
        if name is not None:
            conn.info.setdefault(key, []).append((name, time.perf_counter()))

    def after(conn: Connection, context: ExecutionContext | None, **_: Any) -> None:
        started = conn.info.get(key)
        if feature_set(context) is not None and started:
            name, at = started.pop()
            COMPUTE_SECONDS.labels("feature", name).observe(time.perf_counter() - at)

    # named=True: SQLAlchemy passes the listeners' arguments by name.
    event.listen(engine, "before_cursor_execute", before, named=True)
    event.listen(engine, "after_cursor_execute", after, named=True)

    def stop() -> None:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)

    return stop


class TimedModel:
    """A model whose ``predict`` observes :data:`COMPUTE_SECONDS` (``cache="model"``)."""

    def __init__(self, inner: Model) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def version(self) -> str:
        return self.inner.version

    @property
    def deterministic(self) -> bool:
        return self.inner.deterministic

    @property
    def n_features(self) -> int | None:
        n = getattr(self.inner, "n_features", None)
        return n if isinstance(n, int) else None

    def predict(self, x: Array, /) -> Array:
        started = time.perf_counter()
        try:
            return self.inner.predict(x)
        finally:
            COMPUTE_SECONDS.labels("model", self.inner.name).observe(time.perf_counter() - started)
