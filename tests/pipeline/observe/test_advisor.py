"""The cache advisor: verdicts on constructed workloads, and figures from real scrapes."""

from __future__ import annotations

import pytest

from freshline.pipeline.observe.advisor import (
    Figures,
    advise,
    difference,
    expected_latency,
    figures_from_samples,
    parse_exposition,
)


def workload(**overrides: object) -> Figures:
    base: dict[str, object] = dict(
        name="txn_90d",
        kind="feature_set",
        qps=100.0,
        hit_rate=0.8,
        lookup_s=0.0005,
        compute_s=0.05,
        miss_overhead_s=0.001,
    )
    base.update(overrides)
    return Figures(**base)  # type: ignore[arg-type]


def test_a_31_percent_hit_rate_on_a_2ms_computation_with_3ms_miss_overhead_is_killed() -> None:
    f = workload(hit_rate=0.31, compute_s=0.002, miss_overhead_s=0.003, lookup_s=0.0005)
    advice = advise(f)
    assert advice.verdict == "kill"
    # The arithmetic behind it: 0.5 + 0.69 * (2 + 3) = 3.95 ms against 2 ms.
    assert advice.cached_s == pytest.approx(0.0005 + 0.69 * 0.005)
    assert advice.uncached_s == pytest.approx(0.002)
    assert advice.saving_s < 0


def test_a_45_percent_hit_rate_on_a_220ms_computation_is_kept() -> None:
    advice = advise(workload(hit_rate=0.45, compute_s=0.220, miss_overhead_s=0.003))
    assert advice.verdict == "keep"
    assert advice.cached_s == pytest.approx(0.0005 + 0.55 * 0.223)
    assert advice.saving_s > 0.09


@pytest.mark.parametrize(
    "others",
    [
        dict(hit_rate=0.99, compute_s=2.0),
        dict(hit_rate=0.45, compute_s=0.220),
        dict(hit_rate=0.0, compute_s=0.001),
    ],
)
def test_two_requests_per_second_is_killed_whatever_the_rest(others: dict[str, float]) -> None:
    advice = advise(workload(qps=2.0, **others))
    assert advice.verdict == "kill"
    assert "requests/s" in advice.reason


def test_a_low_hit_rate_is_a_tax_even_when_the_arithmetic_favours_the_cache() -> None:
    f = workload(hit_rate=0.25, compute_s=1.0)
    cached, uncached = expected_latency(f)
    assert cached < uncached
    assert advise(f).verdict == "kill"


def test_a_non_deterministic_computation_is_refused_first() -> None:
    advice = advise(workload(kind="model", name="m", deterministic=False, qps=1.0))
    assert advice.verdict == "refuse"


def test_ttl_advice_follows_the_sampled_ages() -> None:
    # Entries rewritten by events long before the TTL: the TTL only expires unchanged ones.
    young = advise(workload(hit_rate=0.6, ttl_s=3600, mean_age_s=300, oldest_age_s=900))
    assert young.verdict == "lengthen-ttl" and young.suggested_ttl_s == 7200
    # Entries live out the TTL and most reads still miss.
    old = advise(
        workload(hit_rate=0.35, compute_s=0.2, ttl_s=3600, mean_age_s=1800, oldest_age_s=3500)
    )
    assert old.verdict == "shorten-ttl" and old.suggested_ttl_s == 1800
    settled = advise(workload(hit_rate=0.7, ttl_s=3600, mean_age_s=1800, oldest_age_s=3500))
    assert settled.verdict == "keep" and settled.suggested_ttl_s is None


def test_an_entry_older_than_its_ttl_is_reported_as_a_bug() -> None:
    advice = advise(workload(ttl_s=600, oldest_age_s=5000, mean_age_s=300))
    assert any("not enforced" in w for w in advice.warnings)


def test_model_slots_follow_littles_law() -> None:
    advice = advise(workload(kind="model", name="fraud", qps=400.0, hit_rate=0.75, compute_s=0.05))
    assert advice.slots_uncached == pytest.approx(400 * 0.05)
    assert advice.slots_cached == pytest.approx(400 * 0.25 * 0.05)
    assert advise(workload()).slots_cached is None  # feature sets have no serving slots


BEFORE = """
# TYPE freshline_api_feature_hits_total counter
freshline_api_feature_hits_total{feature_set="geo",tier="redis"} 10
# TYPE freshline_api_feature_misses_total counter
freshline_api_feature_misses_total{feature_set="geo"} 10
# TYPE freshline_cache_read_seconds histogram
freshline_cache_read_seconds_count{cache="feature",name="geo"} 10
freshline_cache_read_seconds_sum{cache="feature",name="geo"} 0.01
# TYPE freshline_compute_seconds histogram
freshline_compute_seconds_count{cache="feature",name="geo"} 10
freshline_compute_seconds_sum{cache="feature",name="geo"} 1.0
# TYPE freshline_cache_miss_seconds histogram
freshline_cache_miss_seconds_count{cache="feature",name="geo"} 10
freshline_cache_miss_seconds_sum{cache="feature",name="geo"} 1.05
"""

AFTER = """
# TYPE freshline_api_feature_hits_total counter
freshline_api_feature_hits_total{feature_set="geo",tier="redis"} 610
freshline_api_feature_hits_total{feature_set="geo",tier="local"} 200
# TYPE freshline_api_feature_misses_total counter
freshline_api_feature_misses_total{feature_set="geo"} 210
# TYPE freshline_cache_read_seconds histogram
freshline_cache_read_seconds_count{cache="feature",name="geo"} 810
freshline_cache_read_seconds_sum{cache="feature",name="geo"} 0.81
# TYPE freshline_compute_seconds histogram
freshline_compute_seconds_count{cache="feature",name="geo"} 210
freshline_compute_seconds_sum{cache="feature",name="geo"} 9.0
# TYPE freshline_cache_miss_seconds histogram
freshline_cache_miss_seconds_count{cache="feature",name="geo"} 210
freshline_cache_miss_seconds_sum{cache="feature",name="geo"} 9.6
# TYPE freshline_feature_ttl_seconds gauge
freshline_feature_ttl_seconds{feature_set="geo"} 86400
# TYPE freshline_staleness_oldest_age_seconds gauge
freshline_staleness_oldest_age_seconds{feature_set="geo"} 80000
# TYPE freshline_staleness_mean_age_seconds gauge
freshline_staleness_mean_age_seconds{feature_set="geo"} 43000
# TYPE freshline_model_deterministic gauge
freshline_model_deterministic{model="dice"} 0
"""


def test_figures_from_two_scrapes_a_window_apart() -> None:
    before, after = parse_exposition([BEFORE]), parse_exposition([AFTER])
    figures = {f.name: f for f in figures_from_samples(difference(after, before), after, 100)}
    geo = figures["geo"]
    assert geo.qps == pytest.approx(10.0)  # (800 hits + 200 misses) / 100 s
    assert geo.hit_rate == pytest.approx(0.8)
    assert geo.lookup_s == pytest.approx(0.001)
    assert geo.compute_s == pytest.approx(0.04)
    # The miss path, less the computation and the lookup.
    assert geo.miss_overhead_s == pytest.approx(8.55 / 200 - 0.04 - 0.001)
    assert (geo.ttl_s, geo.oldest_age_s, geo.mean_age_s) == (86400, 80000, 43000)
    assert advise(geo).verdict == "keep"
    assert advise(figures["dice"]).verdict == "refuse"


def test_scrapes_of_several_processes_add_counters_and_not_gauges() -> None:
    merged = parse_exposition([AFTER, AFTER])
    hits = merged[
        ("freshline_api_feature_hits_total", frozenset({("feature_set", "geo"), ("tier", "local")}))
    ]
    ttl = merged[("freshline_feature_ttl_seconds", frozenset({("feature_set", "geo")}))]
    assert (hits, ttl) == (400, 86400)


SEMANTIC = """
# TYPE freshline_semantic_lookups_total counter
freshline_semantic_lookups_total{{model="support-bot",outcome="hit"}} {hits}
freshline_semantic_lookups_total{{model="support-bot",outcome="miss"}} {misses}
freshline_semantic_lookups_total{{model="support-bot",outcome="refused"}} {refused}
# TYPE freshline_cache_read_seconds histogram
freshline_cache_read_seconds_count{{cache="semantic",name="support-bot"}} {hits}
freshline_cache_read_seconds_sum{{cache="semantic",name="support-bot"}} {read}
# TYPE freshline_compute_seconds histogram
freshline_compute_seconds_count{{cache="semantic",name="support-bot"}} {misses}
freshline_compute_seconds_sum{{cache="semantic",name="support-bot"}} {compute}
"""


def test_the_semantic_cache_gets_a_verdict_from_its_own_figures() -> None:
    before = parse_exposition([SEMANTIC.format(hits=0, misses=0, refused=0, read=0, compute=0)])
    after = parse_exposition(
        [SEMANTIC.format(hits=400, misses=600, refused=500, read=8.0, compute=480.0)]
    )
    [bot] = figures_from_samples(difference(after, before), after, 100)
    assert (bot.name, bot.kind) == ("support-bot", "semantic")
    assert bot.qps == pytest.approx(10.0)  # refused requests are not cache traffic
    assert bot.hit_rate == pytest.approx(0.4)
    assert (bot.lookup_s, bot.compute_s) == pytest.approx((0.02, 0.8))
    assert advise(bot).verdict == "keep"  # 20 ms + 0.6 x 800 ms < 800 ms
