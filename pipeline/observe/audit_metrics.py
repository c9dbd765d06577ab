"""Prometheus metrics of the consistency auditor (:mod:`freshline.pipeline.observe.audit`).

The counters move while an audit runs (``checked`` per batch, ``inconsistent`` when a
re-check after a grace still finds a mismatch, ``caught_up_settled`` when an entry
caught up on its watermark alone is verified or left unverified); the gauges hold the last finished
audit's figures. ``freshline audit --metrics-port`` serves them.
"""

from __future__ import annotations

import functools
import time

from prometheus_client import REGISTRY as METRICS
from prometheus_client import CollectorRegistry, Counter, Gauge

from freshline.pipeline.observe.consistency import AuditReport, grace_label


class AuditMetrics:
    """The auditor's metrics, registered in ``registry`` (the global one by default)."""

    def __init__(self, registry: CollectorRegistry = METRICS) -> None:
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
        self.settled_total = Counter(
            "freshline_audit_caught_up_settled_total",
            "Entries caught up on their watermarks alone, by how their values were "
            "settled: verified (then seen to match a recompute) or unverified (never, "
            "within the audit's bound)",
            ["feature_set", "outcome"],
            registry=registry,
        )
        self.unverified_ratio = Gauge(
            "freshline_audit_unverified_ratio",
            "Entries of the last audit caught up on their watermarks alone and never "
            "verified by value, per entry checked",
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

    def settled(self, feature_set: str, *, verified: int, unverified: int) -> None:
        for outcome, n in (("verified", verified), ("unverified", unverified)):
            if n:
                self.settled_total.labels(feature_set=feature_set, outcome=outcome).inc(n)

    def finished(self, report: AuditReport) -> None:
        """Set the gauges from a finished audit (one that checked nothing sets none)."""
        if report.checked == 0:
            return
        for result in report.results():
            nines, fraction = result.nines, result.consistent_fraction
            if nines is not None and fraction is not None:
                self.nines.labels(grace=result.label).set(nines)
                self.consistent_ratio.labels(grace=result.label).set(fraction)
        self.unverified_ratio.set(report.unverified_fraction or 0.0)
        self.entries_per_second.set(report.capacity_per_s)
        self.last_run.set(time.time())


@functools.cache
def audit_metrics() -> AuditMetrics:
    """The process's metrics in the global registry, created once."""
    return AuditMetrics()
