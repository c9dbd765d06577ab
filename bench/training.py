"""Training sets: spine rows/s, many moments per statement (LATERAL) against one each.

The run's seeded tenant's rows are copied into history tables (as a backfill would, all
current from the start). Two spines: one row per transaction, at its own ``created_at``
(nearly every row its own moment), and every user at the same few daily moments (many
keys a moment). Each feature set is evaluated by
:func:`pipeline.history.training.training_set` two ways: up to 2,000 spine rows a
statement (the default: the feature query runs once per moment, over that moment's
keys, through ``LATERAL``), and one moment a statement (the same SQL; a round trip and
a plan per moment). The two alternate which goes first.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from bench import common
from pipeline.core.repository import active
from pipeline.history import tables
from pipeline.history.training import training_set

FEATURES = ["txn_90d", "geo"]
CAPTURED = ("transactions", "users", "user_devices", "devices", "geoip")
START = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


def _capture(ctx: common.Context) -> None:
    with ctx.engine.begin() as conn:
        for table in CAPTURED:
            found = tables.layout(conn, "public", table)
            tables.create(conn, found, None)
            conn.execute(
                sa.text(
                    f"INSERT INTO {tables.qualified(found.history)} SELECT t.*, '3'::xid8, "
                    f"NULL, '0/0', NULL, :s, NULL, '0/0' FROM public.{table} t"
                ),
                {"s": START},
            )
            conn.execute(
                sa.text(
                    "UPDATE freshline.history_tables SET s0_at = :s, complete_to = 'infinity' "
                    "WHERE source_table = :t"
                ),
                {"s": START, "t": table},
            )


def _spines(ctx: common.Context, rows: int) -> dict[str, Any]:
    import pyarrow as pa

    data = ctx.dataset()
    with ctx.engine.connect() as conn:
        per_txn = conn.execute(
            sa.text(
                "SELECT tenant_id, user_id, created_at FROM transactions WHERE tenant_id = :t "
                "AND created_at <= now() ORDER BY id LIMIT :n"
            ),
            {"t": data.tenant, "n": rows},
        ).all()
        users = (
            conn.execute(
                sa.text("SELECT id FROM users WHERE tenant_id = :t ORDER BY id LIMIT :n"),
                {"t": data.tenant, "n": rows // 4},
            )
            .scalars()
            .all()
        )
    days = [common.ANCHOR - dt.timedelta(days=d) for d in range(4)]
    daily = [(data.tenant, u, day) for day in days for u in users]

    def table(spine: Sequence[Any]) -> Any:
        return pa.table(
            {
                "tenant_id": [r[0] for r in spine],
                "user_id": pa.array([r[1] for r in spine], pa.int64()),
                "timestamp": pa.array([r[2] for r in spine], pa.timestamp("us", tz="UTC")),
            }
        )

    return {"per_transaction": table(per_txn), "daily": table(daily)}


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    _capture(ctx)
    rows, rounds = (400, 2) if quick else (2_000, 3)
    spines = _spines(ctx, rows)
    repo = active()
    chunks = {"lateral": 2000, "per_moment": 1}
    figures: dict[str, Any] = {}
    for spine_name, spine in spines.items():
        moments = len(set(spine.column("timestamp").to_pylist()))
        for fs in repo.registry:
            rates: dict[str, list[float]] = {name: [] for name in chunks}
            tables_: dict[str, Any] = {}
            for r in range(rounds):
                order = list(chunks) if r % 2 == 0 else list(reversed(chunks))
                for name in order:
                    got, took = common.timed(
                        functools.partial(
                            training_set,
                            repo,
                            spine,
                            [fs.name],
                            engine=ctx.engine,
                            chunk=chunks[name],
                        )
                    )
                    rates[name].append(spine.num_rows / took)
                    tables_[name] = got
            figures[f"{spine_name}/{fs.name}"] = {
                "rows": spine.num_rows,
                "moments": moments,
                "lateral_rows_per_s": max(rates["lateral"]),
                "per_moment_rows_per_s": max(rates["per_moment"]),
                "ratio": max(rates["lateral"]) / max(rates["per_moment"]),
                "same_values": tables_["lateral"].equals(tables_["per_moment"]),
            }
    return {
        "parameters": {"rounds": rounds, "tenant_transactions": ctx.dataset().transactions},
        "figures": figures,
    }


def markdown(res: dict[str, Any]) -> str:
    p = res["parameters"]
    lines = [
        "## training: spine rows/s, moments per statement through LATERAL against one each",
        "",
        f"Best of {p['rounds']} rounds; the tenant has {p['tenant_transactions']:,} "
        "transactions, copied into history as a backfill would. `per_transaction`: a row "
        "per transaction at its own moment; `daily`: users at 4 daily moments.",
        "",
        "| spine / feature set | rows | moments | LATERAL rows/s | a moment a statement "
        "rows/s | ratio | same values |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, f in res["figures"].items():
        lines.append(
            f"| {name} | {f['rows']:,} | {f['moments']:,} | {f['lateral_rows_per_s']:,.0f} | "
            f"{f['per_moment_rows_per_s']:,.0f} | {f['ratio']:.2f}x | {f['same_values']} |"
        )
    return "\n".join(lines) + "\n"
