"""Prometheus metrics of a consumer process, served on its own port.

Created once per process (prometheus-client registers metrics globally); with
``PROMETHEUS_MULTIPROC_DIR`` set, several consumer processes can share one scrape.
"""

from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ConsumerMetrics:
    def __init__(self) -> None:
        self.consumed = Counter("freshline_events_consumed_total", "Records consumed", ["topic"])
        self.applied = Counter("freshline_events_applied_total", "Events applied", ["topic"])
        self.dead_lettered = Counter(
            "freshline_events_dead_lettered_total",
            "Records sent to the dead-letter topic",
            ["topic", "kind"],
        )
        self.skipped = Counter(
            "freshline_events_skipped_total",
            "Records with nothing to do (tombstones, unfeatured tables)",
            ["topic"],
        )
        self.batch_size = Histogram(
            "freshline_batch_events",
            "Events per batch",
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2000, 5000),
        )
        self.recompute_seconds = Histogram(
            "freshline_recompute_seconds",
            "Set-based recompute per feature set and batch",
            ["feature_set"],
            buckets=LATENCY_BUCKETS,
        )
        self.redis_write_seconds = Histogram(
            "freshline_redis_write_seconds", "Redis writes per batch", buckets=LATENCY_BUCKETS
        )
        self.freshness_seconds = Histogram(
            "freshline_freshness_lag_seconds",
            "Redis write time minus the source commit time",
            buckets=LATENCY_BUCKETS,
        )
        self.consumer_lag = Gauge(
            "freshline_consumer_lag",
            "Records between the group's committed offset and the partition's end "
            "(high watermark), per partition this member is assigned",
            ["group", "topic", "partition"],
            multiprocess_mode="max",
        )
        self.subscribed_topics = Gauge(
            "freshline_consumer_subscribed_topics",
            "Topics the consumer's subscription matches (0: it reads nothing)",
            ["group"],
            multiprocess_mode="livemax",
        )
        self.retries = Counter(
            "freshline_transient_retries_total",
            "Batches retried after a transient failure",
            ["service"],
        )
        self.config_retries = Counter(
            "freshline_config_retries_total",
            "Batches held and retried after a configuration error (never dead-lettered)",
            ["cause"],
        )
        self.paused = Gauge(
            "freshline_consumer_paused",
            "1 while a configuration error holds the consumer's batch",
            ["cause"],
            multiprocess_mode="livemax",
        )
        self.redis_failovers = Counter(
            "freshline_redis_failovers_total",
            "Changes of the Redis server written to (run id or replication id) after "
            "which every floor was raised",
        )
        self.delivery_failures = Counter(
            "freshline_delivery_failures_total",
            "Flushes whose dead letters or invalidations the broker refused (sent again)",
            ["topic"],
        )


@functools.cache
def consumer_metrics() -> ConsumerMetrics:
    return ConsumerMetrics()


class HistoryMetrics:
    """The history recorder's (``freshline record``)."""

    def __init__(self) -> None:
        self.versions = Counter(
            "freshline_history_versions_total", "Versions of rows made or changed", ["table"]
        )
        self.duplicates = Counter(
            "freshline_history_duplicates_total",
            "Change records already recorded (redelivered, duplicated)",
            ["table"],
        )
        self.skipped_s0 = Counter(
            "freshline_history_before_s0_total",
            "Change records the backfill's snapshot already held",
            ["table"],
        )
        self.malformed = Counter(
            "freshline_history_malformed_total", "Records that are not change records"
        )
        self.broken = Gauge(
            "freshline_history_broken",
            "1 while a table's history is marked broken (DDL it does not follow)",
            ["table"],
            multiprocess_mode="max",
        )
        self.complete_lag = Gauge(
            "freshline_history_complete_lag_seconds",
            "How far behind now history is known complete (complete_to)",
            multiprocess_mode="min",
        )
        self.bytes = Gauge(
            "freshline_history_bytes",
            "A history table's size on disk, with its indexes",
            ["table"],
            multiprocess_mode="max",
        )


@functools.cache
def history_metrics() -> HistoryMetrics:
    return HistoryMetrics()
