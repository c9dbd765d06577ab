"""The history audit: does history, read as of a snapshot, equal the table then?

In one REPEATABLE READ transaction, snapshot ``S`` reads the user table's rows and the
history versions that ``S`` sees (``pg_visible_in_snapshot(_fl_xmin, S) AND (_fl_xmax
IS NULL OR NOT pg_visible_in_snapshot(_fl_xmax, S))``, the evaluator's predicate), and
compares them both ways, every column as text: a row missing from history, a version
no row matches, and a row with two visible versions are differences. Equal at ``S``
means the latest version of every row is the current row. A change the recorder has not
read yet shows as a difference: :func:`audit` retries until ``deadline_s`` for that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.history.tables import Registered, qualified, quote, registered

SAMPLE = 5


@dataclass
class TableAudit:
    """One table's audit at one snapshot."""

    schema: str
    table: str
    snapshot: str
    rows: int
    missing: int
    """Rows of the table that history does not have as a visible version."""
    extra: int
    """Visible versions that no row of the table matches."""
    samples: list[str] = field(default_factory=list)
    broken: str | None = None

    @property
    def ok(self) -> bool:
        return self.missing == 0 and self.extra == 0 and self.broken is None


def _columns(engine: Engine, found: Registered) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:rel) "
                    "AND attnum > 0 AND NOT attisdropped AND attname NOT LIKE '\\_fl\\_%' "
                    "ORDER BY attnum"
                ),
                {"rel": qualified(found.history)},
            ).scalars()
        )


def audit_table(engine: Engine, found: Registered) -> TableAudit:
    """Compare ``found``'s table and its history at a snapshot taken now."""
    names = _columns(engine, found)
    as_text = ", ".join(f"{quote(n)}::text" for n in names)
    visible = (
        "pg_visible_in_snapshot(_fl_xmin, s.s) AND "
        "(_fl_xmax IS NULL OR NOT pg_visible_in_snapshot(_fl_xmax, s.s))"
    )
    source = f"{quote(found.schema)}.{quote(found.table)}"
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        snapshot = str(conn.execute(sa.text("SELECT pg_current_snapshot()::text")).scalar())
        params = {"s": snapshot}
        current = f"SELECT {as_text} FROM {source}"
        versions = (
            f"SELECT {as_text} FROM {qualified(found.history)}, "
            f"(SELECT CAST(:s AS pg_snapshot) AS s) AS s WHERE {visible}"
        )
        rows = int(conn.execute(sa.text(f"SELECT count(*) FROM {source}")).scalar_one())
        missing = conn.execute(
            sa.text(f"SELECT * FROM ({current} EXCEPT ALL {versions}) AS d LIMIT 1000"), params
        ).all()
        extra = conn.execute(
            sa.text(f"SELECT * FROM ({versions} EXCEPT ALL {current}) AS d LIMIT 1000"), params
        ).all()
        conn.rollback()
    samples = [f"missing from history: {tuple(r)}" for r in missing[:SAMPLE]]
    samples += [f"in history, not in the table: {tuple(r)}" for r in extra[:SAMPLE]]
    broken = None
    if found.broken_from_us is not None:
        broken = found.broken_reason or "broken"
    return TableAudit(
        found.schema, found.table, snapshot, rows, len(missing), len(extra), samples, broken
    )


def audit(engine: Engine, deadline_s: float = 0.0) -> list[TableAudit]:
    """Audit every registered (and backfilled) table; while one differs, try again until
    ``deadline_s`` has passed (the recorder may not have read the latest changes)."""
    end = time.monotonic() + deadline_s
    while True:
        with engine.connect() as conn:
            known = [r for r in registered(conn).values() if r.s0_snapshot is not None]
        results = [audit_table(engine, found) for found in known]
        if all(r.ok or r.broken for r in results) or time.monotonic() >= end:
            return results
        time.sleep(0.1)  # the recorder is behind: look again
