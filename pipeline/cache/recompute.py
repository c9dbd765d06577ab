"""Computing feature sets for a batch of entities, with a safe watermark.

Why this watermark
------------------
Every entry carries a watermark, and a write replaces an entry only when its
watermark is strictly greater (:mod:`pipeline.cache.store`). For that to keep stale values
out, the order of watermarks must follow the order of the snapshots they describe:
a computation that saw less must never outrank one that saw more.

So a computation reads its watermark *before* its snapshot exists: in one READ
COMMITTED transaction, statement 1 reads ``pg_current_wal_flush_lsn()`` and
``clock_timestamp()``; statement 2, the feature query, takes its snapshot when it
starts, after both were read. The watermark is the pair ``(flush LSN, clock µs)``
packed into one integer and compared LSN first.

* Both readings only move forward, so the pair orders readings by when they were
  taken, and a snapshot taken after a reading sees everything committed before it.
  Of two computations, the one with the greater watermark read it later and so
  began its snapshot later: it saw at least as much.
* An invalidation reads its watermark the same way, *after* the change committed.
  A computation whose snapshot missed the change read its watermark before the
  change was visible, so it is strictly older than the invalidation's tombstone
  and cannot replace it; a computation that began after the invalidation is newer.
* The LSN alone would not do: it can stand still while commits become visible
  (asynchronous commit, a quiet WAL), and two snapshots sharing an LSN may differ.
  The clock alone would not either: a wall clock can step back. The LSN makes a
  backward clock step harmless whenever WAL was written in between.
* Nothing compares a computation's watermark with an event's own LSN
  (``source.lsn``): the consumer always recomputes from a snapshot taken after it
  read the event, and writes that snapshot's watermark.

The read-through path is also guarded by leases (:mod:`pipeline.cache.readthrough`), which
an invalidation or source-driven write revokes, so a stale fill needs both guards to
fail.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from pipeline.core.errors import InvalidId
from pipeline.core.features import FeatureSet
from pipeline.core.keys import validate_id
from pipeline.core.types import FeatureValues, Watermark

CLOCK_BITS = 56
_WATERMARK_SQL = sa.text(
    # On a read replica the flush position does not exist; the replay position is
    # its equivalent: everything replayed before the snapshot is visible in it.
    "SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() "
    "ELSE pg_current_wal_flush_lsn() END - '0/0'::pg_lsn AS lsn, "
    "floor(extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS us"
)


def pack_watermark(lsn: int, clock_us: int) -> Watermark:
    return (lsn << CLOCK_BITS) | clock_us


def unpack_watermark(wm: Watermark) -> tuple[int, int]:
    return wm >> CLOCK_BITS, wm & ((1 << CLOCK_BITS) - 1)


def read_watermark(conn: Connection) -> tuple[Watermark, int]:
    """The current watermark and the database clock in ms; see the module docstring."""
    lsn, us = conn.execute(_WATERMARK_SQL).one()
    return pack_watermark(int(lsn), int(us)), int(us) // 1000


def current_watermark(engine: Engine) -> Watermark:
    """A watermark read now: what an invalidation applied after a commit carries."""
    with engine.connect() as conn:
        return read_watermark(conn)[0]


@dataclass(frozen=True, slots=True)
class Batch:
    """One feature set computed for many entities from one snapshot."""

    feature_set: FeatureSet
    values: dict[tuple[str, str], FeatureValues]
    watermark: Watermark
    computed_at_ms: int


def entity_ids(refs: Iterable[tuple[str, str]]) -> tuple[list[str], list[int]]:
    """Validate and split (tenant, entity) pairs into the query's parallel arrays."""
    tenants: list[str] = []
    ids: list[int] = []
    for tenant, entity in dict.fromkeys(refs):
        validate_id("tenant", tenant)
        text = validate_id("entity", entity)
        if not text.isdigit() or len(text) > 18 or (len(text) > 1 and text[0] == "0"):
            raise InvalidId("entity", entity,
                            "a user id is a non-negative integer without leading zeros")
        tenants.append(tenant)
        ids.append(int(text))
    return tenants, ids


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return int(value.timestamp() * 1000)
    return value


def compute(
    db: Engine | Connection,
    feature_set: FeatureSet,
    refs: Sequence[tuple[str, str]],
    *,
    as_of: dt.datetime | None = None,
) -> Batch:
    """Compute ``feature_set`` for every (tenant, entity) in ``refs`` in one query.

    Timestamps come back as epoch milliseconds. The watermark is read first, in
    the same transaction, so it is a lower bound of the query's snapshot.
    """
    tenants, ids = entity_ids(refs)
    if isinstance(db, Connection):
        return _compute(db, feature_set, tenants, ids, as_of)
    with db.connect() as conn:
        batch = _compute(conn, feature_set, tenants, ids, as_of)
        conn.rollback()
        return batch


def _compute(conn: Connection, fs: FeatureSet, tenants: list[str], ids: list[int],
             as_of: dt.datetime | None) -> Batch:
    watermark, now_ms = read_watermark(conn)
    values: dict[tuple[str, str], FeatureValues] = {}
    if ids:
        rows = conn.execute(fs.statement, {"tenants": tenants, "ids": ids, "as_of": as_of})
        names = fs.field_names
        for row in rows:
            values[(row[0], str(row[1]))] = {
                name: _jsonable(v) for name, v in zip(names, row[2:], strict=True)
            }
    return Batch(fs, values, watermark, now_ms)
