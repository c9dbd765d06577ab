"""The shape of one declaration's derived path: its aggregations as :mod:`kinds`, the
names of its tables, their key columns, and which aggregations an update may move."""

from __future__ import annotations

from freshline.pipeline.core.declarations import Declaration
from freshline.pipeline.core.features import Entity
from freshline.pipeline.core.maintenance.kinds import CountDistinct, Kind, kind_of
from freshline.pipeline.core.maintenance.sql import SCHEMA, named_columns, utc_day

LAYOUT = 5
"""The generated tables' layout; part of their names, so a change of it (a new column, a
new table) installs anew beside what an earlier freshline made."""


class Shape:
    """What the generators of a derived path read: the declaration, its aggregations
    (:attr:`slots`) and its tables' names."""

    def __init__(self, fs_name: str, entity: Entity, decl: Declaration, digest: str) -> None:
        """``digest``: of the defining query, so that a changed declaration (a new
        schema version) gets tables of its own beside the old one's."""
        self.entity = entity
        self.decl = decl
        self.prefix = f"agg_{fs_name[:40]}_{digest}"
        self.slots: list[Kind] = [
            kind_of(i, a, w, decl.tiebreak is not None)
            for i, (a, w) in enumerate(zip(decl.aggs, decl.windows_s, strict=True))
        ]
        self.windows = sorted(set(decl.windows_s))

    # -- names ------------------------------------------------------------------------

    @property
    def days(self) -> str:
        """The day partials."""
        return f"{SCHEMA}.{self.prefix}_days"

    def members(self, slot: Kind) -> str:
        """A ``count_distinct``'s (key, day, value, rows)."""
        return f"{SCHEMA}.{self.prefix}_d{slot.index}"

    def latest(self, slot: Kind) -> str:
        """A ``count_distinct``'s (key, value, latest day)."""
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
    def function(self) -> str:
        """The prefix of the path's functions' names, qualified."""
        return f"{SCHEMA}.{self.prefix}"

    @property
    def trigger(self) -> str:
        """The prefix of the path's triggers' names."""
        return f"freshline_{self.prefix}"

    @property
    def lock(self) -> str:
        """The advisory lock that folds and rebuilds of this path take."""
        return f"hashtext('{SCHEMA}.{self.prefix}')"

    @property
    def tables(self) -> list[str]:
        """Every table of the path."""
        return [
            self.days,
            *(t for s in self.distinct for t in (self.members(s), self.latest(s))),
            *([self.head] if self.heads else []),
            self.log,
        ]

    # -- what it keeps --------------------------------------------------------------------

    @property
    def heads(self) -> bool:
        """Whether the path keeps heads: only when every window is a day or longer, so
        that the whole of ``as_of``'s day before ``as_of`` is in every window."""
        return min(self.windows) >= 86_400

    @property
    def distinct(self) -> list[CountDistinct]:
        """The ``count_distinct`` aggregations (each with tables of its own)."""
        return [s for s in self.slots if isinstance(s, CountDistinct)]

    @property
    def fixed(self) -> set[str]:
        """The source columns an UPDATE must leave as they were (as a multiset over the
        rows it changed) to be logged as a delta: the key, time and tiebreak, the
        declaration's ``where``'s, and every column a ``count_distinct`` or ``last``
        reads (what no delta can take back)."""
        decl = self.decl
        kept = [s for s in self.slots if s.fixes_columns]
        columns = {*self.source_columns(), decl.time, *([decl.tiebreak] if decl.tiebreak else [])}
        columns |= {str(s.agg.column) for s in kept if s.agg.column}
        return columns | named_columns(decl.where, *(s.agg.where for s in kept))

    @property
    def moving(self) -> list[Kind]:
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
            if not named | named_columns(s.agg.where) <= fixed:
                out.append(s)
        return out

    def partial_columns(self) -> list[str]:
        """The day partials' value columns, in the slots' order."""
        return [name for s in self.slots for name, _ in s.columns()]

    # -- keys -----------------------------------------------------------------------------

    @property
    def keys(self) -> list[str]:
        """The partials' key columns: the entity's (tenant first), then ``day``."""
        return [*self.entity.columns, "day"]

    def key_types(self) -> list[str]:
        """The types of :attr:`keys`."""
        return [*(["text"] if self.entity.tenant else []), self.entity.type, "date"]

    def source_columns(self) -> list[str]:
        """The source's columns that hold the entity's (tenant first)."""
        columns = [self.decl.entity_column]
        if self.entity.tenant:
            columns.insert(0, str(self.decl.tenant_column))
        return columns

    def source_keys(self, alias: str) -> list[str]:
        """The source's columns that hold the partials' key columns, on ``alias``."""
        own = [f"{alias}.{c}" for c in self.source_columns()]
        return [*own, utc_day(f"{alias}.{self.decl.time}")]

    def row_filter(self, alias: str) -> str:
        """The rows the partials summarise: with a key and a time, passing ``where``."""
        own = [f"{alias}.{c} IS NOT NULL" for c in [*self.source_columns(), self.decl.time]]
        if self.decl.where:
            own.append("(" + self.decl.where.replace("x.", f"{alias}.") + ")")
        return " AND ".join(own)
