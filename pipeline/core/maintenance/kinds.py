"""One class per aggregation kind: what each keeps in the day partials and what each
adds to the generated SQL (the partial of some rows, an update's delta, a head's fold,
and its part of the incremental query: the partials' sum, the edge rows', the two
combined). A new kind is one new class here and one entry in :data:`KINDS`.

The SQL aliases the methods write in are those of the statements that call them: ``x``
a source row, ``b`` a day partial; in the incremental query (:mod:`.query`)
``buckets``, ``edges``, ``head``, ``bounds``, ``dirty`` and ``late``; in a head's fold
(:mod:`.fold`) ``o`` and ``n``, the head before and the partial of the rows since its
cut; in an update's delta, ``x.fl_sg``, the sign of a row (new 1, old -1). Why the
values are exact: docs/incremental.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from freshline.pipeline.core.declarations import Agg, last_order
from freshline.pipeline.core.maintenance.sql import filtered

Columns = list[tuple[str, str]]
"""(name, type) of columns; ``{col}`` stands for the source column's type, ``{tb}`` the
tiebreak's."""


@dataclass(frozen=True)
class Reading:
    """What one aggregation's part of the incremental query reads by."""

    inside: str | None
    """Which partials ``b`` are whole days of its window (``None``: all those read)."""
    edge: str
    """Which edge rows ``x`` count for it."""
    time: str
    """The source row's time column, on ``x``."""
    tiebreak: str | None
    """The source row's tiebreak column, on ``x``, when the declaration has one."""
    window: int
    """Its window's index among the path's windows (``bounds.start<j>``)."""
    entity: tuple[str, ...]
    """The entity's columns (tenant first)."""
    heads: bool
    """Whether the path keeps heads (``head``)."""
    members: str = ""
    latest: str = ""
    """A ``count_distinct``'s member and latest-day tables."""


@dataclass(frozen=True)
class Kind:
    """One aggregation of a declaration: its columns in the day partials, and its SQL."""

    index: int
    agg: Agg
    window_s: int
    tiebreak: bool = False

    fixes_columns: ClassVar[bool] = False
    """Whether an UPDATE must leave its columns as they were to be logged as a delta
    (what no delta can take back)."""

    @property
    def where(self) -> str:
        """Its own ``where``, on ``x``."""
        return f"({self.agg.where})" if self.agg.where else "true"

    def columns(self) -> Columns:
        """Its partial columns."""
        return []

    def deltas(self) -> Columns:
        """Its columns in an update's delta log row; none when no delta can move it."""
        return []

    def partial(self, column: str, condition: str, time: str, tiebreak: str | None) -> list[str]:
        """The aggregates of its partial columns over the rows passing ``condition``."""
        return []

    def signed(self, column: str) -> list[str]:
        """Its delta columns of an update's rows ``x``, new ones signed ``fl_sg`` 1, old
        ones -1."""
        return []

    def delta_sums(self, log: str, only: str) -> list[str]:
        """Its delta columns summed over the delta log rows ``log`` (``only``: their
        FILTER), each named as its column."""
        return [f"sum({log}.{name}){only} AS {name}" for name, _ in self.deltas()]

    def takes(self, log: str, head: str) -> list[str]:
        """What a delta log row ``log`` must be for head ``head`` to take it in: a NaN
        or an infinity never cancels, so the rows are read instead."""
        return [
            f"coalesce({log}.{name} NOT IN ('NaN', 'Infinity', '-Infinity'), true)"
            for name, kind in self.deltas()
            if kind == "numeric"
        ]

    def held(self, head: str) -> list[str]:
        """Head ``head``'s partial columns as they are."""
        return [f"{head}.{c}" for c, _ in self.columns()]

    def taken(self, head: str, deltas: str) -> list[str]:
        """Head ``head``'s partial columns with the sums ``deltas`` of its delta log rows
        (``NULL`` when none) taken in."""
        return [f"{head}.{c} + coalesce({deltas}.d{c}, 0) AS {c}" for c, _ in self.columns()]

    def merged(self) -> list[str]:
        """A head's partial columns after a fold: old head ``o`` grown by the partial
        ``n`` of the rows between the two cuts."""
        return [f"coalesce(o.{c}, 0) + coalesce(n.{c}, 0)" for c, _ in self.columns()]

    def bucket(self, read: Reading) -> list[str]:
        """Its partial columns summed over the clean whole days ``b``."""
        return [
            f"coalesce({filtered(f'sum(b.{c})', read.inside)}, 0) AS {c}" for c, _ in self.columns()
        ]

    def edge(self, column: str, read: Reading) -> list[str]:
        """Its partial columns over the edge rows ``x``."""
        return self.partial(column, read.edge, read.time, read.tiebreak)

    def combine(self, read: Reading) -> str:
        """Its value from the partials' ``buckets`` and the edge rows' ``edges``."""
        raise NotImplementedError


class Count(Kind):
    """The rows: their count."""

    def columns(self) -> Columns:
        return [(f"c{self.index}", "bigint")]

    def deltas(self) -> Columns:
        return [(f"dc{self.index}", "bigint")]

    def partial(self, column: str, condition: str, time: str, tiebreak: str | None) -> list[str]:
        return [f"count(*) FILTER (WHERE {condition})"]

    def signed(self, column: str) -> list[str]:
        return [f"coalesce(sum(x.fl_sg) FILTER (WHERE {self.where}), 0)"]

    def edge(self, column: str, read: Reading) -> list[str]:
        return [f"count(*) FILTER (WHERE {read.edge}) AS c{self.index}"]

    def combine(self, read: Reading) -> str:
        return f"buckets.c{self.index} + edges.c{self.index}"


class Moments(Kind):
    """A sum, mean or deviation: the count, ``numeric`` sum and sum of squares."""

    def columns(self) -> Columns:
        i = self.index
        return [(f"n{i}", "bigint"), (f"s{i}", "numeric"), (f"q{i}", "numeric")]

    def deltas(self) -> Columns:
        i = self.index
        return [(f"dn{i}", "bigint"), (f"ds{i}", "numeric"), (f"dq{i}", "numeric")]

    def partial(self, column: str, condition: str, time: str, tiebreak: str | None) -> list[str]:
        return [
            f"count({column}) FILTER (WHERE {condition})",
            f"coalesce(sum({column}::numeric) FILTER (WHERE {condition}), 0)",
            f"coalesce(sum({column}::numeric * {column}::numeric) FILTER (WHERE {condition}), 0)",
        ]

    def signed(self, column: str) -> list[str]:
        where = self.where
        return [
            f"coalesce(sum(x.fl_sg) FILTER (WHERE {where} AND {column} IS NOT NULL), 0)",
            f"coalesce(sum(x.fl_sg * {column}::numeric) FILTER (WHERE {where}), 0)",
            f"coalesce(sum(x.fl_sg * {column}::numeric * {column}::numeric) "
            f"FILTER (WHERE {where}), 0)",
        ]

    def edge(self, column: str, read: Reading) -> list[str]:
        i, edge = self.index, read.edge
        return [
            f"count({column}) FILTER (WHERE {edge}) AS n{i}",
            f"coalesce(sum({column}::numeric) FILTER (WHERE {edge}), 0) AS s{i}",
            f"coalesce(sum({column}::numeric * {column}::numeric) "
            f"FILTER (WHERE {edge}), 0) AS q{i}",
        ]

    def sums(self) -> tuple[str, str, str]:
        """(count, sum, sum of squares) of the partials and the edge rows together."""
        i = self.index
        count, total, squares = (f"(buckets.{c}{i} + edges.{c}{i})" for c in ("n", "s", "q"))
        return count, total, squares


class Sum(Moments):
    """The column's ``numeric`` sum."""

    def combine(self, read: Reading) -> str:
        return self.sums()[1]


class Mean(Moments):
    """The column's mean, as the defining query's ``numeric`` formula."""

    def combine(self, read: Reading) -> str:
        count, total, _ = self.sums()
        return f"CASE WHEN {count} > 0 THEN {total} / {count} END"


class Stddev(Moments):
    """The column's population deviation, as the defining query's ``numeric`` formula."""

    def combine(self, read: Reading) -> str:
        count, total, squares = self.sums()
        return (
            f"CASE WHEN {count} > 0 THEN sqrt(greatest({count} * {squares} - {total} * {total}, 0) "
            f"/ ({count} * {count})) END"
        )


class Extreme(Kind):
    """A minimum or maximum: the least or greatest value."""

    function: ClassVar[str]
    """``min`` or ``max``."""
    pick: ClassVar[str]
    """``least`` or ``greatest``."""
    short: ClassVar[str]
    """Its partial column's prefix."""
    old: ClassVar[str]
    """Its delta's column of the old rows' extreme."""
    beaten: ClassVar[str]
    """How a value that is not the extreme compares with it (``<`` under a maximum)."""

    def columns(self) -> Columns:
        return [(f"{self.short}{self.index}", "{col}")]

    def deltas(self) -> Columns:
        i = self.index
        return [(f"d{self.short}{i}", "{col}"), (f"{self.old}{i}", "{col}")]

    def partial(self, column: str, condition: str, time: str, tiebreak: str | None) -> list[str]:
        return [f"{self.function}({column}) FILTER (WHERE {condition})"]

    def signed(self, column: str) -> list[str]:
        where, function = self.where, self.function
        return [
            f"{function}({column}) FILTER (WHERE {where} AND x.fl_sg > 0)",
            f"{function}({column}) FILTER (WHERE {where} AND x.fl_sg < 0)",
        ]

    def delta_sums(self, log: str, only: str) -> list[str]:
        # the new rows' extreme; the old one is a check (takes)
        name = self.deltas()[0][0]
        return [f"{self.function}({log}.{name}){only} AS {name}"]

    def takes(self, log: str, head: str) -> list[str]:
        # the values the delta took away were inside the head's extreme, so the rows that
        # hold the extreme still do
        old, mine = f"{log}.{self.old}{self.index}", f"{head}.{self.short}{self.index}"
        return [*super().takes(log, head), f"coalesce({old} {self.beaten} {mine}, {old} IS NULL)"]

    def taken(self, head: str, deltas: str) -> list[str]:
        return [f"{self.pick}({head}.{c}, {deltas}.d{c}) AS {c}" for c, _ in self.columns()]

    def merged(self) -> list[str]:
        return [f"{self.pick}(o.{c}, n.{c})" for c, _ in self.columns()]

    def bucket(self, read: Reading) -> list[str]:
        column = f"{self.short}{self.index}"
        return [f"{filtered(f'{self.function}(b.{column})', read.inside)} AS {column}"]

    def edge(self, column: str, read: Reading) -> list[str]:
        name = f"{self.short}{self.index}"
        return [f"{self.function}({column}) FILTER (WHERE {read.edge}) AS {name}"]

    def combine(self, read: Reading) -> str:
        name = f"{self.short}{self.index}"
        return f"{self.pick}(buckets.{name}, edges.{name})"


class Min(Extreme):
    """The column's least value."""

    function, pick, short, old, beaten = "min", "least", "mn", "don", ">"


class Max(Extreme):
    """The column's greatest value."""

    function, pick, short, old, beaten = "max", "greatest", "mx", "dox", "<"


class Last(Kind):
    """The latest row's time, tiebreak (when the declaration has one) and value."""

    fixes_columns = True

    def columns(self) -> Columns:
        i = self.index
        broken = [(f"lb{i}", "{tb}")] if self.tiebreak else []
        return [(f"lt{i}", "timestamptz"), *broken, (f"lv{i}", "{col}")]

    def partial(self, column: str, condition: str, time: str, tiebreak: str | None) -> list[str]:
        tiebreak = tiebreak if self.tiebreak else None
        out = [f"max({time}) FILTER (WHERE {condition})"]
        if tiebreak:
            first = f"{time} DESC, {tiebreak} DESC NULLS LAST"
            out.append(f"(array_agg({tiebreak} ORDER BY {first}) FILTER (WHERE {condition}))[1]")
        order = last_order(time, column, tiebreak)
        out.append(f"(array_agg({column} ORDER BY {order}) FILTER (WHERE {condition}))[1]")
        return out

    def merged(self) -> list[str]:
        # every new row is at or after the old cut, every old one before
        i = self.index
        return [
            f"CASE WHEN n.lt{i} IS NOT NULL THEN n.{c} ELSE o.{c} END" for c, _ in self.columns()
        ]

    def bucket(self, read: Reading) -> list[str]:
        i, inside = self.index, read.inside
        timed = f"b.lt{i} IS NOT NULL" + (f" AND {inside}" if inside else "")
        tiebreak = f"b.lb{i}" if self.tiebreak else None
        out = [f"{filtered(f'max(b.lt{i})', inside)} AS lt{i}"]
        if tiebreak:
            first = f"b.lt{i} DESC, {tiebreak} DESC NULLS LAST"
            out.append(
                f"(array_agg({tiebreak} ORDER BY {first}) FILTER (WHERE {timed}))[1] AS lb{i}"
            )
        order = last_order(f"b.lt{i}", f"b.lv{i}", tiebreak)
        out.append(f"(array_agg(b.lv{i} ORDER BY {order}) FILTER (WHERE {timed}))[1] AS lv{i}")
        return out

    def edge(self, column: str, read: Reading) -> list[str]:
        i = self.index
        names = [f"lt{i}", *([f"lb{i}"] if self.tiebreak and read.tiebreak else []), f"lv{i}"]
        values = self.partial(column, read.edge, read.time, read.tiebreak)
        return [f"{value} AS {name}" for value, name in zip(values, names, strict=True)]

    def combine(self, read: Reading) -> str:
        i = self.index
        new, old, new_value, old_value = (
            f"edges.lt{i}",
            f"buckets.lt{i}",
            f"edges.lv{i}",
            f"buckets.lv{i}",
        )
        new_tie, old_tie = f"edges.lb{i}", f"buckets.lb{i}"
        tied = (
            f"WHEN {new_tie} IS NOT NULL AND ({old_tie} IS NULL OR {new_tie} > {old_tie}) "
            f"THEN {new_value} "
            f"WHEN {old_tie} IS NOT NULL AND ({new_tie} IS NULL OR {new_tie} < {old_tie}) "
            f"THEN {old_value} "
            if self.tiebreak
            else ""
        )
        return (
            f"CASE WHEN {new} IS NULL THEN {old_value} WHEN {old} IS NULL OR {new} > {old} "
            f"THEN {new_value} WHEN {new} < {old} THEN {old_value} {tied}WHEN {new_value} IS NULL "
            f"THEN {old_value} WHEN {old_value} IS NULL THEN {new_value} "
            f"ELSE greatest({new_value}, {old_value}) END"
        )


class CountDistinct(Kind):
    """Distinct values: a table of (key, day, value, rows) and one of each value's
    latest day; the partials count the values whose latest day each day is (``lc``)."""

    fixes_columns = True

    def member(self, alias: str, where: str) -> tuple[str, str]:
        """(the column, the condition) of its values among rows ``alias`` passing
        ``where``: its own ``where`` too, and no ``NULL``."""
        column = f"{alias}.{self.agg.column}"
        own = self.where.replace("x.", f"{alias}.")
        return column, f"{where} AND {own} AND {column} IS NOT NULL"

    def bucket(self, read: Reading) -> list[str]:
        i = self.index
        return [f"coalesce({filtered(f'sum(b.lc{i})', read.inside)}, 0) AS lc{i}"]

    def edge(self, column: str, read: Reading) -> list[str]:
        # the edge and logged days' values, gathered in the one scan of their rows
        condition = f"{read.edge} AND {column} IS NOT NULL"
        return [f"array_agg(DISTINCT {column}) FILTER (WHERE {condition}) AS ev{self.index}"]

    def combine(self, read: Reading) -> str:
        # Values in the whole days (dc, da): those whose latest day is in them, and those
        # whose latest day is da or later that also occur in them; then the edge rows'
        # values that do not. Each probed only when there can be such values (folded
        # days from as_of's on, logged days).
        i = self.index
        in_clean = self._probe(read, "l.value")
        edge_values = f"edges.ev{i} || head.hv{i}" if read.heads else f"edges.ev{i}"
        own = " AND ".join(f"l.{c} = k.{c}" for c in read.entity)
        return (
            f"(buckets.lc{i}"
            f" + CASE WHEN late.present THEN (SELECT count(*) FROM {read.latest} l "
            f"WHERE {own} AND l.latest >= bounds.as_of_day AND {in_clean} IS NOT NULL) "
            "ELSE 0 END"
            f" + CASE WHEN cardinality(dirty.days) > 0 THEN (SELECT count(*) "
            f"FROM {read.latest} l WHERE {own} AND l.latest = ANY(dirty.days) "
            f"AND {in_clean} IS NOT NULL) ELSE 0 END"
            f" + (SELECT count(DISTINCT ev.value) FROM unnest({edge_values}) "
            f"AS ev(value) WHERE {self._probe(read, 'ev.value')} IS NULL))"
        )

    @staticmethod
    def _probe(read: Reading, value: str) -> str:
        """Whether ``value`` has a member row on a clean whole day of the window. One
        value at a time (a scalar subquery with LIMIT is never made a join): the values
        of the edge rows and of as_of's day are few, the member rows of a head entity's
        window many."""
        own = " AND ".join(f"m.{c} = k.{c}" for c in read.entity)
        inside = (
            f"m.day > bounds.start_day{read.window} AND m.day < bounds.as_of_day "
            "AND m.day <> ALL(dirty.days)"
        )
        return (
            f"(SELECT 1 FROM {read.members} m WHERE {own} AND m.value = {value} "
            f"AND {inside} LIMIT 1)"
        )


KINDS: dict[str, type[Kind]] = {
    "count": Count,
    "sum": Sum,
    "mean": Mean,
    "stddev": Stddev,
    "min": Min,
    "max": Max,
    "last": Last,
    "count_distinct": CountDistinct,
}


def kind_of(index: int, agg: Agg, window_s: int, tiebreak: bool) -> Kind:
    """The :class:`Kind` of ``agg``, the ``index``-th aggregation of its declaration."""
    return KINDS[agg.kind](index, agg, window_s, tiebreak)
