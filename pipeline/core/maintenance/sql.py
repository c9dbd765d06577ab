"""The small SQL vocabulary the derived path's generators share: the schema, the UTC
day of a time and the start of a day, the columns a declaration's SQL names as ``x.col``."""

from __future__ import annotations

import re

SCHEMA = "freshline"
COLUMN_OF_X = re.compile(r'\bx\.("?)(\w+)\1')
"""A column of the source row ``x`` named in a declaration's SQL (group 2)."""
ROW_X = re.compile(r"\bx\b")
"""The source row ``x`` named otherwise (as a whole row, say)."""
# Qualified: the functions run with the user's schemas on their search_path.
_UTC_DAY = "(({t}) AT TIME ZONE 'UTC')::pg_catalog.date"
_DAY_START = "({d})::timestamp AT TIME ZONE 'UTC'"


def utc_day(expr: str) -> str:
    """The UTC day of the time ``expr``."""
    return _UTC_DAY.format(t=expr)


def day_start(day: str) -> str:
    """The first moment of the UTC day ``day``."""
    return _DAY_START.format(d=day)


def group_by(count: int) -> str:
    """``1, 2, ..., count``: a GROUP BY of the first ``count`` select items."""
    return ", ".join(str(i + 1) for i in range(count))


def filtered(aggregate: str, condition: str | None) -> str:
    """``aggregate`` over the rows passing ``condition`` (all without one)."""
    return f"{aggregate} FILTER (WHERE {condition})" if condition else aggregate


def named_columns(*texts: str | None) -> set[str]:
    """The columns of ``x`` that ``texts`` name as ``x.col``."""
    return {m.group(2) for t in texts if t for m in COLUMN_OF_X.finditer(t)}
