"""Feature values as Arrow columns: the names and types training sets and batch reads share.

A requested feature is a feature set (``txn_90d``: all its fields) or one field
(``geo:distinct_countries_30d``); each field becomes a column ``feature_set__field``,
typed as declared: ``int`` as int64, ``float`` as float64, ``bool``, ``str``, and
``timestamp`` as ``timestamp[ms, UTC]`` (entries hold epoch milliseconds). A training set
(:func:`freshline.pipeline.history.training.training_set`) and a batch read
(:meth:`freshline.pipeline.cache.client.FeatureClient.get_frame`) build their columns here,
so a model trained on one scores on the other.

pyarrow is imported only when a frame is built (the ``training`` extra); without it,
:class:`FrameError` says what to install.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from freshline.pipeline.core.errors import FreshlineError, UnknownFeatureSet
from freshline.pipeline.core.features import Entity, FeatureSet, Field, FieldType, Registry
from freshline.pipeline.core.types import FeatureValues, Item

if TYPE_CHECKING:
    import pyarrow as pa

EXTRA = "pip install 'freshline[training]'"


class FrameError(FreshlineError):
    """A frame that cannot be built (pyarrow missing, an unknown feature): one line."""


def arrow(what: str = "Arrow frames") -> Any:
    """The pyarrow module, or :class:`FrameError` naming the extra that installs it."""
    try:
        import pyarrow
    except ImportError:
        raise FrameError(f"{what} need pyarrow: {EXTRA}") from None
    return pyarrow


@dataclass(frozen=True, slots=True)
class Requested:
    """One output column: a field of a feature set."""

    feature_set: FeatureSet
    field: Field

    @property
    def column(self) -> str:
        return f"{self.feature_set.name}__{self.field.name}"


def requested(registry: Registry, features: Sequence[str]) -> list[Requested]:
    """``txn_90d`` (every field) or ``geo:distinct_countries_30d`` (one), in order."""
    if isinstance(features, str):
        raise FrameError(f"features are a list of names, not one string: [{features!r}]")
    if not features:
        raise FrameError("no features asked for: name feature sets, e.g. txn_90d,geo")
    out: list[Requested] = []
    for spec in features:
        name, _, field = spec.strip().partition(":")
        try:
            fs = registry[name]
        except UnknownFeatureSet as exc:
            raise FrameError(str(exc)) from None
        if not field:
            out += [Requested(fs, f) for f in fs.fields]
            continue
        found = next((f for f in fs.fields if f.name == field), None)
        if found is None:
            raise FrameError(
                f"feature set {name!r} has no field {field!r}; its fields: "
                f"{', '.join(fs.field_names)}"
            )
        out.append(Requested(fs, found))
    return list(dict.fromkeys(out))


def arrow_type(kind: FieldType) -> Any:
    """The Arrow type of a declared field type."""
    pa = arrow()
    return {
        "int": pa.int64(),
        "float": pa.float64(),
        "bool": pa.bool_(),
        "str": pa.string(),
        "timestamp": pa.timestamp("ms", tz="UTC"),
    }[kind]


def arrow_column(kind: FieldType, values: list[Any]) -> pa.Array:
    """Entry values (timestamps as epoch ms) as an Arrow column of the declared type."""
    pa = arrow()
    if kind == "timestamp":
        return pa.array(values, pa.int64()).cast(arrow_type(kind))
    return pa.array(values, arrow_type(kind))


def key_column(entity: Entity, ids: list[str]) -> pa.Array:
    """Entity ids (canonical text) as their key column: int64 for a ``bigint`` key,
    else strings."""
    pa = arrow()
    if entity.type == "bigint":
        return pa.array([int(i) for i in ids], pa.int64())
    return pa.array(ids, pa.string())


class Served(Protocol):
    """What a read gives per item (:class:`freshline.pipeline.cache.client.Features`)."""

    @property
    def values(self) -> FeatureValues: ...

    @property
    def age_ms(self) -> int: ...

    @property
    def schema_version(self) -> int: ...


def entity_frame(
    entity: Entity,
    wanted: Sequence[Requested],
    tenant: str,
    ids: list[str],
    found: Mapping[str, Sequence[Served | None]],
) -> pa.Table:
    """A row per entity id: its tenant column (where the entity has one), its key column,
    then a column per requested field; ``found`` holds each feature set's reads, in the
    ids' order (None: a miss, whose fields are null)."""
    pa = arrow()
    columns: dict[str, Any] = {}
    if entity.tenant:
        columns[entity.tenant] = pa.array([tenant] * len(ids), pa.string())
    columns[entity.key] = key_column(entity, ids)
    for r in wanted:
        reads = found[r.feature_set.name]
        values = [None if f is None else f.values.get(r.field.name) for f in reads]
        columns[r.column] = arrow_column(r.field.type, values)
    return pa.table(columns)


def items_frame(
    registry: Registry, items: Sequence[Item], found: Sequence[Served | None]
) -> pa.Table:
    """A row per item: ``feature_set``, ``tenant``, ``entity``, ``age_ms`` and
    ``schema_version`` (null for a miss), then every field of each feature set the items
    name, in their order (null in the rows of other sets)."""
    pa = arrow()
    columns: dict[str, Any] = {
        "feature_set": pa.array([fs for fs, _, _ in items], pa.string()),
        "tenant": pa.array([tenant for _, tenant, _ in items], pa.string()),
        "entity": pa.array([entity for _, _, entity in items], pa.string()),
        "age_ms": pa.array([None if f is None else f.age_ms for f in found], pa.int64()),
        "schema_version": pa.array(
            [None if f is None else f.schema_version for f in found], pa.int64()
        ),
    }
    names = list(dict.fromkeys(fs for fs, _, _ in items))
    for r in requested(registry, names):
        name = r.feature_set.name
        values = [
            f.values.get(r.field.name) if f is not None and fs == name else None
            for (fs, _, _), f in zip(items, found, strict=True)
        ]
        columns[r.column] = arrow_column(r.field.type, values)
    return pa.table(columns)
