"""The statement triggers a derived path puts on the user's tables, and their
functions: each appends the (key, day)s its statement touched to the log, in the
writer's transaction (an UPDATE that moves only sums and extremes, as a delta), and
refuses to run as any trigger but its own (docs/incremental.md). The insert trigger's,
which every INSERT and COPY enters, is kept cheap: :func:`guard`, :func:`settings`."""

from __future__ import annotations

from collections.abc import Sequence

from freshline.pipeline.core.declarations import Lookup
from freshline.pipeline.core.maintenance.catalog import Source, search_path
from freshline.pipeline.core.maintenance.shape import Shape
from freshline.pipeline.core.maintenance.sql import SCHEMA, group_by

OPERATIONS = {"i": "INSERT", "u": "UPDATE", "d": "DELETE", "t": "TRUNCATE"}


def fold_signature(shape: Shape) -> str:
    return f"{shape.prefix}_fold(integer, boolean, boolean)"


def signatures(shape: Shape) -> list[str]:
    """Every function of the path, as ``pg_get_function_identity_arguments`` names its
    arguments (no schema)."""
    ops = "iudt"
    lookups = [f"l{n}{k}" for n in range(len(shape.decl.lookups)) for k in ops]
    return [*(f"{shape.prefix}_{k}()" for k in [*ops, "p", *lookups]), fold_signature(shape)]


def made_for(table: str, lookups: list[str]) -> dict[str, tuple[str, str]]:
    """Each trigger function (``i()``, ``l0t()``, ...) -> (the table, the operation) of
    the one trigger it is made for."""
    out = {f"{k}()": (table, op) for k, op in OPERATIONS.items()}
    out["p()"] = (table, "TRUNCATE")  # BEFORE, on a partition: see partition_truncate
    for n, looked in enumerate(lookups):
        out |= {f"l{n}{k}()": (looked, op) for k, op in OPERATIONS.items()}
    return out


def guard(shape: Shape, name: str, table: str, op: str) -> str:
    """Trigger function ``name``'s first statement: refuse to run as any trigger but the
    AFTER ``op`` statement trigger on ``table``. EXECUTE is checked when a trigger is
    made, not when it fires, and the owner may attach it anywhere. Its operators are
    qualified, so that it means the same under any ``search_path`` (:func:`functions`:
    the insert trigger's function runs under the writer's)."""
    literal = table.replace("'", "''")
    root = f"'{literal}'::pg_catalog.regclass"
    ne, eq = " OPERATOR(pg_catalog.<>) ", " OPERATOR(pg_catalog.=) "
    # A write addressed to a partition fires the partition's own statement triggers,
    # not the parent's: i(), u() and d() run on every partition too, and p() on a
    # partition only. CASE orders the checks: the parent's costs no lookup (in
    # parentheses: PL/pgSQL ends an IF's condition at the first THEN outside them).
    partition = (
        f"NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree({root}) AS p "
        f"WHERE p.relid{eq}TG_RELID)"
    )
    when, what = "AFTER", f"the AFTER {op} statement trigger on %"
    if name in ("i", "u", "d"):
        relation = f"(CASE WHEN TG_RELID{eq}{root} THEN false ELSE {partition} END)"
        what += " or a partition of it"
    elif name == "p":
        relation = f"(CASE WHEN TG_RELID{eq}{root} THEN true ELSE {partition} END)"
        when, what = "BEFORE", f"the BEFORE {op} statement trigger on a partition of %"
    else:
        relation = f"TG_RELID{ne}{root}"
    trigger = f"TG_WHEN{ne}'{when}' OR TG_LEVEL{ne}'STATEMENT' OR TG_OP{ne}'{op}'"
    check = (
        f"IF {relation} OR {trigger} THEN\n"
        f"        RAISE EXCEPTION 'freshline: {SCHEMA}.{shape.prefix}_{name}() runs only as "
        f"{what}', '{literal}' "
        "USING ERRCODE = 'triggered_action_exception';\n    END IF"
    )
    if name not in ("i", "u", "d"):
        return check
    # The partitions' subquery makes the condition one PL/pgSQL hands to the executor
    # (a plan started and ended at every call); a condition without one it evaluates
    # itself. So the trigger on the table itself, which every write to the table
    # fires, is told apart first without it.
    nested = check.replace("\n", "\n    ")
    return f"IF TG_RELID{ne}{root} OR {trigger} THEN\n        {nested};\n    END IF"


def plpgsql(
    shape: Shape,
    path: str | None,
    name: str,
    body: list[str],
    declare: str = "",
    returns: str = "trigger",
) -> str:
    """``CREATE OR REPLACE FUNCTION`` of the path's function ``name``, SECURITY DEFINER:
    no other login needs a right on freshline's schema, and a writer of the table none
    on the log. With the fixed ``search_path`` ``path``; without one (``None``) only for
    a body that names everything qualified, operators too, so that no schema on the
    caller's ``search_path`` can lend it a function of its own."""
    statements = "".join(f"    {b};\n" for b in body)
    end = "    RETURN NULL;\n" if returns == "trigger" else ""
    fixed = "" if path is None else f"SET search_path = {path} "
    return (
        f"CREATE OR REPLACE FUNCTION {shape.function}_{name} RETURNS {returns} LANGUAGE plpgsql "
        f"SECURITY DEFINER {fixed}"
        f"AS $fn$\n{declare}BEGIN\n{statements}{end}END\n$fn$"
    )


def settings(table: str, lookups: list[str]) -> dict[str, str | None]:
    """Each function's fixed ``search_path`` (:func:`plpgsql`), by name (``i()``, ...):
    none for the insert trigger's, whose body freshline writes whole (the key columns,
    the UTC day, the log) and qualifies: every INSERT and COPY enters it, and entering
    a function with a ``SET`` clause sets the setting and restores it, a cost measured
    in bench/RESULTS.md (section ``incremental``). Every other function runs SQL of the
    declaration's, which names what it names as the repository wrote it."""
    path = search_path(table, lookups)
    return {name: None if name == "i()" else path for name in made_for(table, lookups)}


def functions(shape: Shape, source: Source) -> list[str]:
    """The trigger functions, each guarded (:func:`guard`)."""
    targets = made_for(source.table, source.lookups)
    paths = settings(source.table, source.lookups)

    def function(name: str, body: list[str]) -> str:
        checked = [guard(shape, name[:-2], *targets[name]), *body]
        return plpgsql(shape, paths[name], name, checked)

    truncate = [f"TRUNCATE {', '.join(shape.tables)}"]
    out = [
        # An INSERT or COPY logs a row per row, without DISTINCT: measured in one
        # transaction, a single-row INSERT pays +6 us for it against +9.4 us with
        # DISTINCT (+4.6 us as a row trigger, which made a COPY 3.6x slower); 40,000
        # rows inserted at once pay +34% against +50%. The fold's DISTINCT takes the
        # repeats back. The declaration's own where is left out (a day logged that
        # the filter would skip costs a read, no more).
        function("i()", [log_inserts(shape)]),
        function("u()", [log_update(shape, source.read, source.collated)]),
        function("d()", [logged(shape, "old_rows x")]),
        function("t()", truncate),
        function("p()", [partition_truncate(shape)]),
    ]
    every = logged(shape, f"{source.table} x")
    for n, lookup in enumerate(shape.decl.lookups):
        out += [
            function(f"l{n}i()", [_looked_up(shape, source.table, lookup, "new_rows")]),
            function(f"l{n}u()", [_looked_up(shape, source.table, lookup, "old_rows", "new_rows")]),
            function(f"l{n}d()", [_looked_up(shape, source.table, lookup, "old_rows")]),
            function(f"l{n}t()", [every]),
        ]
    return out


def _looked_up(shape: Shape, table: str, lookup: Lookup, *transition: str) -> str:
    """A lookup's trigger's body: every (key, day) of the source rows that a changed
    row ``g`` decides (its ``rows=``), before and after, logged."""
    return logged(shape, *(f"{table} x JOIN {t} g ON ({lookup.rows})" for t in transition))


def log_inserts(shape: Shape) -> str:
    """The insert trigger's body: every new row with a key and a time, logged. It names
    nothing by the ``search_path``, which is the writer's here (:func:`settings`): the
    transition table, columns, the log, the UTC day (``AT TIME ZONE`` is
    ``pg_catalog.timezone``) and ``IS NOT NULL``; the declaration's ``where`` is left
    out (:func:`functions`)."""
    time = shape.decl.time
    own = " AND ".join(f"x.{c} IS NOT NULL" for c in [*shape.source_columns(), time])
    keys = ", ".join(shape.keys)
    return (
        f"INSERT INTO {shape.log} ({keys}, at) SELECT {', '.join(shape.source_keys('x'))}, "
        f"x.{time} FROM new_rows x WHERE {own}"
    )


def logged(shape: Shape, *sources: str) -> str:
    """The statement that logs the (key, day)s of the source rows ``x`` of each FROM
    item in ``sources``, each once, with the earliest time of its rows."""
    rows = " UNION ALL ".join(
        f"SELECT {', '.join(shape.source_keys('x'))}, x.{shape.decl.time} FROM {source} "
        f"WHERE {shape.row_filter('x')}"
        for source in sources
    )
    keys = ", ".join(shape.keys)
    return (
        f"INSERT INTO {shape.log} ({keys}, at) SELECT {keys}, min(at) "
        f"FROM ({rows}) AS x({keys}, at) GROUP BY {keys}"
    )


def partition_truncate(shape: Shape) -> str:
    """p()'s body, before a TRUNCATE of one partition: log the (key, day)s of every row
    it holds, so that reads take those days from the rows (then gone) until a fold
    rebuilds them. A TRUNCATE of the whole table empties the partials (t())."""
    statement = logged(shape, "__partition__ x").replace("%", "%%")
    statement = statement.replace("__partition__", "%s")
    return f"EXECUTE pg_catalog.format($q${statement}$q$, TG_RELID::pg_catalog.regclass)"


def identity(read: list[str], collated: frozenset[str]) -> str:
    """The select list that compares rows of ``read`` by identity: each column, and each
    of ``collated`` also as its text in the "C" collation, so that a change its
    collation calls equal ('open' to 'OPEN' under a case-insensitive one) differs."""
    columns = [f'"{c}"' for c in read]
    columns += [f'"{c}"::pg_catalog.text COLLATE "C" AS "fl_c_{c}"' for c in read if c in collated]
    return ", ".join(columns)


def changed_rows(read: list[str], collated: frozenset[str] = frozenset()) -> tuple[str, str]:
    """An UPDATE's rows to log, as FROM items ``x``: of ``read`` (the columns values
    read), the old rows' that no new row has and the new rows' that no old row has
    (EXCEPT ALL, by :func:`identity`): an UPDATE that leaves them as they were logs
    nothing, and a day whose rows read the same, as a multiset, has the same partial.
    Without ``read``, every old and new row."""
    if not read:
        return "old_rows x", "new_rows x"
    columns = identity(read, collated)
    return (
        f"(SELECT {columns} FROM old_rows EXCEPT ALL SELECT {columns} FROM new_rows) AS x",
        f"(SELECT {columns} FROM new_rows EXCEPT ALL SELECT {columns} FROM old_rows) AS x",
    )


def log_update(shape: Shape, read: list[str], collated: frozenset[str] = frozenset()) -> str:
    """The update trigger's body: the changed rows logged (:func:`changed_rows`), as
    deltas when the statement left every fixed column as it was, as a multiset over
    those rows (so every (key, day, time) has the rows it had, with other values of the
    moving aggregations' columns): per (key, day), the earliest and latest time of its
    changed rows and what they changed (:meth:`Kind.signed`)."""
    old, new = changed_rows(read, collated)
    plain = logged(shape, old, new)
    if not read or not shape.moving:
        return plain
    fixed = shape.fixed
    columns = identity([c for c in read if c in fixed], collated)
    same = (
        f"NOT EXISTS (SELECT {columns} FROM {old} EXCEPT ALL SELECT {columns} FROM {new}) "
        f"AND NOT EXISTS (SELECT {columns} FROM {new} EXCEPT ALL SELECT {columns} FROM {old})"
    )
    rows = shape.row_filter("x")
    signed = (
        f"(SELECT 1 AS fl_sg, x.* FROM {new} WHERE {rows} UNION ALL "
        f"SELECT -1, x.* FROM {old} WHERE {rows}) AS x"
    )
    values = [v for s in shape.moving for v in s.signed(f"x.{s.agg.column}")]
    names = [name for s in shape.moving for name, _ in s.deltas()]
    time = f"x.{shape.decl.time}"
    keys = shape.source_keys("x")
    delta = (
        f"INSERT INTO {shape.log} ({', '.join([*shape.keys, 'at', 'till', *names])}) "
        f"SELECT {', '.join([*keys, f'min({time})', f'max({time})', *values])} "
        f"FROM {signed} GROUP BY {group_by(len(keys))}"
    )
    return f"IF {same} THEN\n        {delta};\n    ELSE\n        {plain};\n    END IF"


def always(shape: Shape, table: str, ops: str) -> list[str]:
    """The triggers ``ops`` of ``table`` fire in every session, also one with
    ``session_replication_role = replica`` (``pg_restore --disable-triggers`` and
    logical replication's apply workers set it), where an ordinary trigger does not."""
    return [f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {shape.trigger}_{op}" for op in ops]


def _create(name: str, op: str, table: str, function: str, when: str = "AFTER") -> str:
    """``CREATE TRIGGER`` of the statement trigger ``name`` for ``op`` (i, u, d, t)."""
    transitions = {
        "i": "REFERENCING NEW TABLE AS new_rows ",
        "u": "REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows ",
        "d": "REFERENCING OLD TABLE AS old_rows ",
    }
    return (
        f"CREATE TRIGGER {name} {when} {OPERATIONS[op]} ON {table} {transitions.get(op, '')}"
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
    )


def table_triggers(shape: Shape, table: str) -> list[str]:
    """The statement triggers of the source table."""
    name, function = shape.trigger, shape.function
    return [
        *(f"DROP TRIGGER IF EXISTS {name}_{op} ON {table}" for op in "iudt"),
        *(_create(f"{name}_{op}", op, table, f"{function}_{op}") for op in "iudt"),
        *always(shape, table, "iudt"),
    ]


def partition_triggers(shape: Shape, partitions: Sequence[str]) -> list[str]:
    """The statement triggers of ``partitions``: a write addressed to a partition fires
    its own triggers, not the parent's (one addressed to the parent fires the parent's
    only), so every write is logged once."""
    name, function = shape.trigger, shape.function
    out = []
    for part in partitions:
        out += [
            *(f"DROP TRIGGER IF EXISTS {name}_{op} ON {part}" for op in "iudp"),
            *(_create(f"{name}_{op}", op, part, f"{function}_{op}") for op in "iud"),
            _create(f"{name}_p", "t", part, f"{function}_p", when="BEFORE"),
            *always(shape, part, "iudp"),
        ]
    return out


def lookup_triggers(shape: Shape, lookups: list[str]) -> list[str]:
    """The statement triggers of the lookups' tables: a change there logs the days it
    decides."""
    out = []
    for n, looked in enumerate(lookups):
        name, function = f"{shape.trigger}_l{n}", f"{shape.function}_l{n}"
        out += [
            *(f"DROP TRIGGER IF EXISTS {name}{op} ON {looked}" for op in "iudt"),
            *(_create(f"{name}{op}", op, looked, f"{function}{op}") for op in "iudt"),
            *(f"ALTER TABLE {looked} ENABLE ALWAYS TRIGGER {name}{op}" for op in "iudt"),
        ]
    return out
