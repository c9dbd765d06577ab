"""The exact backfill: the current rows, read in one snapshot S0, as history's first
versions.

``freshline apply`` runs it once per newly registered table, after the connector's
replication slot exists: in one REPEATABLE READ transaction, the first statement takes
S0 (``pg_current_snapshot()``, the clock, and the WAL insert position read after it),
every later one copies a table's rows as S0 sees them, and the registry records S0.
The recorder then skips every change whose transaction S0 sees
(``pg_visible_in_snapshot``) and records every other one. A transaction S0 does not see
commits after S0 was taken, hence after the slot was made, so Debezium streams it: no
change is missing and none is recorded twice, whatever ran during the backfill.

The backfilled versions have ``_fl_xmin = 3`` (frozen: every snapshot sees them), and
S0's time and WAL position as their ``_fl_from`` and ``_fl_from_lsn``. Before S0,
history knows only S0's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.core.db import SCHEMA
from freshline.pipeline.history.tables import FROZEN_XID, Layout, epoch_us, qualified, quote

_S0_SQL = sa.text(
    "SELECT pg_current_snapshot()::text, clock_timestamp(), pg_current_wal_insert_lsn()::text"
)


@dataclass(frozen=True, slots=True)
class S0:
    """The backfill's snapshot, and how many rows it copied per table."""

    snapshot: str
    at_us: int
    lsn: str
    rows: dict[str, int]


def backfill(engine: Engine, layouts: Sequence[Layout]) -> S0:
    """Copy the rows of every table of ``layouts`` into its (empty) history table, all
    as one snapshot S0 sees them, and record S0 for each. Run as the owner."""
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        snapshot, at, lsn = conn.execute(_S0_SQL).one()
        rows: dict[str, int] = {}
        for found in layouts:
            names = ", ".join(quote(n) for n in found.names)
            copied = conn.execute(
                sa.text(
                    f"INSERT INTO {qualified(found.history)} ({names}, _fl_xmin, _fl_from_lsn, "
                    f"_fl_from, _fl_change) SELECT {names}, '{FROZEN_XID}'::xid8, "
                    "CAST(:lsn AS pg_lsn), :at, '0/0'::pg_lsn "
                    f"FROM {quote(found.schema)}.{quote(found.table)}"
                ),
                {"lsn": lsn, "at": at},
            )
            rows[found.table] = copied.rowcount
            conn.execute(
                sa.text(
                    f"UPDATE {SCHEMA}.history_tables SET s0_snapshot = :s, "
                    "s0_at = :at, s0_lsn = :lsn "
                    "WHERE source_schema = :schema AND source_table = :table"
                ),
                {"s": snapshot, "at": at, "lsn": lsn, "schema": found.schema, "table": found.table},
            )
        conn.commit()
    return S0(snapshot, epoch_us(at), lsn, rows)
