"""``freshline plan``: what the active repository would change, checked against Postgres.

:func:`plan` changes nothing. It loads the definitions, then checks each against the
database: every table and column a definition names exists, each feature query returns
the entity's key columns and then the declared fields, in order, with types that fit
(the query is planned and run over no keys, in a read-only transaction), and each table
has the replica identity its routing needs (a delete's before-image carries only the
primary key unless the identity is FULL, so a routing column outside the key needs
FULL). It compares the definitions with the repository's lock (a changed feature set
needs a ``SCHEMA_VERSION`` bump) and lists the tables change data capture must cover.

A problem names the file and line of the definition it is about.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.core.errors import LockMismatch
from freshline.pipeline.core.features import (
    AS_OF,
    FeatureSet,
    FieldType,
    clock_calls,
    reads_clock,
)
from freshline.pipeline.core.lock import Lock, check
from freshline.pipeline.core.maintenance import DerivedPath
from freshline.pipeline.core.repository import Repository
from freshline.pipeline.deploy import derived_checks

# Postgres types (pg_type.typname) a declared field type accepts.
FITS: dict[FieldType, frozenset[str]] = {
    "int": frozenset({"int2", "int4", "int8", "numeric"}),
    "float": frozenset({"float4", "float8", "numeric", "int2", "int4", "int8"}),
    "bool": frozenset({"bool"}),
    "str": frozenset({"text", "varchar", "bpchar", "name", "inet", "uuid", "citext"}),
    "timestamp": frozenset({"timestamptz", "timestamp", "date"}),
}
KEY_FITS = {"bigint": {"int8", "int4", "int2"}, "text": {"text", "varchar"}, "uuid": {"uuid"}}
_PARAM = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


@dataclass
class Plan:
    """What :func:`plan` found."""

    repository: Repository
    schema_version: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What would serve stale values but not fail (a query that reads the moment it is
    computed for and has no horizon); ``plan`` still passes."""
    lock: str = ""
    """``ok`` (the lock has this version, unchanged), ``new`` (apply records it), or the
    mismatch (a SCHEMA_VERSION bump is needed)."""
    tables: list[str] = field(default_factory=list)
    replica_identity: dict[str, str] = field(default_factory=dict)
    """Table -> the DDL its routing needs (``ALTER TABLE ... REPLICA IDENTITY FULL``)."""
    publication_missing: list[str] = field(default_factory=list)
    own_schema: str = ""
    """freshline's own schema: ``ok`` (at head), or what apply does to it."""
    grants: list[str] = field(default_factory=list)
    """``GRANT SELECT`` statements the two freshline roles need on the tables."""
    derived: dict[str, str] = field(default_factory=dict)
    """Feature set -> what installing its derived incremental path does (triggers on
    the user's table: ``apply --alter-tables``), for those not installed yet."""
    security: dict[str, list[str]] = field(default_factory=dict)
    """Feature set -> what its installed derived path lacks of who may do what (an
    earlier freshline's install): apply replaces its functions and grants in place."""
    path_grants: dict[str, list[str]] = field(default_factory=dict)
    """Feature set -> the ``GRANT``/``REVOKE`` apply runs on its derived path's objects
    (one it installs or fixes)."""
    history: list[str] = field(default_factory=list)
    """What history records and what apply does for it (``freshline.pipeline.history.status``)."""

    @property
    def ok(self) -> bool:
        return not self.problems and self.lock in ("ok", "new")


def plan(repo: Repository, engine: Engine, schema_version: int, publication: str) -> Plan:
    """Check ``repo`` against the database ``engine`` reaches (read-only)."""
    result = Plan(repo, schema_version, tables=repo.table_names())
    entity_tables = {fs.entity.table for fs in repo.registry if fs.entity.table is not None}
    with engine.connect() as conn:
        conn.execute(sa.text("SET TRANSACTION READ ONLY"))
        columns = _columns(conn, sorted(set(result.tables) | entity_tables))
        for fs in repo.registry:
            # A query is run only once its tables are known to be there.
            problems = (
                _check_sources(fs, columns)
                or _check_query(conn, fs)
                or _check_horizon(conn, fs)
                or derived_checks.check(conn, fs)
            )
            if not problems and repo.history.enabled:
                problems = _check_history(conn, fs, set(result.tables))
            result.problems += problems
            result.warnings += staleness_warnings(fs)
        for table in result.tables:
            if table in columns:
                ddl = _replica_identity(conn, repo, table)
                if ddl:
                    result.replica_identity[table] = ddl
        found = conn.execute(
            sa.text("SELECT tablename FROM pg_publication_tables WHERE pubname = :p"),
            {"p": publication},
        ).scalars()
        result.publication_missing = sorted(set(result.tables) - set(found))
        result.own_schema = _own_schema(conn)
        result.grants = missing_grants(conn, [t for t in result.tables if t in columns])
        for fs in repo.registry:
            path = fs.maintenance
            if not isinstance(path, DerivedPath) or path.decl.table not in columns:
                continue
            if not path.installed(conn):
                result.derived[fs.name] = path.describe(conn)
            elif fixes := path.table_fixes(conn):
                result.derived[fs.name] = (
                    f"{'; '.join(fixes)}: installs it again and rebuilds its partials"
                )
            elif lacking := path.unsecured(conn):
                result.security[fs.name] = lacking
            else:
                continue
            result.path_grants[fs.name] = path.grants(conn)
        conn.rollback()
    try:
        result.lock = check(Lock.load(repo.lock_path), schema_version, repo.registry)
    except LockMismatch as exc:
        result.lock = str(exc)
    return result


def _check_history(conn: Connection, fs: FeatureSet, captured: set[str]) -> list[str]:
    """With history on, a query must compute from its rows and ``t(as_of)`` alone, so a
    training set can evaluate it at any past moment (docs/training.md): no clock read
    directly, no user function that is not IMMUTABLE, no table history does not capture
    (the plan of the full path, EXPLAINed, says which relations and functions it uses)."""
    where = fs.origin or fs.name
    problems = []
    clock = reads_clock(fs.query)
    if clock:
        problems.append(
            f"{where}: feature set {fs.name!r}: with history on, the query may not read the "
            f"clock ({clock}): use t.as_of, the moment it computes for"
        )
    # The defining query (the full path) with t(as_of) given: its own clock reads only.
    keys = fs.entity.keys_cte().replace(AS_OF, "CAST(:as_of AS timestamptz)")
    plan = conn.execute(
        sa.text(f"EXPLAIN (VERBOSE, FORMAT JSON) {keys}{fs.query}"),
        {"tenants": [], "ids": [], "as_of": None},
    ).scalar()
    schema = conn.execute(sa.text("SELECT current_schema()")).scalar()
    relations, calls, clocks = _explained(plan)
    if clocks and not clock:  # through a function Postgres inlined
        problems.append(
            f"{where}: feature set {fs.name!r}: with history on, the query may not read the "
            f"clock ({', '.join(sorted(clocks))}, through a function): use t.as_of"
        )
    for relation_schema, name in sorted(relations):
        if relation_schema != schema or name not in captured:
            problems.append(
                f"{where}: feature set {fs.name!r}: with history on, the query may read only "
                f"the tables history captures (its sources): it reads {relation_schema}.{name}"
            )
    for function_schema, name in conn.execute(_NOT_IMMUTABLE, {"names": sorted(calls)}):
        problems.append(
            f"{where}: feature set {fs.name!r}: with history on, the query may call only "
            f"IMMUTABLE user functions: {function_schema}.{name} is not"
        )
    return problems


# A call as EXPLAIN VERBOSE prints it: qualified where the search path would not find it.
_CALL = re.compile(r"\b(?:[a-z_][a-z0-9_]*\.)?([a-z_][a-z0-9_]*)\(")
# The user functions (outside Postgres's own schemas) of those names that are not IMMUTABLE.
_NOT_IMMUTABLE = sa.text(
    "SELECT DISTINCT n.nspname, p.proname FROM pg_proc p "
    "JOIN pg_namespace n ON n.oid = p.pronamespace "
    "WHERE p.proname = ANY(CAST(:names AS text[])) AND p.provolatile <> 'i' "
    "AND n.nspname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2"
)


def _explained(plan: object) -> tuple[set[tuple[str, str]], set[str], set[str]]:
    """The relations a JSON plan scans, the names of the functions it calls, and the
    clock functions it reads."""
    relations: set[tuple[str, str]] = set()
    calls: set[str] = set()
    clocks: set[str] = set()
    todo = [plan]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if "Relation Name" in node:
                relations.add((str(node.get("Schema")), str(node["Relation Name"])))
            todo += node.values()
        elif isinstance(node, list):
            todo += node
        elif isinstance(node, str):
            calls |= set(_CALL.findall(node))
            clock = reads_clock(node)
            if clock:
                clocks.add(clock)
    return relations, calls, clocks


ROLES = ("freshline_api", "freshline_consumer")


def _own_schema(conn: Connection) -> str:
    from freshline import migrations

    head = migrations.head()
    found = conn.execute(sa.text("SELECT to_regclass('freshline.alembic_version')")).scalar()
    if found is None:
        return f"missing (apply creates it, at revision {head})"
    at = conn.execute(sa.text("SELECT version_num FROM freshline.alembic_version")).scalar()
    return "ok" if at == head else f"at revision {at} (apply upgrades it to {head})"


def missing_grants(conn: Connection, tables: list[str]) -> list[str]:
    """The ``GRANT SELECT`` the freshline roles lack on ``tables`` (none while the roles
    do not exist yet: apply creates them, then asks again)."""
    grants = []
    for role in ROLES:
        if conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first():
            lacking = [
                t
                for t in tables
                if not conn.execute(
                    sa.text("SELECT has_table_privilege(:r, quote_ident(:t), 'SELECT')"),
                    {"r": role, "t": t},
                ).scalar()
            ]
            if lacking:
                grants.append(f"GRANT SELECT ON {', '.join(lacking)} TO {role}")
    return grants


def _columns(conn: Connection, tables: list[str]) -> dict[str, set[str]]:
    rows = conn.execute(
        sa.text(
            "SELECT c.relname, a.attname FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = current_schema() "
            "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
            "WHERE c.relname = ANY(:t) AND c.relkind IN ('r', 'p')"
        ),
        {"t": tables},
    )
    found: dict[str, set[str]] = {}
    for table, column in rows:
        found.setdefault(table, set()).add(column)
    return found


def _check_sources(fs: FeatureSet, columns: dict[str, set[str]]) -> list[str]:
    where = fs.origin or fs.name
    problems = []
    for source in fs.sources:
        have = columns.get(source.table)
        if have is None:
            problems.append(f"{where}: feature set {fs.name!r}: unknown table {source.table!r}")
            continue
        wanted = [*source.entity_columns, *([source.tenant] if source.tenant else [])]
        wanted += _PARAM.findall(source.reverse or "")
        for column in dict.fromkeys(wanted):
            if column not in have:
                problems.append(
                    f"{where}: feature set {fs.name!r}: table {source.table!r} has no "
                    f"column {column!r}"
                )
    entity = fs.entity
    if entity.table is not None:
        have = columns.get(entity.table)
        needed = [entity.table_key or entity.key, *([entity.tenant] if entity.tenant else [])]
        if have is None:
            problems.append(f"{where}: entity {entity.name!r}: unknown table {entity.table!r}")
        else:
            problems += [
                f"{where}: entity {entity.name!r}: table {entity.table!r} has no column {c!r}"
                for c in needed
                if c not in have
            ]
    return problems


def _check_query(conn: Connection, fs: FeatureSet) -> list[str]:
    """Run the query over no keys and compare its result's columns with the declaration."""
    where = fs.origin or fs.name
    statement = sa.text(f"SELECT * FROM ({fs.statement.text}) AS q LIMIT 0")
    try:
        with conn.begin_nested():
            result = conn.execute(statement, {"tenants": [], "ids": [], "as_of": None})
            described = result.cursor.description if result.cursor else None
    except sa.exc.DBAPIError as exc:
        message = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        if getattr(exc.orig, "sqlstate", None) == "42501":  # a missing grant, not the query
            return [
                f"{where}: feature set {fs.name!r}: cannot check the query as "
                f"{conn.engine.url.username or 'this login'} ({message}): run plan as the "
                "tables' owner (FRESHLINE_POSTGRES_ADMIN_URL), which apply uses too"
            ]
        return [f"{where}: feature set {fs.name!r}: the query fails: {message}"]
    if not described:
        return [f"{where}: feature set {fs.name!r}: the query returns no columns"]
    types: dict[object, str] = dict(
        conn.execute(
            sa.text("SELECT oid, typname FROM pg_type WHERE oid = ANY(:o)"),
            {"o": [d[1] for d in described]},
        ).all()
    )
    got = [(str(d[0]), types.get(d[1], "?")) for d in described]
    keys = fs.entity.columns
    want = [*keys, *fs.field_names]
    if [n for n, _ in got] != want:
        return [
            f"{where}: feature set {fs.name!r}: the query returns columns "
            f"({', '.join(n for n, _ in got)}); declared ({', '.join(want)}): the entity's "
            "key columns, then the fields, in order"
        ]
    problems = []
    key_type = got[len(keys) - 1][1]
    if key_type not in KEY_FITS[fs.entity.type]:
        problems.append(
            f"{where}: feature set {fs.name!r}: key column {fs.entity.key!r} is {key_type}, "
            f"the entity's key type is {fs.entity.type}"
        )
    for f, (_, typname) in zip(fs.fields, got[len(keys) :], strict=True):
        if typname not in FITS[f.type]:
            problems.append(
                f"{where}: feature set {fs.name!r}: field {f.name!r} is declared {f.type} "
                f"but the query returns {typname}"
            )
    return problems


def _check_horizon(conn: Connection, fs: FeatureSet) -> list[str]:
    """Compile the horizon the way recomputes run it (over the query's rows, ``f``)."""
    if fs.horizon is None:
        return []
    statement = sa.text(
        f"SELECT f.*, {fs.horizon} AS valid_until FROM ({fs.statement.text}) AS f LIMIT 0"
    )
    try:
        with conn.begin_nested():
            conn.execute(statement, {"tenants": [], "ids": [], "as_of": None})
    except sa.exc.DBAPIError as exc:
        message = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        return [
            f"{fs.origin or fs.name}: feature set {fs.name!r}: the horizon fails: {message} "
            "(it reads the query's row as f.<column>: "
            f"{', '.join(f'f.{c}' for c in fs.entity.columns)})"
        ]
    return []


# What makes a query's result change with time alone: the moment it computes for
# (``t.as_of``, ``:as_of``) or the clock. Matched outside comments and string literals.
def staleness_warnings(fs: FeatureSet) -> list[str]:
    """A query whose result changes with time alone (it reads the moment it computes for)
    and has no horizon serves a stale value until its TTL once a row leaves its window."""
    if fs.horizon is not None or fs.declared is not None:
        return []
    read = clock_calls(fs.query, as_of=True)
    if not read:
        return []
    return [
        f"{fs.origin or fs.name}: feature set {fs.name!r}: its query reads "
        f"{', '.join(read)} but declares no horizon, so an entry stays served until its "
        f'TTL ({fs.ttl_s} s) after a row leaves its window; add horizon="<SQL: the first '
        'moment after as_of its value may change with no row changing>" (see '
        "docs/repositories.md#horizons), or a short ttl"
    ]


def _replica_identity(conn: Connection, repo: Repository, table: str) -> str:
    """The DDL ``table`` needs so that a delete's (or update's) before-image carries every
    column its routing reads; empty when it has that already."""
    row = conn.execute(
        sa.text(
            "SELECT c.relreplident, coalesce(array_agg(a.attname) FILTER "
            "(WHERE a.attname IS NOT NULL), '{}') FROM pg_class c "
            "LEFT JOIN pg_index i ON i.indrelid = c.oid AND i.indisprimary "
            "LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(i.indkey) "
            "WHERE c.oid = to_regclass(:t) GROUP BY c.relreplident"
        ),
        {"t": table},
    ).first()
    if row is None or row[0] == "f":
        return ""
    routed: set[str] = set()
    for _, source in repo.sources_of(table):
        routed |= set(source.entity_columns) | set(_PARAM.findall(source.reverse or ""))
        if source.tenant:
            routed.add(source.tenant)
    if routed <= set(row[1]) and row[0] == "d":
        return ""
    return f"ALTER TABLE {table} REPLICA IDENTITY FULL"
