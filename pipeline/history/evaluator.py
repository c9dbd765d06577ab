"""Feature values at past moments: each feature set's defining query over history.

The online path (:func:`freshline.pipeline.cache.recompute.compute`) runs a feature set's defining
query, always on the full path, over the source tables as one snapshot sees them. This
evaluator runs the same query text, unmodified, over the history tables that
:mod:`freshline.pipeline.history` records: in front of it, where ``keys``/``k``/``t`` go online,
it puts one ``NOT MATERIALIZED`` CTE per captured table, named after the table, that
reads its history table under a visibility predicate. The unqualified table names of the
query then resolve to those CTEs, so the query reads the rows as they were:

* :class:`AtCommitTime` ``(t)``: the versions whose creating transaction committed at or
  before ``t`` and whose ending one did not, with ``as_of = t``;
* :class:`AtSnapshot` ``(s, as_of)``: the versions snapshot ``s`` sees
  (``pg_visible_in_snapshot``), with the entry's recorded ``as_of``.

Many moments go in one statement: the query runs once per moment through ``LATERAL``,
each time over that moment's keys (why, with the figures: docs/training.md). Values are
converted as entries hold them (:func:`freshline.pipeline.cache.recompute.entry_value`).

Guards: a statement whose plan scans any relation but a history table is refused (a
query that names a table history does not capture, or names one with its schema, would
read today's rows); so is a query that reads a bind parameter or the clock directly, and
a moment outside what history holds (before it starts, past what it is complete to,
where it is broken, beyond retention, in the future).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from freshline.pipeline.cache.recompute import entity_ids, entry_value
from freshline.pipeline.core.db import SCHEMA
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.features import IMPLICIT_TENANT, FeatureSet, reads_clock
from freshline.pipeline.core.types import FeatureValues


@dataclass(frozen=True, slots=True)
class AtCommitTime:
    """The rows as committed at ``at`` (aware): a version is visible iff its creating
    transaction committed at or before ``at`` and its ending one did not. The query runs
    with ``as_of = at``. What a spine timestamp means."""

    at: dt.datetime


@dataclass(frozen=True, slots=True)
class AtSnapshot:
    """The rows snapshot ``snapshot`` (``pg_current_snapshot()`` text) sees: a version is
    visible iff it sees the creating transaction and not the ending one. The query runs
    with ``as_of``, the entry's recorded moment. What an entry names."""

    snapshot: str
    as_of: dt.datetime

    @property
    def at(self) -> dt.datetime:
        return self.as_of


Moment = AtCommitTime | AtSnapshot
M = TypeVar("M", bound=AtCommitTime | AtSnapshot)
Ref = tuple[str, str]
"""(tenant, entity id) as keys spell them."""


class HistoryRefused(FreshlineError):
    """The evaluator will not answer: the answer could leak rows from after the moment,
    or history does not hold what it would need."""


@dataclass(frozen=True, slots=True)
class Captured:
    """A user table whose history is recorded, as ``freshline.history_tables`` has it."""

    table: str
    history: str
    columns: tuple[str, ...]
    start: dt.datetime | None
    """When history starts (the backfill's snapshot, S0)."""
    complete_to: dt.datetime | None
    broken_from: dt.datetime | None
    retention_s: int | None


# Postgres's infinite timestamps, which Python has no datetime for, as the far ends.
_FIRST, _LAST = "'0001-01-01 00:00:00+00'", "'9999-12-31 23:59:59.999999+00'"


def _finite(column: str) -> str:
    return (
        f"CASE WHEN {column} IS NULL OR isfinite({column}) THEN {column} "
        f"WHEN {column} > 'epoch' THEN {_LAST}::timestamptz ELSE {_FIRST}::timestamptz END"
    )


_REGISTRY_SQL = sa.text(
    f"SELECT h.source_table, h.history_table, {_finite('h.s0_at')}, "
    f"{_finite('h.complete_to')}, {_finite('h.broken_from')}, "
    f"h.retention_s, ARRAY(SELECT a.attname::text FROM pg_attribute a "
    f"  WHERE a.attrelid = to_regclass('{SCHEMA}.' || quote_ident(h.history_table)) "
    f"    AND a.attnum > 0 AND NOT a.attisdropped AND a.attname NOT LIKE '\\_fl\\_%%' "
    f"  ORDER BY a.attnum) "
    f"FROM {SCHEMA}.history_tables h WHERE h.source_schema = current_schema()"
)


def captured(conn: Connection) -> dict[str, Captured]:
    """The tables of the connection's current schema whose history is recorded, by name
    (the names a feature query uses unqualified); empty where history is not set up."""
    if conn.execute(sa.text(f"SELECT to_regclass('{SCHEMA}.history_tables')")).scalar() is None:
        return {}
    return {
        row[0]: Captured(row[0], row[1], tuple(row[6]), row[2], row[3], row[4], row[5])
        for row in conn.execute(_REGISTRY_SQL)
    }


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


_COMMIT_TIME = "h._fl_from <= _fl_m.at AND (h._fl_to IS NULL OR h._fl_to > _fl_m.at)"
_SNAPSHOT = (
    "pg_visible_in_snapshot(h._fl_xmin, _fl_m.snap) AND "
    "(h._fl_xmax IS NULL OR NOT pg_visible_in_snapshot(h._fl_xmax, _fl_m.snap))"
)


def _array(values: Sequence[int | str]) -> str:
    """``values`` as a Postgres array literal (``{"a","b"}``), every element quoted."""
    quoted = (str(v).replace("\\", "\\\\").replace('"', '\\"') for v in values)
    return "{" + ",".join(f'"{v}"' for v in quoted) + "}"


def history_sql(fs: FeatureSet, tables: Mapping[str, Captured], snapshots: bool) -> str:
    """The statement evaluating ``fs`` at many moments: :class:`AtSnapshot` ones with
    ``snapshots``, else :class:`AtCommitTime` ones.

    Parameters, one element per moment: ``:mg`` (a group number), ``:mat`` (``as_of``),
    ``:msnap`` (the snapshot text or NULL), ``:mtenants`` and ``:mids`` (its distinct
    keys, each an array literal: :func:`_array`). Rows: the group, then what the feature
    query returns.

    Each moment carries its own keys, so its ``keys`` cost what they hold, not a scan of
    the chunk's spine; ``unnest`` of a computed array is planned as a few rows, as the
    keys of one moment are (docs/training.md, *How it is evaluated*).
    """
    entity = fs.entity
    predicate = _SNAPSHOT if snapshots else _COMMIT_TIME
    ids = f"CAST(_fl_m.ids AS {entity.type}[])"
    keys = f"CAST(_fl_m.tenants AS text[]), {ids}" if entity.tenant else ids
    history = "".join(
        f",\n{_quote(c.table)} AS NOT MATERIALIZED (\n"
        f"    SELECT {', '.join('h.' + _quote(col) for col in c.columns)}\n"
        f"    FROM {SCHEMA}.{_quote(c.history)} AS h WHERE {predicate}\n)"
        for c in tables.values()
    )
    return (
        "WITH _fl_moments(g, at, snap, tenants, ids) AS (\n"
        "    SELECT u.g, u.at, CAST(u.snap AS pg_snapshot), u.tenants, u.ids FROM "
        "unnest(CAST(:mg AS int[]), CAST(:mat AS timestamptz[]), CAST(:msnap AS text[]), "
        "CAST(:mtenants AS text[]), CAST(:mids AS text[])) AS u(g, at, snap, tenants, ids)\n"
        ")\nSELECT _fl_m.g, f.* FROM _fl_moments AS _fl_m CROSS JOIN LATERAL (\n"
        f"WITH keys({', '.join(entity.columns)}) AS (SELECT * FROM unnest({keys})), "
        "k AS (SELECT * FROM keys), t(as_of) AS (SELECT _fl_m.at)"
        f"{history}\n{fs.query}\n) AS f"
    )


def _check_query(fs: FeatureSet) -> None:
    if sa.text(fs.query)._bindparams:
        names = ", ".join(f":{n}" for n in sa.text(fs.query)._bindparams)
        raise HistoryRefused(
            f"feature set {fs.name!r}: its query reads {names} directly; "
            "read the moment from t.as_of so it can be evaluated at past moments"
        )
    found = reads_clock(fs.query)
    if found:
        raise HistoryRefused(
            f"feature set {fs.name!r}: its query reads the clock ({found}); "
            "use t.as_of, the moment it computes for, so past moments do not see today"
        )


def _relations(plan: Any) -> Iterator[tuple[str | None, str]]:
    if isinstance(plan, dict):
        if "Relation Name" in plan:
            yield plan.get("Schema"), plan["Relation Name"]
        for value in plan.values():
            yield from _relations(value)
    elif isinstance(plan, list):
        for value in plan:
            yield from _relations(value)


def scanned(conn: Connection, statement: str, params: Mapping[str, Any]) -> list[str]:
    """The relations the plan of ``statement`` scans, as ``schema.name`` (EXPLAIN)."""
    plan = conn.execute(sa.text(f"EXPLAIN (VERBOSE, FORMAT JSON) {statement}"), params).scalar()
    return sorted({f"{schema}.{name}" for schema, name in _relations(plan)})


def guard(
    conn: Connection,
    fs: FeatureSet,
    statement: str,
    params: Mapping[str, Any],
    tables: Mapping[str, Captured],
) -> list[Captured]:
    """Refuse ``statement`` unless its plan scans history tables only; the captured
    tables it reads."""
    histories = {f"{SCHEMA}.{c.history}": c for c in tables.values()}
    relations = scanned(conn, statement, params)
    others = [r for r in relations if r not in histories]
    if others:
        raise HistoryRefused(
            f"feature set {fs.name!r}: its query reads {', '.join(others)}, which history "
            "does not capture (or names with its schema): it would read today's rows, not "
            "the rows as they were; capture the table (freshline.toml [history]) or read "
            "it unqualified"
        )
    return [histories[r] for r in relations]


def _check_moment(moment: Moment, read: Sequence[Captured], now: dt.datetime) -> None:
    at = moment.at
    if at.tzinfo is None:
        raise HistoryRefused(f"moment {at.isoformat()} has no time zone")
    if at > now:
        raise HistoryRefused(f"{at.isoformat()} is in the future (Postgres's now: {now})")
    for c in read:
        if c.start is None or at < c.start:
            since = "has not started" if c.start is None else f"starts at {c.start.isoformat()}"
            raise HistoryRefused(f"{at.isoformat()}: history of table {c.table!r} {since}")
        if c.broken_from is not None and at >= c.broken_from:
            raise HistoryRefused(
                f"{at.isoformat()}: history of table {c.table!r} is broken from "
                f"{c.broken_from.isoformat()}"
            )
        if c.complete_to is None or at > c.complete_to:
            upto = "nothing yet" if c.complete_to is None else c.complete_to.isoformat()
            raise HistoryRefused(
                f"{at.isoformat()}: history of table {c.table!r} is complete to {upto} only "
                "(the recorder has not caught up)"
            )
        if c.retention_s is not None and at < now - dt.timedelta(seconds=c.retention_s):
            raise HistoryRefused(
                f"{at.isoformat()}: beyond the retention of table {c.table!r}'s history "
                f"({c.retention_s} s)"
            )


@dataclass
class Evaluator:
    """Evaluates feature sets at past moments on one connection (run it in one
    REPEATABLE READ transaction, so every chunk reads the same history)."""

    conn: Connection
    tables: dict[str, Captured]
    now: dt.datetime
    _read: dict[tuple[str, type], list[Captured]]

    @classmethod
    def on(cls, conn: Connection) -> Evaluator:
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
        return cls(conn, captured(conn), now, {})

    def reads(self, fs: FeatureSet, moments: Mapping[M, Sequence[Ref]]) -> list[Captured]:
        """The captured tables the statement evaluating ``fs`` at ``moments`` (of one
        kind) reads; refused unless they are history tables only."""
        kind = self._kind(moments)
        _check_query(fs)
        if (fs.name, kind) not in self._read:
            statement = history_sql(fs, self.tables, kind is AtSnapshot)
            first = next(iter(moments))
            params = _params(fs, {first: moments[first]})  # the plan's relations, not sizes
            self._read[(fs.name, kind)] = guard(self.conn, fs, statement, params, self.tables)
        return self._read[(fs.name, kind)]

    def check(self, fs: FeatureSet, moments: Mapping[M, Sequence[Ref]]) -> None:
        """Refuse any of ``moments`` that history cannot answer for ``fs`` without
        leaking (:class:`HistoryRefused`). Each refusal is of the moments before or after
        some point, so the earliest and the latest moment decide for all."""
        read = self.reads(fs, moments)
        if any(m.at.tzinfo is None for m in moments):
            _check_moment(next(m for m in moments if m.at.tzinfo is None), read, self.now)
        for moment in (min(moments, key=_at), max(moments, key=_at)):
            _check_moment(moment, read, self.now)

    @staticmethod
    def _kind(moments: Mapping[M, Sequence[Ref]]) -> type:
        kinds = {type(m) for m in moments}
        if len(kinds) != 1:
            raise ValueError("moments of one kind per call: AtCommitTime or AtSnapshot")
        return kinds.pop()

    def evaluate(
        self, fs: FeatureSet, moments: Mapping[M, Sequence[Ref]]
    ) -> dict[M, dict[Ref, FeatureValues]]:
        """``fs``'s values for each moment's refs, in one statement. Every moment must be
        of one kind (:class:`AtCommitTime` or :class:`AtSnapshot`). A ref the query
        returns no row for is absent."""
        if not moments:
            return {}
        self.check(fs, moments)
        order = list(moments)
        params = _params(fs, moments)
        statement = history_sql(fs, self.tables, isinstance(order[0], AtSnapshot))
        out: dict[M, dict[Ref, FeatureValues]] = {m: {} for m in order}
        names = fs.field_names
        kinds_ = [f.type for f in fs.fields]
        tenanted = fs.entity.tenant is not None
        start = 3 if tenanted else 2
        for row in self.conn.execute(sa.text(statement), params):
            key = (str(row[1]), str(row[2])) if tenanted else (IMPLICIT_TENANT, str(row[1]))
            out[order[row[0]]][key] = {
                name: entry_value(v, kind_)
                for name, kind_, v in zip(names, kinds_, row[start:], strict=True)
            }
        return out


def _at(moment: Moment) -> dt.datetime:
    return moment.at


def _params(fs: FeatureSet, moments: Mapping[M, Sequence[Ref]]) -> dict[str, Any]:
    """The parameters of :func:`history_sql` for ``moments``, numbered in their order,
    each one array literal (:func:`_array`): one text value to send, not an array of
    thousands for the driver to escape one by one."""
    tenants: list[str] = []
    ids: list[str] = []
    for refs in moments.values():
        moment_tenants, moment_ids = entity_ids(refs, fs.entity)
        tenants.append(_array(moment_tenants))
        ids.append(_array(moment_ids))
    snaps = [m.snapshot if isinstance(m, AtSnapshot) else None for m in moments]
    return {
        "mg": "{" + ",".join(map(str, range(len(moments)))) + "}",
        "mat": _array([m.at.isoformat() for m in moments]),
        "msnap": "{" + ",".join("NULL" if s is None else _array([s])[1:-1] for s in snaps) + "}",
        "mtenants": _array(tenants),
        "mids": _array(ids),
    }
