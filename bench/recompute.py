"""Recompute: entities/s of the set-based query against one query per entity; read-through.

For each feature set, a batch of 500 users is computed by
:func:`freshline.pipeline.cache.recompute.compute` (one watermark read, one set-based query) and, in
the same round, by the same feature query run once per entity on one connection (the
way a per-key cache fill would do it). Rounds alternate which goes first and take a
fresh sample of users each time, so both meet the same cache state.

Read-through (:meth:`freshline.pipeline.cache.readthrough.ReadThrough.get`): a hit against a raw
redis-py GET of the same key, and a miss (MGET, lease, query, guarded write) against
the bare :func:`compute` of the same single entity, interleaved.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
from sqlalchemy.engine import Engine

from bench import common
from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.features import FeatureSet
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY

BATCH = 500


def _per_entity(engine: Engine, fs: FeatureSet, refs: list[tuple[str, str]]) -> int:
    found = 0
    with engine.connect() as conn:
        for tenant, entity in refs:
            rows = conn.execute(
                fs.statement, {"tenants": [tenant], "ids": [int(entity)], "as_of": None}
            ).all()
            found += len(rows)
        conn.rollback()
    return found


def _batched(ctx: common.Context, rounds: int, rng: random.Random) -> dict[str, Any]:
    data = ctx.dataset()
    out: dict[str, Any] = {}
    for fs in REGISTRY:
        rates: dict[str, list[float]] = {"batched": [], "per_entity": []}
        for r in range(rounds):
            users = rng.sample(range(1, data.users + 1), BATCH)
            refs = [(data.tenant, str(u)) for u in users]
            order = ["batched", "per_entity"] if r % 2 == 0 else ["per_entity", "batched"]
            for how in order:
                if how == "batched":
                    _, took = common.timed(functools.partial(compute, ctx.engine, fs, refs))
                else:
                    _, took = common.timed(functools.partial(_per_entity, ctx.engine, fs, refs))
                rates[how].append(BATCH / took)
        batched = float(np.median(rates["batched"]))
        single = float(np.median(rates["per_entity"]))
        out[fs.name] = {
            "batched_entities_per_s": round(batched),
            "per_entity_entities_per_s": round(single),
            "batch_ms": round(BATCH / batched * 1000, 1),
            "per_entity_total_ms": round(BATCH / single * 1000, 1),
            "ratio": common.ratio(batched, single),
        }
    return out


def _read_through(ctx: common.Context, n: int, rng: random.Random) -> dict[str, Any]:
    data = ctx.dataset()
    version = ctx.schema_version()
    store = EntryStore(ctx.redis, version, registry=REGISTRY)
    rt = ReadThrough(store, ctx.engine, early_refresh=False)
    out: dict[str, Any] = {}
    for fs in REGISTRY:
        users = rng.sample(range(1, data.users + 1), 2 * n)
        refs = [EntityRef(fs.name, data.tenant, str(u)) for u in users]
        keys = [store.key(r) for r in refs]
        # Misses, interleaved one by one with the bare computation of the same entity.
        miss_ns: list[int] = []
        bare_ns: list[int] = []
        for i, ref in enumerate(refs[:n]):
            pair = [("miss", ref), ("bare", refs[n + i])]
            if i % 2:
                pair.reverse()
            for how, r in pair:
                t0 = common.now_ns()
                if how == "miss":
                    result = rt.get(r)
                    if result.source != "computed":
                        raise RuntimeError(f"expected a miss, got {result.source}")
                    miss_ns.append(common.now_ns() - t0)
                else:
                    compute(ctx.engine, fs, [(r.tenant, r.entity)])
                    bare_ns.append(common.now_ns() - t0)
        hit_refs = refs[:n]
        it = iter(range(10**9))

        def hit(hit_refs: list[EntityRef] = hit_refs, it: Any = it) -> None:
            rt.get(hit_refs[next(it) % len(hit_refs)])

        def raw_get(keys: list[str] = keys[:n], it: Any = it) -> None:
            ctx.redis.get(keys[next(it) % len(keys)])

        hits = common.measure({"hit": hit, "raw_get": raw_get}, rounds=5, calls=max(200, n * 2))
        miss = common.stats_ns(miss_ns)
        bare = common.stats_ns(bare_ns)
        out[fs.name] = {
            "hit": hits["hit"],
            "raw_get": hits["raw_get"],
            "miss": miss,
            "bare_compute": bare,
            "hit_vs_raw_get_p50": common.ratio(hits["hit"]["p50_us"], hits["raw_get"]["p50_us"]),
            "miss_vs_bare_compute_p50": common.ratio(miss["p50_us"], bare["p50_us"]),
        }
    return out


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    rng = random.Random(11)
    rounds, n = (1, 10) if quick else (5, 200)
    batched = _batched(ctx, rounds, rng)
    rt = _read_through(ctx, n, rng)
    targets = [
        common.target(
            f"{name}: batch of {BATCH} vs one query per entity", r["ratio"], ">=", 10, "x"
        )
        for name, r in batched.items()
    ]
    data = ctx.dataset()
    return {
        "parameters": {
            "batch": BATCH,
            "rounds": rounds,
            "read_through_samples": n,
            "dataset": {"users": data.users, "transactions": data.transactions},
        },
        "batched": batched,
        "read_through": rt,
        "targets": targets,
    }


def markdown(res: dict[str, Any]) -> str:
    p = res["parameters"]
    rows = [
        (
            name,
            r["batched_entities_per_s"],
            r["per_entity_entities_per_s"],
            f"{r['ratio']}x",
            r["batch_ms"],
            r["per_entity_total_ms"],
        )
        for name, r in res["batched"].items()
    ]
    rt_rows = [
        (
            name,
            r["hit"]["p50_us"],
            r["hit"]["p99_us"],
            r["raw_get"]["p50_us"],
            f"{r['hit_vs_raw_get_p50']}x",
            r["miss"]["p50_us"],
            r["miss"]["p99_us"],
            r["bare_compute"]["p50_us"],
            f"{r['miss_vs_bare_compute_p50']}x",
        )
        for name, r in res["read_through"].items()
    ]
    return "\n".join(
        [
            "## recompute: set-based batches against one query per entity",
            "",
            f"Data set: {p['dataset']['users']:,} users, {p['dataset']['transactions']:,} "
            f"transactions. A batch of {p['batch']} random users per round, {p['rounds']} "
            "interleaved rounds (median).",
            "",
            common.table(
                [
                    "feature set",
                    "batched entities/s",
                    "per-entity entities/s",
                    "ratio",
                    "batch ms",
                    "per-entity ms (500)",
                ],
                rows,
            ),
            "",
            f"Read-through `ReadThrough.get` for one entity ({p['read_through_samples']} samples "
            "each; µs): a hit against a raw GET of the same key, and a miss (MGET, lease, query, "
            "guarded write) against the bare `compute` of one entity.",
            "",
            common.table(
                [
                    "feature set",
                    "hit p50",
                    "hit p99",
                    "raw GET p50",
                    "hit/GET",
                    "miss p50",
                    "miss p99",
                    "compute p50",
                    "miss/compute",
                ],
                rt_rows,
            ),
            "",
            common.targets_table(res["targets"]),
        ]
    )
