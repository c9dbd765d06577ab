"""The vocabulary of declared aggregations: one aggregation (:class:`Agg`) and a resolved
declaration (:class:`Declaration`), shared by the declaration API
(:mod:`freshline.pipeline.core.aggregations`) and the incremental path derived from it
(:mod:`freshline.pipeline.core.maintenance`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from freshline.pipeline.core.features import FieldType, Table, duration

ALL_TIME = 2**62
"""The window of ``window="all"``: every row at or before ``as_of``, however old."""


def since(as_of: str, window_s: int) -> str:
    """SQL of the moment a window of ``window_s`` seconds before ``as_of`` opens (rows
    after it are in): ``-infinity`` for :data:`ALL_TIME`."""
    if window_s == ALL_TIME:
        return "'-infinity'::timestamptz"
    return f"{as_of} - interval '{window_s} seconds'"


def window_text(window_s: int) -> str:
    """A window as a declaration writes it (``"30d"``, ``"all"``)."""
    return "all" if window_s == ALL_TIME else duration(window_s)


AggKind = Literal["count", "sum", "mean", "min", "max", "stddev", "count_distinct", "last"]


@dataclass(frozen=True, slots=True)
class Agg:
    """One aggregation of a declaration: made by :func:`count`, :func:`sum`, ... ."""

    kind: AggKind
    column: str | None = None
    name: str | None = None
    where: str | None = None
    window: str | int | None = None
    type: FieldType | None = None
    default: int | float | None = None
    """The value over no rows (for the aggregations that are ``NULL`` there)."""
    digits: int | None = None
    """Decimal places to round the value to (``round(value, digits)``)."""

    def finish(self, expr: str) -> str:
        """``expr`` (the aggregate's SQL) with the default and rounding applied: the one
        place both the defining query and the incremental one take them from."""
        if self.default is not None:
            expr = f"coalesce({expr}, {self.default!r})"
        if self.digits is not None:
            expr = f"round(({expr})::numeric, {self.digits})"
        return expr

    def field_name(self) -> str:
        if self.name is not None:
            return self.name
        if self.kind == "count":
            return "count"
        if self.kind == "count_distinct":
            return f"distinct_{self.column}"
        return f"{self.kind}_{self.column}"

    def field_type(self, time: str) -> FieldType:
        if self.type is not None:
            return self.type
        if self.kind in ("count", "count_distinct"):
            return "int"
        if self.kind in ("min", "max", "last") and self.column == time:
            return "timestamp"
        return "float"


@dataclass(frozen=True, slots=True)
class Lookup:
    """Columns a source row takes from another table, for aggregations over them (made by
    :func:`freshline.pipeline.core.aggregations.Lookup`, where the arguments are described)."""

    table: Table
    columns: tuple[str, ...]
    query: str
    rows: str

    def join(self, index: int) -> str:
        """The ``LEFT JOIN LATERAL`` that gives row ``x`` the columns, as ``lk<index>``."""
        return f" LEFT JOIN LATERAL ({self.query}) AS lk{index}({', '.join(self.columns)}) ON true"


@dataclass(frozen=True, slots=True)
class Declaration:
    """What :func:`Aggregations` was given, resolved: kept on the feature set
    (:attr:`FeatureSet.declared`) for ``plan`` and for incremental maintenance."""

    table: str
    entity_column: str
    tenant_column: str | None
    time: str
    where: str | None
    aggs: tuple[Agg, ...]
    windows_s: tuple[int, ...]
    """Each aggregation's window in seconds, in the order of ``aggs``."""
    lookups: tuple[Lookup, ...] = ()
    tiebreak: str | None = None
    """The column that orders rows of the same time for ``last`` (greatest first)."""

    def looked_up(self) -> tuple[str, str]:
        """(the select list, the joins) of source rows ``x`` with the lookups' columns:
        ``SELECT {cols} FROM table x{joins}``."""
        cols = ["x.*"] + [f"lk{i}.{c}" for i, lk in enumerate(self.lookups) for c in lk.columns]
        return ", ".join(cols), "".join(lk.join(i) for i, lk in enumerate(self.lookups))

    @property
    def widest_s(self) -> int:
        return max(self.windows_s)


def last_order(time: str, value: str, tiebreak: str | None) -> str:
    """The order of ``last``: latest time, then greatest tiebreak, then value."""
    middle = f", {tiebreak} DESC NULLS LAST" if tiebreak else ""
    return f"{time} DESC{middle}, {value} DESC NULLS LAST"
