"""Incremental maintenance derived from a declaration of windowed aggregations.

:func:`freshline.pipeline.core.aggregations.Aggregations` with ``incremental=True`` gets a
:class:`DerivedPath`: per-day partial aggregates in freshline's schema, a log of the days
writes have changed, kept by statement-level triggers on the source table, a fold, and an
incremental query that reads at most one partial per whole day of the window plus the
source rows of the days the window's edges cut through and of the days logged since the
last fold, whatever the entity's history.

What the partials hold
----------------------
Per (tenant, key, UTC day of the time column), for each aggregation over the rows that
pass the declaration's and its own ``where``: the row count; the count, ``numeric`` sum
and sum of squares of the column; its least and greatest value; the latest row's time
and value (ties: the greatest value, as the defining query orders them). Per
``count_distinct``, a table of (tenant, key, day, value, rows) and each value's latest
day. The incremental query adds the *clean* whole days strictly between the window's edge
days to the source rows of the edge days (``(c, end of c's day)`` and ``[start of
as_of's day, as_of]``) and of the *dirty* days (those in the log), so a row after
``as_of`` is never counted, and a row leaving the window is simply no longer read.

Why the values are exact in every snapshot
------------------------------------------
A write costs one small insert: a statement trigger appends the (key, day)s of the rows
it added, removed or changed (before and after) to the log, in the writer's
transaction.
An UPDATE logs only the old and new rows whose columns that any value reads (key, time,
tiebreak, aggregated columns, those its SQL names as ``x.col``) are not matched, as a
multiset, among the other side's: where they all are, every (key, day) has the same
multiset of what is read, so the same partials.
So in any snapshot, every committed write to a day the snapshot sees has its log row
there too, until a fold removes it. The fold (one function, under an advisory lock that
rebuilds take too) deletes some logged (key, day)s, then recomputes those days' partials
from the source rows, in later statements (their snapshot is the same or later). A
reader's snapshot R reads a day's partial only if R sees no log row of it:

* if R does not see the fold's commit, it sees the log rows the fold deleted: the day
  is dirty and read from its source rows;
* if R sees it, the partial is the day as of the fold's recompute, which saw every write
  whose log row the fold deleted; a write the fold did not see committed after the
  fold's delete began, so its log row was not deleted, and R, seeing the write, sees
  that row: the day is dirty again.

So a clean day's partial always equals the aggregate of the source rows R sees. For a
``count_distinct``, a value counts once if it has a member row on a clean whole day (its
latest day is such a day, or, when its latest day is dirty or not before ``as_of``'s, a
member row on one exists), plus the distinct values of the edge and dirty days' rows that
have none: the members of clean days are exact, and a value's latest day is the latest of
its member rows as folded. The sums are ``numeric`` and the mean and deviation the same
``numeric`` formulas the defining query uses, so both paths give the same digits.

Heads: the current day without its rows
--------------------------------------
A read takes ``as_of``'s day from the rows, and an entity written all day long has many
there. So the consumers' fold also keeps, per key, a *head*: the partial of the current
UTC day's rows before a *cut* (the fold's ``now()``). A log row carries the earliest time
of the rows it names (``at``), and a read uses a key's head only if it is of ``as_of``'s
day, its cut is at or before ``as_of``, and the reader sees no log row of the day with
``at`` before the cut; it then reads the day's rows from the cut on. The fold deletes the
day's log rows before its new cut (for up to ``$1`` keys) and writes the heads in one
statement, so in one snapshot: an old head of the day whose cut is at or before every
deleted row's ``at`` grows by the rows between the two cuts, any other is made from the
day's rows before the new cut. The argument above holds with "the day" read as "the day
before the cut": a write to those rows the snapshot does not see left its log row, which
the reader sees; one whose log row the fold deleted is in the snapshot. Those deleted
rows no longer mark the whole day dirty, so the fold leaves a marker (``at`` = infinity,
never before a cut) that does until a fold of the whole day, which also drops the day's
heads. Heads are kept only when every window is a day or longer (then all of
``as_of``'s day before ``as_of`` is in every window).

Updates as deltas
-----------------
An UPDATE of a row before a head's cut would make the head stale, and every read take the
day's rows again until the next fold: under corrections of amounts, a busy entity's reads
would take its whole day. So an UPDATE that leaves every *fixed* column as it was (the key,
time, tiebreak, the declaration's ``where``'s columns, and every column a
``count_distinct`` or ``last`` reads), as a multiset over the rows it changed, logs per
(key, day) a *delta* instead: the earliest and latest time of those rows (``at``,
``till``), and, for each *moving* aggregation (a count, sum, mean, deviation, min or max
whose column or ``where`` is not fixed), the new rows' counts and sums less the old rows',
and the new and the old rows' least or greatest value. Every (key, day, time) then has the
same rows, with other values in those columns only, so the aggregations that are not
moving are unchanged, and a head's counts and sums plus the deltas are those of its rows
now. A maximum is taken in only while every old value of the deltas is below the head's:
then no row that held it was changed, and every value a row took and lost on the way is
an old value of a later delta, so the greatest of the head's and the deltas' new values
is the maximum (a minimum likewise). A read uses a head with the deltas whose ``till`` is
before its cut added, unless a log row of the day before the cut is not such a delta (no
``till``, one that reaches the cut, or one that moves the head's extreme): then it reads
the day's rows from their start, as before. The deltas a head has not taken are exactly
those in the log that the reader sees: the fold that made the head deleted, in its
snapshot, the log rows of every write that snapshot sees, and a write it does not see
left its log row for every reader that sees the write. The fold takes them into an old
head the same way (with the rows from its cut to the new one). A delta of a day before
``as_of``'s marks that day to be read from its rows, as any log row does.

Installing it changes the user's table (triggers), so ``freshline apply`` does it only
with ``--alter-tables``, and fills the partials from the existing rows in the same
transaction, under ``LOCK TABLE ... IN SHARE MODE`` (writers wait for the build). The
consumers' upkeep thread folds (:meth:`DerivedPath.fold`, EXECUTE on the generated
function is all it needs); ``freshline buckets fold`` does it by hand. The consumers fold
the current UTC day only now and then (:meth:`DerivedPath.fold_settled` leaves it): a read
takes its ``as_of``'s day from the rows whatever the partial holds, so under a steady
stream of writes a fold of that day is recomputed again and again for no reader.

Every generated function runs as the owner, and no other login may write the path's
tables or run its functions (:meth:`DerivedPath.grants`: freshline's roles read, the
consumers fold): a log row forged by another login would move a head's values. Each
trigger function refuses to run as any trigger but its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.core.declarations import Agg, Declaration, Lookup, last_order, since
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.features import Entity
from freshline.pipeline.core.incremental import IncrementalPath, Queries

SCHEMA = "freshline"
LAYOUT = 5
"""The generated tables' layout; part of their names, so a change of it (a new column, a
new table) installs anew beside what an earlier freshline made."""
HEAD_ROWS = 64
"""How many logged rows of the current day after a head's cut (or of a key with none) a
fold waits for before it moves the head (``SET freshline.head_rows`` in the fold's
session overrides it): reads take those rows from the table, few enough to cost less
than a fold of every key written to."""
_COLUMN_OF_X = re.compile(r'\bx\.("?)(\w+)\1')
_ROW_X = re.compile(r"\bx\b")
_UTC_DAY = "(({t}) AT TIME ZONE 'UTC')::pg_catalog.date"  # qualified: see _functions
_DAY_START = "({d})::timestamp AT TIME ZONE 'UTC'"


def _day(expr: str) -> str:
    return _UTC_DAY.format(t=expr)


def _start(day: str) -> str:
    return _DAY_START.format(d=day)


@dataclass(frozen=True)
class _Slot:
    """One aggregation's columns in the day partials."""

    index: int
    agg: Agg
    window_s: int
    tiebreak: bool = False

    @property
    def where(self) -> str:
        return f"({self.agg.where})" if self.agg.where else "true"

    def columns(self) -> list[tuple[str, str]]:
        """(name, type) of its partial columns; ``{col}`` is the source column's type."""
        i, kind = self.index, self.agg.kind
        if kind == "count":
            return [(f"c{i}", "bigint")]
        if kind in ("sum", "mean", "stddev"):
            return [(f"n{i}", "bigint"), (f"s{i}", "numeric"), (f"q{i}", "numeric")]
        if kind == "min":
            return [(f"mn{i}", "{col}")]
        if kind == "max":
            return [(f"mx{i}", "{col}")]
        if kind == "last":
            broken = [(f"lb{i}", "{tb}")] if self.tiebreak else []
            return [(f"lt{i}", "timestamptz"), *broken, (f"lv{i}", "{col}")]
        return []  # count_distinct: a table of its own

    def deltas(self) -> list[tuple[str, str]]:
        """(name, type) of its columns in an update's delta log row: the change of each
        count and sum, and of a min or max the new rows' extreme and the old rows'."""
        i, kind = self.index, self.agg.kind
        if kind == "count":
            return [(f"dc{i}", "bigint")]
        if kind in ("sum", "mean", "stddev"):
            return [(f"dn{i}", "bigint"), (f"ds{i}", "numeric"), (f"dq{i}", "numeric")]
        if kind == "min":
            return [(f"dmn{i}", "{col}"), (f"don{i}", "{col}")]
        if kind == "max":
            return [(f"dmx{i}", "{col}"), (f"dox{i}", "{col}")]
        return []


class DerivedPath(IncrementalPath):
    """The incremental path of one declaration (see the module's docstring)."""

    name = "derived"

    def __init__(self, fs_name: str, entity: Entity, decl: Declaration, digest: str) -> None:
        """``digest``: of the defining query, so that a changed declaration (a new
        schema version) gets tables of its own beside the old one's."""
        self.entity = entity
        self.decl = decl
        self.prefix = f"agg_{fs_name[:40]}_{digest}"
        self.slots = [
            _Slot(i, a, w, decl.tiebreak is not None)
            for i, (a, w) in enumerate(zip(decl.aggs, decl.windows_s, strict=True))
        ]
        self.windows = sorted(set(decl.windows_s))

    # -- names ------------------------------------------------------------------------

    @property
    def days(self) -> str:
        return f"{SCHEMA}.{self.prefix}_days"

    def members(self, slot: _Slot) -> str:
        return f"{SCHEMA}.{self.prefix}_d{slot.index}"

    def latest(self, slot: _Slot) -> str:
        return f"{SCHEMA}.{self.prefix}_l{slot.index}"

    @property
    def log(self) -> str:
        """The (key, day)s whose partials writes have changed since the last fold."""
        return f"{SCHEMA}.{self.prefix}_log"

    @property
    def head(self) -> str:
        """Per key, the partial of the current UTC day's rows before a cut."""
        return f"{SCHEMA}.{self.prefix}_head"

    @property
    def heads(self) -> bool:
        """Whether the path keeps heads: only when every window is a day or longer, so
        that the whole of ``as_of``'s day before ``as_of`` is in every window."""
        return min(self.windows) >= 86_400

    @property
    def tables(self) -> list[str]:
        """Every table of the path."""
        return [
            self.days,
            *(t for s in self.distinct for t in (self.members(s), self.latest(s))),
            *([self.head] if self.heads else []),
            self.log,
        ]

    @property
    def distinct(self) -> list[_Slot]:
        return [s for s in self.slots if s.agg.kind == "count_distinct"]

    @property
    def fixed(self) -> set[str]:
        """The source columns an UPDATE must leave as they were (as a multiset over the
        rows it changed) to be logged as a delta: the key, time and tiebreak, the
        declaration's ``where``'s, and every column a ``count_distinct`` or ``last``
        reads (what no delta can take back)."""
        d = self.decl
        kept = [s for s in self.slots if s.agg.kind in ("count_distinct", "last")]
        texts = [t for t in [d.where, *(s.agg.where for s in kept)] if t]
        cols = {*self._src_cols(), d.time, *([d.tiebreak] if d.tiebreak else [])}
        cols |= {str(s.agg.column) for s in kept if s.agg.column}
        return cols | {m.group(2) for t in texts for m in _COLUMN_OF_X.finditer(t)}

    @property
    def moving(self) -> list[_Slot]:
        """The aggregations an update logged as a delta can change (their column or
        ``where`` names a column not :attr:`fixed`): counts, sums, means, deviations,
        minima and maxima. Only with heads, and without lookups."""
        if not self.heads or self.decl.lookups:
            return []
        fixed = self.fixed
        out = []
        for s in self.slots:
            if not s.deltas():
                continue
            named = {s.agg.column} if s.agg.column else set()
            named |= {m.group(2) for m in _COLUMN_OF_X.finditer(s.agg.where or "")}
            if not named <= fixed:
                out.append(s)
        return out

    @property
    def keys(self) -> list[str]:
        """The partials' key columns: the entity's (tenant first), then ``day``."""
        return [*self.entity.columns, "day"]

    def _src_keys(self, alias: str) -> list[str]:
        """The source's columns that hold the partials' key columns, on ``alias``."""
        own = [f"{alias}.{self.decl.entity_column}"]
        if self.entity.tenant:
            own.insert(0, f"{alias}.{self.decl.tenant_column}")
        return [*own, _day(f"{alias}.{self.decl.time}")]

    def _row_filter(self, alias: str) -> str:
        """The rows the partials summarise: with a key and a time, passing ``where``."""
        own = [f"{alias}.{c} IS NOT NULL" for c in [*self._src_cols(), self.decl.time]]
        if self.decl.where:
            own.append("(" + self.decl.where.replace("x.", f"{alias}.") + ")")
        return " AND ".join(own)

    # -- DDL ----------------------------------------------------------------------------

    # long: the partials' DDL; issue 59 splits it into per-kind classes
    def ddl(self, conn: Connection) -> list[str]:
        """The statements that install this path: its tables, trigger functions and the
        triggers on the source table (the last change the user's table), then the
        build of the partials from the rows there are."""
        table = self._qualified(conn)
        lookups = self._lookup_tables(conn)
        types = self._column_types(conn, table, lookups)
        key_types = [
            *(["text"] if self.entity.tenant else []),
            self.entity.type,
            "date",
        ]
        keys = ", ".join(f"{k} {t} NOT NULL" for k, t in zip(self.keys, key_types, strict=True))
        tb = types[self.decl.tiebreak] if self.decl.tiebreak else ""
        partial = [
            f"{name} {kind.format(col=types[s.agg.column], tb=tb) if s.agg.column else kind}"
            for s in self.slots
            for name, kind in s.columns()
        ]
        # Per count_distinct: how many values have this day as their latest (so that the
        # values whose latest day is a clean whole day are a sum over days, not a count
        # over values).
        cols = partial + [f"lc{s.index} bigint NOT NULL DEFAULT 0" for s in self.distinct]
        out = [
            f"CREATE TABLE IF NOT EXISTS {self.days} ({keys}, {', '.join(cols)}, "
            f"PRIMARY KEY ({', '.join(self.keys)}))"
        ]
        entity_keys = ", ".join(
            f"{k} {t} NOT NULL" for k, t in zip(self.keys[:-1], key_types[:-1], strict=True)
        )
        ents = ", ".join(self.entity.columns)
        for s in self.distinct:
            assert s.agg.column is not None
            value = f"value {types[s.agg.column]} NOT NULL"
            out += [
                f"CREATE TABLE IF NOT EXISTS {self.members(s)} ({keys}, {value}, "
                f"n bigint NOT NULL, PRIMARY KEY ({ents}, value, day))",
                f"CREATE TABLE IF NOT EXISTS {self.latest(s)} ({entity_keys}, {value}, "
                f"latest date NOT NULL, PRIMARY KEY ({ents}, value))",
                f"CREATE INDEX IF NOT EXISTS {self.prefix}_l{s.index}_by_day "
                f"ON {self.latest(s)} ({ents}, latest)",
            ]
        if self.heads:
            hv = [f"hv{s.index} {types[str(s.agg.column)]}[]" for s in self.distinct]
            out.append(
                f"CREATE TABLE IF NOT EXISTS {self.head} ({entity_keys}, day date NOT NULL, "
                f"cut timestamptz NOT NULL, {', '.join([*partial, *hv])}, PRIMARY KEY ({ents}))"
            )
        day_keys = ", ".join(self.keys)
        deltas = "".join(
            f", {name} {kind.format(col=types[s.agg.column]) if s.agg.column else kind}"
            for s in self.moving
            for name, kind in s.deltas()
        )
        out += [
            f"CREATE TABLE IF NOT EXISTS {self.log} ({keys}, at timestamptz NOT NULL, "
            f"till timestamptz{deltas})",
            f"CREATE INDEX IF NOT EXISTS {self.prefix}_log_by_key ON {self.log} ({day_keys}, at)",
        ]
        read = self._read_columns(conn, table, types)
        out += self._functions(table, types, lookups, read, self._collated(conn, table, read))
        out += self.grants(conn)
        fn = f"{SCHEMA}.{self.prefix}"
        trigger = self.trigger
        out += [
            f"DROP TRIGGER IF EXISTS {trigger}_i ON {table}",
            f"DROP TRIGGER IF EXISTS {trigger}_u ON {table}",
            f"DROP TRIGGER IF EXISTS {trigger}_d ON {table}",
            f"DROP TRIGGER IF EXISTS {trigger}_t ON {table}",
            f"CREATE TRIGGER {trigger}_i AFTER INSERT ON {table} REFERENCING NEW TABLE AS "
            f"new_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn}_i()",
            f"CREATE TRIGGER {trigger}_u AFTER UPDATE ON {table} "
            "REFERENCING OLD TABLE AS "
            f"old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn}_u()",
            f"CREATE TRIGGER {trigger}_d AFTER DELETE ON {table} REFERENCING OLD TABLE AS "
            f"old_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn}_d()",
            f"CREATE TRIGGER {trigger}_t AFTER TRUNCATE ON {table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {fn}_t()",
            *self._always(table, "iudt"),
        ]
        out += self.partition_triggers(self.partitions(conn))
        for n, looked in enumerate(lookups):  # a change there logs the days it decides
            name = f"{trigger}_l{n}"
            out += [
                *(f"DROP TRIGGER IF EXISTS {name}{op} ON {looked}" for op in "iudt"),
                f"CREATE TRIGGER {name}i AFTER INSERT ON {looked} REFERENCING NEW TABLE AS "
                f"new_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn}_l{n}i()",
                f"CREATE TRIGGER {name}u AFTER UPDATE ON {looked} REFERENCING OLD TABLE AS "
                f"old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn}_l{n}u()",
                f"CREATE TRIGGER {name}d AFTER DELETE ON {looked} REFERENCING OLD TABLE AS "
                f"old_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn}_l{n}d()",
                f"CREATE TRIGGER {name}t AFTER TRUNCATE ON {looked} "
                f"FOR EACH STATEMENT EXECUTE FUNCTION {fn}_l{n}t()",
                *(f"ALTER TABLE {looked} ENABLE ALWAYS TRIGGER {name}{op}" for op in "iudt"),
            ]
        out += [
            *self._locks(table, lookups),
            *self._rebuild_sql(table, keys_from=None),
            # Statistics now, not at autovacuum's leisure: without them the first
            # recomputes plan the partials as empty tables (a head entity's took a
            # second, against milliseconds once analysed).
            *(f"ANALYZE {t}" for t in self.tables),
        ]
        return out

    @staticmethod
    def _collated(conn: Connection, table: str, read: list[str]) -> frozenset[str]:
        """The columns of ``read`` whose equality is not identity: those with a
        collation (a nondeterministic one calls 'open' and 'OPEN' equal), and citext."""
        if not read:
            return frozenset()
        return frozenset(
            conn.execute(
                sa.text(
                    "SELECT a.attname FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
                    "WHERE a.attrelid = CAST(:t AS regclass) AND a.attname = ANY(:c) "
                    "AND (a.attcollation <> 0 OR t.typname = 'citext')"
                ),
                {"t": table, "c": read},
            ).scalars()
        )

    def _read_columns(self, conn: Connection, table: str, types: dict[str, str]) -> list[str]:
        """The source table's columns a value can depend on: its key, time and tiebreak,
        the aggregated ones, and those the ``where``s and lookups name as ``x.col``; none
        (every column) when some SQL of the declaration names the row ``x`` otherwise, or
        a column's type has no default equality (the update trigger compares them)."""
        d = self.decl
        sql = [d.where, *(a.where for a in d.aggs), *(lk.query for lk in d.lookups)]
        texts = [t for t in [*sql, *(lk.rows for lk in d.lookups)] if t]
        if any(_ROW_X.search(_COLUMN_OF_X.sub("", t)) for t in texts):
            return []
        used = [*self._src_cols(), d.time, *([d.tiebreak] if d.tiebreak else [])]
        used += [a.column for a in d.aggs if a.column]
        used += [m.group(2) for t in texts for m in _COLUMN_OF_X.finditer(t)]
        looked_up = {c for lk in d.lookups for c in lk.columns}
        columns = [c for c in dict.fromkeys(used) if c in types and c not in looked_up]
        comparable = conn.execute(
            sa.text(
                "SELECT bool_and(EXISTS (SELECT 1 FROM pg_opclass o JOIN pg_am m "
                "ON m.oid = o.opcmethod WHERE m.amname = 'btree' AND o.opcdefault "
                "AND o.opcintype = a.atttypid)) FROM pg_attribute a "
                "WHERE a.attrelid = CAST(:t AS regclass) AND a.attname = ANY(:c)"
            ),
            {"t": table, "c": columns},
        ).scalar()
        return columns if comparable else []

    def _qualified(self, conn: Connection, name: str | None = None) -> str:
        name = name or self.decl.table
        found = conn.execute(sa.text("SELECT to_regclass(:t)::text"), {"t": name}).scalar()
        if found is None:
            raise ConfigError(f"table {name!r} does not exist")
        return str(found) if "." in str(found) else f"public.{found}"

    def _lookup_tables(self, conn: Connection) -> list[str]:
        """The lookups' tables, qualified, in the declaration's order."""
        return [self._qualified(conn, lk.table.name) for lk in self.decl.lookups]

    def _locks(self, table: str, lookups: list[str]) -> list[str]:
        """What a build of partials holds: the path's lock, its tables unwritten."""
        return [
            f"SELECT pg_advisory_xact_lock({self.lock})",
            *(f"LOCK TABLE {t} IN SHARE MODE" for t in [table, *lookups]),
        ]

    def _column_types(self, conn: Connection, table: str, lookups: list[str]) -> dict[str, str]:
        """The source table's column types, and the lookups' columns' (each its own
        table's column of that name)."""

        def types_of(name: str) -> dict[str, str]:
            rows = conn.execute(
                sa.text(
                    "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                    "WHERE attrelid = CAST(:t AS regclass) AND attnum > 0 AND NOT attisdropped"
                ),
                {"t": name},
            ).all()
            return {str(column): str(kind) for column, kind in rows}

        types = types_of(table)
        for lookup, looked in zip(self.decl.lookups, lookups, strict=True):
            theirs = types_of(looked)
            for column in lookup.columns:
                if column in types:
                    raise ConfigError(
                        f"lookup column {column!r} is also a column of {self.decl.table!r} "
                        "(name them apart)"
                    )
                if column not in theirs:
                    raise ConfigError(
                        f"lookup column {column!r} is not a column of {lookup.table.name!r}"
                    )
                types[column] = theirs[column]
        return types

    def _aggregate_rows(self, source: str, alias: str, where: str, arrays: bool = False) -> str:
        """``SELECT`` of the partials of ``source`` rows ``alias`` passing ``where``; with
        ``arrays``, then each ``count_distinct``'s values as an array (a head's)."""
        parts = self._src_keys(alias)
        values = []
        for s in self.slots:
            cond = f"({where} AND {s.where.replace('x.', f'{alias}.')})"
            col = f"{alias}.{s.agg.column}"
            match s.agg.kind:
                case "count":
                    values.append(f"count(*) FILTER (WHERE {cond})")
                case "sum" | "mean" | "stddev":
                    values += [
                        f"count({col}) FILTER (WHERE {cond})",
                        f"coalesce(sum({col}::numeric) FILTER (WHERE {cond}), 0)",
                        f"coalesce(sum({col}::numeric * {col}::numeric) FILTER (WHERE {cond}), 0)",
                    ]
                case "min" | "max":
                    values.append(f"{s.agg.kind}({col}) FILTER (WHERE {cond})")
                case "last":
                    time = f"{alias}.{self.decl.time}"
                    values.append(f"max({time}) FILTER (WHERE {cond})")
                    tiebreak = f"{alias}.{self.decl.tiebreak}" if s.tiebreak else None
                    if tiebreak:
                        first = f"{time} DESC, {tiebreak} DESC NULLS LAST"
                        values.append(
                            f"(array_agg({tiebreak} ORDER BY {first}) FILTER (WHERE {cond}))[1]"
                        )
                    order = last_order(time, col, tiebreak)
                    values.append(f"(array_agg({col} ORDER BY {order}) FILTER (WHERE {cond}))[1]")
        for s in self.distinct if arrays else []:
            col, cond = self._member(s, alias, where)
            values.append(f"array_agg(DISTINCT {col}) FILTER (WHERE {cond})")
        group = ", ".join(str(i + 1) for i in range(len(parts)))
        return (
            f"SELECT {', '.join(parts + values)} FROM {source} {alias} WHERE {where} "
            f"GROUP BY {group} ORDER BY {group}"
        )

    @staticmethod
    def _member(slot: _Slot, alias: str, where: str) -> tuple[str, str]:
        """(the column, the condition) of a ``count_distinct``'s values among rows
        ``alias`` passing ``where``: its own ``where`` too, and no ``NULL``."""
        col = f"{alias}.{slot.agg.column}"
        return col, f"{where} AND {slot.where.replace('x.', f'{alias}.')} AND {col} IS NOT NULL"

    def _members_rows(self, slot: _Slot, source: str, alias: str, where: str) -> str:
        col, cond = self._member(slot, alias, where)
        parts = [*self._src_keys(alias), col]
        group = ", ".join(str(i + 1) for i in range(len(parts)))
        return (
            f"SELECT {', '.join(parts)}, count(*) FROM {source} {alias} WHERE {cond} "
            f"GROUP BY {group} ORDER BY {group}"
        )

    def _column_list(self) -> list[str]:
        return [name for s in self.slots for name, _ in s.columns()]

    def _insert_days(self, select: str) -> str:
        target = ", ".join([*self.keys, *self._column_list()])
        return f"INSERT INTO {self.days} ({target}) {select}"

    def _insert_members(self, slot: _Slot, select: str) -> str:
        target = ", ".join([*self.keys, "value", "n"])
        return f"INSERT INTO {self.members(slot)} ({target}) {select}"

    def _latest_from_members(self, slot: _Slot, values: str) -> list[str]:
        """Recompute the latest day of the (entity, value)s in ``values`` from the
        members table (after it was recomputed)."""
        ents = ", ".join(self.entity.columns)
        members, latest = self.members(slot), self.latest(slot)
        return [
            f"DELETE FROM {latest} WHERE ({ents}, value) IN ({values})",
            f"INSERT INTO {latest} ({ents}, value, latest) SELECT {ents}, value, max(day) "
            f"FROM {members} WHERE ({ents}, value) IN ({values}) GROUP BY {ents}, value",
        ]

    def _touched_rows(self, table: str, touched: str) -> str:
        """The source rows of the (key, day)s in ``touched``, as a subquery."""
        keys = ", ".join(self.keys)
        cond = " AND ".join(
            [f"x.{c} = t.{k}" for c, k in zip(self._src_cols(), self.entity.columns, strict=True)]
            + [
                f"x.{self.decl.time} >= {_start('t.day')}",
                f"x.{self.decl.time} < {_start('t.day + 1')}",
            ]
        )
        cols, joins = self.decl.looked_up()
        return f"(SELECT {cols} FROM ({touched}) AS t({keys}) JOIN {table} x ON {cond}{joins})"

    def _recompute_days(self, table: str, touched: str, values: dict[int, str]) -> list[str]:
        """Statements that recompute the days in ``touched`` (a query of the partials'
        key columns) from ``table``'s rows; ``values[i]``: a query of the (key, value)s
        of ``count_distinct`` slot ``i`` whose latest day may change."""
        keys = ", ".join(self.keys)
        source = self._touched_rows(table, touched)
        out = [f"DELETE FROM {self.days} WHERE ({keys}) IN ({touched})"]
        if self.heads:  # the log rows that kept a head of these days from use are gone
            out.append(f"DELETE FROM {self.head} WHERE ({keys}) IN ({touched})")
        out.append(self._insert_days(self._aggregate_rows(source, "x", self._row_filter("x"))))
        for s in self.distinct:
            out.append(f"DELETE FROM {self.members(s)} WHERE ({keys}) IN ({touched})")
            select = self._members_rows(s, source, "x", self._row_filter("x"))
            out.append(self._insert_members(s, select))
            out += self._latest_from_members(s, values[s.index])
        return out

    def _log_inserts(self) -> list[str]:
        """The insert trigger's body: every new row with a key and a time, logged."""
        own = " AND ".join(f"x.{c} IS NOT NULL" for c in [*self._src_cols(), self.decl.time])
        keys = ", ".join(self.keys)
        return [
            f"INSERT INTO {self.log} ({keys}, at) SELECT {', '.join(self._src_keys('x'))}, "
            f"x.{self.decl.time} FROM new_rows x WHERE {own}"
        ]

    def _latest_counts(self, slot: _Slot, days: str) -> str:
        """Recount ``slot``'s values whose latest day is each (key, day) in ``days``."""
        mine = " AND ".join(f"l.{c} = d.{c}" for c in self.entity.columns)
        return (
            f"UPDATE {self.days} d SET lc{slot.index} = (SELECT count(*) FROM "
            f"{self.latest(slot)} l WHERE {mine} AND l.latest = d.day) "
            f"WHERE ({', '.join(f'd.{k}' for k in self.keys)}) IN ({days})"
        )

    def _src_cols(self) -> list[str]:
        cols = [self.decl.entity_column]
        if self.entity.tenant:
            cols.insert(0, str(self.decl.tenant_column))
        return cols

    @property
    def lock(self) -> str:
        """The advisory lock that folds and rebuilds of this path take."""
        return f"hashtext('{SCHEMA}.{self.prefix}')"

    @staticmethod
    def _search_path(table: str, lookups: list[str]) -> str:
        """The functions' ``search_path``. A ``where`` or a lookup's query names tables
        and functions as the user wrote them: they resolve in the schemas of the tables
        involved, after pg_catalog (so no user object shadows a built-in), as ``plan``
        checks (:meth:`search_path`)."""
        schemas = dict.fromkeys(t.rsplit(".", 1)[0] for t in [table, *lookups])
        return ", ".join(["pg_catalog", *schemas, "pg_temp"])

    def search_path(self, conn: Connection) -> str:
        """The ``search_path`` the path's trigger functions and fold run with: ``plan``
        checks the declaration's SQL under it, so what plan accepts, the triggers run."""
        return self._search_path(self._qualified(conn), self._lookup_tables(conn))

    def _made_for(self, table: str, lookups: list[str]) -> dict[str, tuple[str, str]]:
        """Each trigger function (``i()``, ``l0t()``, ...) -> (the table, the operation)
        of the one trigger it is made for."""
        ops = {"i": "INSERT", "u": "UPDATE", "d": "DELETE", "t": "TRUNCATE"}
        out = {f"{k}()": (table, op) for k, op in ops.items()}
        out["p()"] = (table, "TRUNCATE")  # BEFORE, on a partition: see _partition_truncate
        for n, looked in enumerate(lookups):
            out |= {f"l{n}{k}()": (looked, op) for k, op in ops.items()}
        return out

    def _guard(self, name: str, table: str, op: str) -> str:
        """Trigger function ``name``'s first statement: refuse to run as any trigger but
        the AFTER ``op`` statement trigger on ``table``. EXECUTE is checked when a
        trigger is made, not when it fires, and the owner may attach it anywhere."""
        literal = table.replace("'", "''")
        root = f"'{literal}'::pg_catalog.regclass"
        # A write addressed to a partition fires the partition's own statement triggers,
        # not the parent's: i(), u() and d() run on every partition too, and p() on a
        # partition only. CASE orders the checks: the parent's costs no lookup (in
        # parentheses: PL/pgSQL ends an IF's condition at the first THEN outside them).
        partition = (
            f"NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree({root}) AS p "
            "WHERE p.relid = TG_RELID)"
        )
        when, what = "AFTER", f"the AFTER {op} statement trigger on %"
        if name in ("i", "u", "d"):
            relation = f"(CASE WHEN TG_RELID = {root} THEN false ELSE {partition} END)"
            what += " or a partition of it"
        elif name == "p":
            relation = f"(CASE WHEN TG_RELID = {root} THEN true ELSE {partition} END)"
            when, what = "BEFORE", f"the BEFORE {op} statement trigger on a partition of %"
        else:
            relation = f"TG_RELID <> {root}"
        return (
            f"IF {relation} OR TG_WHEN <> '{when}' "
            f"OR TG_LEVEL <> 'STATEMENT' OR TG_OP <> '{op}' THEN\n"
            f"        RAISE EXCEPTION 'freshline: {SCHEMA}.{self.prefix}_{name}() runs only as "
            f"{what}', '{literal}' "
            "USING ERRCODE = 'triggered_action_exception';\n    END IF"
        )

    @property
    def _fold_signature(self) -> str:
        return f"{self.prefix}_fold(integer, boolean, boolean)"

    @property
    def _signatures(self) -> list[str]:
        """Every function of the path, as ``pg_get_function_identity_arguments`` names
        its arguments (no schema)."""
        ops = "iudt"
        lookups = [f"l{n}{k}" for n in range(len(self.decl.lookups)) for k in ops]
        return [*(f"{self.prefix}_{k}()" for k in [*ops, "p", *lookups]), self._fold_signature]

    # long: the PL/pgSQL trigger functions; issue 59 splits them into per-kind classes
    def _functions(
        self,
        table: str,
        types: dict[str, str],
        lookups: list[str],
        read: list[str],
        collated: frozenset[str] = frozenset(),
    ) -> list[str]:
        """The trigger functions (each records the (key, day)s its statement touched in
        the log) and the fold (which recomputes logged days from the source rows), each
        SECURITY DEFINER with a fixed ``search_path``: no other login needs a right on
        freshline's schema, and a writer of the table none on the log (see :meth:`grants`)."""
        fn = f"{SCHEMA}.{self.prefix}"
        keys = ", ".join(self.keys)
        path = self._search_path(table, lookups)
        made_for = self._made_for(table, lookups)

        def function(name: str, body: list[str], head: str = "", returns: str = "trigger") -> str:
            if returns == "trigger":
                body = [self._guard(name.removesuffix("()"), *made_for[name]), *body]
            statements = "".join(f"    {b};\n" for b in body)
            end = "    RETURN NULL;\n" if returns == "trigger" else ""
            return (
                f"CREATE OR REPLACE FUNCTION {fn}_{name} RETURNS {returns} LANGUAGE plpgsql "
                f"SECURITY DEFINER SET search_path = {path} "
                f"AS $fn$\n{head}BEGIN\n{statements}{end}END\n$fn$"
            )

        # The fold: the logged (key, day)s, up to $1 of them, leave the log; their days
        # are recomputed from the source rows (see the module's docstring on why that
        # is exact under any interleaving with writers). $3: only days before the
        # current UTC day, which every read takes from its rows anyway, and the heads
        # of the current day (_head_fold).
        key_types = [*(["text"] if self.entity.tenant else []), self.entity.type, "date"]
        picked = [f"fl_k{i}" for i in range(len(self.keys))]
        declare = [f"{v} {t}[];" for v, t in zip(picked, key_types, strict=True)]
        touched = f"SELECT * FROM unnest({', '.join(picked)})"
        ents = ", ".join(self.entity.columns)
        source = self._touched_rows(table, touched)
        body = [
            f"IF $2 THEN PERFORM pg_advisory_xact_lock({self.lock}); "
            f"ELSIF NOT pg_try_advisory_xact_lock({self.lock}) THEN RETURN NULL; END IF",
        ]
        whole = [
            f"SELECT {', '.join(f'array_agg(g.{k})' for k in self.keys)} "
            f"INTO {', '.join(picked)} FROM (SELECT DISTINCT {keys} FROM {self.log} "
            f"WHERE NOT $3 OR day < {_day('now()')} LIMIT $1) AS g",
        ]
        declare.append("fl_h integer := 0;")
        if self.heads:
            head_declare, head_block = self._head_fold(table, key_types[:-1])
            declare += head_declare
            body.append(head_block)
        body += [
            *whole,
            f"IF {picked[0]} IS NULL THEN RETURN fl_h; END IF",
            f"DELETE FROM {self.log} WHERE ({keys}) IN ({touched})",
        ]
        values: dict[int, str] = {}
        after: list[str] = []
        for s in self.distinct:
            assert s.agg.column is not None
            names = [f"fl_v{s.index}_{i}" for i in range(len(self.entity.columns) + 1)]
            vtypes = [*key_types[:-1], types[s.agg.column]]
            declare += [f"{v} {t}[];" for v, t in zip(names, vtypes, strict=True)]
            col = f"x.{s.agg.column}"
            from_rows = (
                f"SELECT {', '.join(self._src_keys('x')[:-1])}, {col} FROM {source} x "
                f"WHERE {self._row_filter('x')} AND {s.where} AND {col} IS NOT NULL"
            )
            from_members = (
                f"SELECT {ents}, value FROM {self.members(s)} WHERE ({keys}) IN ({touched})"
            )
            columns = [*self.entity.columns, "value"]
            body.append(
                f"SELECT {', '.join(f'array_agg(g.{c})' for c in columns)} "
                f"INTO {', '.join(names)} FROM ({from_members} UNION {from_rows}) "
                f"AS g({', '.join(columns)})"
            )
            values[s.index] = f"SELECT * FROM unnest({', '.join(names)})"
            olds = [f"fl_o{s.index}_{i}" for i in range(len(self.keys))]
            declare += [f"{v} {t}[];" for v, t in zip(olds, key_types, strict=True)]
            latest_of = (
                f"SELECT {ents}, latest FROM {self.latest(s)} "
                f"WHERE ({ents}, value) IN ({values[s.index]})"
            )
            body.append(  # the latest days of those values before the fold
                f"SELECT {', '.join(f'array_agg(g.{k})' for k in self.keys)} "
                f"INTO {', '.join(olds)} FROM ({latest_of}) AS g({keys})"
            )
            after.append(
                self._latest_counts(
                    s,
                    f"{touched} UNION SELECT * FROM unnest({', '.join(olds)}) UNION {latest_of}",
                )
            )
        body += self._recompute_days(table, touched, values)
        body += after
        body.append(f"RETURN cardinality({picked[0]}) + fl_h")
        truncate = [f"TRUNCATE {', '.join(self.tables)}"]
        return [
            # An INSERT or COPY logs a row per row, without DISTINCT: measured in one
            # transaction, a single-row INSERT pays +6 us for it against +9.4 us with
            # DISTINCT (+4.6 us as a row trigger, which made a COPY 3.6x slower); 40,000
            # rows inserted at once pay +34% against +50%. The fold's DISTINCT takes the
            # repeats back. The declaration's own where is left out (a day logged that
            # the filter would skip costs a read, no more).
            function("i()", self._log_inserts()),
            function("u()", [self._log_update(read, collated)]),
            function("d()", [self._logged("old_rows x")]),
            function("t()", truncate),
            function("p()", [self._partition_truncate()]),
            *self._lookup_functions(table, function),
            function(
                "fold(integer, boolean, boolean)",
                body,
                head="DECLARE\n" + "".join(f"    {d}\n" for d in declare),
                returns="integer",
            ),
        ]

    def _always(self, table: str, ops: str) -> list[str]:
        """The triggers ``ops`` of ``table`` fire in every session, also one with
        ``session_replication_role = replica`` (``pg_restore --disable-triggers`` and
        logical replication's apply workers set it), where an ordinary trigger does not."""
        return [f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {self.trigger}_{op}" for op in ops]

    def partitions(self, conn: Connection) -> list[str]:
        """Every partition of the source table, at every level, qualified; none when it is
        not partitioned."""
        return list(
            conn.execute(
                sa.text(
                    "SELECT format('%I.%I', n.nspname, c.relname) "
                    "FROM pg_partition_tree(to_regclass(:t)) p JOIN pg_class c ON c.oid = p.relid "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE p.relid <> to_regclass(:t) ORDER BY p.level, 1"
                ),
                {"t": self._qualified(conn)},
            ).scalars()
        )

    def untriggered_partitions(self, conn: Connection) -> list[str]:
        """The partitions without the path's triggers (made after ``apply``): writes
        addressed to them are not logged until ``apply --alter-tables`` attaches them."""
        found = self.partitions(conn)
        if not found:
            return []
        triggered = set(
            conn.execute(
                sa.text(
                    "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_trigger t "
                    "JOIN pg_class c ON c.oid = t.tgrelid "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE t.tgname = :name"
                ),
                {"name": f"{self.trigger}_p"},
            ).scalars()
        )
        return [p for p in found if p not in triggered]

    def partition_triggers(self, partitions: Sequence[str]) -> list[str]:
        """The statement triggers of ``partitions``: a write addressed to a partition fires
        its own triggers, not the parent's (one addressed to the parent fires the
        parent's only), so every write is logged once."""
        fn, trigger = f"{SCHEMA}.{self.prefix}", self.trigger
        out = []
        for part in partitions:
            out += [
                *(f"DROP TRIGGER IF EXISTS {trigger}_{op} ON {part}" for op in "iudp"),
                f"CREATE TRIGGER {trigger}_i AFTER INSERT ON {part} REFERENCING NEW TABLE AS "
                f"new_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn}_i()",
                f"CREATE TRIGGER {trigger}_u AFTER UPDATE ON {part} REFERENCING OLD TABLE AS "
                f"old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn}_u()",
                f"CREATE TRIGGER {trigger}_d AFTER DELETE ON {part} REFERENCING OLD TABLE AS "
                f"old_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn}_d()",
                f"CREATE TRIGGER {trigger}_p BEFORE TRUNCATE ON {part} "
                f"FOR EACH STATEMENT EXECUTE FUNCTION {fn}_p()",
                *self._always(part, "iudp"),
            ]
        return out

    def table_fixes(self, conn: Connection) -> list[str]:
        """What an installed path needs on the user's tables to see every write: its
        triggers on partitions made after it was installed, and ALWAYS on triggers an
        earlier freshline left firing in origin sessions only. ``apply --alter-tables``
        installs it again (:meth:`install`: the triggers, then its partials rebuilt from
        the rows, which a write to an untriggered partition may have missed)."""
        out = []
        parts = self.untriggered_partitions(conn)
        if parts:
            out.append(f"partitions without its triggers: {', '.join(parts)}")
        origin = conn.execute(
            sa.text("SELECT count(*) FROM pg_trigger WHERE tgname LIKE :name AND tgenabled = 'O'"),
            {"name": f"{self.trigger}\\_%"},
        ).scalar()
        if origin:
            out.append(f"{origin} trigger(s) not fired in replica-role sessions (not ALWAYS)")
        return out

    def _partition_truncate(self) -> str:
        """p()'s body, before a TRUNCATE of one partition: log the (key, day)s of every
        row it holds, so that reads take those days from the rows (then gone) until a
        fold rebuilds them. A TRUNCATE of the whole table empties the partials (t())."""
        logged = self._logged("__partition__ x").replace("%", "%%").replace("__partition__", "%s")
        return f"EXECUTE pg_catalog.format($q${logged}$q$, TG_RELID::pg_catalog.regclass)"

    @staticmethod
    def _identity(read: list[str], collated: frozenset[str]) -> str:
        """The select list that compares rows of ``read`` by identity: each column, and
        each of ``collated`` also as its text in the "C" collation, so that a change its
        collation calls equal ('open' to 'OPEN' under a case-insensitive one) differs."""
        cols = [f'"{c}"' for c in read]
        cols += [f'"{c}"::pg_catalog.text COLLATE "C" AS "fl_c_{c}"' for c in read if c in collated]
        return ", ".join(cols)

    @staticmethod
    def _changed_rows(read: list[str], collated: frozenset[str] = frozenset()) -> tuple[str, str]:
        """An UPDATE's rows to log, as FROM items ``x``: of ``read`` (the columns values
        read), the old rows' that no new row has and the new rows' that no old row has
        (EXCEPT ALL, by identity: :meth:`_identity`): an UPDATE that leaves them as they
        were logs nothing, and a day whose rows read the same, as a multiset, has the
        same partial. Without ``read``, every old and new row."""
        if not read:
            return "old_rows x", "new_rows x"
        cols = DerivedPath._identity(read, collated)
        return (
            f"(SELECT {cols} FROM old_rows EXCEPT ALL SELECT {cols} FROM new_rows) AS x",
            f"(SELECT {cols} FROM new_rows EXCEPT ALL SELECT {cols} FROM old_rows) AS x",
        )

    def _log_update(self, read: list[str], collated: frozenset[str] = frozenset()) -> str:
        """The update trigger's body: the changed rows logged (:meth:`_changed_rows`),
        as deltas when the statement left every :attr:`fixed` column as it was, as a
        multiset over those rows (so every (key, day, time) has the rows it had, with
        other values of the :attr:`moving` aggregations' columns): per (key, day), the
        earliest and latest time of its changed rows and what they changed, the new
        rows' counts and sums less the old rows', and the new and old rows' extremes."""
        old, new = self._changed_rows(read, collated)
        plain = self._logged(old, new)
        if not read or not self.moving:
            return plain
        fixed = self.fixed
        cols = self._identity([c for c in read if c in fixed], collated)
        same = (
            f"NOT EXISTS (SELECT {cols} FROM {old} EXCEPT ALL SELECT {cols} FROM {new}) "
            f"AND NOT EXISTS (SELECT {cols} FROM {new} EXCEPT ALL SELECT {cols} FROM {old})"
        )
        signed = (
            f"(SELECT 1 AS fl_sg, x.* FROM {new} WHERE {self._row_filter('x')} UNION ALL "
            f"SELECT -1, x.* FROM {old} WHERE {self._row_filter('x')}) AS x"
        )
        values = []
        for s in self.moving:
            cond, col = s.where, f"x.{s.agg.column}"
            match s.agg.kind:
                case "count":
                    values.append(f"coalesce(sum(x.fl_sg) FILTER (WHERE {cond}), 0)")
                case "sum" | "mean" | "stddev":
                    values += [
                        f"coalesce(sum(x.fl_sg) FILTER (WHERE {cond} AND {col} IS NOT NULL), 0)",
                        f"coalesce(sum(x.fl_sg * {col}::numeric) FILTER (WHERE {cond}), 0)",
                        f"coalesce(sum(x.fl_sg * {col}::numeric * {col}::numeric) "
                        f"FILTER (WHERE {cond}), 0)",
                    ]
                case "min" | "max":
                    values += [
                        f"{s.agg.kind}({col}) FILTER (WHERE {cond} AND x.fl_sg > 0)",
                        f"{s.agg.kind}({col}) FILTER (WHERE {cond} AND x.fl_sg < 0)",
                    ]
        names = [name for s in self.moving for name, _ in s.deltas()]
        time = f"x.{self.decl.time}"
        parts = self._src_keys("x")
        group = ", ".join(str(i + 1) for i in range(len(parts)))
        delta = (
            f"INSERT INTO {self.log} ({', '.join([*self.keys, 'at', 'till', *names])}) "
            f"SELECT {', '.join([*parts, f'min({time})', f'max({time})', *values])} "
            f"FROM {signed} GROUP BY {group}"
        )
        return f"IF {same} THEN\n        {delta};\n    ELSE\n        {plain};\n    END IF"

    def _logged(self, *sources: str) -> str:
        """The statement that logs the (key, day)s of the source rows ``x`` of each FROM
        item in ``sources``, each once, with the earliest time of its rows."""
        rows = " UNION ALL ".join(
            f"SELECT {', '.join(self._src_keys('x'))}, x.{self.decl.time} FROM {source} "
            f"WHERE {self._row_filter('x')}"
            for source in sources
        )
        keys = ", ".join(self.keys)
        return (
            f"INSERT INTO {self.log} ({keys}, at) SELECT {keys}, min(at) "
            f"FROM ({rows}) AS x({keys}, at) GROUP BY {keys}"
        )

    def _stale(self, g: str, h: str) -> str:
        """Whether log row ``g`` keeps head ``h`` from use: a row of the day before its
        cut, unless it is an update's delta wholly before the cut that the head can
        take, that is, of each minimum or maximum it moves, the values it took away
        were inside the head's extreme (so the rows that hold the extreme still do)."""
        takes = [f"{g}.till < {h}.cut"]
        for s in self.moving:
            i = s.index
            for name, kind in s.deltas():
                if kind == "numeric":  # a NaN or an infinity never cancels: read the rows
                    takes.append(
                        f"coalesce({g}.{name} NOT IN ('NaN', 'Infinity', '-Infinity'), true)"
                    )
            if s.agg.kind == "max":
                takes.append(f"coalesce({g}.dox{i} < {h}.mx{i}, {g}.dox{i} IS NULL)")
            elif s.agg.kind == "min":
                takes.append(f"coalesce({g}.don{i} > {h}.mn{i}, {g}.don{i} IS NULL)")
        return f"({g}.at < {h}.cut AND NOT coalesce({' AND '.join(takes)}, false))"

    def _delta_sums(self, g: str, where: str = "") -> list[str]:
        """The aggregates of the delta log rows ``g`` (those passing ``where``), named as
        their columns: the counts and sums added, the extremes of the new rows."""
        only = f" FILTER (WHERE {where})" if where else ""
        out = []
        for s in self.moving:
            if s.agg.kind in ("min", "max"):  # the new rows' extreme; the old one is a check
                name = s.deltas()[0][0]
                out.append(f"{s.agg.kind}({g}.{name}){only} AS {name}")
            else:
                out += [f"sum({g}.{name}){only} AS {name}" for name, _ in s.deltas()]
        return out

    def _taken(self, h: str, d: str) -> list[str]:
        """Head ``h``'s partial columns with the deltas ``d`` (of :meth:`_delta_sums`,
        ``NULL`` when there were none) taken in, each named as its column."""
        moving = {s.index for s in self.moving}
        out = []
        for s in self.slots:
            for c, _ in s.columns():
                if s.index not in moving:
                    out.append(f"{h}.{c}")
                elif s.agg.kind in ("min", "max"):
                    pick = "least" if s.agg.kind == "min" else "greatest"
                    out.append(f"{pick}({h}.{c}, {d}.d{c}) AS {c}")
                else:
                    out.append(f"{h}.{c} + coalesce({d}.d{c}, 0) AS {c}")
        return out

    # long: the head fold's SQL; issue 59 splits it into per-kind classes
    def _head_fold(self, table: str, ent_types: list[str]) -> tuple[list[str], str]:
        """(declarations, block) of the fold's part that moves the heads of the current
        UTC day up to a new cut (the fold's ``now()``), for the keys with log rows of
        the day before it, up to ``$1`` of them, when ``$3`` (see the module's
        docstring, *Heads*)."""
        ents = self.entity.columns
        cols = ", ".join(ents)
        hk = [f"fl_hk{i}" for i in range(len(ents))]
        declare = [
            *(f"{v} {t}[];" for v, t in zip(hk, ent_types, strict=True)),
            f"fl_da date := {_day('now()')};",
            "fl_cut timestamptz := now();",
        ]
        arrays = ", ".join(hk)
        take = ", ".join(f"array_agg(g.{c})" for c in ents)
        keyed = f"({cols}) IN (SELECT * FROM unnest({arrays}))"
        partial = self._column_list()
        hv = [f"hv{s.index}" for s in self.distinct]
        merged = []
        for s in self.slots:
            i = s.index
            match s.agg.kind:
                case "count" | "sum" | "mean" | "stddev":
                    merged += [f"coalesce(o.{c}, 0) + coalesce(n.{c}, 0)" for c, _ in s.columns()]
                case "min" | "max":
                    pick = "least" if s.agg.kind == "min" else "greatest"
                    merged += [f"{pick}(o.{c}, n.{c})" for c, _ in s.columns()]
                case "last":  # every new row is at or after the old cut, every old one before
                    merged += [
                        f"CASE WHEN n.lt{i} IS NOT NULL THEN n.{c} ELSE o.{c} END"
                        for c, _ in s.columns()
                    ]
        merged += [f"ARRAY(SELECT DISTINCT v FROM unnest(o.{c} || n.{c}) AS v)" for c in hv]
        rows_of = " AND ".join(
            [f"x.{c} = t.{k}" for c, k in zip(self._src_cols(), ents, strict=True)]
            + [f"x.{self.decl.time} >= t.lo", f"x.{self.decl.time} < fl_cut"]
        )
        looked_up, joins = self.decl.looked_up()
        source = f"(SELECT {looked_up} FROM t JOIN {table} x ON {rows_of}{joins})"
        new = self._aggregate_rows(source, "x", self._row_filter("x"), arrays=True)
        target = ", ".join([*ents, "day", "cut", *partial, *hv])
        # the keys with HEAD_ROWS rows of the day before the cut logged, or a head a
        # logged row made stale (what reads would take from the rows)
        on = " AND ".join(f"h.{c} = l.{c}" for c in ents)
        mine = ", ".join(f"l.{c}" for c in ents)
        enough = (
            "coalesce(nullif(current_setting('freshline.head_rows', true), '')::integer, "
            f"{HEAD_ROWS})"
        )
        picked = (
            f"SELECT {take} INTO {arrays} FROM (SELECT {mine} FROM {self.log} l "
            f"LEFT JOIN {self.head} h ON {on} AND h.day = l.day "
            "WHERE l.day = fl_da AND l.at < fl_cut "
            f"GROUP BY {mine}, h.cut HAVING count(*) >= {enough} "
            f"OR coalesce(bool_or({self._stale('l', 'h')}), false) LIMIT $1) AS g"
        )
        sums = ", ".join(
            [
                f"coalesce(bool_or({self._stale('g', 'h0')}), false) AS fl_stale",
                *self._delta_sums("g", "g.till < h0.cut"),
            ]
        )
        held = ", ".join(["h0.cut", *self._taken("h0", "k"), *(f"h0.{c}" for c in hv)])
        statements = [
            # One statement, so one snapshot: its log rows before the cut leave the log,
            # and the head is made of what that snapshot sees. A clean old head (one no
            # deleted row made stale) grows by the deltas before its cut and the rows
            # from its cut to the new one; any other key's is made from the day's rows
            # before the new cut.
            f"WITH gone AS (DELETE FROM {self.log} WHERE {keyed} AND day = fl_da "
            "AND at < fl_cut RETURNING *), "
            f"h0 AS (SELECT h.* FROM {self.head} h WHERE {keyed} AND h.day = fl_da), "
            f"k AS (SELECT {cols}, {sums} FROM gone g LEFT JOIN h0 USING ({cols}) "
            f"GROUP BY {cols}), "
            f"o AS (SELECT {cols}, {held} FROM h0 JOIN k USING ({cols}) WHERE NOT k.fl_stale), "
            f"t AS (SELECT {cols}, coalesce(o.cut, {_start('fl_da')}) AS lo "
            f"FROM k LEFT JOIN o USING ({cols})), "
            f"n({', '.join([*ents, 'day', *partial, *hv])}) AS ({new}) "
            f"INSERT INTO {self.head} ({target}) SELECT "
            + ", ".join([*(f"k.{c}" for c in ents), "fl_da", "fl_cut", *merged])
            + f" FROM k LEFT JOIN o USING ({cols}) LEFT JOIN n USING ({cols}) "
            f"ON CONFLICT ({cols}) DO UPDATE SET "
            + ", ".join(f"{c} = EXCLUDED.{c}" for c in ["day", "cut", *partial, *hv]),
            # the day's partial no longer sees those writes in the log: a marker keeps
            # the day dirty until a fold of the whole day (never before a head's cut)
            f"INSERT INTO {self.log} ({cols}, day, at) SELECT k.*, fl_da, 'infinity' "
            f"FROM unnest({arrays}) AS k({cols}) WHERE NOT EXISTS (SELECT 1 FROM "
            f"{self.log} l WHERE "
            + " AND ".join(f"l.{c} = k.{c}" for c in ents)
            + " AND l.day = fl_da AND l.at = 'infinity')",
            f"fl_h := coalesce(cardinality({hk[0]}), 0)",
        ]
        block = (
            f"IF $3 THEN\n        {picked};\n        IF {hk[0]} IS NOT NULL THEN\n"
            + "".join(f"            {r};\n" for r in statements)
            + "        END IF;\n    END IF"
        )
        return declare, block

    def _lookup_functions(self, table: str, function: Callable[[str, list[str]], str]) -> list[str]:
        """Per lookup, the functions of its table's triggers: every (key, day) of the
        source rows that a changed row ``g`` decides (its ``rows=``), before and after,
        is logged; a TRUNCATE logs every row's."""

        def logged(lookup: Lookup, *transition: str) -> str:
            return self._logged(*(f"{table} x JOIN {t} g ON ({lookup.rows})" for t in transition))

        every = self._logged(f"{table} x")
        out = []
        for n, lookup in enumerate(self.decl.lookups):
            out += [
                function(f"l{n}i()", [logged(lookup, "new_rows")]),
                function(f"l{n}u()", [logged(lookup, "old_rows", "new_rows")]),
                function(f"l{n}d()", [logged(lookup, "old_rows")]),
                function(f"l{n}t()", [every]),
            ]
        return out

    def _rebuild_sql(self, table: str, keys_from: str | None) -> list[str]:
        """Fill the partials from ``table``: of every key, or of the keys in
        ``keys_from`` (a query of the entity's columns)."""
        own = self._src_cols()
        ents = ", ".join(self.entity.columns)
        if keys_from is None:
            out = [f"DELETE FROM {t}" for t in self.tables]
            where = self._row_filter("x")
        else:
            match = f"({', '.join(f'x.{c}' for c in own)}) IN ({keys_from})"
            out = [f"DELETE FROM {t} WHERE ({ents}) IN ({keys_from})" for t in self.tables]
            where = f"{self._row_filter('x')} AND {match}"
        cols, joins = self.decl.looked_up()
        rows = f"(SELECT {cols} FROM {table} x{joins})" if self.decl.lookups else table
        out.append(self._insert_days(self._aggregate_rows(rows, "x", where)))
        for s in self.distinct:
            out.append(self._insert_members(s, self._members_rows(s, rows, "x", where)))
            scope = "" if keys_from is None else f" WHERE ({ents}) IN ({keys_from})"
            out.append(
                f"INSERT INTO {self.latest(s)} ({ents}, value, latest) "
                f"SELECT {ents}, value, max(day) FROM {self.members(s)}{scope} "
                f"GROUP BY {ents}, value"
            )
            counts = " AND ".join(f"d.{c} = c.{c}" for c in self.entity.columns)
            out.append(
                f"UPDATE {self.days} d SET lc{s.index} = c.n FROM (SELECT {ents}, latest, "
                f"count(*) AS n FROM {self.latest(s)}{scope} GROUP BY {ents}, latest) AS c "
                f"WHERE {counts} AND d.day = c.latest"
            )
        return out

    # -- the incremental query ------------------------------------------------------------

    # long: the derived-path query compiler; issue 59 splits it into per-kind classes
    def query(self) -> str:
        """The incremental query: the keys ``k``, ``t.as_of``, like the defining one."""
        e, d = self.entity, self.decl
        time = f"x.{d.time}"
        bounds = ["(t.as_of AT TIME ZONE 'UTC')::date AS da"]
        for j, w in enumerate(self.windows):
            c = since("t.as_of", w)
            bounds += [f"{c} AS c{j}", f"{_day(c)} AS dc{j}"]
        slot_w = {s.index: self.windows.index(s.window_s) for s in self.slots}
        mine_b = " AND ".join(f"b.{c} = k.{c}" for c in e.columns)
        mine_g = " AND ".join(f"g.{c} = k.{c}" for c in e.columns)
        mine_x = " AND ".join(
            f"x.{c} = k.{k}" for c, k in zip(self._src_cols(), e.columns, strict=True)
        )
        widest = len(self.windows) - 1
        # The source rows of the edge days (every window's old edge day, and as_of's day,
        # each once), read day by day as index ranges.
        days = ", ".join([*(f"w.dc{j}" for j in range(len(self.windows))), "w.da"])
        days = f"ARRAY[{days}] || dl.dd"  # and the whole days with writes not yet folded

        # LATERAL behind OFFSET 0 (which keeps the planner from flattening it), so each day
        # is an index range whatever the table's statistics say: flattened, a planner
        # without them read the entity's whole window and filtered it by day.
        def on_edge(j: int) -> str:
            return (
                f"{time} > w.c{j} AND ({_day(time)} = w.dc{j} OR {_day(time)} = w.da "
                f"OR {_day(time)} = ANY(dl.dd))"
            )

        # Each row's place in each window's edge is worked out once, as a column
        # (fl_e<j>), not again in every aggregate's FILTER.
        flags = ", ".join(f"{on_edge(j)} AS fl_e{j}" for j in range(len(self.windows)))
        looked_up, joins = d.looked_up()
        # as_of's day from its head's cut on, when a head is in use (hd)
        lower = _start("ed_days.ed_day")
        if self.heads:
            lower = (
                f"CASE WHEN ed_days.ed_day = w.da THEN coalesce(hd.cut, {lower}) ELSE {lower} END"
            )
        any_edge = " OR ".join(f"x.fl_e{j}" for j in range(len(self.windows)))
        edge_rows = (
            f"(SELECT x.* FROM (SELECT DISTINCT ed_day FROM unnest({days}) AS ed_day) "
            f"AS ed_days CROSS JOIN LATERAL (SELECT {looked_up}, {flags} FROM {d.table} x{joins} "
            f"WHERE {mine_x} AND {time} >= {lower} "
            f"AND {time} < {_start('ed_days.ed_day + 1')} AND {time} <= t.as_of OFFSET 0) AS x)"
        )

        def filtered(agg: str, condition: str | None) -> str:
            return f"{agg} FILTER (WHERE {condition})" if condition else agg

        bucket_vals, edge_vals, out = [], [], []
        for s in self.slots:
            i, j, col = s.index, slot_w[s.index], f"x.{s.agg.column}"
            # The partials read are the clean whole days of the widest window; a narrower
            # window's are those after its own edge day.
            inside = None if j == widest else f"b.day > w.dc{j}"
            edge = f"x.fl_e{j} AND {s.where}"
            match s.agg.kind:
                case "count":
                    bucket_vals.append(f"coalesce({filtered(f'sum(b.c{i})', inside)}, 0) AS c{i}")
                    edge_vals.append(f"count(*) FILTER (WHERE {edge}) AS c{i}")
                    out.append(f"bk.c{i} + ed.c{i}")
                case "sum" | "mean" | "stddev":
                    for c in ("n", "s", "q"):
                        bucket_vals.append(
                            f"coalesce({filtered(f'sum(b.{c}{i})', inside)}, 0) AS {c}{i}"
                        )
                    edge_vals += [
                        f"count({col}) FILTER (WHERE {edge}) AS n{i}",
                        f"coalesce(sum({col}::numeric) FILTER (WHERE {edge}), 0) AS s{i}",
                        f"coalesce(sum({col}::numeric * {col}::numeric) "
                        f"FILTER (WHERE {edge}), 0) AS q{i}",
                    ]
                    n, sm, q = (f"(bk.{c}{i} + ed.{c}{i})" for c in ("n", "s", "q"))
                    if s.agg.kind == "sum":
                        out.append(sm)
                    elif s.agg.kind == "mean":
                        out.append(f"CASE WHEN {n} > 0 THEN {sm} / {n} END")
                    else:
                        out.append(
                            f"CASE WHEN {n} > 0 THEN sqrt(greatest({n} * {q} - {sm} * {sm}, 0) "
                            f"/ ({n} * {n})) END"
                        )
                case "min" | "max":
                    m = "mn" if s.agg.kind == "min" else "mx"
                    bucket_vals.append(f"{filtered(f'{s.agg.kind}(b.{m}{i})', inside)} AS {m}{i}")
                    edge_vals.append(f"{s.agg.kind}({col}) FILTER (WHERE {edge}) AS {m}{i}")
                    pick = "least" if s.agg.kind == "min" else "greatest"
                    out.append(f"{pick}(bk.{m}{i}, ed.{m}{i})")
                case "last":
                    tiebreak = f"x.{d.tiebreak}" if s.tiebreak else None
                    btie = f"b.lb{i}" if s.tiebreak else None
                    timed = f"b.lt{i} IS NOT NULL" + (f" AND {inside}" if inside else "")
                    bucket_vals.append(f"{filtered(f'max(b.lt{i})', inside)} AS lt{i}")
                    edge_vals.append(f"max({time}) FILTER (WHERE {edge}) AS lt{i}")
                    if btie and tiebreak:
                        bfirst = f"b.lt{i} DESC, {btie} DESC NULLS LAST"
                        bucket_vals.append(
                            f"(array_agg({btie} ORDER BY {bfirst}) FILTER (WHERE {timed}))[1] "
                            f"AS lb{i}"
                        )
                        first = f"{time} DESC, {tiebreak} DESC NULLS LAST"
                        edge_vals.append(
                            f"(array_agg({tiebreak} ORDER BY {first}) FILTER (WHERE {edge}))[1] "
                            f"AS lb{i}"
                        )
                    border = last_order(f"b.lt{i}", f"b.lv{i}", btie)
                    order = last_order(time, col, tiebreak)
                    bucket_vals.append(
                        f"(array_agg(b.lv{i} ORDER BY {border}) FILTER (WHERE {timed}))[1] AS lv{i}"
                    )
                    edge_vals.append(
                        f"(array_agg({col} ORDER BY {order}) FILTER (WHERE {edge}))[1] AS lv{i}"
                    )
                    new, old, nv, ov = f"ed.lt{i}", f"bk.lt{i}", f"ed.lv{i}", f"bk.lv{i}"
                    nb, ob = f"ed.lb{i}", f"bk.lb{i}"
                    tied = (
                        f"WHEN {nb} IS NOT NULL AND ({ob} IS NULL OR {nb} > {ob}) THEN {nv} "
                        f"WHEN {ob} IS NOT NULL AND ({nb} IS NULL OR {nb} < {ob}) THEN {ov} "
                        if s.tiebreak
                        else ""
                    )
                    out.append(
                        f"CASE WHEN {new} IS NULL THEN {ov} WHEN {old} IS NULL OR {new} > {old} "
                        f"THEN {nv} WHEN {new} < {old} THEN {ov} {tied}WHEN {nv} IS NULL "
                        f"THEN {ov} WHEN {ov} IS NULL THEN {nv} ELSE greatest({nv}, {ov}) END"
                    )
                case "count_distinct":
                    # Values in the whole days (dc, da): those whose latest day is in
                    # them, and those whose latest day is da or later that also occur in
                    # them; then the edge rows' values that do not.
                    members, latest = self.members(s), self.latest(s)
                    mine_l = " AND ".join(f"l.{c} = k.{c}" for c in e.columns)
                    same = " AND ".join(f"m.{c} = k.{c}" for c in e.columns)
                    inside_m = f"m.day > w.dc{j} AND m.day < w.da AND m.day <> ALL(dl.dd)"
                    # Probes one value at a time (a scalar subquery with LIMIT is never
                    # made a join): the values of the edge rows and of as_of's day are few,
                    # the member rows of a head entity's window many.
                    probe = (
                        f"(SELECT 1 FROM {members} m WHERE {same} AND m.value = {{value}} "
                        f"AND {inside_m} LIMIT 1)"
                    )

                    bucket_vals.append(f"coalesce({filtered(f'sum(b.lc{i})', inside)}, 0) AS lc{i}")
                    in_clean = probe.format(value="l.value")
                    edge_values = f"ed.ev{i} || hd.hv{i}" if self.heads else f"ed.ev{i}"
                    # the edge and logged days' values, gathered in the one scan of
                    # their rows
                    edge_vals.append(
                        f"array_agg(DISTINCT {col}) FILTER (WHERE {edge} AND {col} IS NOT NULL) "
                        f"AS ev{i}"
                    )
                    out.append(
                        f"(bk.lc{i}"
                        # (each probed only when there can be such values: folded days
                        # from as_of's on, logged days)
                        f" + CASE WHEN lt.late THEN (SELECT count(*) FROM {latest} l "
                        f"WHERE {mine_l} AND l.latest >= w.da AND {in_clean} IS NOT NULL) "
                        "ELSE 0 END"
                        f" + CASE WHEN cardinality(dl.dd) > 0 THEN (SELECT count(*) "
                        f"FROM {latest} l WHERE {mine_l} AND l.latest = ANY(dl.dd) "
                        f"AND {in_clean} IS NOT NULL) ELSE 0 END"
                        f" + (SELECT count(DISTINCT ev.value) FROM unnest({edge_values}) "
                        f"AS ev(value) WHERE {probe.format(value='ev.value')} IS NULL))"
                    )
        names = [a.field_name() for a in d.aggs]
        body = ",\n       ".join(
            [f"k.{c} AS {c}" for c in e.columns]
            + [
                f"{a.finish(expr)} AS {name}"
                for a, expr, name in zip(d.aggs, out, names, strict=True)
            ]
        )
        bucket_sel = ", ".join(bucket_vals) or "1 AS none"
        partials = (
            f"{self.days} b WHERE {mine_b} AND b.day > w.dc{widest} AND b.day < w.da "
            "AND b.day <> ALL(dl.dd)"
        )
        head = ""
        if self.heads:  # as_of's day before the cut of its head, if no write since made it stale
            # (with the deltas of the updates since its fold of rows before its cut)
            mine_h = " AND ".join(f"h.{c} = k.{c}" for c in e.columns)
            taken = ", ".join(
                [
                    "h.day",
                    "h.cut",
                    *self._taken("h", "gd"),
                    *(f"h.hv{s.index}" for s in self.distinct),
                ]
            )
            sums = ""
            if self.moving:
                sums = (
                    f"CROSS JOIN LATERAL (SELECT {', '.join(self._delta_sums('g'))} "
                    f"FROM {self.log} g WHERE {mine_g} AND g.day = w.da AND g.till < h.cut) "
                    "AS gd "
                )
            head = (
                f"LEFT JOIN LATERAL (SELECT {taken} FROM {self.head} h {sums}WHERE {mine_h} "
                f"AND h.day = w.da AND h.cut <= t.as_of AND NOT EXISTS (SELECT 1 FROM "
                f"{self.log} g WHERE {mine_g} AND g.day = w.da AND {self._stale('g', 'h')})) "
                "AS hd ON true\n"
            )
            columns = ["day", *self._column_list()]
            lcs = [f"lc{s.index}" for s in self.distinct]
            theirs = ", ".join([*(f"hd.{c}" for c in columns), *("0::bigint" for _ in lcs)])
            partials = (
                f"(SELECT {', '.join(f'b.{c}' for c in [*columns, *lcs])} FROM {partials} "
                f"UNION ALL SELECT {theirs} WHERE hd.day IS NOT NULL) AS b"
            )
        edge_sel = ", ".join(edge_vals) or "1 AS none"
        return (
            f"\nSELECT {body}\nFROM k CROSS JOIN t\n"
            f"CROSS JOIN LATERAL (SELECT {', '.join(bounds)}) AS w\n"
            f"CROSS JOIN LATERAL (SELECT coalesce(array_agg(DISTINCT g.day), '{{}}') AS dd "
            f"FROM {self.log} g WHERE {mine_g} AND g.day > w.dc{widest} AND g.day < w.da) "
            "AS dl\n"
            + (
                f"CROSS JOIN LATERAL (SELECT EXISTS (SELECT 1 FROM {self.days} b "
                f"WHERE {mine_b} AND b.day >= w.da) AS late) AS lt\n"
                if self.distinct
                else ""
            )
            + head
            + f"CROSS JOIN LATERAL (SELECT {bucket_sel} FROM {partials}) AS bk\n"
            f"CROSS JOIN LATERAL (SELECT {edge_sel} FROM {edge_rows} x "
            f"WHERE {self._row_filter('x')} AND ({any_edge})) AS ed\n"
        )

    # -- the extension point's hooks --------------------------------------------------------

    def statement(self, fs: Queries) -> str:
        return self.entity.keys_cte() + str(fs.incremental)

    def rebuild(self, conn: Connection, keys: Sequence[tuple[str, Any]]) -> None:
        table = self._qualified(conn)
        if self.entity.tenant:
            keys_from = (
                "SELECT * FROM unnest(CAST(:tenants AS text[]), "
                f"CAST(:ids AS {self.entity.type}[]))"
            )
        else:
            keys_from = f"SELECT * FROM unnest(CAST(:ids AS {self.entity.type}[]))"
        params = {
            "tenants": [t for t, _ in keys],
            "ids": [self.entity.param(str(k)) for _, k in keys],
        }
        for statement in self._locks(table, self._lookup_tables(conn)):
            conn.execute(sa.text(statement))
        for statement in self._rebuild_sql(table, keys_from):
            conn.execute(sa.text(statement), params)

    def fold(self, db: Engine | Connection, *, max_keys: int, wait: bool) -> int | None:
        """Recompute up to ``max_keys`` logged (key, day)s (the generated function does,
        as the partials' owner: a consumer needs only EXECUTE on it). With an Engine,
        one statement in autocommit, so the lock is let go as the statement ends."""
        return self._fold(db, max_keys=max_keys, wait=wait, settled=False)

    def fold_settled(self, db: Engine | Connection, *, max_keys: int, wait: bool) -> int | None:
        """:meth:`fold` of the days before the current UTC day only. A read takes the
        day of its ``as_of`` from the source rows whatever the partials hold, so a
        partial of the current day is read only once the day is over: folding it
        while writes keep logging it recomputes it again and again for nothing."""
        return self._fold(db, max_keys=max_keys, wait=wait, settled=True)

    def _fold(
        self, db: Engine | Connection, *, max_keys: int, wait: bool, settled: bool
    ) -> int | None:
        fold = sa.text(f"SELECT {SCHEMA}.{self.prefix}_fold(:n, :wait, :settled)")
        params = {"n": max_keys, "wait": wait, "settled": settled}
        if isinstance(db, Connection):
            n = db.execute(fold, params).scalar_one()
        else:
            with db.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                n = conn.execute(fold, params).scalar_one()
        return None if n is None else int(n)

    def pending(self, db: Engine | Connection) -> tuple[int, int]:
        """(logged (key, day)s, keys they belong to): a scan of the log."""
        ents = ", ".join(self.entity.columns)
        row = _one_row(db, f"SELECT count(*), count(DISTINCT ({ents})) FROM {self.log}")
        return int(row[0]), int(row[1])

    def summary(self, db: Engine | Connection) -> str:
        sizes = " + ".join(f"pg_total_relation_size('{t}')" for t in self.tables)
        row = _one_row(db, f"SELECT (SELECT count(*) FROM {self.days}), pg_size_pretty({sizes})")
        return f"{row[0]:,} day rows, {row[1]}"

    def install(self, conn: Connection) -> None:
        """Run :meth:`ddl` in ``conn``'s transaction."""
        for statement in self.ddl(conn):
            conn.execute(sa.text(statement))

    @property
    def trigger(self) -> str:
        return f"freshline_{self.prefix}"

    def installed(self, conn: Connection) -> bool:
        """Whether this path's table and triggers are in the database."""
        return bool(
            conn.execute(
                sa.text(
                    "SELECT to_regclass(:days) IS NOT NULL AND to_regclass(:log) IS NOT NULL "
                    "AND EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = :trigger)"
                ),
                {"days": self.days, "log": self.log, "trigger": f"{self.trigger}_t"},
            ).scalar()
        )

    def grants(self, conn: Connection) -> list[str]:
        """The privileges on the path's objects, set whole: PUBLIC has none (every
        function runs as the owner, and the triggers on the user's tables were made by
        the owner), freshline's roles read the tables, the consumers run the fold."""
        roles = conn.execute(
            sa.text(
                "SELECT rolname FROM pg_roles "
                "WHERE rolname IN ('freshline_api', 'freshline_consumer') ORDER BY 1"
            )
        ).scalars()
        tables = ", ".join(self.tables)
        functions = ", ".join(f"{SCHEMA}.{f}" for f in self._signatures)
        out = [
            f"REVOKE ALL ON {tables} FROM PUBLIC",
            f"REVOKE ALL ON FUNCTION {functions} FROM PUBLIC",
        ]
        for role in roles:
            out.append(f"GRANT SELECT ON {tables} TO {role}")
            if role == "freshline_consumer":
                out.append(f"GRANT EXECUTE ON FUNCTION {SCHEMA}.{self._fold_signature} TO {role}")
        return out

    def unsecured(self, conn: Connection) -> list[str]:
        """What an installed path lacks of what :meth:`ddl` makes now, as to who may do
        what (an earlier freshline's, say): each function SECURITY DEFINER with the fixed
        ``search_path``, each trigger function checking the trigger it runs as, none
        executable by PUBLIC, no privilege of PUBLIC on a table, the grants of
        :meth:`grants`. Empty when nothing; :meth:`secure` makes it so."""
        table = self._qualified(conn)
        lookups = self._lookup_tables(conn)
        config = [f"search_path={self._search_path(table, lookups)}"]
        guards = {
            f"{self.prefix}_{name}": self._guard(name.removesuffix("()"), *on)
            for name, on in self._made_for(table, lookups).items()
        }
        found = {
            str(row[0]): row[1:]
            for row in conn.execute(
                sa.text(
                    "SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')', "
                    "p.prosecdef, p.proconfig, p.prosrc, "
                    "has_function_privilege('public', p.oid, 'EXECUTE') "
                    "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                    "WHERE n.nspname = :schema AND left(p.proname, length(:p)) = :p"
                ),
                {"schema": SCHEMA, "p": f"{self.prefix}_"},
            )
        }
        lacking: dict[str, list[str]] = {}
        for name in self._signatures:
            if name not in found:
                lacking.setdefault("missing", []).append(name)
                continue
            definer, settings, source, public = found[name]
            if not definer or list(settings or []) != config:
                lacking.setdefault("not SECURITY DEFINER with its fixed search_path", []).append(
                    name
                )
            if guards.get(name, "") not in source:
                lacking.setdefault("running as any trigger it is attached to", []).append(name)
            if public:
                lacking.setdefault("executable by PUBLIC", []).append(name)
        out = [f"{what}: {self._named(names)}" for what, names in lacking.items()]
        for t in self.tables:
            if conn.execute(
                sa.text(
                    "SELECT has_table_privilege('public', :t, "
                    "'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER') "
                    "OR has_any_column_privilege('public', :t, 'SELECT, INSERT, UPDATE')"
                ),
                {"t": t},
            ).scalar():
                out.append(f"PUBLIC may use {t}")
        if self._fold_signature not in found:
            return out
        granted = conn.execute(
            sa.text(
                "SELECT bool_and(CASE WHEN r.rolname = 'freshline_consumer' "
                "AND NOT has_function_privilege(r.oid, CAST(:fold AS regprocedure), 'EXECUTE') "
                "THEN false ELSE has_table_privilege(r.oid, t, 'SELECT') END) "
                "FROM pg_roles r CROSS JOIN unnest(CAST(:tables AS text[])) AS t "
                "WHERE r.rolname IN ('freshline_api', 'freshline_consumer')"
            ),
            {"fold": f"{SCHEMA}.{self._fold_signature}", "tables": self.tables},
        ).scalar()
        if granted is False:
            out.append("freshline's roles lack their grants")
        return out

    def _named(self, names: list[str]) -> str:
        """Functions of the path, few words: ``freshline.<prefix>_{i,u,d,t}()``."""
        bare = [n.removeprefix(f"{self.prefix}_") for n in names]
        if len(bare) > 1 and all(b.endswith("()") for b in bare):
            return f"{SCHEMA}.{self.prefix}_{{{','.join(b[:-2] for b in bare)}}}()"
        return ", ".join(f"{SCHEMA}.{n}" for n in names)

    def secure(self, conn: Connection) -> None:
        """Replace the installed path's functions with those :meth:`ddl` makes now and
        set :meth:`grants`, in ``conn``'s transaction. Its tables, partials, log and
        triggers stay as they are: a replaced function keeps its oid, so the triggers
        call the new one, and its log rows mean what they meant."""
        table = self._qualified(conn)
        lookups = self._lookup_tables(conn)
        types = self._column_types(conn, table, lookups)
        read = self._read_columns(conn, table, types)
        functions = self._functions(table, types, lookups, read, self._collated(conn, table, read))
        for statement in [*functions, *self.grants(conn)]:
            conn.execute(sa.text(statement))

    def describe(self, conn: Connection) -> str:
        """What installing it does, in one line (for ``plan``)."""
        tables = ", ".join([self.days, *(self.members(s) for s in self.distinct)])
        table = self._qualified(conn)
        lookups = self._lookup_tables(conn)
        also = "".join(
            f"; statement triggers {self.trigger}_l{n}{{i,u,d,t}} on {looked}"
            for n, looked in enumerate(lookups)
        )
        held = ", ".join([table, *lookups])
        return (
            f"create {tables}; statement triggers {self.trigger}_{{i,u,d,t}} on {table}{also}; "
            f"fill them from its rows under LOCK TABLE {held} IN SHARE MODE"
        )


def _one_row(db: Engine | Connection, sql: str) -> tuple[Any, ...]:
    """The one row of ``sql``, in ``db``'s transaction or a connection of its own."""
    if isinstance(db, Connection):
        return tuple(db.execute(sa.text(sql)).one())
    with db.connect() as conn:
        return tuple(conn.execute(sa.text(sql)).one())


def install_missing(conn: Connection, paths: Iterable[IncrementalPath]) -> list[DerivedPath]:
    """Install the derived paths among ``paths`` that are not installed yet, in ``conn``'s
    transaction (what ``freshline apply --alter-tables`` does); those it installed."""
    done = []
    for path in paths:
        if isinstance(path, DerivedPath) and not path.installed(conn):
            path.install(conn)
            done.append(path)
    return done


def secure_installed(conn: Connection, paths: Iterable[IncrementalPath]) -> list[DerivedPath]:
    """Fix in place the installed derived paths among ``paths`` that
    :meth:`DerivedPath.unsecured` finds lacking (an earlier freshline's), in ``conn``'s
    transaction, as ``freshline apply`` does; those it fixed."""
    done = []
    for path in paths:
        if isinstance(path, DerivedPath) and path.installed(conn) and path.unsecured(conn):
            path.secure(conn)
            done.append(path)
    return done


@dataclass(frozen=True)
class Installed:
    """A derived path found in the database by its objects' names: its tables, the
    triggers on the user's tables and its functions."""

    prefix: str
    tables: tuple[str, ...]
    triggers: tuple[tuple[str, str], ...]
    """(trigger, the table it is on)."""
    functions: tuple[str, ...]
    logged: int
    """Rows in its log: what its triggers have appended and no fold took."""

    def drop(self, conn: Connection) -> None:
        """Drop its triggers, functions and tables, in ``conn``'s transaction."""
        for trigger, table in self.triggers:
            conn.execute(sa.text(f'DROP TRIGGER IF EXISTS "{trigger}" ON {table}'))
        for function in self.functions:
            conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {function}"))
        for table in self.tables:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS {SCHEMA}."{table}"'))


def superseded(conn: Connection, keep: Iterable[DerivedPath]) -> list[Installed]:
    """The derived paths installed in the database that are none of ``keep``: those of
    an earlier declaration (a schema version no longer deployed) or of an earlier
    freshline's layout. Their triggers go on logging every write for no reader."""
    kept = {path.prefix for path in keep}
    prefixes = conn.execute(
        sa.text(
            "SELECT left(c.relname, length(c.relname) - 5) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :schema AND c.relkind = 'r' AND c.relname LIKE 'agg%' "
            "AND right(c.relname, 5) = '_days' ORDER BY 1"
        ),
        {"schema": SCHEMA},
    ).scalars()
    found = []
    for prefix in prefixes:
        if prefix in kept:
            continue
        params = {"schema": SCHEMA, "p": f"{prefix}_", "t": f"freshline_{prefix}_"}
        tables = conn.execute(
            sa.text(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = :schema AND c.relkind = 'r' "
                "AND left(c.relname, length(:p)) = :p ORDER BY 1"
            ),
            params,
        ).scalars()
        triggers = conn.execute(
            sa.text(
                "SELECT t.tgname, t.tgrelid::regclass::text FROM pg_trigger t "
                "WHERE NOT t.tgisinternal AND left(t.tgname, length(:t)) = :t ORDER BY 1"
            ),
            params,
        ).all()
        functions = conn.execute(
            sa.text(
                "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n "
                "ON n.oid = p.pronamespace WHERE n.nspname = :schema "
                "AND left(p.proname, length(:p)) = :p ORDER BY 1"
            ),
            params,
        ).scalars()
        table_names = tuple(str(t) for t in tables)
        log = f"{prefix}_log"
        logged = (
            conn.execute(sa.text(f'SELECT count(*) FROM {SCHEMA}."{log}"')).scalar_one()
            if log in table_names
            else 0
        )
        found.append(
            Installed(
                prefix,
                table_names,
                tuple((str(a), str(b)) for a, b in triggers),
                tuple(str(f) for f in functions),
                int(logged),
            )
        )
    return found


__all__ = ["DerivedPath", "Installed", "install_missing", "secure_installed", "superseded"]
