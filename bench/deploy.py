"""Deploys: the hit rate across a SCHEMA_VERSION bump, and purging an old namespace.

**Hit rate over time.** A reader thread reads random batches of the hottest users
through :class:`freshline.pipeline.cache.readthrough.ReadThrough` following a private deploy pointer
(:class:`freshline.pipeline.cache.versions.Pointer.scoped`, an in-memory lock holding both
versions),
and records, per call, how many answers were cache hits. Mid-way the version is
bumped, twice in the same run: cold (``flip`` straight to the new version) and warmed
(``start``, warm the hottest users by sampled reads with
:func:`freshline.pipeline.deploy.warm.warm`,
then ``flip``). Each bump gets fresh versions.

**Purge.** An old namespace of N keys is removed by :func:`freshline.pipeline.deploy.purge.purge`
(SCAN + UNLINK batches of 500) in a separate process, while a reader in this process
reads active entries with :class:`freshline.pipeline.cache.client.FeatureClient`; the reader's
latency during the purge is compared with its latency just before and after.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from bench import common
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.hot import HotReads
from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.versions import Pointer, VersionResolver
from freshline.pipeline.core.codec import encode_entry
from freshline.pipeline.core.keys import feature_key
from freshline.pipeline.core.lock import Lock, LockedSet
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.deploy.pointer import flip, start
from freshline.pipeline.deploy.warm import warm
from tests.helpers import REGISTRY

FEATURE_SET = "txn_90d"
READ_BATCH = 50
BIN_S = 0.1


def _lock(*versions: int) -> Lock:
    entry = {fs.name: LockedSet.of(fs) for fs in REGISTRY}
    return Lock(dict.fromkeys(versions, entry))


def _bump(
    ctx: common.Context, *, warmed: bool, hot: int, before_s: float, after_s: float
) -> dict[str, Any]:
    data = ctx.dataset()
    a, b = ctx.schema_version(), ctx.schema_version()
    lock = _lock(a, b)
    pointer = Pointer.scoped(f"bench{ctx.tag}{a}")
    settings = ctx.settings_for(schema_version=a)
    r = ctx.new_redis()
    flip(r, settings, a, lock, pointer=pointer, registry=REGISTRY)
    users = [(data.tenant, str(u)) for u in range(1, min(hot, data.users) + 1)]
    for chunk in common.chunks(users, 500):
        warm(r, ctx.engine, a, FEATURE_SET, [chunk], lock, registry=REGISTRY)
    resolver = VersionResolver(r, settings, pointer=pointer, lock=lock, max_age_s=0.05)
    rt = ReadThrough(
        EntryStore(r, a, registry=REGISTRY),
        ctx.engine,
        early_refresh=False,
        versions=resolver,
        hot=HotReads(r, sample=1),
    )
    refs = [EntityRef(FEATURE_SET, t, e) for t, e in users]
    rng = random.Random(4)
    samples: list[tuple[float, int, int, int]] = []
    stop = threading.Event()
    error: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                got = rt.get_many(rng.sample(refs, READ_BATCH))
                hits = sum(1 for x in got if x.hit)
                samples.append((time.monotonic(), hits, len(got), got[0].schema_version))
        except BaseException as exc:  # reported after the join
            error.append(exc)

    thread = threading.Thread(target=reader, daemon=True)
    t0 = time.monotonic()
    thread.start()
    time.sleep(before_s)  # steady reads before the deploy
    deploy_started = time.monotonic()
    warm_s = 0.0
    if warmed:
        start(r, settings, b, lock, pointer=pointer)
        top = HotReads(r).top(a, FEATURE_SET, [data.tenant], len(users))
        _, warm_s = common.timed(
            lambda: [
                warm(r, ctx.engine, b, FEATURE_SET, [chunk], lock, registry=REGISTRY)
                for chunk in common.chunks(top, 500)
            ]
        )
    flip(r, settings, b, lock, pointer=pointer, registry=REGISTRY)
    flipped = time.monotonic()
    time.sleep(after_s)  # steady reads after the deploy
    stop.set()
    thread.join(30)
    r.delete(pointer.active_key, pointer.next_key)
    if error:
        raise error[0]
    times = np.array([s[0] - t0 for s in samples])
    hits = np.array([s[1] for s in samples])
    total = np.array([s[2] for s in samples])
    versions = np.array([s[3] for s in samples])
    edges = np.arange(0, times.max() + BIN_S, BIN_S)
    series = []
    for lo in edges:
        sel = (times >= lo) & (times < lo + BIN_S)
        if sel.any():
            rate = float(hits[sel].sum() / total[sel].sum())
            series.append((round(float(lo), 2), round(rate, 4)))
    flip_at = flipped - t0
    after = (times >= flip_at) & (versions == b)
    before = times < deploy_started - t0
    first_s = after & (times < flip_at + 1.0)
    return {
        "hot_users": len(users),
        "reads_per_call": READ_BATCH,
        "calls": len(samples),
        "warm_s": round(warm_s, 3),
        "flip_at_s": round(flip_at, 3),
        "deploy_s": round(flipped - deploy_started, 3),
        "hit_rate_before": _rate(hits[before], total[before]),
        "hit_rate_first_second_after": _rate(hits[first_s], total[first_s]),
        "hit_rate_after": _rate(hits[after], total[after]),
        "lowest_bin_after": min((h for t, h in series if t >= flip_at - BIN_S), default=None),
        "db_computations": rt.counters.computed + rt.counters.uncached,
        "series": series,
    }


def _rate(h: np.ndarray, t: np.ndarray) -> float | None:
    return round(float(h.sum() / t.sum()), 4) if t.sum() else None


_PURGE = """
import json, sys, time, redis
from freshline.pipeline.cache.versions import Pointer
from freshline.pipeline.deploy.purge import purge
from freshline.pipeline.core.settings import Settings
s = Settings(redis_url=sys.argv[1], schema_version=int(sys.argv[2]))
r = redis.Redis.from_url(sys.argv[1])
pointer = Pointer.scoped(sys.argv[4])
t0 = time.time()
res = purge(r, s, int(sys.argv[3]), pointer=pointer, count=500)
t1 = time.time()
print(json.dumps({"removed": res.removed, "scans": res.scans, "unlinks": res.unlinks,
                  "start": t0, "end": t1, "done": res.done}))
"""


def _purge(ctx: common.Context, keys: int, quiet_s: float) -> dict[str, Any]:
    data = ctx.dataset()
    active, old = ctx.schema_version(), ctx.schema_version()
    fs = REGISTRY[FEATURE_SET]
    r = ctx.new_redis()
    # The active namespace the reader reads, and an old one of ``keys`` entries.
    readers = [(data.tenant, str(u)) for u in range(1, min(1000, data.users) + 1)]
    from freshline.pipeline.cache.recompute import compute

    store = EntryStore(r, active, registry=REGISTRY)
    for chunk in common.chunks(readers, 500):
        store.write(compute(ctx.engine, fs, list(chunk)))
    payload = encode_entry([0] * len(fs.field_names), old, int(time.time() * 1000), 1)
    pipe = r.pipeline(transaction=False)
    for i in range(keys):
        pipe.set(
            feature_key(old, EntityRef(FEATURE_SET, data.tenant, str(i + 1))), payload, px=3_600_000
        )
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    client = FeatureClient(ctx.new_redis(), active, registry=REGISTRY)
    items = [(FEATURE_SET, t, e) for t, e in readers]
    lat: list[tuple[float, int]] = []
    stop = threading.Event()

    def reader() -> None:
        i = 0
        while not stop.is_set():
            t = common.now_ns()
            client.get(*items[i % len(items)])
            lat.append((time.time(), common.now_ns() - t))
            i += 1

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    time.sleep(quiet_s)  # the reader alone, before the purge
    pointer_scope = f"bench{ctx.tag}purge{old}"
    env = {**os.environ, "PYTHONPATH": str(common.REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _PURGE,
            ctx.settings.redis_url,
            str(active),
            str(old),
            pointer_scope,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,
    )
    info = json.loads(done.stdout.strip().splitlines()[-1])
    time.sleep(quiet_s)  # the reader alone, after the purge
    stop.set()
    thread.join(10)
    during = [ns for at, ns in lat if info["start"] <= at <= info["end"]]
    quiet = [ns for at, ns in lat if at < info["start"] or at > info["end"]]
    seconds = info["end"] - info["start"]
    d, q = common.stats_ns(during), common.stats_ns(quiet)
    return {
        "keys": keys,
        "removed": info["removed"],
        "scans": info["scans"],
        "unlinks": info["unlinks"],
        "seconds": round(seconds, 3),
        "keys_per_s": round(info["removed"] / seconds) if seconds else None,
        "reader_during": d,
        "reader_without": q,
        "p99_during_vs_without": common.ratio(d.get("p99_us", 0), q.get("p99_us", 0)),
        "p50_during_vs_without": common.ratio(d.get("p50_us", 0), q.get("p50_us", 0)),
    }


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    hot, before_s, after_s = (100, 1.0, 1.0) if quick else (2000, 3.0, 5.0)
    cold = _bump(ctx, warmed=False, hot=hot, before_s=before_s, after_s=after_s)
    warmed = _bump(ctx, warmed=True, hot=hot, before_s=before_s, after_s=after_s)
    purge = _purge(ctx, 2_000 if quick else 300_000, 1.0 if quick else 2.0)
    plots = _plot(cold, warmed)
    targets = [
        common.target(
            "warmed bump: hit rate in the first second after the flip",
            warmed["hit_rate_first_second_after"],
            ">=",
            0.99,
            "",
        ),
    ]
    return {
        "parameters": {
            "feature_set": FEATURE_SET,
            "hot_users": hot,
            "reads_per_call": READ_BATCH,
            "bin_s": BIN_S,
        },
        "cold": cold,
        "warmed": warmed,
        "purge": purge,
        "plots": plots,
        "targets": targets,
    }


def _plot(cold: dict[str, Any], warmed: dict[str, Any]) -> list[str]:
    plt = common.pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for label, res, color in (
        ("flip without warming", cold, "tab:red"),
        ("warm, then flip", warmed, "tab:green"),
    ):
        xs = [t - res["flip_at_s"] for t, _ in res["series"]]
        ys = [h for _, h in res["series"]]
        ax.plot(xs, ys, label=label, color=color)
    ax.axvline(0, color="gray", linestyle="--", label="flip")
    ax.set_xlabel("seconds from the flip")
    ax.set_ylabel(f"hit rate per {BIN_S * 1000:.0f} ms")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title("hit rate across a SCHEMA_VERSION bump")
    ax.legend(loc="lower right")
    return [common.save_plot(fig, "deploy_hit_rate")]


def markdown(res: dict[str, Any]) -> str:
    c, w, p = res["cold"], res["warmed"], res["purge"]
    rows = [
        (
            label,
            x["hit_rate_before"],
            x["hit_rate_first_second_after"],
            x["lowest_bin_after"],
            x["hit_rate_after"],
            x["db_computations"],
            x["deploy_s"],
        )
        for label, x in (("flip without warming", c), ("warm, then flip", w))
    ]
    lines = [
        "## deploy: a SCHEMA_VERSION bump, and purging the old namespace",
        "",
        f"A reader thread reads random batches of {res['parameters']['reads_per_call']} of the "
        f"{res['parameters']['hot_users']:,} hottest users (`{res['parameters']['feature_set']}`) "
        "through the read-through that follows the deploy pointer; the version is bumped "
        "mid-way. Hit rate per call, binned every "
        f"{res['parameters']['bin_s'] * 1000:.0f} ms.",
        "",
        common.table(
            [
                "deploy",
                "hit rate before",
                "first second after",
                "lowest 100 ms bin",
                "after (all)",
                "DB computations by readers",
                "deploy took s",
            ],
            rows,
        ),
        "",
    ]
    for plot in res.get("plots", []):
        lines += [f"![hit rate across a deploy]({plot})", ""]
    lines += [
        f"Purge: {p['removed']:,} keys of an old version removed in {p['seconds']} s "
        f"(**{common.fmt(p['keys_per_s'])} keys/s**; {p['scans']} SCAN steps, {p['unlinks']} "
        "UNLINKs of at most 500 keys), in its own process, while a reader in another read "
        "active entries with `FeatureClient.get` (µs):",
        "",
        common.table(
            ["reader", "calls", "p50", "p90", "p99", "max"],
            [
                (name, *(p[reader].get(k) for k in ("n", "p50_us", "p90_us", "p99_us", "max_us")))
                for name, reader in (
                    ("without purge (before and after)", "reader_without"),
                    ("during purge", "reader_during"),
                )
            ],
        ),
        "",
        f"Reader p99 during / without: **{p['p99_during_vs_without']}x** "
        f"(p50 {p['p50_during_vs_without']}x).",
        "",
        common.targets_table(res["targets"]),
    ]
    return "\n".join(lines)
