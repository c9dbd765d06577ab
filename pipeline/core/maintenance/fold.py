"""The fold: one generated function that takes logged (key, day)s out of the log and
recomputes their partials from the source rows, and moves the heads of the current UTC
day up to a new cut (docs/incremental.md says why that is exact under any interleaving
with writers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from freshline.pipeline.core.maintenance.catalog import Source, search_path
from freshline.pipeline.core.maintenance.kinds import CountDistinct
from freshline.pipeline.core.maintenance.partials import (
    aggregate_rows,
    insert_days,
    insert_members,
    members_rows,
    touched_rows,
)
from freshline.pipeline.core.maintenance.shape import Shape
from freshline.pipeline.core.maintenance.sql import day_start, utc_day
from freshline.pipeline.core.maintenance.triggers import plpgsql

HEAD_ROWS = 64
"""How many logged rows of the current day after a head's cut (or of a key with none) a
fold waits for before it moves the head (``SET freshline.head_rows`` in the fold's
session overrides it): reads take those rows from the table, few enough to cost less
than a fold of every key written to."""


@dataclass
class Function:
    """A PL/pgSQL function's body as it is put together: its variables and statements."""

    declare: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)


def fold_function(shape: Shape, source: Source) -> str:
    """The fold: the logged (key, day)s, up to $1 of them, leave the log; their days are
    recomputed from the source rows. $2: wait for the lock; $3: only days before the
    current UTC day, which every read takes from its rows anyway, and the heads of the
    current day (:func:`head_fold`)."""
    key_types = shape.key_types()
    picked = [f"fl_k{i}" for i in range(len(shape.keys))]
    keys = ", ".join(shape.keys)
    touched = f"SELECT * FROM unnest({', '.join(picked)})"
    fold = Function(declare=[f"{v} {t}[];" for v, t in zip(picked, key_types, strict=True)])
    fold.body.append(
        f"IF $2 THEN PERFORM pg_advisory_xact_lock({shape.lock}); "
        f"ELSIF NOT pg_try_advisory_xact_lock({shape.lock}) THEN RETURN NULL; END IF"
    )
    fold.declare.append("fl_h integer := 0;")
    if shape.heads:
        head_fold(shape, source.table, fold)
    fold.body += [
        f"SELECT {', '.join(f'array_agg(g.{k})' for k in shape.keys)} "
        f"INTO {', '.join(picked)} FROM (SELECT DISTINCT {keys} FROM {shape.log} "
        f"WHERE NOT $3 OR day < {utc_day('now()')} LIMIT $1) AS g",
        f"IF {picked[0]} IS NULL THEN RETURN fl_h; END IF",
        f"DELETE FROM {shape.log} WHERE ({keys}) IN ({touched})",
    ]
    values: dict[int, str] = {}
    recounts: list[str] = []
    for slot in shape.distinct:
        values[slot.index], recount = _distinct_values(shape, slot, source, touched, fold)
        recounts.append(recount)
    fold.body += recompute_days(shape, source.table, touched, values)
    fold.body += recounts
    fold.body.append(f"RETURN cardinality({picked[0]}) + fl_h")
    declare = "DECLARE\n" + "".join(f"    {d}\n" for d in fold.declare)
    path = search_path(source.table, source.lookups)
    name = "fold(integer, boolean, boolean)"
    return plpgsql(shape, path, name, fold.body, declare=declare, returns="integer")


def _distinct_values(
    shape: Shape, slot: CountDistinct, source: Source, touched: str, fold: Function
) -> tuple[str, str]:
    """Add to ``fold`` the gathering of ``slot``'s (key, value)s whose latest day the
    fold may change (those of the touched days' members before and rows after), and the
    latest days they had; (a query of those values, the recount of the days' latest
    counts to run after the recompute)."""
    assert slot.agg.column is not None
    index, entity = slot.index, shape.entity.columns
    keys, entities = ", ".join(shape.keys), ", ".join(entity)
    names = [f"fl_v{index}_{i}" for i in range(len(entity) + 1)]
    types = [*shape.key_types()[:-1], source.types[slot.agg.column]]
    fold.declare += [f"{v} {t}[];" for v, t in zip(names, types, strict=True)]
    column = f"x.{slot.agg.column}"
    from_rows = (
        f"SELECT {', '.join(shape.source_keys('x')[:-1])}, {column} "
        f"FROM {touched_rows(shape, source.table, touched)} x "
        f"WHERE {shape.row_filter('x')} AND {slot.where} AND {column} IS NOT NULL"
    )
    from_members = (
        f"SELECT {entities}, value FROM {shape.members(slot)} WHERE ({keys}) IN ({touched})"
    )
    columns = [*entity, "value"]
    fold.body.append(
        f"SELECT {', '.join(f'array_agg(g.{c})' for c in columns)} "
        f"INTO {', '.join(names)} FROM ({from_members} UNION {from_rows}) "
        f"AS g({', '.join(columns)})"
    )
    values = f"SELECT * FROM unnest({', '.join(names)})"
    olds = [f"fl_o{index}_{i}" for i in range(len(shape.keys))]
    fold.declare += [f"{v} {t}[];" for v, t in zip(olds, shape.key_types(), strict=True)]
    latest_of = (
        f"SELECT {entities}, latest FROM {shape.latest(slot)} "
        f"WHERE ({entities}, value) IN ({values})"
    )
    fold.body.append(  # the latest days of those values before the fold
        f"SELECT {', '.join(f'array_agg(g.{k})' for k in shape.keys)} "
        f"INTO {', '.join(olds)} FROM ({latest_of}) AS g({keys})"
    )
    days = f"{touched} UNION SELECT * FROM unnest({', '.join(olds)}) UNION {latest_of}"
    return values, _latest_counts(shape, slot, days)


def _latest_counts(shape: Shape, slot: CountDistinct, days: str) -> str:
    """Recount ``slot``'s values whose latest day is each (key, day) in ``days``."""
    own = " AND ".join(f"l.{c} = d.{c}" for c in shape.entity.columns)
    return (
        f"UPDATE {shape.days} d SET lc{slot.index} = (SELECT count(*) FROM "
        f"{shape.latest(slot)} l WHERE {own} AND l.latest = d.day) "
        f"WHERE ({', '.join(f'd.{k}' for k in shape.keys)}) IN ({days})"
    )


def recompute_days(shape: Shape, table: str, touched: str, values: dict[int, str]) -> list[str]:
    """Statements that recompute the days in ``touched`` (a query of the partials' key
    columns) from ``table``'s rows; ``values[i]``: a query of the (key, value)s of
    ``count_distinct`` slot ``i`` whose latest day may change."""
    keys = ", ".join(shape.keys)
    rows = touched_rows(shape, table, touched)
    out = [f"DELETE FROM {shape.days} WHERE ({keys}) IN ({touched})"]
    if shape.heads:  # the log rows that kept a head of these days from use are gone
        out.append(f"DELETE FROM {shape.head} WHERE ({keys}) IN ({touched})")
    out.append(insert_days(shape, aggregate_rows(shape, rows, "x", shape.row_filter("x"))))
    for slot in shape.distinct:
        out.append(f"DELETE FROM {shape.members(slot)} WHERE ({keys}) IN ({touched})")
        select = members_rows(shape, slot, rows, "x", shape.row_filter("x"))
        out.append(insert_members(shape, slot, select))
        out += _latest_from_members(shape, slot, values[slot.index])
    return out


def _latest_from_members(shape: Shape, slot: CountDistinct, values: str) -> list[str]:
    """Recompute the latest day of the (entity, value)s in ``values`` from the members
    table (after it was recomputed)."""
    entities = ", ".join(shape.entity.columns)
    members, latest = shape.members(slot), shape.latest(slot)
    return [
        f"DELETE FROM {latest} WHERE ({entities}, value) IN ({values})",
        f"INSERT INTO {latest} ({entities}, value, latest) SELECT {entities}, value, max(day) "
        f"FROM {members} WHERE ({entities}, value) IN ({values}) GROUP BY {entities}, value",
    ]


# -- heads ------------------------------------------------------------------------------


def stale(shape: Shape, log: str, head: str) -> str:
    """Whether log row ``log`` keeps head ``head`` from use: a row of the day before its
    cut, unless it is an update's delta wholly before the cut that the head can take
    (:meth:`Kind.takes`)."""
    takes = [f"{log}.till < {head}.cut"]
    for slot in shape.moving:
        takes += slot.takes(log, head)
    return f"({log}.at < {head}.cut AND NOT coalesce({' AND '.join(takes)}, false))"


def delta_sums(shape: Shape, log: str, where: str = "") -> list[str]:
    """The aggregates of the delta log rows ``log`` (those passing ``where``), named as
    their columns: the counts and sums added, the extremes of the new rows."""
    only = f" FILTER (WHERE {where})" if where else ""
    return [value for slot in shape.moving for value in slot.delta_sums(log, only)]


def taken(shape: Shape, head: str, deltas: str) -> list[str]:
    """Head ``head``'s partial columns with the deltas ``deltas`` (of :func:`delta_sums`,
    ``NULL`` when there were none) taken in, each named as its column."""
    moving = {slot.index for slot in shape.moving}
    return [
        value
        for slot in shape.slots
        for value in (slot.taken(head, deltas) if slot.index in moving else slot.held(head))
    ]


def head_fold(shape: Shape, table: str, fold: Function) -> None:
    """Add to ``fold`` the part that moves the heads of the current UTC day up to a new
    cut (the fold's ``now()``), for the keys with log rows of the day before it, up to
    ``$1`` of them, when ``$3`` (docs/incremental.md, *Heads*)."""
    entity = shape.entity.columns
    picked = [f"fl_hk{i}" for i in range(len(entity))]
    fold.declare += [
        *(f"{v} {t}[];" for v, t in zip(picked, shape.key_types()[:-1], strict=True)),
        f"fl_da date := {utc_day('now()')};",
        "fl_cut timestamptz := now();",
    ]
    statements = [
        _move_heads(shape, table, picked),
        _keep_day_dirty(shape, picked),
        f"fl_h := coalesce(cardinality({picked[0]}), 0)",
    ]
    fold.body.append(
        f"IF $3 THEN\n        {_heads_to_move(shape, picked)};\n"
        f"        IF {picked[0]} IS NOT NULL THEN\n"
        + "".join(f"            {r};\n" for r in statements)
        + "        END IF;\n    END IF"
    )


def _heads_to_move(shape: Shape, picked: list[str]) -> str:
    """Into ``picked``: the keys with HEAD_ROWS rows of the day before the cut logged,
    or a head a logged row made stale (what reads would take from the rows)."""
    entity = shape.entity.columns
    on = " AND ".join(f"h.{c} = l.{c}" for c in entity)
    own = ", ".join(f"l.{c}" for c in entity)
    enough = (
        f"coalesce(nullif(current_setting('freshline.head_rows', true), '')::integer, {HEAD_ROWS})"
    )
    return (
        f"SELECT {', '.join(f'array_agg(g.{c})' for c in entity)} INTO {', '.join(picked)} "
        f"FROM (SELECT {own} FROM {shape.log} l "
        f"LEFT JOIN {shape.head} h ON {on} AND h.day = l.day "
        "WHERE l.day = fl_da AND l.at < fl_cut "
        f"GROUP BY {own}, h.cut HAVING count(*) >= {enough} "
        f"OR coalesce(bool_or({stale(shape, 'l', 'h')}), false) LIMIT $1) AS g"
    )


def _move_heads(shape: Shape, table: str, picked: list[str]) -> str:
    """One statement, so one snapshot: the keys' log rows before the cut leave the log,
    and each head is made of what that snapshot sees. A clean old head (one no deleted
    row made stale) grows by the deltas before its cut and the rows from its cut to the
    new one; any other key's is made from the day's rows before the new cut."""
    entity = shape.entity.columns
    entities = ", ".join(entity)
    keyed = f"({entities}) IN (SELECT * FROM unnest({', '.join(picked)}))"
    partial = shape.partial_columns()
    arrays = [f"hv{slot.index}" for slot in shape.distinct]
    merged = [value for slot in shape.slots for value in slot.merged()]
    merged += [f"ARRAY(SELECT DISTINCT v FROM unnest(o.{c} || n.{c}) AS v)" for c in arrays]
    rows_of = " AND ".join(
        [f"x.{c} = t.{k}" for c, k in zip(shape.source_columns(), entity, strict=True)]
        + [f"x.{shape.decl.time} >= t.lo", f"x.{shape.decl.time} < fl_cut"]
    )
    looked_up, joins = shape.decl.looked_up()
    source = f"(SELECT {looked_up} FROM t JOIN {table} x ON {rows_of}{joins})"
    new = aggregate_rows(shape, source, "x", shape.row_filter("x"), arrays=True)
    sums = ", ".join(
        [
            f"coalesce(bool_or({stale(shape, 'g', 'h0')}), false) AS fl_stale",
            *delta_sums(shape, "g", "g.till < h0.cut"),
        ]
    )
    held = ", ".join(["h0.cut", *taken(shape, "h0", "k"), *(f"h0.{c}" for c in arrays)])
    target = ", ".join([*entity, "day", "cut", *partial, *arrays])
    return (
        f"WITH gone AS (DELETE FROM {shape.log} WHERE {keyed} AND day = fl_da "
        "AND at < fl_cut RETURNING *), "
        f"h0 AS (SELECT h.* FROM {shape.head} h WHERE {keyed} AND h.day = fl_da), "
        f"k AS (SELECT {entities}, {sums} FROM gone g LEFT JOIN h0 USING ({entities}) "
        f"GROUP BY {entities}), "
        f"o AS (SELECT {entities}, {held} FROM h0 JOIN k USING ({entities}) "
        "WHERE NOT k.fl_stale), "
        f"t AS (SELECT {entities}, coalesce(o.cut, {day_start('fl_da')}) AS lo "
        f"FROM k LEFT JOIN o USING ({entities})), "
        f"n({', '.join([*entity, 'day', *partial, *arrays])}) AS ({new}) "
        f"INSERT INTO {shape.head} ({target}) SELECT "
        + ", ".join([*(f"k.{c}" for c in entity), "fl_da", "fl_cut", *merged])
        + f" FROM k LEFT JOIN o USING ({entities}) LEFT JOIN n USING ({entities}) "
        f"ON CONFLICT ({entities}) DO UPDATE SET "
        + ", ".join(f"{c} = EXCLUDED.{c}" for c in ["day", "cut", *partial, *arrays])
    )


def _keep_day_dirty(shape: Shape, picked: list[str]) -> str:
    """The day's partial no longer sees the moved heads' writes in the log: a marker
    (``at`` = infinity, never before a head's cut) keeps the day dirty until a fold of
    the whole day."""
    entity = shape.entity.columns
    entities = ", ".join(entity)
    return (
        f"INSERT INTO {shape.log} ({entities}, day, at) SELECT k.*, fl_da, 'infinity' "
        f"FROM unnest({', '.join(picked)}) AS k({entities}) WHERE NOT EXISTS (SELECT 1 FROM "
        f"{shape.log} l WHERE "
        + " AND ".join(f"l.{c} = k.{c}" for c in entity)
        + " AND l.day = fl_da AND l.at = 'infinity')"
    )
