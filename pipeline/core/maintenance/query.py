"""The incremental query of a derived path: per key ``k`` at ``t.as_of``, the clean
whole days' partials of each window, plus the source rows of the days its edges cut
through and of the days logged since the last fold (docs/incremental.md).

Its FROM items, each a LATERAL per key: ``w`` the window bounds (``da`` as_of's day,
``c<j>`` and ``dc<j>`` window ``j``'s start and its day), ``dl`` the logged days
(``dl.dd``), ``lt`` whether a partial of as_of's day or later exists (with a
``count_distinct``), ``hd`` as_of's head, ``bk`` the partials' sums and ``ed`` the edge
rows' aggregates. Each aggregation's part is its :class:`~.kinds.Kind`'s."""

from __future__ import annotations

from freshline.pipeline.core.declarations import since
from freshline.pipeline.core.maintenance.fold import delta_sums, stale, taken
from freshline.pipeline.core.maintenance.kinds import Reading
from freshline.pipeline.core.maintenance.shape import Shape
from freshline.pipeline.core.maintenance.sql import day_start, utc_day


def incremental_query(shape: Shape) -> str:
    """The incremental query: the keys ``k``, ``t.as_of``, like the defining one."""
    decl, widest = shape.decl, len(shape.windows) - 1
    buckets: list[str] = []
    edges: list[str] = []
    values: list[str] = []
    for slot in shape.slots:
        read = _reading(shape, slot.index, shape.windows.index(slot.window_s))
        column = f"x.{slot.agg.column}"
        buckets += slot.bucket(read)
        edges += slot.edge(column, read)
        values.append(slot.combine(read))
    names = [a.field_name() for a in decl.aggs]
    body = ",\n       ".join(
        [f"k.{c} AS {c}" for c in shape.entity.columns]
        + [
            f"{a.finish(value)} AS {name}"
            for a, value, name in zip(decl.aggs, values, names, strict=True)
        ]
    )
    own = _own(shape, "g")
    return (
        f"\nSELECT {body}\nFROM k CROSS JOIN t\n"
        f"CROSS JOIN LATERAL (SELECT {', '.join(_bounds(shape))}) AS w\n"
        f"CROSS JOIN LATERAL (SELECT coalesce(array_agg(DISTINCT g.day), '{{}}') AS dd "
        f"FROM {shape.log} g WHERE {own} AND g.day > w.dc{widest} AND g.day < w.da) "
        "AS dl\n"
        + (
            f"CROSS JOIN LATERAL (SELECT EXISTS (SELECT 1 FROM {shape.days} b "
            f"WHERE {_own(shape, 'b')} AND b.day >= w.da) AS late) AS lt\n"
            if shape.distinct
            else ""
        )
        + (_head(shape) if shape.heads else "")
        + f"CROSS JOIN LATERAL (SELECT {', '.join(buckets) or '1 AS none'} "
        f"FROM {_partials(shape)}) AS bk\n"
        f"CROSS JOIN LATERAL (SELECT {', '.join(edges) or '1 AS none'} FROM {_edge_rows(shape)} x "
        f"WHERE {shape.row_filter('x')} AND ({_any_edge(shape)})) AS ed\n"
    )


def _own(shape: Shape, alias: str) -> str:
    """``alias``'s rows of the key ``k``."""
    return " AND ".join(f"{alias}.{c} = k.{c}" for c in shape.entity.columns)


def _bounds(shape: Shape) -> list[str]:
    """The window bounds ``w``: as_of's day, each window's start and its day."""
    out = ["(t.as_of AT TIME ZONE 'UTC')::date AS da"]
    for j, window_s in enumerate(shape.windows):
        start = since("t.as_of", window_s)
        out += [f"{start} AS c{j}", f"{utc_day(start)} AS dc{j}"]
    return out


def _reading(shape: Shape, index: int, window: int) -> Reading:
    """What aggregation ``index``, of window ``window``, reads by."""
    slot = shape.slots[index]
    decl = shape.decl
    # The partials read are the clean whole days of the widest window; a narrower
    # window's are those after its own edge day.
    inside = None if window == len(shape.windows) - 1 else f"b.day > w.dc{window}"
    return Reading(
        inside=inside,
        edge=f"x.fl_e{window} AND {slot.where}",
        time=f"x.{decl.time}",
        tiebreak=f"x.{decl.tiebreak}" if decl.tiebreak else None,
        window=window,
        entity=tuple(shape.entity.columns),
        heads=shape.heads,
        members=shape.members(slot),
        latest=shape.latest(slot),
    )


def _on_edge(shape: Shape, window: int) -> str:
    """Whether row ``x`` is in window ``window`` on one of the days read from rows."""
    time = f"x.{shape.decl.time}"
    day = utc_day(time)
    return f"{time} > w.c{window} AND ({day} = w.dc{window} OR {day} = w.da OR {day} = ANY(dl.dd))"


def _any_edge(shape: Shape) -> str:
    return " OR ".join(f"x.fl_e{j}" for j in range(len(shape.windows)))


def _edge_rows(shape: Shape) -> str:
    """The source rows of the edge days (every window's old edge day, and as_of's day,
    each once, and the whole days with writes not yet folded), read day by day as index
    ranges: LATERAL behind OFFSET 0 (which keeps the planner from flattening it), so each
    day is an index range whatever the table's statistics say (flattened, a planner
    without them read the entity's whole window and filtered it by day). Each row's place
    in each window's edge is worked out once, as a column ``fl_e<j>``, not again in every
    aggregate's FILTER."""
    decl = shape.decl
    time = f"x.{decl.time}"
    days = ", ".join([*(f"w.dc{j}" for j in range(len(shape.windows))), "w.da"])
    days = f"ARRAY[{days}] || dl.dd"
    flags = ", ".join(f"{_on_edge(shape, j)} AS fl_e{j}" for j in range(len(shape.windows)))
    looked_up, joins = decl.looked_up()
    own = " AND ".join(
        f"x.{c} = k.{k}" for c, k in zip(shape.source_columns(), shape.entity.columns, strict=True)
    )
    lower = day_start("ed_days.ed_day")
    if shape.heads:  # as_of's day from its head's cut on, when a head is in use (hd)
        lower = f"CASE WHEN ed_days.ed_day = w.da THEN coalesce(hd.cut, {lower}) ELSE {lower} END"
    return (
        f"(SELECT x.* FROM (SELECT DISTINCT ed_day FROM unnest({days}) AS ed_day) "
        f"AS ed_days CROSS JOIN LATERAL (SELECT {looked_up}, {flags} FROM {decl.table} x{joins} "
        f"WHERE {own} AND {time} >= {lower} "
        f"AND {time} < {day_start('ed_days.ed_day + 1')} AND {time} <= t.as_of OFFSET 0) AS x)"
    )


def _head(shape: Shape) -> str:
    """``hd``: as_of's day before the cut of its head, if no write since made it stale,
    with the deltas of the updates since its fold of rows before its cut taken in."""
    own_log = _own(shape, "g")
    values = ", ".join(
        [
            "h.day",
            "h.cut",
            *taken(shape, "h", "gd"),
            *(f"h.hv{slot.index}" for slot in shape.distinct),
        ]
    )
    sums = ""
    if shape.moving:
        sums = (
            f"CROSS JOIN LATERAL (SELECT {', '.join(delta_sums(shape, 'g'))} "
            f"FROM {shape.log} g WHERE {own_log} AND g.day = w.da AND g.till < h.cut) "
            "AS gd "
        )
    return (
        f"LEFT JOIN LATERAL (SELECT {values} FROM {shape.head} h {sums}WHERE {_own(shape, 'h')} "
        f"AND h.day = w.da AND h.cut <= t.as_of AND NOT EXISTS (SELECT 1 FROM "
        f"{shape.log} g WHERE {own_log} AND g.day = w.da AND {stale(shape, 'g', 'h')})) "
        "AS hd ON true\n"
    )


def _partials(shape: Shape) -> str:
    """The day partials ``b`` read: the clean whole days of the widest window, and, with
    heads, as_of's head as one more."""
    widest = len(shape.windows) - 1
    partials = (
        f"{shape.days} b WHERE {_own(shape, 'b')} AND b.day > w.dc{widest} AND b.day < w.da "
        "AND b.day <> ALL(dl.dd)"
    )
    if not shape.heads:
        return partials
    columns = ["day", *shape.partial_columns()]
    counts = [f"lc{slot.index}" for slot in shape.distinct]
    theirs = ", ".join([*(f"hd.{c}" for c in columns), *("0::bigint" for _ in counts)])
    return (
        f"(SELECT {', '.join(f'b.{c}' for c in [*columns, *counts])} FROM {partials} "
        f"UNION ALL SELECT {theirs} WHERE hd.day IS NOT NULL) AS b"
    )
