"""The incremental query of a derived path: per key ``k`` at ``t.as_of``, the clean
whole days' partials of each window, plus the source rows of the days its edges cut
through and of the days logged since the last fold (docs/incremental.md).

Its FROM items, each a LATERAL per key ``k``: ``bounds`` (``as_of_day``, and each
window ``j``'s ``start<j>`` and ``start_day<j>``), ``dirty`` (``days``: the logged days
inside the widest window), ``late`` (``present``: whether a partial of as_of's day or
later exists; with a ``count_distinct``), ``head`` (as_of's head, when the path keeps
heads), ``buckets`` (the clean whole days' partials summed) and ``edges`` (the edge and
dirty days' rows aggregated). Each aggregation's part is its :class:`~.kinds.Kind`'s."""

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
        f"CROSS JOIN LATERAL (SELECT {', '.join(_bounds(shape))}) AS bounds\n"
        f"CROSS JOIN LATERAL (SELECT coalesce(array_agg(DISTINCT g.day), '{{}}') AS days "
        f"FROM {shape.log} g WHERE {own} AND g.day > bounds.start_day{widest} "
        "AND g.day < bounds.as_of_day) "
        "AS dirty\n"
        + (
            f"CROSS JOIN LATERAL (SELECT EXISTS (SELECT 1 FROM {shape.days} b "
            f"WHERE {_own(shape, 'b')} AND b.day >= bounds.as_of_day) AS present) AS late\n"
            if shape.distinct
            else ""
        )
        + (_head(shape) if shape.heads else "")
        + f"CROSS JOIN LATERAL (SELECT {', '.join(buckets) or '1 AS none'} "
        f"FROM {_partials(shape)}) AS buckets\n"
        f"CROSS JOIN LATERAL (SELECT {', '.join(edges) or '1 AS none'} FROM {_edge_rows(shape)} x "
        f"WHERE {shape.row_filter('x')} AND ({_any_edge(shape)})) AS edges\n"
    )


def _own(shape: Shape, alias: str) -> str:
    """``alias``'s rows of the key ``k``."""
    return " AND ".join(f"{alias}.{c} = k.{c}" for c in shape.entity.columns)


def _bounds(shape: Shape) -> list[str]:
    """The window bounds: as_of's day, each window's start and its day."""
    out = ["(t.as_of AT TIME ZONE 'UTC')::date AS as_of_day"]
    for j, window_s in enumerate(shape.windows):
        start = since("t.as_of", window_s)
        out += [f"{start} AS start{j}", f"{utc_day(start)} AS start_day{j}"]
    return out


def _reading(shape: Shape, index: int, window: int) -> Reading:
    """What aggregation ``index``, of window ``window``, reads by."""
    slot = shape.slots[index]
    decl = shape.decl
    # The partials read are the clean whole days of the widest window; a narrower
    # window's are those after its own edge day.
    inside = None if window == len(shape.windows) - 1 else f"b.day > bounds.start_day{window}"
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
    return (
        f"{time} > bounds.start{window} AND ({day} = bounds.start_day{window} "
        f"OR {day} = bounds.as_of_day OR {day} = ANY(dirty.days))"
    )


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
    days = ", ".join(
        [*(f"bounds.start_day{j}" for j in range(len(shape.windows))), "bounds.as_of_day"]
    )
    days = f"ARRAY[{days}] || dirty.days"
    flags = ", ".join(f"{_on_edge(shape, j)} AS fl_e{j}" for j in range(len(shape.windows)))
    looked_up, joins = decl.looked_up()
    own = " AND ".join(
        f"x.{c} = k.{k}" for c, k in zip(shape.source_columns(), shape.entity.columns, strict=True)
    )
    lower = day_start("edge_days.edge_day")
    if shape.heads:  # as_of's day from its head's cut on, when a head is in use
        lower = (
            "CASE WHEN edge_days.edge_day = bounds.as_of_day "
            f"THEN coalesce(head.cut, {lower}) ELSE {lower} END"
        )
    return (
        f"(SELECT x.* FROM (SELECT DISTINCT edge_day FROM unnest({days}) AS edge_day) "
        f"AS edge_days CROSS JOIN LATERAL (SELECT {looked_up}, {flags} FROM {decl.table} x{joins} "
        f"WHERE {own} AND {time} >= {lower} "
        f"AND {time} < {day_start('edge_days.edge_day + 1')} AND {time} <= t.as_of OFFSET 0) AS x)"
    )


def _head(shape: Shape) -> str:
    """``head``: as_of's day before the cut of its head, if no write since made it stale,
    with the deltas of the updates since its fold of rows before its cut taken in."""
    own_log = _own(shape, "g")
    values = ", ".join(
        [
            "h.day",
            "h.cut",
            *taken(shape, "h", "deltas"),
            *(f"h.hv{slot.index}" for slot in shape.distinct),
        ]
    )
    sums = ""
    if shape.moving:
        sums = (
            f"CROSS JOIN LATERAL (SELECT {', '.join(delta_sums(shape, 'g'))} "
            f"FROM {shape.log} g WHERE {own_log} AND g.day = bounds.as_of_day AND g.till < h.cut) "
            "AS deltas "
        )
    return (
        f"LEFT JOIN LATERAL (SELECT {values} FROM {shape.head} h {sums}WHERE {_own(shape, 'h')} "
        f"AND h.day = bounds.as_of_day AND h.cut <= t.as_of AND NOT EXISTS (SELECT 1 FROM "
        f"{shape.log} g WHERE {own_log} AND g.day = bounds.as_of_day "
        f"AND {stale(shape, 'g', 'h')})) "
        "AS head ON true\n"
    )


def _partials(shape: Shape) -> str:
    """The day partials ``b`` read: the clean whole days of the widest window, and, with
    heads, as_of's head as one more."""
    widest = len(shape.windows) - 1
    partials = (
        f"{shape.days} b WHERE {_own(shape, 'b')} AND b.day > bounds.start_day{widest} "
        "AND b.day < bounds.as_of_day "
        "AND b.day <> ALL(dirty.days)"
    )
    if not shape.heads:
        return partials
    columns = ["day", *shape.partial_columns()]
    counts = [f"lc{slot.index}" for slot in shape.distinct]
    theirs = ", ".join([*(f"head.{c}" for c in columns), *("0::bigint" for _ in counts)])
    return (
        f"(SELECT {', '.join(f'b.{c}' for c in [*columns, *counts])} FROM {partials} "
        f"UNION ALL SELECT {theirs} WHERE head.day IS NOT NULL) AS b"
    )
