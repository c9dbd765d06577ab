"""Incremental aggregates: head against median entity, and what the triggers cost writes.

1. **Recompute cost by entity size.** The data set's busiest user (the head of the
   Zipf activity) and a median user (the median row count among users with rows),
   each recomputed alone by :func:`freshline.pipeline.cache.recompute.compute` on the full path
   and on the incremental one, the four candidates interleaved round by round
   (:func:`bench.common.measure`). The figures to read: head / median per path. Twice:
   with every change folded, and with changes logged (``PENDING_HEAD`` new rows of the
   busiest user and one of the median user, what a consumer recomputing just-written
   users meets between folds); then those rows are deleted and folded away again.
2. **Write amplification.** The same transaction rows loaded with COPY into fresh
   tenants with the derived path's triggers enabled and disabled (``ALTER TABLE ...
   DISABLE TRIGGER``), interleaved; and single-row INSERTs (autocommit, one transaction
   each, ``synchronous_commit`` as configured) with and without, interleaved in blocks.
   The triggers only log the (user, day)s a statement changed; the work they defer is
   measured next: the fold of every day the "with" rounds logged, ``FOLD_USERS`` per
   transaction (days folded per second, and COPY plus its fold against COPY without).
   The rows written without triggers are removed with the triggers off, with their
   tenants' partials and log, so the partials stay exact.
3. **The insert trigger's rights.** The same writes, triggers on, with the insert
   trigger as freshline makes it (SECURITY DEFINER) and as it was before (the writer's
   rights), interleaved.

txn_90d's and geo's paths are derived from their declarations
(:mod:`freshline.pipeline.core.maintenance`); the write cost is that of both paths' triggers.

Run alone: ``.venv/bin/python -m bench.incremental [--quick] [--users N
--transactions N]``; or as part of ``python -m bench``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import sqlalchemy as sa

from bench import common
from bench.seed import ROW_COLUMNS, sample_rows
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.core.features import Path
from freshline.pipeline.core.maintenance import DerivedPath
from tests.helpers import REGISTRY

# The derived incremental paths (txn_90d's and geo's), each with triggers on transactions.
PATHS: list[DerivedPath] = [p for p in REGISTRY.maintenances() if isinstance(p, DerivedPath)]
assert PATHS and all(p.decl.table == "transactions" for p in PATHS)

TRIGGERS = tuple(f"{p.trigger}_{op}" for p in PATHS for op in "iud")
TARGET_HEAD_RATIO = 3.0
TARGET_WRITE_COST = 1.30
PENDING_HEAD = 64
"""About what the busiest user writes between two folds at 500 writes/s (1 s apart)."""
FOLD_USERS = 1000


def _head_and_median(ctx: common.Context, tenant: str) -> dict[str, Any]:
    with ctx.engine.connect() as conn:
        counts = conn.execute(
            sa.text(
                "SELECT user_id, count(*) FROM transactions WHERE tenant_id = :t "
                "GROUP BY user_id ORDER BY 2 DESC, 1"
            ),
            {"t": tenant},
        ).all()
    head = counts[0]
    median = counts[len(counts) // 2]
    return {
        "head": {"user": str(head[0]), "rows": int(head[1])},
        "median": {"user": str(median[0]), "rows": int(median[1])},
        "users_with_rows": len(counts),
    }


def _recompute(
    ctx: common.Context, tenant: str, who: dict[str, Any], rounds: int, calls: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fs in REGISTRY:
        if fs.incremental is None:
            continue
        candidates: dict[str, Callable[[], Any]] = {}
        paths: tuple[Path, ...] = ("full", "incremental")
        for path in paths:
            for role in ("head", "median"):
                ref = [(tenant, who[role]["user"])]
                candidates[f"{path}_{role}"] = functools.partial(
                    compute, ctx.engine, fs, ref, path=path
                )
        res = common.measure(candidates, rounds=rounds, calls=calls, warmup=3)
        p50 = {name: r["p50_us"] / 1000 for name, r in res.items()}
        out[fs.name] = {
            "p50_ms": {k: round(v, 2) for k, v in p50.items()},
            "p99_ms": {k: round(r["p99_us"] / 1000, 2) for k, r in res.items()},
            "head_vs_median": {
                "full": common.ratio(p50["full_head"], p50["full_median"]),
                "incremental": common.ratio(p50["incremental_head"], p50["incremental_median"]),
            },
            "incremental_vs_full_head": common.ratio(p50["incremental_head"], p50["full_head"]),
        }
    return out


@contextlib.contextmanager
def _pending(ctx: common.Context, tenant: str, who: dict[str, Any]) -> Iterator[None]:
    """New rows for the head (PENDING_HEAD) and the median user (1), left unfolded;
    afterwards deleted and both users folded, so the data set is as it was."""
    users = [int(who["head"]["user"]), int(who["median"]["user"])]
    counts = [PENDING_HEAD, 1]
    with ctx.engine.begin() as conn:
        ids = list(
            conn.execute(
                sa.text(
                    "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, device_id, "
                    "ip, created_at) SELECT :t, u, 10 + (i % 90), 'm' || (i % 17), NULL, "
                    "'11.0.0.1', now() - i * interval '1 minute' "
                    "FROM unnest(CAST(:u AS bigint[]), CAST(:n AS int[])) AS x(u, n), "
                    "generate_series(1, x.n) AS i RETURNING id"
                ),
                {"t": tenant, "u": users, "n": counts},
            ).scalars()
        )
    try:
        yield
    finally:
        with ctx.engine.begin() as conn:
            conn.execute(
                sa.text("DELETE FROM transactions WHERE tenant_id = :t AND id = ANY(:ids)"),
                {"t": tenant, "ids": ids},
            )
        _fold_all(ctx)


def _fold_all(ctx: common.Context) -> None:
    for path in PATHS:
        path.fold_all(ctx.engine, max_keys=FOLD_USERS)


def _triggers(ctx: common.Context, enabled: bool) -> None:
    verb = "ENABLE" if enabled else "DISABLE"
    with ctx.engine.begin() as conn:
        for name in TRIGGERS:
            conn.execute(sa.text(f"ALTER TABLE transactions {verb} TRIGGER {name}"))


def _copy(ctx: common.Context, tenant: str, rows: list[tuple[Any, ...]]) -> None:
    buf = io.StringIO()
    for r in rows:
        buf.write("\t".join([tenant, *("\\N" if v is None else str(v) for v in r)]) + "\n")
    with ctx.engine.begin() as conn:
        raw = common.psycopg_of(conn.connection)
        with (
            raw.cursor() as cur,
            cur.copy(f"COPY transactions (tenant_id, {ROW_COLUMNS}) FROM STDIN") as copy,
        ):
            copy.write(buf.getvalue())


def write_rounds(
    ctx: common.Context,
    tenant: str,
    sample: int,
    rounds: int,
    insert_rounds: int,
    block: int,
    toggle: Callable[[bool], None],
    scratch: list[str],
) -> tuple[list[tuple[Any, ...]], dict[str, list[float]], dict[str, list[int]]]:
    """COPY rounds and single-row INSERT blocks with triggers on and off by ``toggle``,
    interleaved; (the rows, COPY rows/s and INSERT ns per mode). The tenants written go
    to ``scratch`` as they are made: the caller removes their rows, even after an error."""
    rows = sample_rows(ctx.engine, tenant, sample)
    copy_rates: dict[str, list[float]] = {"with": [], "without": []}
    insert_ns: dict[str, list[int]] = {"with": [], "without": []}
    try:
        for r in range(rounds):
            for mode in ("with", "without") if r % 2 == 0 else ("without", "with"):
                toggle(mode == "with")
                t = f"{ctx.tenant_prefix()}w"
                scratch.append(t)
                _, took = common.timed(functools.partial(_copy, ctx, t, rows))
                copy_rates[mode].append(len(rows) / took)
        # Single-row INSERTs in many small blocks, the mode alternating block by block,
        # so that bursts of load from other processes land on both alike.
        targets = {"with": f"{ctx.tenant_prefix()}i", "without": f"{ctx.tenant_prefix()}i"}
        scratch += targets.values()
        raw_conn = ctx.engine.raw_connection()
        try:
            driver = common.psycopg_of(raw_conn)
            driver.autocommit = True
            with driver.cursor() as cur:
                i = 0
                for r in range(insert_rounds):
                    for mode in ("with", "without") if r % 2 == 0 else ("without", "with"):
                        toggle(mode == "with")
                        for _ in range(block):
                            row = rows[i % len(rows)]
                            i += 1
                            t0 = common.now_ns()
                            cur.execute(
                                f"INSERT INTO transactions (tenant_id, {ROW_COLUMNS}) "
                                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                                (targets[mode], *row),
                                prepare=True,
                            )
                            insert_ns[mode].append(common.now_ns() - t0)
        finally:
            raw_conn.close()
    finally:
        toggle(True)
    return rows, copy_rates, insert_ns


def _writes(
    ctx: common.Context, tenant: str, sample: int, rounds: int, insert_rounds: int, block: int
) -> dict[str, Any]:
    scratch: list[str] = []
    try:
        rows, copy_rates, insert_ns = write_rounds(
            ctx,
            tenant,
            sample,
            rounds,
            insert_rounds,
            block,
            lambda on: _triggers(ctx, on),
            scratch,
        )
        # The deferred work: fold every day the rounds with triggers logged.
        deltas = sum(path.pending(ctx.engine)[0] for path in PATHS)
        _, fold_s = common.timed(lambda: _fold_all(ctx))
    finally:
        _cleanup(ctx, scratch)
    copy = {m: round(float(np.median(v))) for m, v in copy_rates.items()}
    ins = {m: common.stats_ns(v) for m, v in insert_ns.items()}
    fold_rate = deltas / fold_s if fold_s else 0.0
    return {
        "copy_rows_per_s": copy,
        "copy_rounds": {m: [round(x) for x in v] for m, v in copy_rates.items()},
        "copy_cost": common.ratio(copy["without"], copy["with"]),
        "insert_us": ins,
        "insert_p50_cost": common.ratio(ins["with"]["p50_us"], ins["without"]["p50_us"]),
        "fold": {
            "deltas": deltas,
            "seconds": round(fold_s, 3),
            "deltas_per_s": round(fold_rate),
            # a row's COPY with triggers plus its fold, against its COPY without
            "copy_and_fold_cost": common.ratio(
                1 / copy["with"] + (1 / fold_rate if fold_rate else 0), 1 / copy["without"]
            ),
        },
        "sample_rows": len(rows),
        "inserts_per_mode": insert_rounds * block,
        "insert_block": block,
    }


_GUARD = re.compile(r"    IF TG_RELID .*?\n    END IF;\n", re.S)
"""The check of the trigger it runs as: its outer IF, whose END IF has the body's indent."""
_DEFINER = re.compile(r"\n SECURITY DEFINER(?:\n SET search_path TO [^\n]*)?")


def _insert_rights(
    ctx: common.Context, tenant: str, sample: int, rounds: int, insert_rounds: int, block: int
) -> dict[str, Any]:
    """What the insert trigger's rights cost a write: the triggers on in both modes,
    each path's insert trigger function as freshline makes it ("definer": SECURITY
    DEFINER, the check of the trigger it runs as) against as it
    was before (the writer's rights, no check, no search_path of its own), replaced
    block by block and interleaved as :func:`write_rounds` does."""
    with ctx.engine.connect() as conn:
        made = [
            str(
                conn.execute(
                    sa.text("SELECT pg_get_functiondef(CAST(:f AS regprocedure))"),
                    {"f": f"freshline.{path.prefix}_i()"},
                ).scalar_one()
            )
            for path in PATHS
        ]
    before = [_DEFINER.sub("", _GUARD.sub("", f)) for f in made]
    assert all("TG_RELID" not in b and "DEFINER" not in b for b in before)

    def toggle(definer: bool) -> None:
        with ctx.engine.begin() as conn:
            for statement in made if definer else before:
                conn.execute(sa.text(statement))

    scratch: list[str] = []
    try:
        _, copy_rates, insert_ns = write_rounds(
            ctx, tenant, sample, rounds, insert_rounds, block, toggle, scratch
        )
    finally:
        _cleanup(ctx, scratch)
    copy = {m: round(float(np.median(v))) for m, v in copy_rates.items()}
    ins = {m: common.stats_ns(v) for m, v in insert_ns.items()}
    return {
        "copy_rows_per_s": copy,
        "copy_cost": common.ratio(copy["without"], copy["with"]),
        "insert_us": ins,
        "insert_p50_cost": common.ratio(ins["with"]["p50_us"], ins["without"]["p50_us"]),
    }


def _cleanup(ctx: common.Context, tenants: list[str]) -> None:
    """Remove the scratch rows with the triggers off, and their tenants' partials."""
    if not tenants:
        return
    _triggers(ctx, False)
    try:
        with ctx.engine.begin() as conn:
            for table in ("transactions", *(t for path in PATHS for t in path.tables)):
                conn.execute(
                    sa.text(f"DELETE FROM {table} WHERE tenant_id = ANY(:t)"), {"t": tenants}
                )
    finally:
        _triggers(ctx, True)


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    data = ctx.dataset()
    who = _head_and_median(ctx, data.tenant)
    rounds, calls = (1, 2) if quick else (5, 20)
    _fold_all(ctx)
    recompute = _recompute(ctx, data.tenant, who, rounds, calls)
    with _pending(ctx, data.tenant, who):
        pending = _recompute(ctx, data.tenant, who, rounds, calls)
    sample, w_rounds, i_rounds, block = (500, 1, 2, 25) if quick else (20_000, 4, 30, 50)
    writes = _writes(ctx, data.tenant, sample, w_rounds, i_rounds, block)
    rights = _insert_rights(ctx, data.tenant, sample, w_rounds, i_rounds, block)
    targets = []
    for state, res in (("folded", recompute), ("changes logged", pending)):
        for name, r in res.items():
            targets.append(
                common.target(
                    f"{name}: busiest user vs median, incremental, {state}",
                    r["head_vs_median"]["incremental"],
                    "<=",
                    TARGET_HEAD_RATIO,
                    "x",
                )
            )
    targets.append(
        common.target(
            "COPY time with derived triggers vs without",
            writes["copy_cost"],
            "<=",
            TARGET_WRITE_COST,
            "x",
        )
    )
    targets.append(
        common.target(
            "single-row INSERT p50 with derived triggers vs without",
            writes["insert_p50_cost"],
            "<=",
            TARGET_WRITE_COST,
            "x",
        )
    )
    return {
        "parameters": {
            "rounds": rounds,
            "calls": calls,
            "write_rounds": w_rounds,
            "insert_rounds": i_rounds,
            "dataset": {"users": data.users, "transactions": data.transactions},
        },
        "entities": who,
        "recompute": recompute,
        "recompute_pending": pending,
        "pending_head": PENDING_HEAD,
        "writes": writes,
        "insert_rights": rights,
        "targets": targets,
    }


def markdown(res: dict[str, Any]) -> str:
    p, who, w = res["parameters"], res["entities"], res["writes"]
    rows = []
    for state, key in (("folded", "recompute"), ("pending", "recompute_pending")):
        for name, r in res[key].items():
            ms = r["p50_ms"]
            rows.append(
                (
                    f"{name}, {state}",
                    ms["full_head"],
                    ms["full_median"],
                    f"{r['head_vs_median']['full']}x",
                    ms["incremental_head"],
                    ms["incremental_median"],
                    f"{r['head_vs_median']['incremental']}x",
                    f"{r['incremental_vs_full_head']}x",
                )
            )
    ins, fold = w["insert_us"], w["fold"]
    rights = res.get("insert_rights")
    by_rights = []
    if rights is not None:
        r_ins = rights["insert_us"]
        by_rights = [
            "The insert trigger as freshline makes it (SECURITY DEFINER, the check of the "
            "trigger it runs as) against as it was before (the writer's "
            "rights, INSERT on the log granted to PUBLIC), both paths' triggers on, the same "
            "writes interleaved the same way:",
            "",
            common.table(
                ["", "definer", "writer's rights", "cost"],
                [
                    (
                        "COPY rows/s",
                        rights["copy_rows_per_s"]["with"],
                        rights["copy_rows_per_s"]["without"],
                        f"{rights['copy_cost']}x",
                    ),
                    (
                        "INSERT p50 µs",
                        r_ins["with"]["p50_us"],
                        r_ins["without"]["p50_us"],
                        f"{rights['insert_p50_cost']}x",
                    ),
                    ("INSERT p99 µs", r_ins["with"]["p99_us"], r_ins["without"]["p99_us"], ""),
                ],
            ),
            "",
        ]
    return "\n".join(
        [
            "## incremental: head entity against median, and the write cost of the derived path",
            "",
            f"Data set: {p['dataset']['users']:,} users, {p['dataset']['transactions']:,} "
            f"transactions (Zipf). Busiest user: {who['head']['rows']:,} rows; median user "
            f"(of {who['users_with_rows']:,} with rows): {who['median']['rows']:,}. One entity "
            f"per `compute`, {p['rounds']} interleaved rounds of {p['calls']} calls (p50, ms). "
            f"Logged: {res['pending_head']} new rows of the busiest user and 1 of the median "
            "user, not yet folded.",
            "",
            common.table(
                [
                    "feature set",
                    "full head",
                    "full median",
                    "full head/median",
                    "incr. head",
                    "incr. median",
                    "incr. head/median",
                    "incr./full head",
                ],
                rows,
            ),
            "",
            f"Writes: {w['sample_rows']:,} rows by COPY into a fresh tenant per round, "
            f"{p['write_rounds']} rounds per mode, and {w['inserts_per_mode']:,} single-row "
            f"INSERTs (autocommit) per mode in blocks of {w['insert_block']}, derived triggers "
            "enabled and disabled alternately.",
            "",
            common.table(
                ["", "with triggers", "without", "cost"],
                [
                    (
                        "COPY rows/s",
                        w["copy_rows_per_s"]["with"],
                        w["copy_rows_per_s"]["without"],
                        f"{w['copy_cost']}x",
                    ),
                    (
                        "INSERT p50 µs",
                        ins["with"]["p50_us"],
                        ins["without"]["p50_us"],
                        f"{w['insert_p50_cost']}x",
                    ),
                    ("INSERT p99 µs", ins["with"]["p99_us"], ins["without"]["p99_us"], ""),
                ],
            ),
            "",
            f"The deferred work: folding the {fold['deltas']:,} (user, day)s those rounds logged "
            f"took {fold['seconds']} s ({fold['deltas_per_s']:,}/s, {FOLD_USERS:,} per "
            f"transaction); COPY plus its fold costs {fold['copy_and_fold_cost']}x a COPY "
            "without triggers, off the writer's transaction.",
            "",
            *by_rights,
            common.targets_table(res["targets"]),
        ]
    )


def main() -> int:
    return common.seeded_main("incremental", __doc__, run, markdown)


if __name__ == "__main__":
    sys.exit(main())
