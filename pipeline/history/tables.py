"""History tables: their names, their columns (the user's, from the catalog, plus ours),
their indexes, and the registry that lists them.

One history table per captured user table ``<schema>.<table>``, in freshline's schema,
named by :func:`history_table_name`. Its columns are the user table's, with the same
names and catalog types, then freshline's (:data:`FL_COLUMNS`): a version of a row is
visible to snapshot ``s`` when ``pg_visible_in_snapshot(_fl_xmin, s) AND (_fl_xmax IS
NULL OR NOT pg_visible_in_snapshot(_fl_xmax, s))``, and at commit time ``t`` when
``_fl_from <= t AND (_fl_to IS NULL OR _fl_to > t)``. ``docs/training.md`` says what is
recorded and from when; ``/work/wt/HISTORY_CONTRACT.md`` was the shared contract.

Nothing here touches the user's tables: it reads their catalog entries only.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from freshline.pipeline.core.db import SCHEMA
from freshline.pipeline.core.errors import ConfigError

FL_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("_fl_xmin", "xid8", False),
    ("_fl_xmax", "xid8", True),
    ("_fl_from_lsn", "pg_lsn", False),
    ("_fl_to_lsn", "pg_lsn", True),
    ("_fl_from", "timestamptz", False),
    ("_fl_to", "timestamptz", True),
    ("_fl_change", "pg_lsn", False),
)
"""freshline's columns of every history table: ``(name, type, nullable)``.

- ``_fl_xmin``: the creating transaction, widened to ``xid8``; ``3`` (frozen: visible
  to every snapshot) for a row the backfill read;
- ``_fl_xmax``: the transaction that ended the version (an update, a delete, a
  truncate), NULL while it is current;
- ``_fl_from_lsn`` / ``_fl_to_lsn``: the LSN of the change record that created / ended
  it (Debezium gives each record its own LSN, not its transaction's commit LSN; for one
  row, their order is the commit order); the backfill's rows have S0's WAL position;
- ``_fl_from`` / ``_fl_to``: the commit time (µs) of the creating / ending transaction;
  the backfill's rows have S0's time;
- ``_fl_change``: the LSN of the last change record of ``_fl_xmin`` applied to the
  version (``0/0`` for the backfill's): with ``_fl_xmin`` it makes a redelivered or
  older record a no-op, and it orders a row's versions (a transaction that changes a
  row waits for the one that changed it before to commit, so every record of the
  later one comes after every record of the earlier one).
"""
FL_NAMES = tuple(name for name, _, _ in FL_COLUMNS)
FROZEN_XID = 3
"""``FrozenTransactionId``: the ``_fl_xmin`` of backfilled rows, visible to every snapshot."""
MAX_NAME = 63
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
MICROSECOND = dt.timedelta(microseconds=1)


def epoch_us(moment: dt.datetime) -> int:
    """An aware moment as exact epoch microseconds (no float on the way)."""
    return (moment - EPOCH) // MICROSECOND


def from_epoch_us(us: int) -> dt.datetime:
    """Epoch microseconds as an aware UTC moment."""
    return EPOCH + dt.timedelta(microseconds=us)


def history_table_name(schema: str, table: str) -> str:
    """The history table of ``schema.table``, unqualified (it lives in ``freshline``):
    ``h_<schema>__<table>``, or, past Postgres's 63 bytes, its start and a hash."""
    name = f"h_{schema}__{table}"
    if len(name.encode()) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{name.encode()[: MAX_NAME - 13].decode(errors='ignore')}_{digest}"


def quote(identifier: str) -> str:
    """``identifier`` as a quoted SQL identifier."""
    return '"' + identifier.replace('"', '""') + '"'


def qualified(name: str) -> str:
    """A history table's qualified, quoted name."""
    return f"{SCHEMA}.{quote(name)}"


@dataclass(frozen=True, slots=True)
class Column:
    """A user column as the catalog has it."""

    name: str
    type: str
    """``format_type``: the type as DDL writes it (``timestamp(3) without time zone``)."""
    typname: str
    """``pg_type.typname`` (``timestamp``, ``_int4`` for an array)."""
    typmod: int


@dataclass(frozen=True, slots=True)
class Layout:
    """A captured user table as its history table mirrors it."""

    schema: str
    table: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    """The columns that name a row: the primary key (else the replica identity index)."""

    @property
    def history(self) -> str:
        return history_table_name(self.schema, self.table)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)


_COLUMNS_SQL = sa.text(
    "SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typname, a.atttypmod "
    "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
    "WHERE a.attrelid = to_regclass(:rel) AND a.attnum > 0 AND NOT a.attisdropped "
    "ORDER BY a.attnum"
)
_KEY_INDEX_SQL = sa.text(
    "SELECT i.indexrelid FROM pg_index i WHERE i.indrelid = to_regclass(:rel) "
    "AND (i.indisprimary OR i.indisreplident) ORDER BY NOT i.indisprimary LIMIT 1"
)
_INDEXES_SQL = sa.text(
    "SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i "
    "WHERE i.indrelid = to_regclass(:rel) ORDER BY i.indexrelid"
)
_INDEX_BODY = re.compile(r" USING (\w+) (\(.*)$", re.DOTALL)


def layout(conn: Connection, schema: str, table: str) -> Layout:
    """``schema.table`` as the catalog describes it now. Raises :class:`ConfigError` if
    it does not exist or has neither a primary key nor a replica identity index (a
    version could not say which row it is)."""
    rel = f"{quote(schema)}.{quote(table)}"
    columns = tuple(
        Column(name, kind, typname, int(typmod))
        for name, kind, typname, typmod in conn.execute(_COLUMNS_SQL, {"rel": rel})
    )
    if not columns:
        raise ConfigError(f"history: no table {schema}.{table}")
    index = conn.execute(_KEY_INDEX_SQL, {"rel": rel}).scalar()
    if index is None:
        raise ConfigError(
            f"history: {schema}.{table} has no primary key (nor a replica identity index): "
            "a version could not name its row"
        )
    key = tuple(
        conn.execute(
            sa.text(
                "SELECT a.attname FROM pg_index i "
                "JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) ON true "
                "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
                "WHERE i.indexrelid = :index ORDER BY k.n"
            ),
            {"index": index},
        ).scalars()
    )
    return Layout(schema, table, columns, key)


def history_ddl(conn: Connection, found: Layout) -> list[str]:
    """The statements that create ``found``'s history table and its indexes: the user
    table's own (none unique: a row has many versions), one unique on (key, creating
    transaction) that the recorder finds a version by, one on (key, change LSN) that
    orders a row's versions, and one on the commit time they start at."""
    name = found.history
    table = qualified(name)
    columns = [f"{quote(c.name)} {c.type}" for c in found.columns]
    columns += [f"{n} {t}{'' if null else ' NOT NULL'}" for n, t, null in FL_COLUMNS]
    key = ", ".join(quote(c) for c in found.key)
    ddl = [
        f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(columns)})",
        f"CREATE UNIQUE INDEX IF NOT EXISTS {quote(_index_name(name, 'v'))} "
        f"ON {table} ({key}, _fl_xmin)",
        f"CREATE INDEX IF NOT EXISTS {quote(_index_name(name, 'o'))} "
        f"ON {table} ({key}, _fl_change)",
        f"CREATE INDEX IF NOT EXISTS {quote(_index_name(name, 't'))} ON {table} (_fl_from)",
    ]
    rel = f"{quote(found.schema)}.{quote(found.table)}"
    for n, definition in enumerate(conn.execute(_INDEXES_SQL, {"rel": rel}).scalars()):
        body = _INDEX_BODY.search(definition)
        if body is None:
            continue
        ddl.append(
            f"CREATE INDEX IF NOT EXISTS {quote(_index_name(name, f'u{n}'))} "
            f"ON {table} USING {body[1]} {body[2]}"
        )
    return ddl


def _index_name(history: str, suffix: str) -> str:
    return f"{history[: MAX_NAME - len(suffix) - 1]}_{suffix}"


def follow(conn: Connection, found: Layout) -> list[str]:
    """Add to ``found``'s history table the columns its user table has gained (``ADD
    COLUMN``), with the same type and default, so the versions recorded before hold the
    default, as the table's rows did then; the statements run. (A volatile default such
    as ``now()`` is evaluated now, not when the column was added.) Run as the owner."""
    have = set(
        conn.execute(
            sa.text(
                "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:rel) "
                "AND attnum > 0 AND NOT attisdropped"
            ),
            {"rel": qualified(found.history)},
        ).scalars()
    )
    defaults: dict[str, str] = dict(
        conn.execute(
            sa.text(
                "SELECT a.attname, pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d "
                "JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum "
                "WHERE d.adrelid = to_regclass(:rel)"
            ),
            {"rel": f"{quote(found.schema)}.{quote(found.table)}"},
        ).all()
    )
    ran = []
    for column in found.columns:
        if column.name in have:
            continue
        default = defaults.get(column.name)
        statement = (
            f"ALTER TABLE {qualified(found.history)} ADD COLUMN {quote(column.name)} "
            f"{column.type}{f' DEFAULT {default}' if default else ''}"
        )
        conn.execute(sa.text(statement))
        ran.append(statement)
    return ran


GRANTS = (
    "GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO freshline_consumer",
    "GRANT SELECT ON {table} TO freshline_api",
)
"""What the recorder (the consumer role) and the readers (the API role) need on a
history table."""


def create(conn: Connection, found: Layout, retention_s: int | None) -> bool:
    """Create ``found``'s history table, its indexes and grants, and register it
    (idempotent); True if it was not registered before. Run as the owner."""
    for statement in history_ddl(conn, found):
        conn.execute(sa.text(statement))
    for grant in GRANTS:
        conn.execute(sa.text(grant.format(table=qualified(found.history))))
    inserted = conn.execute(
        sa.text(
            f"INSERT INTO {SCHEMA}.history_tables "
            "(source_schema, source_table, history_table, retention_s) "
            "VALUES (:schema, :table, :history, :retention) "
            "ON CONFLICT (source_schema, source_table) DO UPDATE SET retention_s = "
            "excluded.retention_s RETURNING (xmax = 0)"
        ),
        {
            "schema": found.schema,
            "table": found.table,
            "history": found.history,
            "retention": retention_s,
        },
    ).scalar()
    return bool(inserted)


@dataclass(frozen=True, slots=True)
class Registered:
    """A row of ``freshline.history_tables``."""

    schema: str
    table: str
    history: str
    s0_snapshot: str | None
    s0_at_us: int | None
    s0_lsn: str | None
    complete_to_us: int | None
    broken_from_us: int | None
    broken_reason: str | None
    retention_s: int | None


_US = "floor(extract(epoch FROM {0}) * 1000000)::bigint"


def registered(conn: Connection) -> dict[tuple[str, str], Registered]:
    """Every registered history table, by ``(schema, table)``; empty before migration
    0006 or when none is."""
    if conn.execute(sa.text(f"SELECT to_regclass('{SCHEMA}.history_tables')")).scalar() is None:
        return {}
    rows = conn.execute(
        sa.text(
            "SELECT source_schema, source_table, history_table, s0_snapshot::text, "
            f"{_US.format('s0_at')}, s0_lsn::text, {_US.format('complete_to')}, "
            f"{_US.format('broken_from')}, broken_reason, retention_s "
            f"FROM {SCHEMA}.history_tables ORDER BY 1, 2"
        )
    )
    return {(r[0], r[1]): Registered(*r) for r in rows}
