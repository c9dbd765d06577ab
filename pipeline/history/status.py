"""What history holds, in words: for ``freshline plan``, the status page and metrics.

Per captured table: whether its history table exists, from when it is complete (S0,
the backfill's snapshot), up to when (``complete_to``: the recorder has read every
partition to its end after a heartbeat committed later), whether DDL broke it, its size
on disk and its retention.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.core.features import duration
from freshline.pipeline.core.repository import History
from freshline.pipeline.history.tables import (
    Registered,
    from_epoch_us,
    history_table_name,
    registered,
)

SCHEMA = "public"


def _moment(us: int | None) -> str:
    if us is None:
        return "never"
    return from_epoch_us(us).isoformat(timespec="seconds").replace("+00:00", "Z")


def sizes(engine: Engine) -> dict[str, tuple[int, int]]:
    """Each registered history table's ``(bytes on disk, estimated versions)``."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT h.history_table, pg_total_relation_size(c.oid), "
                "greatest(c.reltuples, 0)::bigint "
                "FROM freshline.history_tables h JOIN pg_class c "
                "ON c.oid = to_regclass('freshline.' || quote_ident(h.history_table))"
            )
        ).all()
    return {str(r[0]): (int(r[1]), int(r[2])) for r in rows}


def describe(engine: Engine, config: History, tables: list[str]) -> list[str]:
    """``plan``'s lines about history for the captured ``tables``."""
    with engine.connect() as conn:
        known = registered(conn)
    if not config.enabled:
        if known:
            return [
                "history: off in freshline.toml, but recorded for "
                f"{', '.join(t for _, t in known)} (the recorder stops writing it)"
            ]
        return ["history: off (turn it on with [history] enabled = true in freshline.toml)"]
    keep = duration(config.retention_s) if config.retention_s else "for ever"
    lines = [f"history: on, ended versions kept {keep}"]
    on_disk = sizes(engine) if known else {}
    for table in tables:
        found: Registered | None = known.get((SCHEMA, table))
        name = history_table_name(SCHEMA, table)
        if found is None:
            lines.append(f"  {table}: apply creates freshline.{name} and backfills it")
            continue
        size, versions = on_disk.get(name, (0, 0))
        state = (
            f"from S0 {_moment(found.s0_at_us)}"
            if found.s0_snapshot
            else "not backfilled yet (apply does it)"
        )
        line = (
            f"  {table}: freshline.{name}, {state}, complete to "
            f"{_moment(found.complete_to_us)}, {versions} versions, {size // 1024} KiB"
        )
        if found.broken_from_us is not None:
            line += f"; BROKEN from {_moment(found.broken_from_us)}: {found.broken_reason}"
        lines.append(line)
    return lines


def rows(engine: Engine) -> list[dict[str, object]]:
    """The status page's history section: one row per recorded table."""
    with engine.connect() as conn:
        known = list(registered(conn).values())
    on_disk = sizes(engine) if known else {}
    out: list[dict[str, object]] = []
    for found in known:
        size, versions = on_disk.get(found.history, (0, 0))
        out.append(
            {
                "table": f"{found.schema}.{found.table}",
                "history_table": f"freshline.{found.history}",
                "s0_at": None if found.s0_at_us is None else found.s0_at_us / 1e6,
                "complete_to": None if found.complete_to_us is None else found.complete_to_us / 1e6,
                "lag_s": lag_s(found),
                "versions": versions,
                "bytes": size,
                "retention_s": found.retention_s,
                "broken": found.broken_reason if found.broken_from_us is not None else None,
            }
        )
    return out


def lag_s(found: Registered, now: dt.datetime | None = None) -> float | None:
    """How far behind now ``found``'s history is complete, in seconds (None: never)."""
    if found.complete_to_us is None:
        return None
    moment = now or dt.datetime.now(dt.UTC)
    return max(0.0, (moment - from_epoch_us(found.complete_to_us)).total_seconds())
