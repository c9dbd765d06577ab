"""Spine rows that must get the same values of a declared aggregation, found from history.

The defining query of a declaration (:func:`freshline.pipeline.core.aggregations.full_query`)
reads the moment only in history's visibility (a version counts from its ``_fl_from``,
until its ``_fl_to``) and in its windows (a row counts once ``time <= as_of``, until
``time > as_of - w`` fails). Each of those predicates, as a function of the moment,
changes only at one point: a version's ``_fl_from`` or ``_fl_to``, a row's ``time`` or
``time + w``. Between two consecutive points of the rows a key can read, the query reads
the same rows and so returns the same values: the spine rows of one key whose moments
fall between the same two points share one evaluation, by the same statement, at the
first of their moments (docs/training.md, *How it is evaluated*).

The points of the declaration's table are a key's own (the query joins its rows on the
key); those of any other table the statement reads (a lookup's) count for every key.
A declaration whose own SQL (a ``where``, a lookup) names the moment or its table again
is not shared: its rows are evaluated one moment each.
"""

from __future__ import annotations

import bisect
import datetime as dt
import re
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from freshline.pipeline.core.aggregations import full_query
from freshline.pipeline.core.db import SCHEMA
from freshline.pipeline.core.declarations import ALL_TIME, Declaration
from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.features import FeatureSet
from freshline.pipeline.history.evaluator import Captured, Ref, _quote


def declaration(fs: FeatureSet) -> Declaration | None:
    """The declaration whose generated query ``fs`` runs, if its rows can be shared."""
    decl = fs.declared
    if not isinstance(decl, Declaration) or fs.query != full_query(fs.entity, decl):
        return None
    texts = [decl.where or "", *(a.where or "" for a in decl.aggs)]
    texts += [t for lk in decl.lookups for t in (lk.query, lk.rows)]
    table = re.compile(rf"\b{re.escape(decl.table)}\b", re.IGNORECASE)
    if any("as_of" in t.lower() or table.search(t) for t in texts):
        return None
    return decl


def _points_sql(fs: FeatureSet, decl: Declaration, history: Captured) -> str:
    time = f"CAST(h.{_quote(decl.time)} AS timestamptz)"
    points = ["h._fl_from", "h._fl_to", time]
    points += [
        f"{time} + interval '{w} seconds'" for w in sorted(set(decl.windows_s)) if w != ALL_TIME
    ]
    tenant = decl.tenant_column if decl.tenant_column and fs.entity.tenant else None
    keys = [f"h.{_quote(c)}" for c in ([tenant] if tenant else [])]
    keys.append(f"h.{_quote(decl.entity_column)}")
    return (
        f"SELECT {', '.join(keys)}, array_agg(DISTINCT p.at ORDER BY p.at)\n"
        f"FROM {SCHEMA}.{_quote(history.history)} AS h\n"
        f"CROSS JOIN LATERAL (VALUES {', '.join(f'({p})' for p in points)}) AS p(at)\n"
        f"WHERE h.{_quote(decl.entity_column)} = ANY(CAST(:ids AS {fs.entity.type}[]))\n"
        "  AND p.at > :lo AND p.at <= :hi AND isfinite(p.at)\n"
        f"GROUP BY {', '.join(keys)}"
    )


def _shared_sql(history: Captured) -> str:
    return (
        "SELECT DISTINCT p.at FROM "
        f"{SCHEMA}.{_quote(history.history)} AS h\n"
        "CROSS JOIN LATERAL (VALUES (h._fl_from), (h._fl_to)) AS p(at)\n"
        "WHERE p.at > :lo AND p.at <= :hi ORDER BY p.at"
    )


def representatives(
    conn: Connection,
    fs: FeatureSet,
    decl: Declaration,
    read: Sequence[Captured],
    times: Sequence[dt.datetime],
    refs: Sequence[Ref],
) -> list[int]:
    """For each spine row (its moment ``times[n]``, its key ``refs[n]``), the first row
    that must get the same values: itself where no earlier row does.

    ``read``: the captured tables ``fs``'s statement reads (its plan, as the evaluator's
    guard finds them); run in the evaluation's transaction, so the points are those of
    the history it evaluates.
    """
    if not times:
        return []
    lo, hi = min(times), max(times)
    own: dict[tuple[str, ...], list[dt.datetime]] = {}
    others: list[dt.datetime] = []
    tenanted = bool(decl.tenant_column and fs.entity.tenant)
    for history in read:
        if history.table == decl.table:
            ids = sorted({ref[1] for ref in refs})
            params = {"ids": ids, "lo": lo, "hi": hi}
            for row in conn.execute(sa.text(_points_sql(fs, decl, history)), params):
                try:  # the canonical text a spine's key has (a uuid in lower case)
                    id_ = fs.entity.validate(row[-2])
                except InvalidId:
                    continue  # no spine key is spelt so
                key = (str(row[0]), id_) if tenanted else (id_,)
                own[key] = list(row[-1])
        else:
            params = {"lo": lo, "hi": hi}
            others += conn.execute(sa.text(_shared_sql(history)), params).scalars()
    others.sort()
    first: dict[tuple[object, ...], int] = {}
    out: list[int] = []
    none: list[dt.datetime] = []
    for n, (at, ref) in enumerate(zip(times, refs, strict=True)):
        key = ref if tenanted else (ref[1],)
        where = (
            key,
            bisect.bisect_right(own.get(key, none), at),
            bisect.bisect_right(others, at),
        )
        out.append(first.setdefault(where, n))
    return out
