"""Prometheus metrics of the consistency auditor (:mod:`pipeline.observe.audit`).

The counters move while an audit runs (``checked`` per batch, ``inconsistent`` when a
re-check after a grace still finds a mismatch); the gauges hold the last finished
audit's figures. ``freshline audit --metrics-port`` serves them.
"""

from __future__ import annotations

import functools
import time

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from pipeline.observe.consistency import AuditReport, grace_label


class AuditMetrics:
    """The auditor's metrics, registered in ``registry`` (the global one by default)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.checked = Counter(
            "freshline_audit_checked_total",
            "Entries the auditor checked against Postgres",
            ["feature_set"],
            registry=registry,
        )
        self.inconsistent = Counter(
            "freshline_audit_inconsistent_total",
            "Entries still inconsistent with Postgres when re-checked after the grace",
            ["feature_set", "grace"],
            registry=registry,
        )
        self.nines = Gauge(
            "freshline_audit_consistency_nines",
            "Consistency of the last audit in nines, -log10(1 - consistent fraction), "
            "when mismatches may heal for the grace; log10(checked) if none persisted",
            ["grace"],
            registry=registry,
        )
        self.consistent_ratio = Gauge(
            "freshline_audit_consistent_ratio",
            "Fraction of the last audit's entries consistent within the grace",
            ["grace"],
            registry=registry,
        )
        self.entries_per_second = Gauge(
            "freshline_audit_entries_per_second",
            "Entries the last audit checked per second of Redis and Postgres work",
            registry=registry,
        )
        self.last_run = Gauge(
            "freshline_audit_last_run_timestamp_seconds",
            "When the last audit finished (Unix time)",
            registry=registry,
        )

    def checked_batch(self, feature_set: str, n: int) -> None:
        self.checked.labels(feature_set=feature_set).inc(n)

    def still_inconsistent(self, feature_set: str, grace_s: float) -> None:
        self.inconsistent.labels(feature_set=feature_set, grace=grace_label(grace_s)).inc()

    def finished(self, report: AuditReport) -> None:
        """Set the gauges from a finished audit (one that checked nothing sets none)."""
        if report.checked == 0:
            return
        for result in report.results():
            nines, fraction = result.nines, result.consistent_fraction
            if nines is not None and fraction is not None:
                self.nines.labels(grace=result.label).set(nines)
                self.consistent_ratio.labels(grace=result.label).set(fraction)
        self.entries_per_second.set(report.capacity_per_s)
        self.last_run.set(time.time())


@functools.cache
def audit_metrics() -> AuditMetrics:
    """The process's metrics in the global registry, created once."""
    return AuditMetrics()
