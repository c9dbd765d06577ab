"""Seeding: rows/s of ``freshline fraud seed`` (COPY) against a naive ``executemany`` INSERT.

Two figures. First, the whole ``freshline fraud seed`` load (:func:`fraud.seed.seed`, the
function the command calls): generating and COPYing users, devices, links and
1,000,000 transactions (50,000 with ``--quick``) into a fresh tenant, timed once. The
tenant it creates becomes the run's data set for the other benchmarks.

Second, the same rows two ways, in interleaved rounds: a sample of those transactions
(read back from the database) loaded into a scratch tenant by COPY, and by psycopg's
``executemany`` of a parameterised INSERT, the way a first version would write it.
The rows/s ratio compares the two on identical rows.
"""

from __future__ import annotations

import functools
import io
from typing import Any

import numpy as np
import sqlalchemy as sa

from bench import common

ROW_COLUMNS = (
    "user_id, amount, currency, merchant_id, device_id, ip, status, created_at, updated_at"
)
"""A transaction's columns but its tenant (and id): what :func:`sample_rows` reads."""
_COLUMNS = f"tenant_id, {ROW_COLUMNS}"
_INSERT = f"INSERT INTO transactions ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"


def sample_rows(engine: sa.Engine, tenant: str, n: int) -> list[tuple[Any, ...]]:
    """The first ``n`` transactions of ``tenant`` by id, as :data:`ROW_COLUMNS` tuples."""
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    f"SELECT {ROW_COLUMNS} FROM transactions WHERE tenant_id = :t "
                    "ORDER BY id LIMIT :n"
                ),
                {"t": tenant, "n": n},
            )
        ]


def _copy_rows(raw: Any, tenant: str, rows: list[tuple[Any, ...]]) -> None:
    buf = io.StringIO()
    for r in rows:
        buf.write("\t".join([tenant, *(str(v) for v in r)]) + "\n")
    with raw.cursor() as cur, cur.copy(f"COPY transactions ({_COLUMNS}) FROM STDIN") as copy:
        copy.write(buf.getvalue())


def _insert_rows(raw: Any, tenant: str, rows: list[tuple[Any, ...]]) -> None:
    with raw.cursor() as cur:
        cur.executemany(_INSERT, [(tenant, *r) for r in rows])


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    users, txns = (2_000, 40_000) if quick else (100_000, 1_000_000)
    sample, rounds = (500, 1) if quick else (20_000, 3)

    from fraud.seed import seed

    summary, seconds = common.timed(
        lambda: seed(
            ctx.engine,
            users=users,
            transactions=txns,
            tenant_prefix=ctx.tenant_prefix(),
            anchor=common.ANCHOR,
        )
    )
    tenant = summary.tenants[0]
    with ctx.engine.connect() as conn:
        loaded = conn.execute(
            sa.text(
                "SELECT (SELECT count(*) FROM users WHERE tenant_id = :t) "
                "+ (SELECT count(*) FROM devices WHERE tenant_id = :t) "
                "+ (SELECT count(*) FROM user_devices WHERE tenant_id = :t) "
                "+ (SELECT count(*) FROM transactions WHERE tenant_id = :t)"
            ),
            {"t": tenant},
        ).scalar_one()
    ctx.adopt_dataset(common.Dataset(tenant, users, txns, seconds))

    rows = sample_rows(ctx.engine, tenant, sample)

    rates: dict[str, list[float]] = {"copy": [], "executemany": []}
    scratch: list[str] = []
    for r in range(rounds):
        order = ["copy", "executemany"] if r % 2 == 0 else ["executemany", "copy"]
        for how in order:
            name = f"{ctx.tenant_prefix()}scratch"
            scratch.append(name)
            with ctx.engine.begin() as conn:
                raw = conn.connection.driver_connection
                load = _copy_rows if how == "copy" else _insert_rows
                _, took = common.timed(functools.partial(load, raw, name, rows))
            rates[how].append(len(rows) / took)
    with ctx.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM transactions WHERE tenant_id = ANY(:t)"), {"t": scratch})

    copy_rate = float(np.median(rates["copy"]))
    naive_rate = float(np.median(rates["executemany"]))
    txn_rate = txns / seconds
    targets = [
        common.target(
            "1M transactions seeded in well under a minute (full run)",
            round(seconds, 1) if not quick else None,
            "<",
            60,
            "s",
        ),
    ]
    return {
        "parameters": {
            "users": users,
            "transactions": txns,
            "sample_rows": len(rows),
            "rounds": rounds,
        },
        "seed": {
            "seconds": round(seconds, 2),
            "rows_loaded": int(loaded),
            "rows_per_s": round(loaded / seconds),
            "transactions_per_s": round(txn_rate),
        },
        "same_rows": {
            "copy_rows_per_s": round(copy_rate),
            "executemany_rows_per_s": round(naive_rate),
            "copy_rounds": [round(x) for x in rates["copy"]],
            "executemany_rounds": [round(x) for x in rates["executemany"]],
            "ratio": common.ratio(copy_rate, naive_rate),
        },
        "targets": targets,
    }


def markdown(res: dict[str, Any]) -> str:
    p, s, same = res["parameters"], res["seed"], res["same_rows"]
    return "\n".join(
        [
            "## seed: bulk loading with COPY",
            "",
            f"`freshline fraud seed` loaded {p['users']:,} users and "
            f"{p['transactions']:,} transactions "
            f"({s['rows_loaded']:,} rows with devices and links) in **{s['seconds']} s**: "
            f"{s['transactions_per_s']:,} transactions/s, "
            f"{s['rows_per_s']:,} rows/s of all tables, "
            "data generation included.",
            "",
            f"The same {p['sample_rows']:,} transaction rows, {p['rounds']} interleaved rounds "
            "each (median rows/s):",
            "",
            common.table(
                ["method", "rows/s", "vs executemany"],
                [
                    ("COPY (what seed uses)", same["copy_rows_per_s"], f"{same['ratio']}x"),
                    ("psycopg executemany INSERT (naive)", same["executemany_rows_per_s"], "1x"),
                ],
            ),
            "",
            common.targets_table(res["targets"]),
        ]
    )
