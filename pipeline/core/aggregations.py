"""Declared windowed aggregations: one declaration, and freshline derives the SQL.

A repository declares what it wants over a source table (an entity column, a time
column, a window, aggregations with optional filters, lookups) with :func:`Aggregations`
and :mod:`freshline.agg`'s functions, and gets a
:class:`~freshline.pipeline.core.features.FeatureSet` whose defining query and horizon are
generated from it. Every value is a plain aggregate or a formula over ``numeric`` sums
written out once, here, so that the incremental path can reproduce it digit for digit.

The query, the horizon and the types, in full: docs/repositories.md, "The SQL derived
from Aggregations".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from freshline.pipeline.core import declarations
from freshline.pipeline.core.declarations import (
    ALL_TIME,
    Agg,
    AggKind,
    Declaration,
    last_order,
    since,
)
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.features import (
    AS_OF,
    Entity,
    FeatureSet,
    Field,
    FieldType,
    Table,
    WriteMode,
    identifier,
    seconds,
)


def count(
    *, where: str | None = None, window: str | int | None = None, name: str | None = None
) -> Agg:
    """How many rows (in the window, passing ``where``)."""
    return Agg("count", None, name, where, window, "int")


class ColumnAgg:
    """An aggregation of one column: ``agg.mean("amount", where=..., window=..., name=...,
    type=..., default=0, digits=4)``."""

    def __init__(self, kind: AggKind, doc: str) -> None:
        self.kind = kind
        self.__name__ = self.__qualname__ = kind
        self.__doc__ = doc

    def __call__(
        self,
        column: str,
        *,
        where: str | None = None,
        window: str | int | None = None,
        name: str | None = None,
        type: FieldType | None = None,
        default: int | float | None = None,
        digits: int | None = None,
    ) -> Agg:
        kept = "int" if self.kind == "count_distinct" else type
        return Agg(self.kind, column, name, where, window, kept, default, digits)

    def __repr__(self) -> str:
        return f"<aggregation {self.kind}>"


sum = ColumnAgg("sum", "The sum of a column (0 over no rows).")
mean = ColumnAgg("mean", "The mean of a column's non-null values: their sum over their count.")
min = ColumnAgg("min", "The least value of a column.")
max = ColumnAgg("max", "The greatest value of a column.")
stddev = ColumnAgg("stddev", "The population standard deviation of a column's non-null values.")
count_distinct = ColumnAgg("count_distinct", "How many distinct non-null values a column takes.")
last = ColumnAgg(
    "last",
    "The column's value in the latest row (by the time column; ties: the greatest value).",
)


def Lookup(table: Table, *, columns: Sequence[str], query: str, rows: str) -> declarations.Lookup:
    """Columns each source row takes from ``table``, to aggregate like its own::

        geo_of_ip = Lookup(
            geoip,
            columns=["country", "city"],
            query="SELECT g.country, g.city FROM geoip g WHERE g.ip_from <= x.ip "
            "AND x.ip <= g.ip_to ORDER BY g.ip_from DESC LIMIT 1",
            rows="x.ip BETWEEN g.ip_from AND g.ip_to",
        )

    ``query``: SQL over the source row ``x`` returning at most one row of ``columns``
    (none: the columns are ``NULL``), each a column of ``table`` of the same name.
    ``rows``: a condition on a source row ``x`` and a row ``g`` of ``table``, true of
    every source row whose looked-up values ``g`` can decide, whether ``g`` is added,
    changed or removed; it tells the incremental path which days a change of ``table``
    makes stale, so it must not miss one (more only costs reads). ``table`` must route
    its changes to the entity itself (``Table(..., reverse=...)``), as any source must.
    """
    what = f"lookup in {table.name!r}"
    if not columns:
        raise ConfigError(f"{what}: names no column")
    for column in columns:
        identifier(column, f"{what} column")
    if len(set(columns)) != len(columns):
        raise ConfigError(f"{what}: a column is named twice")
    if "x." not in query:
        raise ConfigError(f"{what}: query= reads nothing of the source row x")
    if "x." not in rows or "g." not in rows:
        raise ConfigError(f"{what}: rows= relates the source row x to a row g of the table")
    return declarations.Lookup(table, tuple(columns), query.strip(), rows.strip())


# long: the public declaration: 16 keywords and their docstring; its checks are helpers
def Aggregations(
    name: str,
    *,
    entity: Entity,
    table: Table,
    time: str,
    aggs: Sequence[Agg],
    window: str | int | None = None,
    where: str | None = None,
    ttl: int | str = "1h",
    mode: WriteMode = "recompute",
    description: str = "",
    sources: Sequence[Table] = (),
    incremental: bool = False,
    max_staleness_ms: int | None = None,
    lookups: Sequence[declarations.Lookup] = (),
    tiebreak: str | None = None,
    log_sample: float = 0.0,
) -> FeatureSet:
    """A feature set of windowed aggregations over ``table``'s rows of each entity.

    ``time``: the table's ``timestamptz`` column that places a row in a window;
    ``window``: the default window (each aggregation may name its own); ``where``: a
    condition on every row, as SQL over the row ``x`` (``"x.status <> 'void'"``);
    ``sources``: other tables whose changes should refresh it (the table itself always
    does). The query and horizon are generated (see the module's docstring).
    ``incremental``: also derive per-day partial aggregates kept by triggers on the
    table, and recompute from them (:mod:`freshline.pipeline.core.maintenance`; ``freshline
    apply --alter-tables`` installs them). ``max_staleness_ms``: the default freshness
    bound of reads (:attr:`FeatureSet.max_staleness_ms`). ``lookups``: columns the rows
    take from other tables (:func:`Lookup`), aggregated by name like the table's own;
    their tables are sources too. ``tiebreak``: a column of the table that orders rows of
    the same time for ``last`` (the greatest wins; a unique one, such as the primary
    key, makes every ``last`` the values of one row); without it, the greatest value.
    ``log_sample``: the share of reads the served log keeps
    (:attr:`FeatureSet.log_sample`).
    """
    what = f"aggregations {name!r}"
    source = table.source_for(entity)
    column = next((c for e, c in table.entities.items() if e.name == entity.name), None)
    if source is None or column is None:
        raise ConfigError(
            f"{what}: table {table.name!r} names no column for entity {entity.name!r} "
            f"(Table({table.name!r}, entities={{{entity.name}: 'its_column'}}))"
        )
    if entity.tenant and not table.tenant:
        raise ConfigError(f"{what}: table {table.name!r} has no tenant column")
    identifier(time, f"{what} time column")
    if tiebreak is not None:
        identifier(tiebreak, f"{what} tiebreak column")
    _check_lookups(what, entity, lookups)
    windows = _windows(what, aggs, window)
    declared = Declaration(
        table=table.name,
        entity_column=column,
        tenant_column=table.tenant if entity.tenant else None,
        time=time,
        where=where,
        aggs=tuple(aggs),
        windows_s=tuple(windows),
        lookups=tuple(lookups),
        tiebreak=tiebreak,
    )
    fields = tuple(Field(a.field_name(), a.field_type(time)) for a in aggs)
    derived: dict[str, Any] = {}
    if incremental:
        from freshline.pipeline.core.maintenance import LAYOUT, DerivedPath

        query = full_query(entity, declared)
        # The layout's format too: a freshline whose generated tables differ gets tables
        # of its own, never a query over another layout's.
        # The lookups' rows= too: they shape the triggers, not the query.
        rows = "".join(f"\n{lk.table.name}: {lk.rows}" for lk in lookups)
        digest = hashlib.sha256(f"{LAYOUT}\n{query}{rows}".encode()).hexdigest()[:8]
        path = DerivedPath(name, entity, declared, digest)
        derived = {"incremental": path.query(), "maintenance": path, "path": "incremental"}
    return FeatureSet(
        name,
        entity=entity,
        fields=fields,
        ttl=ttl,
        query=full_query(entity, declared),
        sources=_unique([table, *(lk.table for lk in lookups), *sources]),
        mode=mode,
        description=description,
        horizon=horizon(entity, declared),
        declared=declared,
        max_staleness_ms=max_staleness_ms,
        log_sample=log_sample,
        **derived,
    )


def _check_lookups(what: str, entity: Entity, lookups: Sequence[declarations.Lookup]) -> None:
    """Each lookup is a ``Lookup`` whose table routes changes to ``entity``, and no two
    give a column of the same name."""
    looked_up: set[str] = set()
    for lookup in lookups:
        if not isinstance(lookup, declarations.Lookup):
            raise ConfigError(f"{what}: {lookup!r} is not a Lookup(...)")
        if lookup.table.source_for(entity) is None:
            raise ConfigError(
                f"{what}: lookup table {lookup.table.name!r} routes no change to entity "
                f"{entity.name!r} (Table({lookup.table.name!r}, reverse={{{entity.name}: "
                "'SELECT ...'}))"
            )
        if looked_up & set(lookup.columns):
            raise ConfigError(f"{what}: two lookups give a column of the same name")
        looked_up |= set(lookup.columns)


def _windows(what: str, aggs: Sequence[Agg], window: str | int | None) -> list[int]:
    """Each aggregation checked (its column, name, ``default=``, ``digits=``), and its
    window in seconds (its own, else the declaration's)."""
    if not aggs:
        raise ConfigError(f"{what}: declares no aggregation")
    windows: list[int] = []
    names: set[str] = set()
    for agg in aggs:
        if not isinstance(agg, Agg):
            raise ConfigError(f"{what}: {agg!r} is not an aggregation (count(), sum('col'), ...)")
        if agg.column is not None:
            identifier(agg.column, f"{what} column")
        field_name = agg.field_name()
        identifier(field_name, f"{what} field name")
        if field_name in names:
            raise ConfigError(f"{what}: two aggregations are named {field_name!r} (pass name=)")
        names.add(field_name)
        if agg.default is not None and (
            agg.kind in ("count", "count_distinct", "sum")
            or isinstance(agg.default, bool)
            or not isinstance(agg.default, int | float)
        ):
            raise ConfigError(
                f"{what}: {field_name} takes no default= (a number, for an aggregation "
                "that is NULL over no rows: mean, stddev, min, max, last)"
            )
        if agg.digits is not None and (
            agg.kind in ("count", "count_distinct") or not 0 <= agg.digits <= 15
        ):
            raise ConfigError(f"{what}: {field_name}: digits= is 0..15, for a non-count")
        chosen = agg.window if agg.window is not None else window
        if chosen is None:
            raise ConfigError(f"{what}: {field_name} has no window (give window= to it or all)")
        windows.append(
            ALL_TIME if chosen == "all" else seconds(chosen, f"{what} window of {field_name}")
        )
    return windows


def _aggregate(agg: Agg, window_s: int, decl: Declaration) -> str:
    """One aggregation's SQL over the joined rows ``x`` (``NULL`` where none joined)."""
    conditions = [f"({agg.where})"] if agg.where else []
    if window_s < decl.widest_s:
        conditions.append(f"x.{decl.time} > {since('t.as_of', window_s)}")
    if agg.kind == "count":  # a joined row has its entity column; an unjoined one not
        conditions.append(f"x.{decl.entity_column} IS NOT NULL")
    only = f" FILTER (WHERE {' AND '.join(conditions)})" if conditions else ""
    col = f"x.{agg.column}"
    n = f"count({col}){only}"
    s = f"sum({col}::numeric){only}"
    match agg.kind:
        case "count":
            return f"count(*){only}"
        case "sum":
            return f"coalesce({s}, 0)"
        case "mean":
            return f"{s} / nullif({n}, 0)"
        case "stddev":
            q = f"sum({col}::numeric * {col}::numeric){only}"
            return f"sqrt(greatest({n} * {q} - {s} * {s}, 0) / nullif({n} * {n}, 0))"
        case "min" | "max":
            return f"{agg.kind}({col}){only}"
        case "count_distinct":
            return f"count(DISTINCT {col}){only}"
        case "last":
            tiebreak = f"x.{decl.tiebreak}" if decl.tiebreak else None
            order = last_order(f"x.{decl.time}", col, tiebreak)
            return f"(array_agg({col} ORDER BY {order}){only})[1]"
    raise ConfigError(f"unknown aggregation {agg.kind!r}")  # pragma: no cover


def full_query(entity: Entity, decl: Declaration) -> str:
    """The defining query of a declaration: the batch's keys ``k``, ``t.as_of``."""
    keys = [f"k.{c} AS {c}" for c in entity.columns]
    values = [
        f"{a.finish(_aggregate(a, w, decl))} AS {a.field_name()}"
        for a, w in zip(decl.aggs, decl.windows_s, strict=True)
    ]
    on = [f"x.{decl.entity_column} = k.{entity.key}"]
    if decl.tenant_column and entity.tenant:
        on.insert(0, f"x.{decl.tenant_column} = k.{entity.tenant}")
    if decl.widest_s != ALL_TIME:
        on.append(f"x.{decl.time} > {since('t.as_of', decl.widest_s)}")
    on.append(f"x.{decl.time} <= t.as_of")
    if decl.where:
        on.append(f"({decl.where})")
    group = ", ".join(f"k.{c}" for c in entity.columns)
    body = ",\n       ".join([*keys, *values])
    joined = "\n      AND ".join(on)
    if decl.lookups:  # each row of the window with its looked-up columns
        cols, joins = decl.looked_up()
        rows = (
            f"LEFT JOIN LATERAL (SELECT {cols} FROM {decl.table} x{joins}\n"
            f"    WHERE {joined}) AS x ON true"
        )
    else:
        rows = f"LEFT JOIN {decl.table} x\n       ON {joined}"
    return f"\nSELECT {body}\nFROM k CROSS JOIN t\n{rows}\nGROUP BY {group}\n"


def _unique(tables: Sequence[Table]) -> tuple[Table, ...]:
    """``tables`` without repeats (by name), in order."""
    seen: dict[str, Table] = {}
    for table in tables:
        seen.setdefault(table.name, table)
    return tuple(seen.values())


def horizon(entity: Entity, decl: Declaration) -> str:
    """When a declaration's values may next change with time alone, for one key ``f``."""
    mine = [f"x.{decl.entity_column} = f.{entity.key}"]
    if decl.tenant_column and entity.tenant:
        mine.insert(0, f"x.{decl.tenant_column} = f.{entity.tenant}")
    own = " AND ".join(mine)
    time = f"x.{decl.time}"
    leaving = [  # (a row never leaves the window of all time)
        f"(SELECT min({time}) FROM {decl.table} x WHERE {own} AND {time} > "
        f"{since(AS_OF, w)} AND {time} <= {AS_OF}) + interval '{w} seconds'"
        for w in sorted(set(decl.windows_s))
        if w != ALL_TIME
    ]
    entering = f"(SELECT min({time}) FROM {decl.table} x WHERE {own} AND {time} > {AS_OF})"
    return "least(\n    " + ",\n    ".join([*leaving, entering]) + ")"
