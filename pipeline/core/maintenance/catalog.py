"""What generating a derived path asks of the database: the source table and the
lookups' tables, qualified, their columns' types, the columns the update trigger
compares, and which of them have a collation. Asked once (:func:`source`); the
generators then only write text."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.maintenance.shape import Shape
from freshline.pipeline.core.maintenance.sql import COLUMN_OF_X, ROW_X


@dataclass(frozen=True)
class Source:
    """The source table of a path as the database has it."""

    table: str
    """Qualified."""
    lookups: list[str]
    """The lookups' tables, qualified, in the declaration's order."""
    types: dict[str, str]
    """The source table's column types, and the lookups' columns' (each its own
    table's column of that name)."""
    read: list[str]
    """The columns a value can depend on (:func:`read_columns`); none: every column."""
    collated: frozenset[str]
    """The columns of :attr:`read` whose equality is not identity."""


def source(conn: Connection, shape: Shape) -> Source:
    """Ask the database what generating ``shape``'s SQL needs."""
    table = qualified(conn, shape.decl.table)
    lookups = lookup_tables(conn, shape)
    types = column_types(conn, shape, table, lookups)
    read = read_columns(conn, shape, table, types)
    return Source(table, lookups, types, read, collated(conn, table, read))


def qualified(conn: Connection, name: str) -> str:
    """``name`` as the database resolves it, with its schema."""
    found = conn.execute(sa.text("SELECT to_regclass(:t)::text"), {"t": name}).scalar()
    if found is None:
        raise ConfigError(f"table {name!r} does not exist")
    return str(found) if "." in str(found) else f"public.{found}"


def lookup_tables(conn: Connection, shape: Shape) -> list[str]:
    """The lookups' tables, qualified, in the declaration's order."""
    return [qualified(conn, lookup.table.name) for lookup in shape.decl.lookups]


def _types_of(conn: Connection, table: str) -> dict[str, str]:
    rows = conn.execute(
        sa.text(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = CAST(:t AS regclass) AND attnum > 0 AND NOT attisdropped"
        ),
        {"t": table},
    ).all()
    return {str(column): str(kind) for column, kind in rows}


def column_types(conn: Connection, shape: Shape, table: str, lookups: list[str]) -> dict[str, str]:
    """The source table's column types, and the lookups' columns' (each its own
    table's column of that name)."""
    types = _types_of(conn, table)
    for lookup, looked in zip(shape.decl.lookups, lookups, strict=True):
        theirs = _types_of(conn, looked)
        for column in lookup.columns:
            if column in types:
                raise ConfigError(
                    f"lookup column {column!r} is also a column of {shape.decl.table!r} "
                    "(name them apart)"
                )
            if column not in theirs:
                raise ConfigError(
                    f"lookup column {column!r} is not a column of {lookup.table.name!r}"
                )
            types[column] = theirs[column]
    return types


def read_columns(conn: Connection, shape: Shape, table: str, types: dict[str, str]) -> list[str]:
    """The source table's columns a value can depend on: its key, time and tiebreak,
    the aggregated ones, and those the ``where``s and lookups name as ``x.col``; none
    (every column) when some SQL of the declaration names the row ``x`` otherwise, or
    a column's type has no default equality (the update trigger compares them)."""
    decl = shape.decl
    sql = [decl.where, *(a.where for a in decl.aggs), *(lk.query for lk in decl.lookups)]
    texts = [t for t in [*sql, *(lk.rows for lk in decl.lookups)] if t]
    if any(ROW_X.search(COLUMN_OF_X.sub("", t)) for t in texts):
        return []
    used = [*shape.source_columns(), decl.time, *([decl.tiebreak] if decl.tiebreak else [])]
    used += [a.column for a in decl.aggs if a.column]
    used += [m.group(2) for t in texts for m in COLUMN_OF_X.finditer(t)]
    looked_up = {c for lk in decl.lookups for c in lk.columns}
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


def collated(conn: Connection, table: str, read: list[str]) -> frozenset[str]:
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


def partitions(conn: Connection, table: str) -> list[str]:
    """Every partition of ``table``, at every level, qualified; none when it is not
    partitioned."""
    return list(
        conn.execute(
            sa.text(
                "SELECT format('%I.%I', n.nspname, c.relname) "
                "FROM pg_partition_tree(to_regclass(:t)) p JOIN pg_class c ON c.oid = p.relid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE p.relid <> to_regclass(:t) ORDER BY p.level, 1"
            ),
            {"t": table},
        ).scalars()
    )


def roles(conn: Connection) -> list[str]:
    """freshline's roles that exist in the database."""
    return list(
        conn.execute(
            sa.text(
                "SELECT rolname FROM pg_roles "
                "WHERE rolname IN ('freshline_api', 'freshline_consumer') ORDER BY 1"
            )
        ).scalars()
    )


def search_path(table: str, lookups: list[str]) -> str:
    """The functions' ``search_path``. A ``where`` or a lookup's query names tables
    and functions as the user wrote them: they resolve in the schemas of the tables
    involved, after pg_catalog (so no user object shadows a built-in), as ``plan``
    checks."""
    schemas = dict.fromkeys(t.rsplit(".", 1)[0] for t in [table, *lookups])
    return ", ".join(["pg_catalog", *schemas, "pg_temp"])
