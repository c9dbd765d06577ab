"""What ``plan`` checks of a declared aggregation's incremental path before ``apply``
installs its triggers on the user's table: that they can run every write the table
takes, and that they keep exactly the defining query's values (docs/repositories.md,
"What plan refuses")."""

from __future__ import annotations

import re

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from freshline.pipeline.core.features import FeatureSet
from freshline.pipeline.core.maintenance import DerivedPath

_CALL = re.compile(r'(?<![\w."])((?:"?[A-Za-z_]\w*"?\.)?"?[A-Za-z_]\w*"?)\s*\(')
_NOT_CODE = re.compile(r"--[^\n]*|/\*.*?\*/|'(?:[^']|'')*'", re.DOTALL)
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "not",
        "in",
        "exists",
        "any",
        "all",
        "some",
        "cast",
        "coalesce",
        "nullif",
        "greatest",
        "least",
        "case",
        "when",
        "then",
        "else",
        "row",
        "array",
        "values",
        "select",
        "from",
        "where",
        "over",
        "filter",
        "within",
        "lateral",
        "on",
        "using",
        "as",
        "is",
        "between",
        "like",
        "ilike",
        "similar",
        "interval",
        "extract",
        "position",
        "overlay",
        "substring",
        "trim",
        "collate",
    }
)


def called_functions(sql: str) -> list[str]:
    """The names ``sql`` calls as functions (``f(``, ``schema.f(``), lower case, each
    once; SQL's own constructs and what is in comments and string literals left out."""
    found = []
    for match in _CALL.finditer(_NOT_CODE.sub(" ", sql)):
        name = match.group(1).replace('"', "").lower()
        if name.rsplit(".", 1)[-1] not in _KEYWORDS:
            found.append(name)
    return list(dict.fromkeys(found))


def check(conn: Connection, fs: FeatureSet) -> list[str]:
    """The problems of ``fs``'s derived path, if it has one, on ``conn``'s database."""
    path = fs.maintenance
    if not isinstance(path, DerivedPath):
        return []
    where = f"{fs.origin or fs.name}: feature set {fs.name!r}"
    problems = _time_column(conn, path, where)
    problems += _collations(conn, path, where)
    problems += _subscribed(conn, path, where)
    problems += _disabled(conn, path, where)
    problems += _as_the_triggers_run(conn, fs, path, where)
    return problems


def _subscribed(conn: Connection, path: DerivedPath, where: str) -> list[str]:
    """A logical-replication subscription's apply worker fires no statement trigger: the
    table's writes would never be logged."""
    tables = [path.decl.table, *(lk.table.name for lk in path.decl.lookups)]
    found = conn.execute(
        sa.text(
            "SELECT DISTINCT srrelid::regclass::text FROM pg_subscription_rel "
            "WHERE srrelid = ANY(SELECT to_regclass(t) FROM unnest(CAST(:t AS text[])) t)"
        ),
        {"t": tables},
    ).scalars()
    return [
        f"{where}: table {table} is written by a logical-replication subscription, whose "
        "apply worker fires no statement trigger: the incremental path would miss its "
        "writes; declare it without incremental=True"
        for table in found
    ]


def _disabled(conn: Connection, path: DerivedPath, where: str) -> list[str]:
    """A trigger of the path someone disabled (``ALTER TABLE ... DISABLE TRIGGER``) or
    set to fire in replica-role sessions only: writes it misses are never logged."""
    rows = conn.execute(
        sa.text(
            "SELECT t.tgname, t.tgrelid::regclass::text, t.tgenabled FROM pg_trigger t "
            "WHERE t.tgname LIKE :name AND t.tgenabled IN ('D', 'R') ORDER BY 2, 1"
        ),
        {"name": f"{path.trigger}\\_%"},
    ).all()
    return [
        f"{where}: trigger {name} on {table} is "
        f"{'disabled' if state == 'D' else 'enabled for replica sessions only'}: writes it "
        f"misses are never logged; ALTER TABLE {table} ENABLE ALWAYS TRIGGER {name}, then "
        "freshline reconcile"
        for name, table, state in rows
    ]


def _column_info(conn: Connection, table: str) -> dict[str, tuple[str, bool]]:
    """Column -> (its type, whether its collation is nondeterministic)."""
    rows = conn.execute(
        sa.text(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod), "
            "coalesce(NOT c.collisdeterministic, false) FROM pg_attribute a "
            "LEFT JOIN pg_collation c ON c.oid = a.attcollation "
            "WHERE a.attrelid = to_regclass(:t) AND a.attnum > 0 AND NOT a.attisdropped"
        ),
        {"t": table},
    ).all()
    return {str(name): (str(kind), bool(nondet)) for name, kind, nondet in rows}


def _time_column(conn: Connection, path: DerivedPath, where: str) -> list[str]:
    columns = _column_info(conn, path.decl.table)
    kind = columns.get(path.decl.time, ("", False))[0]
    if kind and kind != "timestamp with time zone":
        return [
            f"{where}: time column {path.decl.table}.{path.decl.time} is {kind}: declared "
            "aggregations need timestamp with time zone (a timestamp without one is read in "
            "each session's time zone, so two writers would put one row on two days); "
            f"ALTER TABLE {path.decl.table} ALTER {path.decl.time} TYPE timestamptz USING "
            f"{path.decl.time} AT TIME ZONE 'UTC'"
        ]
    return []


def _collations(conn: Connection, path: DerivedPath, where: str) -> list[str]:
    """A nondeterministic collation makes min, max, last and count_distinct of a column
    depend on which of its equal values a plan meets first: no query, incremental or
    not, can give one answer."""
    columns = _column_info(conn, path.decl.table)
    problems = []
    for agg in path.decl.aggs:
        ordered = agg.kind in ("min", "max", "last", "count_distinct")
        if ordered and agg.column and columns.get(agg.column, ("", False))[1]:
            problems.append(
                f"{where}: {agg.kind}({agg.column}) over a column with a "
                "nondeterministic collation: its equal values ('open', 'OPEN') make the "
                f'result depend on the plan; aggregate {agg.column} COLLATE "C" '
                "(a generated column) instead"
            )
    return problems


def _as_the_triggers_run(
    conn: Connection, fs: FeatureSet, path: DerivedPath, where: str
) -> list[str]:
    """Run the defining query with the triggers' ``search_path``, and refuse a volatile
    function in its ``where``s and lookups: the triggers and the fold evaluate them at
    other moments than a read does."""
    search_path = path.search_path(conn)
    try:
        # Rolled back, never released: a SET LOCAL outlives the release of its savepoint.
        savepoint = conn.begin_nested()
        try:
            conn.execute(sa.text(f"SET LOCAL search_path TO {search_path}"))
            conn.execute(
                sa.text(f"SELECT * FROM ({fs.statement.text}) AS q LIMIT 0"),
                {"tenants": [], "ids": [], "as_of": None},
            )
        finally:
            savepoint.rollback()
    except sa.exc.DBAPIError as exc:
        message = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        return [
            f"{where}: its SQL fails as the incremental path's triggers run it "
            f"(search_path {search_path}): {message}; name the object with its schema"
        ]
    d = path.decl
    texts = [t for t in [d.where, *(a.where for a in d.aggs)] if t]
    texts += [t for lk in d.lookups for t in (lk.query, lk.rows) if t]
    names = sorted({n for t in texts for n in called_functions(t)})
    if not names:
        return []
    schemas = [s.strip() for s in search_path.split(",")]
    volatile = conn.execute(
        sa.text(
            "SELECT DISTINCT p.proname FROM pg_proc p "
            "JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE p.provolatile = 'v' AND (n.nspname || '.' || p.proname = ANY(:names) "
            "OR (p.proname = ANY(:names) AND n.nspname = ANY(:schemas))) ORDER BY 1"
        ),
        {"names": names, "schemas": schemas},
    ).scalars()
    return [
        f"{where}: its SQL calls {name}(), which is VOLATILE: the triggers and the fold "
        "evaluate it at other moments than a read, so their values would differ; declare "
        "it IMMUTABLE or STABLE if it is"
        for name in volatile
    ]
