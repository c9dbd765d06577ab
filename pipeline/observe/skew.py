"""The skew report: logged reads checked against history, wrong apart from old.

Each logged read (:mod:`freshline.pipeline.observe.served`, rows as ``freshline served sink``
writes them) is evaluated twice with the training evaluator
(:mod:`freshline.pipeline.history.evaluator`):

* at its entry's snapshot (:class:`AtSnapshot`, from ``freshline.snapshots`` by the
  entry's watermark): the served values must equal these exactly. A difference is an
  exact *mismatch*, a bug; there should be none;
* at the request's own moment (:class:`AtCommitTime`): a served value that differs is
  *stale* (it was right for its snapshot, but the rows had moved on), measured by the
  share of reads that differed, the entry's age at the request, and SMAPE for numbers.

A read served absent while a value existed at its moment is *missing*. A read whose
snapshot was not kept (history off where it was computed, or a read-through on a
standby) or whose moment history cannot answer is *unchecked*, counted by reason.
See ``docs/observability.md``.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter as Tally
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard, TypeVar

import orjson
from prometheus_client import REGISTRY as METRICS
from prometheus_client import CollectorRegistry, Gauge
from sqlalchemy.engine import Connection

from freshline.pipeline.core.features import IMPLICIT_TENANT, FeatureSet, Registry
from freshline.pipeline.history.evaluator import (
    AtCommitTime,
    AtSnapshot,
    Evaluator,
    HistoryRefused,
    Ref,
)
from freshline.pipeline.history.snapshots import snapshots_of
from freshline.pipeline.history.tables import from_epoch_us

M = TypeVar("M", AtCommitTime, AtSnapshot)
QUANTILES = (0.5, 0.9, 0.99, 1.0)


@dataclass(slots=True)
class FieldSkew:
    """One field's figures over the reads checked."""

    mismatched: int = 0
    """Reads whose served value differs from its snapshot's."""
    stale: int = 0
    """Reads exact at their snapshot whose value differs at the request's moment."""
    compared: int = 0
    """Reads compared at the request's moment."""
    smape_sum: float = 0.0
    numeric: int = 0

    @property
    def stale_ratio(self) -> float | None:
        return None if self.compared == 0 else self.stale / self.compared

    @property
    def smape(self) -> float | None:
        """Mean symmetric absolute percentage error (0 to 2) of served against the value
        at the request's moment, over the numeric reads compared (fresh ones count 0)."""
        return None if self.numeric == 0 else self.smape_sum / self.numeric


@dataclass(slots=True)
class SetSkew:
    """One feature set's figures."""

    feature_set: str
    reads: int = 0
    checked: int = 0
    """Reads checked at their snapshot."""
    mismatched: int = 0
    """Reads with any field differing from their snapshot's value: must be 0."""
    missing: int = 0
    """Reads served absent while a value existed at the request's moment."""
    stale: int = 0
    """Reads exact at their snapshot, differing at the request's moment."""
    compared: int = 0
    unchecked: Tally[str] = field(default_factory=Tally)
    """Reads not checked, by reason."""
    stale_ages_ms: list[int] = field(default_factory=list)
    """The entry's age at the request (request time - computed_at) of each stale read."""
    fields: dict[str, FieldSkew] = field(default_factory=dict)

    @property
    def nines(self) -> float | None:
        """Exactness in nines: ``-log10(mismatched / checked)``; ``log10(checked)`` (a
        lower bound) with no mismatch, as the audit reports it."""
        if self.checked == 0:
            return None
        if self.mismatched == 0:
            return math.log10(self.checked)
        return -math.log10(self.mismatched / self.checked)

    @property
    def stale_ratio(self) -> float | None:
        return None if self.compared == 0 else self.stale / self.compared

    def ages(self) -> dict[str, int]:
        """Quantiles of :attr:`stale_ages_ms` (``p50``, ``p90``, ``p99``, ``max``)."""
        ages = sorted(self.stale_ages_ms)
        if not ages:
            return {}
        names = ("p50", "p90", "p99", "max")
        return {
            n: ages[min(len(ages) - 1, int(q * len(ages)))]
            for n, q in zip(names, QUANTILES, strict=True)
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "feature_set": self.feature_set,
            "reads": self.reads,
            "checked": self.checked,
            "mismatched": self.mismatched,
            "missing": self.missing,
            "stale": self.stale,
            "stale_ratio": self.stale_ratio,
            "nines": self.nines,
            "unchecked": dict(self.unchecked),
            "stale_age_ms": self.ages(),
            "fields": {
                name: {
                    "mismatched": f.mismatched,
                    "stale": f.stale,
                    "stale_ratio": f.stale_ratio,
                    "smape": f.smape,
                }
                for name, f in self.fields.items()
            },
        }


@dataclass(slots=True)
class SkewReport:
    sets: dict[str, SetSkew] = field(default_factory=dict)

    @property
    def mismatched(self) -> int:
        return sum(s.mismatched for s in self.sets.values())

    def as_json(self) -> dict[str, Any]:
        return {
            "mismatched": self.mismatched,
            "feature_sets": [s.as_json() for s in self.sets.values()],
        }


def _ref(fs: FeatureSet, row: Mapping[str, Any]) -> Ref:
    tenant = row["tenant"] if fs.entity.tenant is not None else IMPLICIT_TENANT
    return (str(tenant), str(row["entity"]))


def _plain(values: Any) -> Any:
    """Values as an entry's JSON holds them (what the log decoded them from)."""
    return orjson.loads(orjson.dumps(values))


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _smape(served: float, truth: float) -> float:
    scale = (abs(served) + abs(truth)) / 2
    return 0.0 if scale == 0 else abs(served - truth) / scale


def _evaluate(
    evaluator: Evaluator,
    fs: FeatureSet,
    moments: Mapping[M, Sequence[Ref]],
    refused: dict[M, str],
) -> dict[M, dict[Ref, Any]]:
    """``evaluator.evaluate``, the moments it refuses left out with the reason."""
    if not moments:
        return {}
    try:
        return evaluator.evaluate(fs, moments)
    except HistoryRefused:
        pass
    out: dict[M, dict[Ref, Any]] = {}
    for moment, refs in moments.items():  # one at a time, to tell which it refuses
        try:
            out.update(evaluator.evaluate(fs, {moment: refs}))
        except HistoryRefused as exc:
            refused[moment] = _reason(str(exc))
    return out


def _reason(message: str) -> str:
    if "complete to" in message:
        return "history not complete yet"
    if "broken" in message:
        return "history broken"
    if "retention" in message:
        return "beyond history's retention"
    if "starts at" in message or "has not started" in message:
        return "before history starts"
    return message


def check(conn: Connection, registry: Registry, rows: Iterable[Mapping[str, Any]]) -> SkewReport:
    """Check logged reads (``rows``: the served log's columns) against history, on
    ``conn`` (the caller's transaction; REPEATABLE READ keeps every statement on one
    history)."""
    evaluator = Evaluator.on(conn)
    by_set: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        by_set[row["feature_set"]].append(row)
    served = [r for group in by_set.values() for r in group if r["watermark"] is not None]
    snapshots = snapshots_of(conn, {int(r["watermark"]) for r in served})
    report = SkewReport()
    for name, group in sorted(by_set.items()):
        skew = report.sets[name] = SetSkew(name)
        if name not in registry:
            skew.reads = len(group)
            skew.unchecked["feature set not in the repository"] += len(group)
            continue
        _check_set(evaluator, registry[name], group, snapshots, skew)
    return report


def _check_set(
    evaluator: Evaluator,
    fs: FeatureSet,
    group: list[Mapping[str, Any]],
    snapshots: Mapping[int, Any],
    skew: SetSkew,
) -> None:
    skew.fields = {f: FieldSkew() for f in fs.field_names}
    at_snapshot: dict[AtSnapshot, list[Ref]] = defaultdict(list)
    at_request: dict[AtCommitTime, list[Ref]] = defaultdict(list)
    todo: list[tuple[Mapping[str, Any], Any, AtSnapshot | None, AtCommitTime]] = []
    for row in group:
        skew.reads += 1
        values = None if row["values"] is None else orjson.loads(row["values"])
        absent = row["source"] == "miss" or values is None
        moment = None
        if not absent:
            if row["watermark"] is None:
                skew.unchecked["no entry logged"] += 1
                continue
            kept = snapshots.get(int(row["watermark"]))
            if kept is None:
                skew.unchecked["snapshot not kept"] += 1
                continue
            moment = AtSnapshot(kept.snapshot, from_epoch_us(kept.as_of_us))
            at_snapshot[moment].append(_ref(fs, row))
        asked = AtCommitTime(row["requested_at"])
        at_request[asked].append(_ref(fs, row))
        todo.append((row, values, moment, asked))
    refused: dict[Any, str] = {}
    then = _evaluate(evaluator, fs, at_snapshot, refused)
    now = _evaluate(evaluator, fs, at_request, refused)
    for row, values, moment, asked in todo:
        ref = _ref(fs, row)
        if moment is not None and moment in refused:
            skew.unchecked[refused[moment]] += 1
            continue
        if asked in refused:
            skew.unchecked[refused[asked]] += 1
            continue
        truth = now[asked].get(ref)
        if moment is None:  # served absent
            if truth is not None:
                skew.missing += 1
            continue
        skew.checked += 1
        expected = _plain(then[moment].get(ref))
        wrong = [f for f in fs.field_names if expected is None or values.get(f) != expected.get(f)]
        for f in wrong:
            skew.fields[f].mismatched += 1
        if wrong:
            skew.mismatched += 1
            continue
        _compare_at_request(skew, fs, row, values, None if truth is None else _plain(truth))


def _compare_at_request(
    skew: SetSkew, fs: FeatureSet, row: Mapping[str, Any], values: Any, truth: Any
) -> None:
    skew.compared += 1
    differed = False
    for name in fs.field_names:
        figures = skew.fields[name]
        figures.compared += 1
        served, now = values.get(name), None if truth is None else truth.get(name)
        if served != now:
            figures.stale += 1
            differed = True
        if _number(served) and _number(now):
            figures.numeric += 1
            figures.smape_sum += _smape(float(served), float(now))
    if differed:
        skew.stale += 1
        if row["computed_at"] is not None:
            age = row["requested_at"] - row["computed_at"]
            skew.stale_ages_ms.append(max(0, age // dt.timedelta(milliseconds=1)))


class SkewMetrics:
    """The last report's figures as Prometheus gauges (``freshline skew --duration``)."""

    def __init__(self, registry: CollectorRegistry = METRICS) -> None:
        self.mismatched = Gauge(
            "freshline_skew_mismatched_reads",
            "Logged reads of the last skew check whose values differ from their entry's "
            "snapshot (must be 0)",
            ["feature_set"],
            registry=registry,
        )
        self.checked = Gauge(
            "freshline_skew_checked_reads",
            "Logged reads the last skew check checked at their snapshot",
            ["feature_set"],
            registry=registry,
        )
        self.missing = Gauge(
            "freshline_skew_missing_reads",
            "Logged reads served absent while a value existed at the request's moment",
            ["feature_set"],
            registry=registry,
        )
        self.stale_ratio = Gauge(
            "freshline_skew_stale_ratio",
            "Share of the last check's reads whose field differed at the request's moment",
            ["feature_set", "field"],
            registry=registry,
        )
        self.nines = Gauge(
            "freshline_skew_exact_nines",
            "Exactness of served values against their snapshots, in nines; log10(checked) "
            "when none differed",
            ["feature_set"],
            registry=registry,
        )
        self.unchecked = Gauge(
            "freshline_skew_unchecked_reads",
            "Logged reads the last skew check could not check, by reason",
            ["feature_set", "reason"],
            registry=registry,
        )

    def update(self, report: SkewReport) -> None:
        for name, s in report.sets.items():
            self.mismatched.labels(name).set(s.mismatched)
            self.checked.labels(name).set(s.checked)
            self.missing.labels(name).set(s.missing)
            if s.nines is not None:
                self.nines.labels(name).set(s.nines)
            for reason, n in s.unchecked.items():
                self.unchecked.labels(name, reason).set(n)
            for field_name, f in s.fields.items():
                if f.stale_ratio is not None:
                    self.stale_ratio.labels(name, field_name).set(f.stale_ratio)


_METRICS: list[SkewMetrics] = []


def skew_metrics() -> SkewMetrics:
    """The process's skew metrics, in the global registry (made once)."""
    if not _METRICS:
        _METRICS.append(SkewMetrics())
    return _METRICS[0]
