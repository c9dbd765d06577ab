"""History tables for the evaluator's tests, laid out as the history contract says.

The history tables are the history issue's (51: :mod:`freshline.pipeline.history.tables`); these
tests fill them two ways:

* :func:`version`: one row version written directly, with the commit times a test
  chooses (the leakage tests: edges exactly at a window's ends);
* :func:`record`: a trigger on the user table that writes each change's version with its
  real transaction id (``pg_current_xact_id()``), so snapshot visibility is exact, and
  :func:`stamp` then sets the commit time of a committed transaction.

The triggers are a test's stand-in for the change-stream recorder, never the product's:
freshline does not touch user tables. :func:`uncapture` removes all of it.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.history import tables
from freshline.pipeline.history.recorder import Change, Recorder

SCHEMA = "freshline"
_XMINS = itertools.count(10)
LONG_AGO = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
PENDING = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)
"""The commit time of a version whose transaction :func:`stamp` has not stamped yet."""


def history_name(table: str) -> str:
    return tables.history_table_name("public", table)


def _key(conn: Connection, table: str) -> list[str]:
    return list(
        conn.execute(
            sa.text(
                "SELECT a.attname FROM pg_index i JOIN LATERAL unnest(i.indkey) "
                "WITH ORDINALITY AS k(attnum, n) ON true JOIN pg_attribute a "
                "ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
                "WHERE i.indrelid = to_regclass(:t) AND i.indisprimary ORDER BY k.n"
            ),
            {"t": f"public.{table}"},
        ).scalars()
    )


def capture(
    conn: Connection,
    table: str,
    *,
    backfill: bool = True,
    start: dt.datetime = LONG_AGO,
    complete_to: dt.datetime | None = None,
    retention_s: int | None = None,
) -> str:
    """Make ``public.table``'s history table with the history issue's DDL
    (:func:`freshline.pipeline.history.tables.create`) and register it as starting at ``start``
    and complete to ``complete_to`` (default: forever); with ``backfill``, copy today's
    rows in as versions every snapshot sees (``_fl_xmin`` 3) from ``start``. Run as the
    owner."""
    found = tables.layout(conn, "public", table)
    conn.execute(sa.text(f"DROP TABLE IF EXISTS {tables.qualified(found.history)}"))
    tables.create(conn, found, retention_s)
    if backfill:
        conn.execute(sa.text(f"LOCK TABLE public.{table} IN SHARE MODE"))
        conn.execute(
            sa.text(
                f"INSERT INTO {tables.qualified(found.history)} SELECT t.*, '3'::xid8, NULL, "
                f"'0/0', NULL, :start, NULL, '0/0' FROM public.{table} t"
            ),
            {"start": start},
        )
    conn.execute(
        sa.text(
            f"UPDATE {SCHEMA}.history_tables SET s0_at = :s, complete_to = :c, "
            "broken_from = NULL WHERE source_schema = 'public' AND source_table = :t"
        ),
        {"t": table, "s": start, "c": complete_to or dt.datetime.max.replace(tzinfo=dt.UTC)},
    )
    return found.history


def record(conn: Connection, table: str) -> None:
    """Record every later change of ``public.table`` into its history table, by trigger
    (the test's stand-in for the recorder; see the module docstring)."""
    name = history_name(table)
    key = _key(conn, table)
    old = " AND ".join(f"h.{c} = OLD.{c}" for c in key)
    conn.execute(
        sa.text(
            f"""
CREATE OR REPLACE FUNCTION {SCHEMA}.{name}_rec() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        UPDATE {SCHEMA}.{name} SET _fl_xmax = pg_current_xact_id(),
               _fl_to = '{PENDING.isoformat()}', _fl_to_lsn = '0/0' WHERE _fl_xmax IS NULL;
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        -- a version this transaction made and now replaces never was visible
        DELETE FROM {SCHEMA}.{name} h WHERE {old} AND h._fl_xmax IS NULL
            AND h._fl_xmin = pg_current_xact_id();
        UPDATE {SCHEMA}.{name} h SET _fl_xmax = pg_current_xact_id(),
               _fl_to = '{PENDING.isoformat()}', _fl_to_lsn = '0/0'
         WHERE {old} AND h._fl_xmax IS NULL;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO {SCHEMA}.{name} SELECT NEW.*, pg_current_xact_id(), NULL, '0/0', NULL,
               '{PENDING.isoformat()}', NULL, '0/0';
    END IF;
    RETURN NULL;
END $$
"""
        )
    )
    conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}_rec ON public.{table}"))
    conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}_trunc ON public.{table}"))
    conn.execute(
        sa.text(
            f"CREATE TRIGGER {name}_rec AFTER INSERT OR UPDATE OR DELETE ON public.{table} "
            f"FOR EACH ROW EXECUTE FUNCTION {SCHEMA}.{name}_rec()"
        )
    )
    conn.execute(
        sa.text(
            f"CREATE TRIGGER {name}_trunc AFTER TRUNCATE ON public.{table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {SCHEMA}.{name}_rec()"
        )
    )


def unrecord(conn: Connection, table: str) -> None:
    """Stop :func:`record`'s trigger on ``public.table``."""
    name = history_name(table)
    conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}_rec ON public.{table}"))
    conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}_trunc ON public.{table}"))


def stamp(conn: Connection, tables: list[str], xid: int) -> dt.datetime:
    """Give the versions committed transaction ``xid`` made and ended its commit time:
    the clock now, read after the commit (so stamps follow the commit order)."""
    at: dt.datetime = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    for table in tables:
        name = history_name(table)
        conn.execute(
            sa.text(f"UPDATE {SCHEMA}.{name} SET _fl_from = :at WHERE _fl_xmin = CAST(:x AS xid8)"),
            {"at": at, "x": str(xid)},
        )
        conn.execute(
            sa.text(f"UPDATE {SCHEMA}.{name} SET _fl_to = :at WHERE _fl_xmax = CAST(:x AS xid8)"),
            {"at": at, "x": str(xid)},
        )
    return at


def version(
    conn: Connection,
    table: str,
    row: Mapping[str, Any],
    committed: dt.datetime,
    ended: dt.datetime | None = None,
    *,
    xmin: int | None = None,
    xmax: int | None = None,
) -> None:
    """Write one version of a ``table`` row: created by a transaction that committed at
    ``committed``, ended by one that committed at ``ended`` (None: current). Transaction
    ids default to small ones, each new (a row's versions have different creators), that
    every snapshot sees."""
    if xmin is None:
        xmin = next(_XMINS)
    columns = ", ".join(row)
    values = ", ".join(f":{c}" for c in row)
    conn.execute(
        sa.text(
            f"INSERT INTO {SCHEMA}.{history_name(table)} ({columns}, _fl_xmin, _fl_xmax, "
            f"_fl_from_lsn, _fl_to_lsn, _fl_from, _fl_to, _fl_change) VALUES ({values}, "
            "CAST(:_x AS xid8), CAST(:_y AS xid8), '0/0', NULL, :_f, :_t, '0/0')"
        ),
        {
            **row,
            "_x": str(xmin),
            "_y": None if xmax is None else str(xmax),
            "_f": committed,
            "_t": ended,
        },
    )


def uncapture(conn: Connection, table: str) -> None:
    """Remove ``table``'s history table, triggers and registration."""
    name = history_name(table)
    conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}_rec ON public.{table}"))
    conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}_trunc ON public.{table}"))
    conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {SCHEMA}.{name}_rec()"))
    conn.execute(sa.text(f"DROP TABLE IF EXISTS {SCHEMA}.{name}"))
    conn.execute(
        sa.text(
            f"DELETE FROM {SCHEMA}.history_tables WHERE source_schema = 'public' "
            "AND source_table = :t"
        ),
        {"t": table},
    )


LOG = f"{SCHEMA}.h52_changes"
"""The change log :func:`log` fills: what Debezium would stream, for the recorder API."""


def log(conn: Connection, table: str) -> None:
    """Log every later change of ``public.table`` (its images, transaction and WAL
    position) into :data:`LOG`, for :func:`drain` to hand the history recorder as the
    change stream would (no connector: a test's stand-in for Debezium, not the
    recorder's)."""
    conn.execute(
        sa.text(
            f"CREATE TABLE IF NOT EXISTS {LOG} (n bigserial PRIMARY KEY, tbl text, op text, "
            "txid bigint, lsn bigint, before jsonb, after jsonb)"
        )
    )
    conn.execute(
        sa.text(
            f"""
CREATE OR REPLACE FUNCTION {SCHEMA}.h52_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {LOG} (tbl, op, txid, lsn, before, after) VALUES (
        TG_TABLE_NAME,
        CASE TG_OP WHEN 'INSERT' THEN 'c' WHEN 'UPDATE' THEN 'u' WHEN 'DELETE' THEN 'd'
                   ELSE 't' END,
        pg_current_xact_id()::text::bigint, pg_current_wal_insert_lsn() - '0/0'::pg_lsn,
        CASE WHEN TG_OP IN ('UPDATE', 'DELETE') THEN to_jsonb(OLD) END,
        CASE WHEN TG_OP IN ('INSERT', 'UPDATE') THEN to_jsonb(NEW) END);
    RETURN NULL;
END $$
"""
        )
    )
    name = history_name(table)
    conn.execute(
        sa.text(
            f"CREATE TRIGGER {name}_log AFTER INSERT OR UPDATE OR DELETE ON public.{table} "
            f"FOR EACH ROW EXECUTE FUNCTION {SCHEMA}.h52_log()"
        )
    )
    conn.execute(
        sa.text(
            f"CREATE TRIGGER {name}_logt AFTER TRUNCATE ON public.{table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {SCHEMA}.h52_log()"
        )
    )


def drain(owner: Engine, recorder: Recorder) -> int:
    """Hand every logged change of committed transactions to ``recorder`` as Debezium
    change records, each transaction with the clock read now as its commit time (call it
    right after the commit); how many."""
    with owner.begin() as conn:
        rows = conn.execute(
            sa.text(
                f"DELETE FROM {LOG} WHERE pg_xact_status(CAST(CAST(txid AS text) AS xid8)) "
                "= 'committed' RETURNING tbl, op, txid, lsn, before, after, n"
            )
        ).all()
        now_us = int(
            conn.execute(
                sa.text("SELECT floor(extract(epoch FROM clock_timestamp()) * 1e6)::bigint")
            ).scalar_one()
        )
    changes = [
        Change("public", tbl, op, txid % (1 << 32), lsn, now_us, before, after)
        for tbl, op, txid, lsn, before, after, _ in sorted(rows, key=lambda r: r[6])
    ]
    recorder.record(changes)
    return len(changes)
