"""Who may change what a derived path serves: the checks of an installed path's
functions and tables against what :mod:`.ddl` makes now (``plan`` reports them,
``apply`` fixes them: :meth:`.path.DerivedPath.secure`)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from freshline.pipeline.core.maintenance.catalog import search_path
from freshline.pipeline.core.maintenance.shape import Shape
from freshline.pipeline.core.maintenance.sql import SCHEMA
from freshline.pipeline.core.maintenance.triggers import (
    fold_signature,
    guard,
    made_for,
    settings,
    signatures,
)


def lacking(conn: Connection, shape: Shape, table: str, lookups: list[str]) -> list[str]:
    """What the installed path lacks, one line per fault: each function SECURITY
    DEFINER with its fixed ``search_path`` or none (:func:`.triggers.settings`), each
    trigger function checking the trigger it runs as, none executable by PUBLIC, no
    privilege of PUBLIC on a table, the grants of :func:`.ddl.grants`. Empty when
    nothing."""
    found = _functions(conn, shape)
    out = _function_faults(shape, table, lookups, found)
    for name in shape.tables:
        if conn.execute(
            sa.text(
                "SELECT has_table_privilege('public', :t, "
                "'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER') "
                "OR has_any_column_privilege('public', :t, 'SELECT, INSERT, UPDATE')"
            ),
            {"t": name},
        ).scalar():
            out.append(f"PUBLIC may use {name}")
    if fold_signature(shape) not in found:
        return out
    granted = conn.execute(
        sa.text(
            "SELECT bool_and(CASE WHEN r.rolname = 'freshline_consumer' "
            "AND NOT has_function_privilege(r.oid, CAST(:fold AS regprocedure), 'EXECUTE') "
            "THEN false ELSE has_table_privilege(r.oid, t, 'SELECT') END) "
            "FROM pg_roles r CROSS JOIN unnest(CAST(:tables AS text[])) AS t "
            "WHERE r.rolname IN ('freshline_api', 'freshline_consumer')"
        ),
        {"fold": f"{SCHEMA}.{fold_signature(shape)}", "tables": shape.tables},
    ).scalar()
    if granted is False:
        out.append("freshline's roles lack their grants")
    return out


def _functions(conn: Connection, shape: Shape) -> dict[str, tuple[Any, ...]]:
    """The path's functions in the database: signature -> (SECURITY DEFINER, settings,
    source, executable by PUBLIC)."""
    return {
        str(row[0]): tuple(row[1:])
        for row in conn.execute(
            sa.text(
                "SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')', "
                "p.prosecdef, p.proconfig, p.prosrc, "
                "has_function_privilege('public', p.oid, 'EXECUTE') "
                "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = :schema AND left(p.proname, length(:p)) = :p"
            ),
            {"schema": SCHEMA, "p": f"{shape.prefix}_"},
        )
    }


def _function_faults(
    shape: Shape, table: str, lookups: list[str], found: dict[str, tuple[Any, ...]]
) -> list[str]:
    """What the functions ``found`` lack of those :mod:`.ddl` makes now."""
    paths = {f"{shape.prefix}_{name}": path for name, path in settings(table, lookups).items()}
    paths[fold_signature(shape)] = search_path(table, lookups)
    guards = {
        f"{shape.prefix}_{name}": guard(shape, name.removesuffix("()"), *on)
        for name, on in made_for(table, lookups).items()
    }
    faults: dict[str, list[str]] = {}
    for name in signatures(shape):
        if name not in found:
            faults.setdefault("missing", []).append(name)
            continue
        definer, config, source, public = found[name]
        path = paths.get(name)
        if not definer or list(config or []) != ([f"search_path={path}"] if path else []):
            faults.setdefault("not SECURITY DEFINER as made now", []).append(name)
        if guards.get(name, "") not in source:
            faults.setdefault("running as any trigger it is attached to", []).append(name)
        if public:
            faults.setdefault("executable by PUBLIC", []).append(name)
    return [f"{what}: {_named(shape, names)}" for what, names in faults.items()]


def _named(shape: Shape, names: list[str]) -> str:
    """Functions of the path, few words: ``freshline.<prefix>_{i,u,d,t}()``."""
    bare = [n.removeprefix(f"{shape.prefix}_") for n in names]
    if len(bare) > 1 and all(b.endswith("()") for b in bare):
        return f"{SCHEMA}.{shape.prefix}_{{{','.join(b[:-2] for b in bare)}}}()"
    return ", ".join(f"{SCHEMA}.{n}" for n in names)
