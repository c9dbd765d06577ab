"""What the ``/status`` page shows: per feature set, the last hour minute by minute.

:class:`Observer` takes a :class:`Snapshot` of everything the page plots: the API's
hit and miss counters (summed over worker processes), entry staleness sampled from
Redis (:mod:`freshline.pipeline.observe.staleness`), the consumer group's lag read from the broker,
and
the consumers' freshness-lag histogram scraped from their ``/metrics``.

:class:`StatusBoard` keeps a snapshot a minute in an in-process ring buffer (an hour
of them) and turns consecutive snapshots into per-minute points. Every figure it
records is global (counters summed across processes through
``PROMETHEUS_MULTIPROC_DIR``, Redis, the broker), so each API worker's buffer holds
the same curves; a worker started later just has a shorter history. Nothing is
written to Redis for it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry

from freshline.pipeline.core.errors import ServiceUnavailable
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.http import fetch
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.observe.advisor import parse_exposition
from freshline.pipeline.observe.staleness import GroupLag, Staleness, sample, source_topics

log = logging.getLogger(__name__)

WINDOW_S = 3600
INTERVAL_S = 60.0
RATE_WINDOW_S = 300
"""The current hit rate and freshness lag are taken over the last five minutes."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Cumulative counters and sampled figures at one moment (epoch seconds)."""

    at: float
    hits: dict[str, float]
    misses: dict[str, float]
    staleness: dict[str, Staleness]
    lag: dict[str, int] | None
    """Consumer-group lag per feature set; None when the broker did not answer."""
    freshness: tuple[float, float] | None
    """The consumers' freshness histogram: (sum of seconds, count); None if unreachable."""
    dead_letters: float | None = None
    semantic: dict[str, dict[str, float]] = field(default_factory=dict)
    """The semantic cache's counters per model: hit, miss, refused, flagged."""


def counter_totals(
    registry: CollectorRegistry, family: str, label: str = "feature_set"
) -> dict[str, float]:
    """The samples of counter ``family`` summed by ``label`` (other labels added up)."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        if metric.name != family:
            continue
        for s in metric.samples:
            if s.name == f"{family}_total":
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def semantic_totals(registry: CollectorRegistry) -> dict[str, dict[str, float]]:
    """The semantic cache's lookups by outcome, and flags, per model."""
    out: dict[str, dict[str, float]] = {}
    for metric in registry.collect():
        for s in metric.samples:
            model = s.labels.get("model", "")
            if s.name == "freshline_semantic_lookups_total":
                counts = out.setdefault(model, {})
                outcome = s.labels.get("outcome", "")
                counts[outcome] = counts.get(outcome, 0.0) + s.value
            elif s.name == "freshline_semantic_flagged_total":
                counts = out.setdefault(model, {})
                counts["flagged"] = counts.get("flagged", 0.0) + s.value
    return out


def scrape_freshness(
    urls: Sequence[str], timeout_s: float = 1.0
) -> tuple[tuple[float, float] | None, float | None]:
    """``((sum, count) of freshness lag, dead letters)`` summed over consumer scrapes."""
    texts: list[str] = []
    for url in urls:
        try:
            response = fetch(url, timeout=timeout_s, service="consumer metrics")
        except ServiceUnavailable as exc:
            log.debug("%s", exc)
            continue
        if response.status != 200:
            log.debug("consumer metrics at %s answered HTTP %s", url, response.status)
            continue
        texts.append(response.text())
    if not texts:
        return None, None
    samples = parse_exposition(texts)

    def total(name: str) -> float:
        return sum(v for (n, _), v in samples.items() if n == name)

    return (
        (
            total("freshline_freshness_lag_seconds_sum"),
            total("freshline_freshness_lag_seconds_count"),
        ),
        total("freshline_events_dead_lettered_total"),
    )


class Observer:
    """Takes snapshots; caches the slow parts (Redis sample, broker) for ``max_age_s``."""

    def __init__(
        self,
        client: redis.Redis,
        registry: Registry,
        settings: Settings,
        *,
        version: Callable[[], int],
        counters: Callable[[], CollectorRegistry],
        consumer_metrics: Sequence[str] = (),
        lag: GroupLag | None = None,
        semantic_namespaces: Callable[[], dict[str, Any]] | None = None,
        deploy: Callable[[], dict[str, Any]] | None = None,
        max_age_s: float = 5.0,
    ) -> None:
        self.redis = client
        self.registry = registry
        self.settings = settings
        self.version = version
        self.counters = counters
        self.consumer_metrics = list(consumer_metrics)
        self.group_lag = lag
        self.semantic_namespaces = semantic_namespaces
        self.deploy_state = deploy
        self.max_age_s = max_age_s
        self.topics = source_topics(settings, registry)
        self._lock = threading.Lock()
        self._slow: tuple[float, dict[str, Staleness], dict[str, int] | None] | None
        self._slow = None
        self.lag_error: str | None = None
        """Why the last lag was not had (the broker's refusal, a timeout), if it was not."""

    def staleness(self) -> dict[str, Staleness]:
        """A fresh sample of the served schema version's entries."""
        return sample(self.redis, self.registry, self.version()).by_set

    def lag(self) -> dict[str, int] | None:
        """Consumer-group lag per feature set, or None if the broker did not answer."""
        if self.group_lag is None:
            return None
        try:
            lag = self.group_lag.by_feature_set(self.topics)
        except Exception as exc:  # the broker is advisory here; never fail a page
            log.debug("consumer-group lag unavailable: %s", exc)
            self.lag_error = str(exc) or type(exc).__name__
            return None
        self.lag_error = None
        return lag

    def namespaces(self) -> dict[str, Any] | None:
        """The semantic cache's busiest namespaces (:mod:`freshline.pipeline.api.semantic_status`),
        or None when the cache is off or its figures could not be read."""
        if self.semantic_namespaces is None:
            return None
        try:
            return self.semantic_namespaces()
        except Exception as exc:  # advisory, as the broker is: never fail a page
            log.debug("semantic namespaces unavailable: %s", exc)
            return None

    def deploy(self) -> dict[str, Any] | None:
        """The running processes and this reader's problems with the active version
        (:func:`freshline.pipeline.api.app.deploy_report`), or None if unreadable."""
        if self.deploy_state is None:
            return None
        try:
            return self.deploy_state()
        except Exception as exc:  # advisory, as the broker is: never fail a page
            log.debug("deploy state unavailable: %s", exc)
            return None

    def _sampled(self, max_age_s: float) -> tuple[dict[str, Staleness], dict[str, int] | None]:
        with self._lock:
            now = time.monotonic()
            if self._slow is None or now - self._slow[0] > max_age_s:
                self._slow = (now, self.staleness(), self.lag())
            return self._slow[1], self._slow[2]

    def snapshot(self, max_age_s: float | None = None, *, light: bool = False) -> Snapshot:
        """Counters and scrapes now; the Redis sample and broker lag unless ``light``."""
        ages: dict[str, Staleness] = {}
        lag: dict[str, int] | None = None
        if not light:
            ages, lag = self._sampled(self.max_age_s if max_age_s is None else max_age_s)
        counters = self.counters()
        fresh, dlq = scrape_freshness(self.consumer_metrics)
        return Snapshot(
            at=time.time(),
            hits=counter_totals(counters, "freshline_api_feature_hits"),
            misses=counter_totals(counters, "freshline_api_feature_misses"),
            staleness=ages,
            lag=lag,
            freshness=fresh,
            dead_letters=dlq,
            semantic=semantic_totals(counters),
        )

    def close(self) -> None:
        if self.group_lag is not None:
            self.group_lag.close()


_STALENESS_GAUGES = {
    "oldest": (
        "freshline_staleness_oldest_age_seconds",
        "Age of the oldest entry in a random sample of the served namespace.",
    ),
    "mean": (
        "freshline_staleness_mean_age_seconds",
        "Mean entry age in the sample (about TTL/2 when entries live out their TTL).",
    ),
    "over": (
        "freshline_staleness_over_ttl_entries",
        "Sampled entries older than their feature set's TTL (a bug: TTL not enforced).",
    ),
    "immortal": (
        "freshline_staleness_immortal_entries",
        "Sampled keys without an expiry (a bug: every entry has a TTL).",
    ),
    "sampled": ("freshline_staleness_sampled_entries", "Entries in the sample."),
    "ttl": ("freshline_feature_ttl_seconds", "The feature set's TTL."),
}
"""The per-feature-set gauges :class:`SampledMetrics` reports: key, (name, help)."""


class SampledMetrics:
    """A Prometheus collector of the sampled figures, taken at each scrape.

    Staleness is sampled afresh on every scrape (independent samples); the group lag
    is reused for up to ``lag_max_age_s`` to spare the broker.
    """

    def __init__(self, observer: Observer, lag_max_age_s: float = 10.0) -> None:
        self.observer = observer
        self.lag_max_age_s = lag_max_age_s
        self._lag: tuple[float, dict[str, int] | None] | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        ages = self.observer.staleness()
        now = time.monotonic()
        if self._lag is None or now - self._lag[0] > self.lag_max_age_s:
            self._lag = (now, self.observer.lag())
        lag = self._lag[1]
        families = {
            key: GaugeMetricFamily(name, doc, labels=["feature_set"])
            for key, (name, doc) in _STALENESS_GAUGES.items()
        }
        for name, s in ages.items():
            if s.oldest_age_s is not None and s.mean_age_s is not None:
                families["oldest"].add_metric([name], s.oldest_age_s)
                families["mean"].add_metric([name], s.mean_age_s)
            families["over"].add_metric([name], s.over_ttl)
            families["immortal"].add_metric([name], s.immortal)
            families["sampled"].add_metric([name], s.sampled)
            families["ttl"].add_metric([name], s.ttl_s)
        yield from families.values()
        if lag is not None:
            by_set = GaugeMetricFamily(
                "freshline_feature_set_consumer_lag",
                "Records the consumer group has yet to read on the topics feeding the set, "
                "read from the broker (grows while no consumer runs).",
                labels=["feature_set"],
            )
            for name, n in lag.items():
                by_set.add_metric([name], n)
            yield by_set


@dataclass
class _Series:
    t: list[float] = field(default_factory=list)
    values: dict[str, list[float | None]] = field(default_factory=dict)

    def add(self, at: float, **values: float | None) -> None:
        self.t.append(round(at, 3))
        for k, v in values.items():
            self.values.setdefault(k, []).append(None if v is None else round(v, 6))

    def as_dict(self) -> dict[str, Any]:
        return {"t": self.t, **self.values}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


class StatusBoard:
    """The ring buffer of per-minute snapshots and the report the page draws."""

    def __init__(
        self,
        observer: Observer,
        *,
        interval_s: float = INTERVAL_S,
        window_s: int = WINDOW_S,
        history: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.observer = observer
        self.history_rows = history
        """The recorded tables' history, one row each (``freshline.pipeline.history.status.rows``)
        when the repository records history."""
        self.interval_s = interval_s
        self.window_s = window_s
        self.history: deque[Snapshot] = deque(maxlen=int(window_s / interval_s) + 1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self) -> Snapshot:
        snap = self.observer.snapshot(max_age_s=0)
        self.history.append(snap)
        return snap

    def start(self) -> None:
        """Record a baseline of the counters now, then a snapshot per interval in a thread.

        The baseline is light (no Redis sample, no broker call), so start-up stays fast
        and the rates shown from the first request on count only this app's lifetime.
        """
        self.history.append(self.observer.snapshot(light=True))
        self._thread = threading.Thread(target=self._run, name="freshline-status", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._safe_record()

    def _safe_record(self) -> None:
        try:
            self.record()
        except Exception as exc:  # a failed sample leaves a gap, never kills the thread
            log.warning("status sample failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.observer.close()

    def report(self) -> dict[str, Any]:
        """The page's data: current figures and the last hour, per feature set."""
        now = self.observer.snapshot()
        points = [s for s in self.history if s.at >= now.at - self.window_s] + [now]
        base = self._base(now)
        names = self.observer.registry.names()
        problems: list[str] = []
        sets = [self._feature_set(name, points, now, base, problems) for name in names]
        group = self._group(problems) if now.lag is not None else None
        semantic = self._semantic(now, base, problems)
        namespaces = self.observer.namespaces()
        if namespaces is not None:
            self._namespace_problems(namespaces["rows"], problems)
        deploy = self.observer.deploy()
        if deploy is not None:
            problems += deploy["problems"]
        history = self._history(problems)
        fresh = _Series()
        for prev, cur in itertools.pairwise(points):
            fresh.add(cur.at, lag_s=_mean_between(prev.freshness, cur.freshness))
        return {
            "generated_at": round(now.at, 3),
            "schema_version": self.observer.version(),
            "window_s": self.window_s,
            "interval_s": self.interval_s,
            "feature_sets": sets,
            "freshness": {
                "current_s": _mean_between(base.freshness, now.freshness),
                "reachable": now.freshness is not None,
                "series": fresh.as_dict(),
            },
            "semantic": semantic,
            "semantic_namespaces": namespaces,
            "broker_reachable": now.lag is not None,
            "processes": None if deploy is None else deploy["processes"],
            "lag_error": None if now.lag is not None else self.observer.lag_error,
            "consumer_group": group,
            "history": history,
            "problems": problems,
        }

    def _feature_set(
        self,
        name: str,
        points: list[Snapshot],
        now: Snapshot,
        base: Snapshot,
        problems: list[str],
    ) -> dict[str, Any]:
        """One feature set's block of the page: its series over ``points``, its current
        figures since ``base``, and the problems they show (added to ``problems``)."""
        series = _Series()
        for prev, cur in itertools.pairwise(points):
            hits = cur.hits.get(name, 0.0) - prev.hits.get(name, 0.0)
            misses = cur.misses.get(name, 0.0) - prev.misses.get(name, 0.0)
            age = cur.staleness.get(name)
            series.add(
                cur.at,
                hit_rate=_ratio(hits, hits + misses),
                requests=hits + misses,
                staleness_s=age.oldest_age_s if age else None,
                consumer_lag=None if cur.lag is None else cur.lag.get(name),
            )
        hits = now.hits.get(name, 0.0) - base.hits.get(name, 0.0)
        misses = now.misses.get(name, 0.0) - base.misses.get(name, 0.0)
        age = now.staleness.get(name)
        ttl = self.observer.registry[name].ttl_s
        current = {
            "hit_rate": _ratio(hits, hits + misses),
            "hits": hits,
            "misses": misses,
            "window_s": round(now.at - base.at, 1),
            "staleness_s": age.oldest_age_s if age else None,
            "mean_age_s": age.mean_age_s if age else None,
            "sampled": age.sampled if age else 0,
            "over_ttl": age.over_ttl if age else 0,
            "immortal": age.immortal if age else 0,
            "consumer_lag": None if now.lag is None else now.lag.get(name),
        }
        if current["over_ttl"]:
            problems.append(
                f"{name}: {current['over_ttl']} sampled entries are older "
                f"than the {ttl}s TTL (TTL not enforced)"
            )
        if current["immortal"]:
            problems.append(f"{name}: {current['immortal']} sampled keys have no expiry")
        rate = current["hit_rate"]
        if rate is not None and rate < 0.25 and hits + misses >= 20:
            problems.append(f"{name}: hit rate {rate:.0%} is below 25%")
        return {"name": name, "ttl_s": ttl, "current": current, "series": series.as_dict()}

    def _group(self, problems: list[str]) -> dict[str, Any] | None:
        """The group whose lag is shown, and a problem for each feature set none of
        whose topics exists (a consumer subscribed to them reads nothing)."""
        measured = self.observer.group_lag
        if measured is None:
            return None
        missing = set(measured.missing)
        for name, topics in self.observer.topics.items():
            if topics and missing.issuperset(topics):
                problems.append(
                    f"{name}: none of its topics exists ({', '.join(topics)}), so no "
                    "consumer reads its changes; check FRESHLINE_TOPIC_PREFIX, run "
                    "freshline topics ensure and register the connector"
                )
        return {"name": measured.group, "consuming": measured.consuming}

    def _history(self, problems: list[str]) -> list[dict[str, Any]] | None:
        if self.history_rows is None:
            return None
        try:
            rows = self.history_rows()
        except Exception as exc:  # a failed read leaves the section empty, never the page
            log.warning("history status failed: %s", exc)
            return None
        problems += [
            f"history of {r['table']} is broken: {r['broken']}" for r in rows if r["broken"]
        ]
        return rows

    @staticmethod
    def _semantic(now: Snapshot, base: Snapshot, problems: list[str]) -> list[dict[str, Any]]:
        """Per model over the rate window: hit rate, lookups, refusals and flagged hits."""
        rows: list[dict[str, Any]] = []
        for model in sorted(now.semantic):
            cur, old = now.semantic[model], base.semantic.get(model, {})
            d = {
                k: cur.get(k, 0.0) - old.get(k, 0.0) for k in ("hit", "miss", "refused", "flagged")
            }
            rate = _ratio(d["hit"], d["hit"] + d["miss"])
            rows.append(
                {
                    "model": model,
                    "hit_rate": rate,
                    "hits": d["hit"],
                    "misses": d["miss"],
                    "refused": d["refused"],
                    "flagged": d["flagged"],
                }
            )
            if d["flagged"]:
                problems.append(
                    f"semantic cache {model}: {d['flagged']:.0f} hits flagged as "
                    "wrong (each entry removed)"
                )
            if rate is not None and rate < 0.25 and d["hit"] + d["miss"] >= 20:
                problems.append(f"semantic cache {model}: hit rate {rate:.0%} is below 25%")
        return rows

    def _namespace_problems(self, rows: list[dict[str, Any]], problems: list[str]) -> None:
        """A namespace whose callers flag more of its hits than the decision's bound."""
        bound = self.observer.settings.semantic_max_error
        for r in rows:
            error = r["observed_error"]
            if error is not None and error > bound and r["hits"] >= 20:
                problems.append(
                    f"semantic cache {r['tenant']} {r['model']}: {error:.1%} of hits "
                    f"flagged, above the {bound:.1%} bound"
                )

    def _base(self, now: Snapshot) -> Snapshot:
        """The snapshot the current rates are measured from: about five minutes ago."""
        older = [s for s in self.history if s.at <= now.at - RATE_WINDOW_S]
        if older:
            return older[-1]
        return self.history[0] if self.history else now


def _mean_between(a: tuple[float, float] | None, b: tuple[float, float] | None) -> float | None:
    if a is None or b is None:
        return None
    return _ratio(b[0] - a[0], b[1] - a[1])
