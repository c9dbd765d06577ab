"""The partials of source rows: the SELECTs that aggregate rows into day partials and
``count_distinct`` members, the INSERTs that store them, and the rebuild of every key's
or some keys' partials from the rows (what the install and ``rebuild`` run)."""

from __future__ import annotations

from freshline.pipeline.core.maintenance.kinds import CountDistinct
from freshline.pipeline.core.maintenance.shape import Shape
from freshline.pipeline.core.maintenance.sql import day_start, group_by


def aggregate_rows(shape: Shape, source: str, alias: str, where: str, arrays: bool = False) -> str:
    """``SELECT`` of the partials of ``source`` rows ``alias`` passing ``where``; with
    ``arrays``, then each ``count_distinct``'s values as an array (a head's)."""
    keys = shape.source_keys(alias)
    time = f"{alias}.{shape.decl.time}"
    tiebreak = f"{alias}.{shape.decl.tiebreak}" if shape.decl.tiebreak else None
    values = []
    for slot in shape.slots:
        condition = f"({where} AND {slot.where.replace('x.', f'{alias}.')})"
        values += slot.partial(f"{alias}.{slot.agg.column}", condition, time, tiebreak)
    for slot in shape.distinct if arrays else []:
        column, condition = slot.member(alias, where)
        values.append(f"array_agg(DISTINCT {column}) FILTER (WHERE {condition})")
    group = group_by(len(keys))
    return (
        f"SELECT {', '.join(keys + values)} FROM {source} {alias} WHERE {where} "
        f"GROUP BY {group} ORDER BY {group}"
    )


def members_rows(shape: Shape, slot: CountDistinct, source: str, alias: str, where: str) -> str:
    """``SELECT`` of ``slot``'s members of ``source`` rows ``alias`` passing ``where``."""
    column, condition = slot.member(alias, where)
    keys = [*shape.source_keys(alias), column]
    group = group_by(len(keys))
    return (
        f"SELECT {', '.join(keys)}, count(*) FROM {source} {alias} WHERE {condition} "
        f"GROUP BY {group} ORDER BY {group}"
    )


def insert_days(shape: Shape, select: str) -> str:
    target = ", ".join([*shape.keys, *shape.partial_columns()])
    return f"INSERT INTO {shape.days} ({target}) {select}"


def insert_members(shape: Shape, slot: CountDistinct, select: str) -> str:
    target = ", ".join([*shape.keys, "value", "n"])
    return f"INSERT INTO {shape.members(slot)} ({target}) {select}"


def touched_rows(shape: Shape, table: str, touched: str) -> str:
    """The source rows of the (key, day)s in ``touched``, as a subquery."""
    keys = ", ".join(shape.keys)
    columns = zip(shape.source_columns(), shape.entity.columns, strict=True)
    time = shape.decl.time
    condition = " AND ".join(
        [f"x.{c} = t.{k}" for c, k in columns]
        + [f"x.{time} >= {day_start('t.day')}", f"x.{time} < {day_start('t.day + 1')}"]
    )
    looked_up, joins = shape.decl.looked_up()
    return (
        f"(SELECT {looked_up} FROM ({touched}) AS t({keys}) JOIN {table} x ON {condition}{joins})"
    )


def locks(shape: Shape, table: str, lookups: list[str]) -> list[str]:
    """What a build of partials holds: the path's lock, its tables unwritten."""
    return [
        f"SELECT pg_advisory_xact_lock({shape.lock})",
        *(f"LOCK TABLE {t} IN SHARE MODE" for t in [table, *lookups]),
    ]


def rebuild(shape: Shape, table: str, keys_from: str | None) -> list[str]:
    """Fill the partials from ``table``: of every key, or of the keys in ``keys_from``
    (a query of the entity's columns)."""
    entity = ", ".join(shape.entity.columns)
    if keys_from is None:
        out = [f"DELETE FROM {t}" for t in shape.tables]
        where = shape.row_filter("x")
    else:
        match = f"({', '.join(f'x.{c}' for c in shape.source_columns())}) IN ({keys_from})"
        out = [f"DELETE FROM {t} WHERE ({entity}) IN ({keys_from})" for t in shape.tables]
        where = f"{shape.row_filter('x')} AND {match}"
    looked_up, joins = shape.decl.looked_up()
    rows = f"(SELECT {looked_up} FROM {table} x{joins})" if shape.decl.lookups else table
    out.append(insert_days(shape, aggregate_rows(shape, rows, "x", where)))
    scope = "" if keys_from is None else f" WHERE ({entity}) IN ({keys_from})"
    same = " AND ".join(f"d.{c} = c.{c}" for c in shape.entity.columns)
    for slot in shape.distinct:
        latest, index = shape.latest(slot), slot.index
        out += [
            insert_members(shape, slot, members_rows(shape, slot, rows, "x", where)),
            f"INSERT INTO {latest} ({entity}, value, latest) "
            f"SELECT {entity}, value, max(day) FROM {shape.members(slot)}{scope} "
            f"GROUP BY {entity}, value",
            f"UPDATE {shape.days} d SET lc{index} = c.n FROM (SELECT {entity}, latest, "
            f"count(*) AS n FROM {latest}{scope} GROUP BY {entity}, latest) AS c "
            f"WHERE {same} AND d.day = c.latest",
        ]
    return out
