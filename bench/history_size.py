"""History's size on the fraud example: bytes per backfilled row and per recorded change.

On a scratch database (``freshline_bench_history``, dropped after): freshline's schema
and the fraud example's tables, ``--transactions`` seeded rows, history on for every
table the feature sets read (created and backfilled as ``freshline apply`` does), then
``--changes`` corrections of ``transactions`` rows (amount and status, one transaction
each, as a correction stream would make them), each recorded through the recorder from
the Debezium envelope the connector would send (built from the row, its transaction id
and the WAL position). Sizes are ``pg_total_relation_size`` of the history table (heap,
TOAST and its indexes: the user table's three, and history's own three), read after a
plain ``VACUUM`` (what autovacuum does) and after ``VACUUM FULL`` (the floor).

    .venv/bin/python -m bench.history_size [--transactions 100000] [--changes 5000]

Prints the figures; nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bench import common  # noqa: F401  (puts the fraud example's package on the path)
from fraud.seed import seed
from freshline.pipeline.cdc.connect import SCHEMA
from freshline.pipeline.core.repository import load
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.history.backfill import backfill
from freshline.pipeline.history.recorder import Change, Recorder
from freshline.pipeline.history.tables import EPOCH, create, layout, qualified
from tests.helpers import ROOT, drop_database, migrate, recreate_database

DATABASE = "freshline_bench_history"


def size(engine: Engine, table: str, *, full: bool) -> tuple[int, int]:
    """``(bytes, versions)`` of a history table after a VACUUM (FULL)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"VACUUM {'FULL ' if full else ''}{table}"))
        total = conn.execute(sa.text(f"SELECT pg_total_relation_size('{table}')")).scalar_one()
        rows = conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
    return int(total), int(rows)


def corrections(engine: Engine, count: int) -> list[Change]:
    """``count`` one-row transactions correcting a transaction's amount and status, as
    the recorder would read their Debezium records."""
    changes = []
    with engine.connect() as conn:
        ids = conn.execute(
            sa.text("SELECT tenant_id, id FROM transactions ORDER BY random() LIMIT :n"),
            {"n": count},
        ).all()
    for tenant, key in ids:
        with engine.begin() as conn:
            txid = int(conn.execute(sa.text("SELECT pg_current_xact_id()::text")).scalar_one())
            row = conn.execute(
                sa.text(
                    "UPDATE transactions t SET amount = amount + 1, status = 'refunded', "
                    "updated_at = now() WHERE tenant_id = :t AND id = :i RETURNING to_jsonb(t)"
                ),
                {"t": tenant, "i": key},
            ).scalar_one()
            lsn = int(
                conn.execute(sa.text("SELECT pg_current_wal_insert_lsn() - '0/0'")).scalar_one()
            )
            at = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
        row["amount"] = str(row["amount"])  # decimal.handling.mode=string
        commit_us = (at - EPOCH) // dt.timedelta(microseconds=1)
        changes.append(Change(SCHEMA, "transactions", "u", txid, lsn, commit_us, None, row))
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=100_000)
    parser.add_argument("--changes", type=int, default=5_000)
    args = parser.parse_args()
    base = Settings()
    url = recreate_database(base, DATABASE)
    try:
        migrate(url, "head")
        engine = sa.create_engine(url, pool_size=2)
        seed(engine, users=max(args.transactions // 50, 10), transactions=args.transactions)
        repo = load(ROOT / "examples" / "fraud")
        with engine.begin() as conn:
            layouts = [layout(conn, SCHEMA, t) for t in repo.table_names()]
            for found in layouts:
                create(conn, found, None)
        started = time.perf_counter()
        s0 = backfill(engine, layouts)
        backfill_s = time.perf_counter() - started
        history = qualified(next(f for f in layouts if f.table == "transactions").history)
        base_bytes, base_rows = size(engine, history, full=True)
        print(
            f"backfill: {sum(s0.rows.values()):,} rows of {len(layouts)} tables "
            f"in {backfill_s:.1f} s"
        )
        print(
            f"transactions history after backfill: {base_bytes:,} B, {base_rows:,} versions, "
            f"{base_bytes / base_rows:.0f} B per version"
        )
        changes = corrections(engine, args.changes)
        recorder = Recorder(engine)
        started = time.perf_counter()
        for i in range(0, len(changes), 500):
            recorder.record(changes[i : i + 500])
        record_s = time.perf_counter() - started
        grown, rows = size(engine, history, full=False)
        floor, _ = size(engine, history, full=True)
        print(
            f"recorded {len(changes):,} changes in {record_s:.1f} s "
            f"({len(changes) / record_s:,.0f} changes/s, one process, batches of 500)"
        )
        print(
            f"per change after VACUUM: {(grown - base_bytes) / len(changes):.0f} B; "
            f"after VACUUM FULL: {(floor - base_bytes) / len(changes):.0f} B "
            f"({rows - base_rows:,} new versions)"
        )
        engine.dispose()
    finally:
        drop_database(base, DATABASE)


if __name__ == "__main__":
    main()
