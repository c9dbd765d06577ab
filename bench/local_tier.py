"""The in-process tier's expiry: how long past an entry's last moment it is still served.

:class:`freshline.pipeline.cache.local.LocalTier` holds an entry no longer than the shortest TTL
Redis may have given it, counted from when the entry was computed. Each round puts an
entry with ``LIFE_MS`` of that life left and reads it in a tight loop until the tier
misses; the observed lifetime runs from just before ``put`` to the first miss.

The reference, interleaved with it round by round (the order alternating), is the same
loop on a bare ``time.monotonic()`` deadline ``LIFE_MS`` ahead: the floor for a reader
that polls a clock on this machine at this moment. "Past" is the observed lifetime
minus ``LIFE_MS``; the ratio of the median lifetimes is the figure to read.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench import common
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.store import TTL_JITTER
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.types import EntityRef, Entry
from tests.helpers import REGISTRY

FEATURE_SET = "txn_90d"
LIFE_MS = 150
VERSION = 1


def _summary(lifetimes_ms: list[float]) -> dict[str, float]:
    arr = np.asarray(lifetimes_ms, dtype=np.float64)
    past = arr - LIFE_MS
    p50, p90, p99 = np.percentile(past, [50, 90, 99])
    return {
        "n": int(arr.size),
        "lifetime_p50_ms": round(float(np.median(arr)), 3),
        "past_p50_ms": round(float(p50), 3),
        "past_p90_ms": round(float(p90), 3),
        "past_p99_ms": round(float(p99), 3),
        "past_max_ms": round(float(past.max()), 3),
    }


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    rounds = 2 if quick else 60
    tenant = ctx.tenant_prefix() + "local"
    ttl_ms = REGISTRY[FEATURE_SET].ttl_s * 1000 * (1 - TTL_JITTER)
    # The TTL rule alone: without the horizons, whose entries the tier holds back until
    # it has read their Redis TTL (these entries are not in Redis).
    unwindowed = Registry(dataclasses.replace(fs, horizon=None) for fs in REGISTRY)
    tier = LocalTier(ctx.redis, max_entries=rounds + 10, registry=unwindowed).start()
    if not tier.wait_live(10):
        raise RuntimeError("the local tier's subscription was not confirmed in 10 s")

    def with_tier(i: int) -> float:
        ref = EntityRef(FEATURE_SET, tenant, str(i))
        computed_at = time.time_ns() // 1_000_000 - int(ttl_ms - LIFE_MS)
        started = common.now_ns()
        if not tier.put(ref, Entry({"txn_count": 1}, VERSION, computed_at, i), tier.token()):
            raise RuntimeError("the tier refused a put with life left")
        while tier.get(ref, VERSION) is not None:
            pass  # polling as fast as a reader can: the figure is the first miss
        return (common.now_ns() - started) / 1e6

    def reference(_: int) -> float:
        started = common.now_ns()
        deadline = time.monotonic() + LIFE_MS / 1000
        while time.monotonic() < deadline:
            pass
        return (common.now_ns() - started) / 1e6

    candidates: dict[str, Callable[[int], float]] = {
        "tier": with_tier,
        "monotonic deadline": reference,
    }
    lifetimes: dict[str, list[float]] = {name: [] for name in candidates}
    try:
        for r in range(rounds):
            order = list(candidates) if r % 2 == 0 else list(reversed(candidates))
            for name in order:
                lifetimes[name].append(candidates[name](r))
        expired = tier.stats.expired
    finally:
        tier.close()
    out = {name: _summary(values) for name, values in lifetimes.items()}
    tier_s, ref_s = out["tier"], out["monotonic deadline"]
    ratio = common.ratio(tier_s["lifetime_p50_ms"], ref_s["lifetime_p50_ms"])
    return {
        "parameters": {
            "life_ms": LIFE_MS,
            "rounds": rounds,
            "feature_set": FEATURE_SET,
            "expired_counted": expired,
        },
        "results": out,
        "lifetime_ratio_p50": ratio,
        "targets": [
            common.target(
                "tier: p99 served past the entry's last moment",
                tier_s["past_p99_ms"],
                "<=",
                50,
                "ms",
            )
        ],
    }


def markdown(res: dict[str, Any]) -> str:
    p = res["parameters"]
    rows = [
        (
            name,
            r["n"],
            r["lifetime_p50_ms"],
            r["past_p50_ms"],
            r["past_p90_ms"],
            r["past_p99_ms"],
            r["past_max_ms"],
        )
        for name, r in res["results"].items()
    ]
    return "\n".join(
        [
            "## local_tier: how long past its last moment the in-process tier serves an entry",
            "",
            f"An entry put with {p['life_ms']} ms of life left (by the shortest TTL Redis may "
            "have given it) is read in a tight loop until the tier misses; the reference is "
            "the same loop on a bare monotonic deadline as far ahead, interleaved round by "
            f"round ({p['rounds']} rounds each). Times in ms.",
            "",
            common.table(
                [
                    "candidate",
                    "rounds",
                    "median lifetime",
                    "past: median",
                    "past: p90",
                    "past: p99",
                    "past: max",
                ],
                rows,
            ),
            "",
            f"Median lifetime, tier / reference: {common.fmt(res['lifetime_ratio_p50'], 3)}x.",
            "",
            common.targets_table(res["targets"]),
        ]
    )
