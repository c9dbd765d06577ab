"""The API's metrics gathered in process (:class:`freshline.pipeline.api.metrics.Pending`) and
written to prometheus_client in bulk: the same figures as one update per request."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram

from freshline.pipeline.api.metrics import BUCKETS, Pending
from tests.helpers import wait_until


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_a_flush_writes_what_direct_updates_would_have() -> None:
    direct, deferred = CollectorRegistry(), CollectorRegistry()
    made = {}
    for name, registry in (("direct", direct), ("deferred", deferred)):
        made[name] = (
            Histogram("req_seconds", "h", ["route"], buckets=BUCKETS, registry=registry),
            Counter("hits", "c", ["set"], registry=registry),
        )
    pending = Pending(interval_s=3600)  # flushed by hand here
    # Values on bucket bounds, between them, zero and past the last bound.
    values = [0.0, 0.0002, 0.0003, 0.001, 0.0011, 2.5, 7.0, 0.0002, 1e-9]
    for route in ("a", "b"):
        for v in values:
            made["direct"][0].labels(route).observe(v)
            pending.observe(made["deferred"][0].labels(route), v)
        made["direct"][1].labels(route).inc(3)
        pending.inc(made["deferred"][1].labels(route), 3)
        pending.inc(made["deferred"][1].labels(route))
        made["direct"][1].labels(route).inc()

    before = samples(deferred)
    assert all(v == 0 for (name, _), v in before.items()), "nothing is written before a flush"
    pending.flush()
    got, want = samples(deferred), samples(direct)
    assert got.keys() == want.keys()
    for sample, value in want.items():
        assert abs(got[sample] - value) < 1e-12, sample
    pending.flush()  # nothing new: nothing written twice
    assert samples(deferred) == got


def test_the_background_thread_flushes_and_nothing_is_lost_to_concurrency() -> None:
    registry = CollectorRegistry()
    counter = Counter("served", "c", registry=registry)
    hist = Histogram("lat_seconds", "h", buckets=BUCKETS, registry=registry)
    pending = Pending(interval_s=0.01)
    per_thread, threads = 5000, 4

    def work() -> None:
        for _ in range(per_thread):
            pending.inc(counter)
            pending.observe(hist, 0.003)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    total = per_thread * threads
    # Written by the thread, not by a flush of ours.
    assert wait_until(lambda: registry.get_sample_value("served_total") == total)
    assert wait_until(lambda: registry.get_sample_value("lat_seconds_count") == total)
    assert registry.get_sample_value("lat_seconds_bucket", {"le": "0.002"}) == 0
    assert registry.get_sample_value("lat_seconds_bucket", {"le": "0.005"}) == total
