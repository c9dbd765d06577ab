"""Derived incremental maintenance against the fraud example's hand-written path.

``txn_90d``'s aggregates declared with ``freshline.Aggregations(..., incremental=True)``
over the same ``transactions`` (count, sum, mean, max, stddev, two distinct counts, the
latest time; the declaration leaves mean and stddev unrounded and max null over no
rows, so its values are compared field by field only where they mean the same), its
partials and triggers installed for the run and removed after:

1. **Install**: creating the partials and filling them from every row, under ``LOCK
   TABLE transactions IN SHARE MODE`` (rows/s).
2. **Recompute by entity size**: the busiest and the median user, one per ``compute``,
   on the derived path, the hand-written incremental path and the full query,
   interleaved round by round; head / median per path, derived / hand-written.
3. **A batch of 500 users** on each path (p50 ms), derived / hand-written.
4. **Write cost**: COPY and single-row INSERTs with the derived triggers on and off,
   the hand-written triggers off in both modes, interleaved (the derived triggers' own
   cost; the hand-written path's is :mod:`bench.incremental`'s).

Run alone: ``.venv/bin/python -m bench.derived [--quick]``; or ``python -m bench --only
derived``.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

import numpy as np
import orjson
import sqlalchemy as sa

from bench import common, incremental
from freshline import Aggregations, Table, agg
from pipeline.cache.recompute import compute
from pipeline.core.features import FeatureSet
from pipeline.core.maintenance import DerivedPath
from pipeline.core.repository import REGISTRY

TARGET_HEAD_RATIO = 2.0
TARGET_VS_HAND = 1.2
TARGET_WRITE_COST = 1.30
BATCH = 500
SAME_MEANING = ("txn_count", "txn_sum", "distinct_merchants", "distinct_devices", "last_txn_at")


def declaration() -> FeatureSet:
    """txn_90d's aggregates, declared."""
    user = REGISTRY["txn_90d"].entity
    transactions = Table("transactions", entities={user: "user_id"})
    return Aggregations(
        "txn_90d_derived",
        entity=user,
        table=transactions,
        time="created_at",
        window="90d",
        incremental=True,
        aggs=[
            agg.count(name="txn_count"),
            agg.sum("amount", name="txn_sum"),
            agg.mean("amount", name="txn_mean"),
            agg.max("amount", name="txn_max"),
            agg.stddev("amount", name="txn_std"),
            agg.count_distinct("merchant_id", name="distinct_merchants"),
            agg.count_distinct("device_id", name="distinct_devices"),
            agg.last("created_at", name="last_txn_at"),
        ],
    )


def _path(fs: FeatureSet) -> DerivedPath:
    assert isinstance(fs.maintenance, DerivedPath)
    return fs.maintenance


def _uninstall(ctx: common.Context, path: DerivedPath) -> None:
    tables = ", ".join([path.days, *(path.members(s) for s in path.distinct)])
    with ctx.engine.begin() as conn:
        for op in "iudt":
            conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {path.trigger}_{op} ON transactions"))
            conn.execute(sa.text(f"DROP FUNCTION IF EXISTS freshline.{path.prefix}_{op}()"))
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {tables}"))


def _derived_triggers(ctx: common.Context, path: DerivedPath, on: bool) -> None:
    verb = "ENABLE" if on else "DISABLE"
    with ctx.engine.begin() as conn:
        for op in "iud":
            conn.execute(sa.text(f"ALTER TABLE transactions {verb} TRIGGER {path.trigger}_{op}"))


def _recompute(
    ctx: common.Context,
    derived: FeatureSet,
    tenant: str,
    who: dict[str, Any],
    rounds: int,
    calls: int,
) -> dict[str, Any]:
    hand = REGISTRY["txn_90d"]
    candidates = {}
    for role in ("head", "median"):
        ref = [(tenant, who[role]["user"])]
        candidates[f"derived_{role}"] = lambda ref=ref: compute(
            ctx.engine, derived, ref, path="incremental"
        )
        candidates[f"hand_{role}"] = lambda ref=ref: compute(
            ctx.engine, hand, ref, path="incremental"
        )
        candidates[f"full_{role}"] = lambda ref=ref: compute(ctx.engine, hand, ref, path="full")
    res = common.measure(candidates, rounds=rounds, calls=calls, warmup=3)
    p50 = {name: r["p50_us"] / 1000 for name, r in res.items()}
    return {
        "p50_ms": {k: round(v, 2) for k, v in p50.items()},
        "head_vs_median": {
            path: common.ratio(p50[f"{path}_head"], p50[f"{path}_median"])
            for path in ("derived", "hand", "full")
        },
        "derived_vs_hand_head": common.ratio(p50["derived_head"], p50["hand_head"]),
    }


def _batch(
    ctx: common.Context, derived: FeatureSet, tenant: str, rounds: int, calls: int
) -> dict[str, Any]:
    with ctx.engine.connect() as conn:
        users = (
            conn.execute(
                sa.text("SELECT DISTINCT user_id FROM transactions WHERE tenant_id = :t"),
                {"t": tenant},
            )
            .scalars()
            .all()
        )
    refs = [
        (tenant, str(u)) for u in random.Random(7).sample(sorted(users), min(BATCH, len(users)))
    ]
    hand = REGISTRY["txn_90d"]
    res = common.measure(
        {
            "derived": lambda: compute(ctx.engine, derived, refs, path="incremental"),
            "hand": lambda: compute(ctx.engine, hand, refs, path="incremental"),
        },
        rounds=rounds,
        calls=calls,
        warmup=1,
    )
    p50 = {name: r["p50_us"] / 1000 for name, r in res.items()}
    return {
        "entities": len(refs),
        "p50_ms": {k: round(v, 2) for k, v in p50.items()},
        "derived_vs_hand": common.ratio(p50["derived"], p50["hand"]),
    }


def _agreement(
    ctx: common.Context, derived: FeatureSet, tenant: str, who: dict[str, Any]
) -> dict[str, Any]:
    """Derived against full on the declaration, and against txn_90d where they mean the same."""
    refs = [(tenant, who[r]["user"]) for r in ("head", "median")]
    inc = compute(ctx.engine, derived, refs, path="incremental").values
    full = compute(ctx.engine, derived, refs, path="full").values
    hand = compute(ctx.engine, REGISTRY["txn_90d"], refs, path="incremental").values
    return {
        "derived_equals_its_full_query": all(inc[r] == full[r] for r in refs),
        "equals_txn_90d_where_same_meaning": all(
            inc[r][f] == hand[r][f] for r in refs for f in SAME_MEANING
        ),
    }


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    data = ctx.dataset()
    who = incremental._head_and_median(ctx, data.tenant)
    rounds, calls = (2, 5) if quick else (5, 20)
    derived = declaration()
    path = _path(derived)
    with ctx.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT count(*) FROM transactions")).scalar_one()
    _uninstall(ctx, path)
    scratch: list[str] = []
    try:
        with ctx.engine.begin() as conn:
            _, install_s = common.timed(lambda: path.install(conn))
        incremental.BUCKETS.fold_all(ctx.engine, max_keys=incremental.FOLD_USERS)
        agreement = _agreement(ctx, derived, data.tenant, who)
        recompute = _recompute(ctx, derived, data.tenant, who, rounds, calls)
        batch = _batch(ctx, derived, data.tenant, rounds, max(2, calls // 4))
        sample, w_rounds, i_rounds, block = (2_000, 2, 8, 25) if quick else (20_000, 4, 30, 50)
        incremental._triggers(ctx, False)
        try:
            _, copy_rates, insert_ns = incremental.write_rounds(
                ctx,
                data.tenant,
                sample,
                w_rounds,
                i_rounds,
                block,
                lambda on: _derived_triggers(ctx, path, on),
                scratch,
            )
        finally:
            incremental._triggers(ctx, True)
    finally:
        _uninstall(ctx, path)
        incremental._cleanup(ctx, scratch)
    copy = {m: round(float(np.median(v))) for m, v in copy_rates.items()}
    ins = {m: common.stats_ns(v) for m, v in insert_ns.items()}
    writes = {
        "copy_rows_per_s": copy,
        "copy_cost": common.ratio(copy["without"], copy["with"]),
        "insert_us": ins,
        "insert_p50_cost": common.ratio(ins["with"]["p50_us"], ins["without"]["p50_us"]),
        "sample_rows": sample,
        "inserts_per_mode": i_rounds * block,
    }
    targets = [
        common.target(
            "derived path: busiest user vs median",
            recompute["head_vs_median"]["derived"],
            "<=",
            TARGET_HEAD_RATIO,
            "x",
        ),
        common.target(
            f"derived vs hand-written path: batch of {batch['entities']}",
            batch["derived_vs_hand"],
            "<=",
            TARGET_VS_HAND,
            "x",
        ),
        common.target(
            "COPY time with derived triggers vs without",
            writes["copy_cost"],
            "<=",
            TARGET_WRITE_COST,
            "x",
        ),
        common.target(
            "single-row INSERT p50 with derived triggers vs without",
            writes["insert_p50_cost"],
            "<=",
            TARGET_WRITE_COST,
            "x",
        ),
    ]
    return {
        "parameters": {"rounds": rounds, "calls": calls, "rows": rows},
        "entities": who,
        "install_s": round(install_s, 2),
        "install_rows_per_s": round(rows / install_s) if install_s else None,
        "agreement": agreement,
        "recompute": recompute,
        "batch": batch,
        "writes": writes,
        "targets": targets,
    }


def markdown(res: dict[str, Any]) -> str:
    who, r, b, w = res["entities"], res["recompute"], res["batch"], res["writes"]
    ms, agree = r["p50_ms"], res["agreement"]
    rows = f"{res['parameters']['rows']:,}"
    install = f"{res['install_s']} s ({res['install_rows_per_s']:,} rows/s)"
    same = ", ".join(SAME_MEANING)
    paths = (("derived", "derived"), ("hand-written", "hand"), ("full", "full"))
    return "\n".join(
        [
            "## derived: maintenance derived from a declaration, against the hand-written",
            "",
            "txn_90d's aggregates declared with `Aggregations(..., incremental=True)` over the "
            f"same {rows} transactions. Installing it (partials filled from every row under a "
            f"SHARE lock) took {install}. The derived path equals its defining query for the "
            f"head and median user: {agree['derived_equals_its_full_query']}; it equals "
            f"txn_90d's hand-written values where they mean the same ({same}): "
            f"{agree['equals_txn_90d_where_same_meaning']}.",
            "",
            f"Busiest user {who['head']['rows']:,} rows, median {who['median']['rows']:,}; "
            "p50 ms of one `compute`, interleaved:",
            "",
            common.table(
                ["path", "head", "median", "head/median"],
                [
                    (name, ms[f"{k}_head"], ms[f"{k}_median"], f"{r['head_vs_median'][k]}x")
                    for name, k in paths
                ],
            ),
            "",
            f"Derived / hand-written for the busiest user: {r['derived_vs_hand_head']}x. "
            f"A batch of {b['entities']} users: derived {b['p50_ms']['derived']} ms, "
            f"hand-written {b['p50_ms']['hand']} ms ({b['derived_vs_hand']}x).",
            "",
            f"Writes ({w['sample_rows']:,} rows by COPY per round; "
            f"{w['inserts_per_mode']:,} single-row INSERTs per mode), derived triggers on and "
            "off, hand-written triggers off in both:",
            "",
            common.table(
                ["", "with derived triggers", "without", "cost"],
                [
                    (
                        "COPY rows/s",
                        w["copy_rows_per_s"]["with"],
                        w["copy_rows_per_s"]["without"],
                        f"{w['copy_cost']}x",
                    ),
                    (
                        "INSERT p50 µs",
                        w["insert_us"]["with"]["p50_us"],
                        w["insert_us"]["without"]["p50_us"],
                        f"{w['insert_p50_cost']}x",
                    ),
                ],
            ),
            "",
            common.targets_table(res["targets"]),
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.derived", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    res = common.run_standalone(run, args.quick)
    print(orjson.dumps(res, option=orjson.OPT_INDENT_2).decode() if args.json else markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
