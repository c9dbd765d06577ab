"""Prometheus metrics of the read API, per feature set and per endpoint.

With several worker processes set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory
before the workers start (``freshline serve --workers N`` does it for you):
prometheus_client then keeps each process's values in files there, and ``/metrics``
sums them across processes.
"""

from __future__ import annotations

import os
import time
from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from pipeline.api.reader import Answer

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
PREDICTIONS = Counter(
    "freshline_api_predictions_total",
    "Predictions served, by model and outcome (hit or computed).",
    ["model", "outcome"],
)


def record_answers(answers: Iterable[Answer]) -> None:
    """Count hits, misses and read-throughs, one counter update per label set."""
    hits: Tally[tuple[str, str]] = Tally()
    misses: Tally[str] = Tally()
    computed: Tally[str] = Tally()
    for a in answers:
        fs = a.ref.feature_set
        if a.source == "local":
            hits[(fs, "local")] += 1
        elif a.source in ("hit", "waited"):
            hits[(fs, "redis")] += 1
        else:
            misses[fs] += 1
            if a.source in ("computed", "uncached"):
                computed[fs] += 1
    for (fs, tier), n in hits.items():
        HITS.labels(fs, tier).inc(n)
    for fs, n in misses.items():
        MISSES.labels(fs).inc(n)
    for fs, n in computed.items():
        READ_THROUGHS.labels(fs).inc(n)


def record_predictions(model: str, hits: int, computed: int) -> None:
    if hits:
        PREDICTIONS.labels(model, "hit").inc(hits)
    if computed:
        PREDICTIONS.labels(model, "computed").inc(computed)


def observe(endpoint: str, feature_set: str, status: int, started: float) -> None:
    REQUEST_SECONDS.labels(endpoint, feature_set, str(status)).observe(
        time.perf_counter() - started)


def render() -> tuple[bytes, str]:
    """The exposition text, summed over processes in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
