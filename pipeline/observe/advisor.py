"""Should this be cached? A verdict per feature set and per model, from measured figures.

:func:`advise` is pure arithmetic on one cache's :class:`Figures`: a cache is kept only
if ``lookup + (1 - h) * (compute + miss_overhead)`` is below ``compute``, after three
guards (a non-deterministic computation is refused; under 5 requests/s or a 30% hit
rate it is killed); a kept one may be told to lengthen or shorten its TTL from the
staleness sample, and a model's verdict prices the serving slots it saves.

The arithmetic and why each rule: docs/observability.md, "The arithmetic behind the
verdicts".
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Verdict = Literal["keep", "kill", "shorten-ttl", "lengthen-ttl", "refuse"]
Kind = Literal["feature_set", "model", "semantic"]

MIN_QPS = 5.0
MIN_HIT_RATE = 0.30
GOOD_HIT_RATE = 0.40
LENGTHEN_MEAN_AGE = 0.25
SHORTEN_OLDEST_AGE = 0.8
LENGTHEN_BELOW_HIT_RATE = 0.90


@dataclass(frozen=True, slots=True)
class Figures:
    """What was measured for one cache over a window. Times in seconds."""

    name: str
    kind: Kind
    qps: float
    hit_rate: float
    lookup_s: float
    compute_s: float
    miss_overhead_s: float = 0.0
    deterministic: bool = True
    ttl_s: float | None = None
    oldest_age_s: float | None = None
    mean_age_s: float | None = None
    window_s: float | None = None
    notes: tuple[str, ...] = ()
    """What could not be measured and was assumed instead."""


@dataclass(frozen=True, slots=True)
class Advice:
    """A verdict and the numbers behind it."""

    figures: Figures
    verdict: Verdict
    reason: str
    cached_s: float
    """E[latency] with the cache."""
    uncached_s: float
    """E[latency] without it (the computation alone)."""
    suggested_ttl_s: float | None = None
    slots_cached: float | None = None
    slots_uncached: float | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def saving_s(self) -> float:
        """Latency the cache saves per request (negative: what it costs)."""
        return self.uncached_s - self.cached_s


def expected_latency(f: Figures) -> tuple[float, float]:
    """``(E[latency | cache], E[latency | no cache])`` (docs/observability.md)."""
    miss = 1.0 - f.hit_rate
    return f.lookup_s + miss * (f.compute_s + f.miss_overhead_s), f.compute_s


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds for people: three significant figures, whole ms from 1 s."""
    ms = seconds * 1000
    return f"{ms:,.0f} ms" if abs(ms) >= 1000 else f"{ms:.3g} ms"


def advise(f: Figures) -> Advice:
    """The verdict for one cache: pure arithmetic on ``f`` (docs/observability.md)."""
    cached, uncached = expected_latency(f)
    slots = (f.qps * (1 - f.hit_rate) * f.compute_s, f.qps * f.compute_s)
    warnings: list[str] = []
    if f.ttl_s is not None and f.oldest_age_s is not None and f.oldest_age_s > f.ttl_s:
        warnings.append(
            f"an entry is {f.oldest_age_s:.0f}s old, over its {f.ttl_s:.0f}s TTL: "
            "the TTL is not enforced (a bug)"
        )
    warnings.extend(f.notes)

    def verdict(v: Verdict, reason: str, ttl: float | None = None) -> Advice:
        model = f.kind == "model"
        return Advice(
            f,
            v,
            reason,
            cached,
            uncached,
            ttl,
            slots[0] if model else None,
            slots[1] if model else None,
            tuple(warnings),
        )

    if not f.deterministic:
        return verdict(
            "refuse",
            "non-deterministic: a hit could serve a different answer than a computation would",
        )
    if f.qps < MIN_QPS:
        return verdict(
            "kill",
            f"{f.qps:.2g} requests/s is under {MIN_QPS:g}/s: too little traffic for a cache to pay",
        )
    if f.hit_rate < MIN_HIT_RATE:
        return verdict(
            "kill",
            f"hit rate {f.hit_rate:.0%} is under {MIN_HIT_RATE:.0%}: "
            "the lookup and miss overhead are a tax on most requests",
        )
    if cached >= uncached:
        return verdict(
            "kill",
            f"E(cached) {format_ms(cached)} >= "
            f"E(uncached) {format_ms(uncached)}: "
            "the computation is cheaper than the cache",
        )
    reason = f"E(cached) {format_ms(cached)} < E(uncached) {format_ms(uncached)}"
    if f.hit_rate < GOOD_HIT_RATE:
        reason += f" (hit rate {f.hit_rate:.0%} is marginal, under {GOOD_HIT_RATE:.0%})"
    ttl, oldest, mean = f.ttl_s, f.oldest_age_s, f.mean_age_s
    if (
        ttl
        and mean is not None
        and mean < LENGTHEN_MEAN_AGE * ttl
        and f.hit_rate < LENGTHEN_BELOW_HIT_RATE
    ):
        return verdict(
            "lengthen-ttl",
            f"{reason}; entries are rewritten by events (mean age {mean:.0f}s, "
            f"TTL {ttl:.0f}s): the TTL only expires unchanged entries",
            2 * ttl,
        )
    if (
        ttl
        and oldest is not None
        and oldest >= SHORTEN_OLDEST_AGE * ttl
        and f.hit_rate < GOOD_HIT_RATE
    ):
        return verdict(
            "shorten-ttl",
            f"{reason}; entries live out their TTL (oldest {oldest:.0f}s of "
            f"{ttl:.0f}s) yet most reads miss",
            ttl / 2,
        )
    return verdict("keep", reason)


def advise_all(figures: Iterable[Figures]) -> list[Advice]:
    return [advise(f) for f in figures]


# -- figures from Prometheus samples ----------------------------------------------------

Labels = frozenset[tuple[str, str]]
Samples = dict[tuple[str, Labels], float]
"""Sample name and labels -> value, summed over the scraped processes."""


def _sum(samples: Mapping[tuple[str, Labels], float], metric: str, /, **match: str) -> float | None:
    found = [
        v
        for (n, labels), v in samples.items()
        if n == metric and all((k, val) in labels for k, val in match.items())
    ]
    return sum(found) if found else None


def _max(samples: Mapping[tuple[str, Labels], float], metric: str, /, **match: str) -> float | None:
    """A gauge's largest value across the series matching (instances report alike)."""
    found = [
        v
        for (n, labels), v in samples.items()
        if n == metric and all((k, val) in labels for k, val in match.items())
    ]
    return max(found) if found else None


def _values(samples: Mapping[tuple[str, Labels], float], name: str, label: str) -> set[str]:
    return {dict(labels)[label] for (n, labels) in samples if n == name and label in dict(labels)}


def _mean(delta: Samples, total: Samples, histogram: str, /, **match: str) -> float | None:
    """A histogram's mean over the window, else over its whole life, else None."""
    for source in (delta, total):
        count = _sum(source, f"{histogram}_count", **match)
        total_s = _sum(source, f"{histogram}_sum", **match)
        if count and total_s is not None and count > 0:
            return total_s / count
    return None


def figures_from_samples(delta: Samples, latest: Samples, window_s: float) -> list[Figures]:
    """Figures for every feature set and model seen, from counter increases over the
    window (``delta``) and the latest values (``latest``: gauges, lifetime histograms)."""
    out: list[Figures] = []
    # Every cache's figures are read from the same window's samples.
    figures = functools.partial(_figures, delta=delta, latest=latest, window_s=window_s)
    sets = _values(latest, "freshline_api_feature_hits_total", "feature_set") | _values(
        latest, "freshline_api_feature_misses_total", "feature_set"
    )
    for name in sorted(sets):
        hits = _sum(delta, "freshline_api_feature_hits_total", feature_set=name) or 0.0
        misses = _sum(delta, "freshline_api_feature_misses_total", feature_set=name) or 0.0
        out.append(
            figures(
                name,
                "feature_set",
                "feature",
                hits,
                misses,
                deterministic=True,
                ttl=_max(latest, "freshline_feature_ttl_seconds", feature_set=name),
                oldest=_max(latest, "freshline_staleness_oldest_age_seconds", feature_set=name),
                mean=_max(latest, "freshline_staleness_mean_age_seconds", feature_set=name),
            )
        )
    models = _values(latest, "freshline_api_predictions_total", "model") | _values(
        latest, "freshline_model_deterministic", "model"
    )
    for name in sorted(models):
        hits = _sum(delta, "freshline_api_predictions_total", model=name, outcome="hit") or 0.0
        misses = (
            _sum(delta, "freshline_api_predictions_total", model=name, outcome="computed") or 0.0
        )
        flag = _max(latest, "freshline_model_deterministic", model=name)
        out.append(
            figures(name, "model", "model", hits, misses, deterministic=flag is None or flag > 0)
        )
    # The semantic cache of LLM responses: lookup = embedding + search (a hit's whole
    # cost); compute = the generation callers report with each store (generation_ms).
    # Refused (non-deterministic) requests are never cached, so they are not counted.
    for name in sorted(_values(latest, "freshline_semantic_lookups_total", "model")):
        hits = _sum(delta, "freshline_semantic_lookups_total", model=name, outcome="hit") or 0.0
        misses = _sum(delta, "freshline_semantic_lookups_total", model=name, outcome="miss") or 0.0
        out.append(figures(name, "semantic", "semantic", hits, misses, deterministic=True))
    return out


def _figures(
    name: str,
    kind: Kind,
    cache: str,
    hits: float,
    misses: float,
    delta: Samples,
    latest: Samples,
    window_s: float,
    *,
    deterministic: bool,
    ttl: float | None = None,
    oldest: float | None = None,
    mean: float | None = None,
) -> Figures:
    notes: list[str] = []
    lookup = _mean(delta, latest, "freshline_cache_read_seconds", cache=cache, name=name)
    compute = _mean(delta, latest, "freshline_compute_seconds", cache=cache, name=name)
    miss_path = _mean(delta, latest, "freshline_cache_miss_seconds", cache=cache, name=name)
    if lookup is None:
        notes.append("no cache hit measured: lookup cost taken as 0")
        lookup = 0.0
    if compute is None:
        notes.append("no computation measured: compute cost taken as 0")
        compute = 0.0
    overhead = 0.0
    if miss_path is not None:
        overhead = max(0.0, miss_path - compute - lookup)
    else:
        notes.append("no miss measured: miss overhead taken as 0")
    total = hits + misses
    return Figures(
        name=name,
        kind=kind,
        qps=total / window_s if window_s > 0 else 0.0,
        hit_rate=hits / total if total else 0.0,
        lookup_s=lookup,
        compute_s=compute,
        miss_overhead_s=overhead,
        deterministic=deterministic,
        ttl_s=ttl,
        oldest_age_s=oldest,
        mean_age_s=mean,
        window_s=window_s,
        notes=tuple(notes),
    )


def parse_exposition(texts: Iterable[str]) -> Samples:
    """Prometheus text expositions (one per scraped process) merged into one map.

    Counters and histograms add up across processes; gauges (sampled figures every
    API instance reports alike) take the largest value.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, frozenset(s.labels.items()))
                if family.type == "gauge":
                    out[key] = max(out.get(key, s.value), s.value)
                else:
                    out[key] = out.get(key, 0.0) + s.value
    return out


def difference(after: Samples, before: Samples) -> Samples:
    """``after - before`` per series; a series that went down (a restart) counts from 0."""
    out: Samples = {}
    for key, value in after.items():
        prev = before.get(key, 0.0)
        out[key] = value - prev if value >= prev else value
    return out
