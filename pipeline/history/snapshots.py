"""Which snapshot an entry was computed from: ``freshline.snapshots``, by watermark.

Every computation (a consumer batch, a read-through fill, a warm) reads its feature
query and ``pg_current_snapshot()`` in one statement (:mod:`freshline.pipeline.cache.recompute`),
and its entries carry a watermark packed from that snapshot and a clock. The watermark
alone drops the in-progress list and ``as_of``; this table keeps them, keyed by the
watermark, so that ``snapshot_of(entry.watermark)`` names exactly the rows the entry was
computed from (``pg_visible_in_snapshot`` over history's ``_fl_xmin``/``_fl_xmax``), and
the moment its windows were computed for.

Why a table, not a new codec tag: every reader of an entry (the client, the tier, the
API, the Lua of the conditional write) would have to read a longer entry on the hot path
for a value only training and audits need; one row per computation (tens of bytes
plus the in-progress list) is written off the read path, once per batch of entities,
and kept as long as history (:func:`prune`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.cache.recompute import Batch
from freshline.pipeline.core.db import SCHEMA, autocommit


@dataclass(frozen=True, slots=True)
class EntrySnapshot:
    """What a watermark names: the statement's full ``pg_current_snapshot()`` text
    (``xmin:xmax:xip,...``) and its ``as_of`` in epoch µs."""

    watermark: int
    snapshot: str
    as_of_us: int


_INSERT = sa.text(
    f"INSERT INTO {SCHEMA}.snapshots (watermark, snapshot, as_of_us) "
    "SELECT * FROM unnest(CAST(:w AS numeric[]), CAST(:s AS text[]), CAST(:a AS bigint[])) "
    "ON CONFLICT (watermark) DO NOTHING"
)
_SELECT = sa.text(
    f"SELECT watermark, snapshot, as_of_us FROM {SCHEMA}.snapshots "
    "WHERE watermark = ANY(CAST(:w AS numeric[]))"
)


def record(conn: Connection, snapshots: Iterable[EntrySnapshot]) -> None:
    """Keep ``snapshots`` (one statement; a watermark already kept is left as it is).
    The caller commits."""
    rows = list({s.watermark: s for s in snapshots}.values())
    if rows:
        conn.execute(
            _INSERT,
            {
                "w": [r.watermark for r in rows],
                "s": [r.snapshot for r in rows],
                "a": [r.as_of_us for r in rows],
            },
        )


def of_batches(batches: Iterable[Batch]) -> list[EntrySnapshot]:
    """What each computation's entries name (those that carry their snapshot)."""
    return [EntrySnapshot(b.watermark, b.snapshot, b.as_of_us) for b in batches if b.snapshot]


def keeper(engine: Engine) -> Callable[[Sequence[Batch]], None]:
    """A call that keeps the snapshots of computations (one statement, its own
    connection): the consumers' and read-through's ``on_computed``, run before their
    entries are written, so no entry names a snapshot that was not kept."""

    def keep(batches: Sequence[Batch]) -> None:
        rows = of_batches(batches)
        if rows:
            with autocommit(engine) as conn:
                record(conn, rows)

    return keep


def snapshots_of(db: Engine | Connection, watermarks: Iterable[int]) -> dict[int, EntrySnapshot]:
    """The kept snapshot of each of ``watermarks`` that has one."""
    wanted = sorted(set(watermarks))
    if not wanted:
        return {}
    if isinstance(db, Engine):
        with db.connect() as conn:
            return snapshots_of(conn, wanted)
    rows = db.execute(_SELECT, {"w": wanted}).all()
    return {int(w): EntrySnapshot(int(w), str(s), int(a)) for w, s, a in rows}


def snapshot_of(db: Engine | Connection, watermark: int) -> EntrySnapshot | None:
    """The snapshot and ``as_of`` the entry with ``watermark`` was computed from, if kept."""
    return snapshots_of(db, [watermark]).get(watermark)


def prune(conn: Connection, keep_s: int) -> int:
    """Drop the snapshots recorded more than ``keep_s`` seconds ago; how many."""
    return conn.execute(
        sa.text(
            f"DELETE FROM {SCHEMA}.snapshots "
            "WHERE recorded_at < now() - make_interval(secs => :keep)"
        ),
        {"keep": keep_s},
    ).rowcount
