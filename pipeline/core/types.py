"""The small vocabulary the rest of freshline speaks in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

Watermark = int
"""A monotonic measure of source state, packed from the computing statement's own
snapshot: its ``xmax``, its count of in-progress transactions, then a clock (µs). It is
not a WAL position. A greater one never saw less (docs/keys.md says why); see
:mod:`freshline.pipeline.cache.recompute` for how it is read,
:mod:`freshline.pipeline.cache.store` for how writes compare them, and
:mod:`freshline.pipeline.history.snapshots` for the full snapshot and ``as_of`` it names.
"""

TenantId = str
EntityId = str
FeatureSetName = str
FeatureValues = dict[str, Any]
Op = Literal["c", "u", "d", "r", "t"]


@dataclass(frozen=True, slots=True)
class EntityRef:
    """One entity of one feature set for one tenant: the unit a key names."""

    feature_set: FeatureSetName
    tenant: TenantId
    entity: EntityId


Item = tuple[FeatureSetName, TenantId, EntityId]
"""An :class:`EntityRef`'s parts as a plain tuple, for reads that need no object per entity."""


class LazyRefs(Sequence[EntityRef]):
    """A sequence of refs, each built only when asked for: the read from Redis needs
    none, and hot-read sampling reads a few. Subclasses give ``len`` and ``_ref(i)``
    for ``0 <= i < len``; indexing, negative indices and slices are done here."""

    __slots__ = ()

    def _ref(self, i: int) -> EntityRef:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> EntityRef: ...
    @overload
    def __getitem__(self, i: slice) -> list[EntityRef]: ...
    def __getitem__(self, i: int | slice) -> EntityRef | list[EntityRef]:
        n = len(self)
        if isinstance(i, slice):
            return [self._ref(j) for j in range(*i.indices(n))]
        if not -n <= i < n:
            raise IndexError(i)
        return self._ref(i if i >= 0 else i + n)


@dataclass(frozen=True, slots=True)
class Entry:
    """A decoded feature entry as stored in Redis."""

    values: FeatureValues
    schema_version: int
    computed_at_ms: int
    watermark: Watermark


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """A change to one source row, decoded from a Debezium envelope or a domain event.

    ``row`` holds the row's columns after the change (before it, for a delete), merged
    with ``before`` where the envelope carries both, so routing can find every entity
    the change affects. ``watermark`` is the Postgres LSN for CDC events and 0 when the
    source has none (domain events); ``committed_at_ms`` is the source commit time
    (Debezium ``source.ts_ms``, a domain event's ``occurred_at``) when known.
    """

    table: str
    op: Op
    tenant: TenantId | None
    row: Mapping[str, Any]
    before: Mapping[str, Any] | None = None
    watermark: Watermark = 0
    committed_at_ms: int | None = None
    txid: int | None = None


def text(raw: bytes | str | None) -> str:
    """A Redis reply as text: bytes decoded as UTF-8, ``None`` as the empty string."""
    return raw.decode() if isinstance(raw, bytes) else (raw or "")
