"""The vocabulary of declared aggregations: one aggregation (:class:`Agg`) and a resolved
declaration (:class:`Declaration`), shared by the declaration API
(:mod:`pipeline.core.aggregations`) and the incremental path derived from it
(:mod:`pipeline.core.maintenance`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.core.features import FieldType

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

    @property
    def widest_s(self) -> int:
        return max(self.windows_s)
