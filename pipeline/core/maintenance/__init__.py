"""Incremental maintenance derived from a declaration of windowed aggregations:
:class:`DerivedPath` keeps per-day partial aggregates in freshline's schema, a log of the
days writes have changed (statement triggers on the source table) and a fold, and reads
at most one partial per whole day of a window plus the rows of the days its edges cut
through and of the days logged since the last fold. Why its values are exact in every
snapshot: docs/incremental.md.

Modules: :mod:`.kinds` (one class per aggregation kind), :mod:`.shape` (the path's
tables and columns), :mod:`.catalog` (what generation asks of the database),
:mod:`.ddl`, :mod:`.triggers`, :mod:`.partials`, :mod:`.fold`, :mod:`.query` (the SQL),
:mod:`.path` (the hooks), :mod:`.security` and :mod:`.installed`.
"""

from freshline.pipeline.core.maintenance.fold import HEAD_ROWS
from freshline.pipeline.core.maintenance.installed import (
    Installed,
    install_missing,
    paused_inserts,
    secure_installed,
    superseded,
)
from freshline.pipeline.core.maintenance.path import DerivedPath
from freshline.pipeline.core.maintenance.shape import LAYOUT
from freshline.pipeline.core.maintenance.sql import SCHEMA

__all__ = [
    "HEAD_ROWS",
    "LAYOUT",
    "SCHEMA",
    "DerivedPath",
    "Installed",
    "install_missing",
    "paused_inserts",
    "secure_installed",
    "superseded",
]
