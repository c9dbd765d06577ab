"""What installing a derived path runs: its tables (the day partials, each
``count_distinct``'s members and latest days, the heads, the log), its functions, the
grants, the triggers on the user's tables, then the build of the partials from the rows
there are."""

from __future__ import annotations

from collections.abc import Sequence

from freshline.pipeline.core.maintenance import partials, triggers
from freshline.pipeline.core.maintenance.catalog import Source
from freshline.pipeline.core.maintenance.fold import fold_function
from freshline.pipeline.core.maintenance.kinds import Columns
from freshline.pipeline.core.maintenance.shape import Shape
from freshline.pipeline.core.maintenance.sql import SCHEMA


def statements(
    shape: Shape, source: Source, partitions: Sequence[str], roles: Sequence[str]
) -> list[str]:
    """Every statement that installs ``shape``'s path, in order (the triggers, the
    last to change the user's tables, before the build)."""
    return [
        *tables(shape, source),
        *functions(shape, source),
        *grants(shape, roles),
        *triggers.table_triggers(shape, source.table),
        *triggers.partition_triggers(shape, partitions),
        *triggers.lookup_triggers(shape, source.lookups),
        *partials.locks(shape, source.table, source.lookups),
        *partials.rebuild(shape, source.table, keys_from=None),
        # Statistics now, not at autovacuum's leisure: without them the first
        # recomputes plan the partials as empty tables (a head entity's took a
        # second, against milliseconds once analysed).
        *(f"ANALYZE {t}" for t in shape.tables),
    ]


def functions(shape: Shape, source: Source) -> list[str]:
    """The trigger functions, then the fold."""
    return [*triggers.functions(shape, source), fold_function(shape, source)]


def _typed(columns: Columns, types: dict[str, str], column: str | None, tiebreak: str) -> list[str]:
    """``name type`` of ``columns``, with the source column's and the tiebreak's types."""
    if column is None:
        return [f"{name} {kind}" for name, kind in columns]
    return [f"{name} {kind.format(col=types[column], tb=tiebreak)}" for name, kind in columns]


def tables(shape: Shape, source: Source) -> list[str]:
    """The path's tables and their indexes."""
    types = source.types
    key_types = shape.key_types()
    keys = ", ".join(f"{k} {t} NOT NULL" for k, t in zip(shape.keys, key_types, strict=True))
    entity_keys = ", ".join(
        f"{k} {t} NOT NULL" for k, t in zip(shape.keys[:-1], key_types[:-1], strict=True)
    )
    entities = ", ".join(shape.entity.columns)
    tiebreak = types[shape.decl.tiebreak] if shape.decl.tiebreak else ""
    partial = [
        typed
        for slot in shape.slots
        for typed in _typed(slot.columns(), types, slot.agg.column, tiebreak)
    ]
    # Per count_distinct: how many values have this day as their latest (so that the
    # values whose latest day is a clean whole day are a sum over days, not a count
    # over values).
    columns = partial + [f"lc{s.index} bigint NOT NULL DEFAULT 0" for s in shape.distinct]
    out = [
        f"CREATE TABLE IF NOT EXISTS {shape.days} ({keys}, {', '.join(columns)}, "
        f"PRIMARY KEY ({', '.join(shape.keys)}))"
    ]
    for slot in shape.distinct:
        value = f"value {types[str(slot.agg.column)]} NOT NULL"
        out += [
            f"CREATE TABLE IF NOT EXISTS {shape.members(slot)} ({keys}, {value}, "
            f"n bigint NOT NULL, PRIMARY KEY ({entities}, value, day))",
            f"CREATE TABLE IF NOT EXISTS {shape.latest(slot)} ({entity_keys}, {value}, "
            f"latest date NOT NULL, PRIMARY KEY ({entities}, value))",
            f"CREATE INDEX IF NOT EXISTS {shape.prefix}_l{slot.index}_by_day "
            f"ON {shape.latest(slot)} ({entities}, latest)",
        ]
    if shape.heads:
        arrays = [f"hv{s.index} {types[str(s.agg.column)]}[]" for s in shape.distinct]
        out.append(
            f"CREATE TABLE IF NOT EXISTS {shape.head} ({entity_keys}, day date NOT NULL, "
            f"cut timestamptz NOT NULL, {', '.join([*partial, *arrays])}, "
            f"PRIMARY KEY ({entities}))"
        )
    deltas = "".join(
        f", {typed}"
        for slot in shape.moving
        for typed in _typed(slot.deltas(), types, slot.agg.column, tiebreak)
    )
    return [
        *out,
        f"CREATE TABLE IF NOT EXISTS {shape.log} ({keys}, at timestamptz NOT NULL, "
        f"till timestamptz{deltas})",
        f"CREATE INDEX IF NOT EXISTS {shape.prefix}_log_by_key ON {shape.log} "
        f"({', '.join(shape.keys)}, at)",
    ]


def grants(shape: Shape, roles: Sequence[str]) -> list[str]:
    """The privileges on the path's objects, set whole: PUBLIC has none (every function
    runs as the owner, and the triggers on the user's tables were made by the owner),
    freshline's roles (of ``roles``) read the tables, the consumers run the fold."""
    tables = ", ".join(shape.tables)
    functions = ", ".join(f"{SCHEMA}.{f}" for f in triggers.signatures(shape))
    out = [
        f"REVOKE ALL ON {tables} FROM PUBLIC",
        f"REVOKE ALL ON FUNCTION {functions} FROM PUBLIC",
    ]
    for role in roles:
        out.append(f"GRANT SELECT ON {tables} TO {role}")
        if role == "freshline_consumer":
            fold = triggers.fold_signature(shape)
            out.append(f"GRANT EXECUTE ON FUNCTION {SCHEMA}.{fold} TO {role}")
    return out


def describe(shape: Shape, table: str, lookups: list[str]) -> str:
    """What installing it does, in one line (for ``plan``)."""
    made = ", ".join([shape.days, *(shape.members(s) for s in shape.distinct)])
    also = "".join(
        f"; statement triggers {shape.trigger}_l{n}{{i,u,d,t}} on {looked}"
        for n, looked in enumerate(lookups)
    )
    held = ", ".join([table, *lookups])
    return (
        f"create {made}; statement triggers {shape.trigger}_{{i,u,d,t}} on {table}{also}; "
        f"fill them from its rows under LOCK TABLE {held} IN SHARE MODE"
    )
