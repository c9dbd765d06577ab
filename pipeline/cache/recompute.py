"""Computing feature sets for a batch of entities, with a watermark taken from its snapshot.

The watermark is read from the feature query's own snapshot, in the same statement
(``pg_current_snapshot()``: its ``xmax``, how few ids were in progress below it, then the
clock), so a greater watermark never saw less. Before it computes, the statement checks
that every CDC event's transaction is visible in that snapshot (:class:`NotYetVisible`
otherwise), and before a batch writes, :func:`wait_durable` waits until Postgres has
flushed the WAL its snapshot saw (:class:`NotYetDurable`, :class:`Flusher`). Recomputes
run on the primary.

Why each holds: docs/keys.md, "Why watermarks and writes keep stale values out".
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.core.db import autocommit, sql_text
from freshline.pipeline.core.errors import DefinitionFailed, FreshlineError, InvalidId
from freshline.pipeline.core.features import (
    AS_OF,
    IMPLICIT_TENANT,
    Entity,
    FeatureSet,
    FieldType,
    Path,
)
from freshline.pipeline.core.keys import validate_id
from freshline.pipeline.core.types import FeatureValues, Watermark

FORMAT = 1 << 116
"""The top hex digit of a snapshot watermark: above every LSN-based one written before."""
XMAX_BITS, XIP_BITS, CLOCK_BITS = 48, 16, 52
_XIP_ROOM = (1 << XIP_BITS) - 1

# One statement, so pg_current_snapshot() is the snapshot of everything it reads. An
# event's 32-bit transaction id is widened to the xid8 with those low bits in the span
# [xmax - 3 * 2**30, xmax + 2**30): a transaction is at or above xmax while it is not
# yet visible, but by less than the ids then running (a transaction committed before
# its event was read, so its id was issued before this snapshot: at most the running
# transactions' count past xmax, far below 2**30); every older id, even one of an event
# replayed after billions of transactions, widens into the past and reads as visible.
# In epoch 0 an id may widen below 0, to no id ever issued: it reads as visible too.
# Ids from 2**32 up are full xid8s already.
_SNAPSHOT_SELECT = """
SELECT snap.s::text AS snapshot,
       floor(extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS us,
       ARRAY(SELECT t FROM unnest(CAST(:txids AS bigint[])) AS t,
                  LATERAL (SELECT CASE WHEN t >= 4294967296 THEN t
                                       ELSE snap.xmax - 3221225472
                                            + ((t - snap.xmax + 3221225472) & 4294967295)
                                  END AS xid) AS wide
             WHERE wide.xid >= 0
               AND NOT pg_visible_in_snapshot(CAST(CAST(wide.xid AS text) AS xid8), snap.s)
       ) AS invisible
FROM (SELECT s, pg_snapshot_xmax(s)::text::bigint AS xmax
      FROM (SELECT pg_current_snapshot() AS s) AS cur) AS snap
"""
# The WAL insert position, read in the statement of a snapshot (so after the snapshot
# was taken); NULL on a standby, which has no insert position.
_INSERT_LSN = (
    "CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_insert_lsn() - '0/0'::pg_lsn END"
)
# The moment a feature statement computes for (t(as_of)), as epoch µs.
_AS_OF_US = f"floor(extract(epoch FROM {AS_OF}) * 1000000)::bigint"
# The consumer's snapshot, with the WAL insert position.
_SNAPSHOT_SQL = sa.text(
    f"SELECT w.snapshot, w.us, w.invisible, {_INSERT_LSN} AS lsn FROM ({_SNAPSHOT_SELECT}) AS w"
)
_FLUSHED_SQL = sa.text("SELECT pg_current_wal_flush_lsn() - '0/0'::pg_lsn")
_IDENTITY_SQL = sa.text(
    "SELECT (SELECT system_identifier FROM pg_control_system())::text, "
    "('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint"
)


class NotYetVisible(FreshlineError):
    """A change's transaction is committed but not yet visible to new snapshots.

    Transient: the batch is retried, and writes nothing meanwhile.
    """

    def __init__(self, txids: Sequence[int]) -> None:
        self.txids = tuple(txids)
        shown = ", ".join(map(str, self.txids[:5])) + (" ..." if len(self.txids) > 5 else "")
        super().__init__(f"transaction(s) {shown} not yet visible to new snapshots")


class NotYetDurable(FreshlineError):
    """Postgres has not yet flushed its WAL past a snapshot's position: a transaction
    the snapshot sees, committed asynchronously, could still be lost in a crash.

    Transient: the batch is retried, and writes nothing meanwhile.
    """

    def __init__(self, lsn: int, flushed: int, waited_s: float) -> None:
        self.lsn, self.flushed = lsn, flushed
        super().__init__(
            f"Postgres flushed its WAL to {format_lsn(flushed)}, not yet past the "
            f"snapshot's {format_lsn(lsn)}, within {waited_s:.2f}s"
        )


def format_lsn(lsn: int) -> str:
    """An LSN as Postgres prints it (``9/51F96A0``)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one statement's snapshot says: its watermark, the clock, unseen changes, and
    the WAL insert position read after it (0 on a standby, or where not read)."""

    watermark: Watermark
    now_ms: int
    invisible: tuple[int, ...] = ()
    lsn: int = 0

    def require_visible(self) -> Snapshot:
        """Raise :class:`NotYetVisible` if a change it was asked about is not visible."""
        if self.invisible:
            raise NotYetVisible(self.invisible)
        return self


def snapshot_rank(xmax: int, in_progress: int) -> int:
    """A snapshot's part of its watermarks (all but the clock): of two, the greater saw
    at least as much (docs/keys.md, "A greater watermark never saw less")."""
    return (
        FORMAT >> CLOCK_BITS
        | (xmax & ((1 << XMAX_BITS) - 1)) << XIP_BITS
        | (_XIP_ROOM - min(in_progress, _XIP_ROOM))
    )


def snapshot_watermark(snapshot: str, clock_us: int) -> Watermark:
    """The watermark of a ``pg_current_snapshot()`` text and a clock reading (µs)."""
    _, xmax, xip = snapshot.split(":")
    in_progress = len(xip.split(",")) if xip else 0
    clock = clock_us & ((1 << CLOCK_BITS) - 1)
    return snapshot_rank(int(xmax), in_progress) << CLOCK_BITS | clock


def unpack_watermark(wm: Watermark) -> tuple[int, int]:
    """``(the snapshot's part, the clock in µs)`` of a watermark."""
    return wm >> CLOCK_BITS, wm & ((1 << CLOCK_BITS) - 1)


def _snapshot(snapshot: str, us: int, invisible: Sequence[int] | None) -> Snapshot:
    return Snapshot(snapshot_watermark(snapshot, int(us)), int(us) // 1000, tuple(invisible or ()))


def take_snapshot(conn: Connection, txids: Iterable[int] = ()) -> Snapshot:
    """The watermark of the statement run now, and which of ``txids`` it cannot see.

    In a REPEATABLE READ transaction, run first, it is the snapshot of every later
    statement of the transaction too.
    """
    row = conn.execute(_SNAPSHOT_SQL, {"txids": sorted(set(txids))}).one()
    snap = _snapshot(row.snapshot, row.us, row.invisible)
    return Snapshot(snap.watermark, snap.now_ms, snap.invisible, int(row.lsn or 0))


def flushed_lsn(conn: Connection) -> int:
    """How far Postgres has flushed its WAL to disk (the primary's own flush)."""
    return int(conn.execute(_FLUSHED_SQL).scalar_one())


FORCE_AFTER_S = 0.02
"""How long :func:`wait_durable` polls before it makes Postgres flush (``force``)."""


def wait_durable(
    conn: Connection,
    lsn: int,
    timeout_s: float,
    *,
    force: Callable[[], None] | None = None,
    poll: Callable[[float], None] = time.sleep,
) -> int:
    """Wait until Postgres has flushed its WAL to at least ``lsn``; the flushed position.

    ``lsn`` is a :attr:`Snapshot.lsn`: past every commit record the snapshot sees, and
    maybe past WAL no commit asked to flush (page pruning by a read, a transaction
    still running), which the WAL writer leaves in a partial page until someone
    commits. So after :data:`FORCE_AFTER_S` without the flush, ``force`` (such as
    :func:`force_flush`) is called once. Raises :class:`NotYetDurable` once
    ``timeout_s`` has passed. Works inside the snapshot's transaction (the position is
    not part of a snapshot).
    """
    started = time.monotonic()
    interval = 0.001
    while (flushed := flushed_lsn(conn)) < lsn:
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise NotYetDurable(lsn, flushed, waited)
        if force is not None and waited >= FORCE_AFTER_S:
            force()
            force = None
            continue
        poll(min(interval, timeout_s - waited))
        interval = min(interval * 2, 0.01)
    return flushed


# One simple query of two statements: Postgres runs it as one transaction of its own,
# so ``SET LOCAL`` holds for its commit, on a connection in autocommit as on any other.
_FORCE_FLUSH = (
    "SET LOCAL synchronous_commit = local; "
    "CREATE TEMPORARY TABLE freshline_flush (x int) ON COMMIT DROP"
)


def force_flush(db: Engine | Connection) -> None:
    """Make Postgres flush its WAL up to now, on ``db``: a connection outside a
    transaction (a fill's own, in autocommit), or an engine's, taken for it.

    A commit flushes the WAL up to its own record only when it wrote some and commits
    synchronously; a read-only role has one thing to write that every role may: a
    temporary table's catalog rows (``TEMPORARY`` is granted to ``PUBLIC`` by default),
    dropped at commit. ``local``: the primary's own flush, not a standby's.
    """
    if isinstance(db, Engine):
        with autocommit(db) as conn:
            force_flush(conn)
        return
    db.exec_driver_sql(_FORCE_FLUSH)


FORCE_RETRY_S = 60.0
"""How long a :class:`Flusher` whose role was refused waits before it asks again."""


class Flusher:
    """:func:`force_flush`, as :func:`wait_durable`'s ``force``, unless the role may not
    (it lacks ``TEMPORARY``): then a call does nothing, so the wait lasts until some
    commit flushes, and ``log`` says so once (``waiter``: what waits). A refused role is
    asked again every :data:`FORCE_RETRY_S`, so a grant made later takes effect without
    a restart (and that is said too).

    A call flushes on the connection it is given, outside a transaction: a caller that
    holds a connection of ``engine``'s pool passes it, for a second one may never come
    (every connection held by a caller waiting for one more). Without one, on a
    connection of ``engine``'s."""

    def __init__(self, engine: Engine, log: logging.Logger, waiter: str) -> None:
        self.engine = engine
        self.log = log
        self.waiter = waiter
        self.refused_at: float | None = None
        """When the role was last refused a forced flush, if it was."""
        self.clock: Callable[[], float] = time.monotonic

    @property
    def allowed(self) -> bool:
        """Whether the role may force a flush, as far as the last try told."""
        return self.refused_at is None

    def __call__(self, conn: Connection | None = None) -> None:
        now = self.clock()
        refused_at = self.refused_at
        if refused_at is not None and now - refused_at < FORCE_RETRY_S:
            return
        try:
            force_flush(self.engine if conn is None else conn)
        except sa.exc.ProgrammingError as exc:
            self.refused_at = now
            if refused_at is None:
                self.log.warning(
                    "cannot make Postgres flush its WAL (%s): grant this role TEMPORARY on "
                    "the database; until then %s waits for a commit to flush past its "
                    "snapshot",
                    str(exc.orig).strip().splitlines()[0] if exc.orig else exc,
                    self.waiter,
                )
            return
        if refused_at is not None:
            self.refused_at = None
            self.log.warning("Postgres flushes its WAL when asked again: this role may now")


@dataclass(frozen=True, slots=True)
class SourceIdentity:
    """Which Postgres history a snapshot belongs to: the cluster's system identifier
    (new after an ``initdb`` or a restore into a new cluster) and its timeline (new
    after a standby's promotion or a point-in-time recovery)."""

    system_identifier: str
    timeline: int

    def __str__(self) -> str:
        return f"system {self.system_identifier}, timeline {self.timeline}"


def source_identity(conn: Connection) -> SourceIdentity:
    """The identity of the primary ``conn`` is on (its timeline is that of the WAL
    being inserted now, not of the last checkpoint, which a promotion updates late)."""
    row = conn.execute(_IDENTITY_SQL).one()
    return SourceIdentity(str(row[0]), int(row[1]))


@dataclass(frozen=True, slots=True)
class Position:
    """A primary's snapshot watermark, with the WAL insert position read after it."""

    watermark: Watermark
    lsn: int


_POSITION_SQL = sa.text(
    f"SELECT w.snapshot, w.us, pg_current_wal_insert_lsn() - '0/0'::pg_lsn AS lsn "
    f"FROM ({_SNAPSHOT_SELECT}) AS w"
)


def primary_position(engine: Engine) -> Position:
    """The watermark of a snapshot on the primary, and a WAL position past its commits.

    Every transaction visible in the snapshot wrote its commit record before the
    statement read the insert position, so a standby that has replayed up to ``lsn``
    sees all of them (and maybe more: see :func:`replayed_lsn`).
    """
    with autocommit(engine) as conn:
        row = conn.execute(_POSITION_SQL, {"txids": []}).one()
    return Position(snapshot_watermark(row.snapshot, int(row.us)), int(row.lsn))


def replayed_lsn(engine: Engine) -> int:
    """How far a hot standby has replayed the WAL; 0 if it is not a standby.

    Read in a statement of its own, before a query on the standby: that query's
    snapshot, taken later, sees every commit up to this position (a standby's
    visibility follows the replay of commit records).
    """
    with autocommit(engine) as conn:
        lsn = conn.execute(
            sa.text("SELECT coalesce(pg_last_wal_replay_lsn() - '0/0'::pg_lsn, 0)")
        ).scalar()
    return int(lsn or 0)


def current_watermark(engine: Engine) -> Watermark:
    """A watermark read now: what an invalidation applied after a commit carries."""
    with autocommit(engine) as conn:
        return take_snapshot(conn).watermark


@dataclass(frozen=True, slots=True)
class Batch:
    """One feature set computed for many entities from one snapshot."""

    feature_set: FeatureSet
    values: dict[tuple[str, str], FeatureValues]
    watermark: Watermark
    computed_at_ms: int
    valid_until_ms: dict[tuple[str, str], int] = field(default_factory=dict)
    """For a feature set with a horizon, per entity that has one: when its values may
    next change with time alone (epoch ms, Postgres's clock, as ``computed_at_ms``)."""
    lsn: int = 0
    """The WAL insert position read after the snapshot (:attr:`Snapshot.lsn`; 0 on a
    standby): once Postgres has flushed this far, every commit the values hold is
    durable (:func:`wait_durable`)."""
    snapshot: str = ""
    """The statement's full ``pg_current_snapshot()`` (``xmin:xmax:xip,...``): exactly
    which transactions the values hold (:mod:`freshline.pipeline.history.snapshots` keeps it by
    watermark)."""
    as_of_us: int = 0
    """The moment the query computed for (``t(as_of)``), epoch µs."""


def entity_ids(
    refs: Iterable[tuple[str, str]], entity: Entity
) -> tuple[list[str], list[int | str]]:
    """Validate and split (tenant, entity) pairs into the query's parallel arrays: each
    id checked as a key of ``entity``'s type (:meth:`Entity.validate`)."""
    tenants: list[str] = []
    ids: list[int | str] = []
    for tenant, key in dict.fromkeys(refs):
        validate_id("tenant", tenant)
        if entity.tenant is None and tenant != IMPLICIT_TENANT:
            raise InvalidId(
                "tenant",
                tenant,
                f"the repository is single-tenant (its tenant is {IMPLICIT_TENANT!r})",
            )
        tenants.append(tenant)
        ids.append(entity.param(entity.validate(key)))
    return tenants, ids


def entry_value(value: Any, kind: FieldType = "float") -> Any:
    """A column's value as the entry holds it: a timestamp as epoch ms, a ``numeric`` as
    the declared field's ``int`` or ``float`` (the training evaluator converts the same
    way: :mod:`freshline.pipeline.history.evaluator`)."""
    if isinstance(value, dt.datetime):
        return int(value.timestamp() * 1000)
    if isinstance(value, Decimal):
        return int(value) if kind == "int" else float(value)
    return value


def compute(
    db: Engine | Connection,
    feature_set: FeatureSet,
    refs: Sequence[tuple[str, str]],
    *,
    as_of: dt.datetime | None = None,
    txids: Iterable[int] = (),
    path: Path | None = None,
) -> Batch:
    """Compute ``feature_set`` for every (tenant, entity) in ``refs`` in one statement.

    Timestamps come back as epoch milliseconds. The watermark comes from the same
    statement's snapshot (docs/keys.md says why); if any of ``txids`` is not visible
    in it, :class:`NotYetVisible` is raised and nothing is returned.

    ``path`` picks the evaluation: ``"full"`` (the defining query over the source
    rows: the reference, e.g. for an audit), ``"incremental"`` (the partial aggregates
    the repository's :mod:`~freshline.pipeline.core.incremental` path keeps, same values), or
    None for the feature set's own ``path``.
    """
    tenants, ids = entity_ids(refs, feature_set.entity)
    if isinstance(db, Connection):
        return _compute(db, feature_set, tenants, ids, as_of, txids, path)
    with autocommit(db) as conn:  # one statement: no transaction around it
        return _compute(conn, feature_set, tenants, ids, as_of, txids, path)


_EXPORT_SQL = sa.text("SELECT pg_export_snapshot()")
_SNAPSHOT_ID = re.compile(r"[0-9A-F]+(-[0-9A-F]+)+")


def export_snapshot(conn: Connection) -> str:
    """The id of ``conn``'s transaction snapshot (``pg_export_snapshot()``), for
    :func:`compute_in_snapshot` on other connections while that transaction stays open.

    In a REPEATABLE READ transaction it is the snapshot of its first statement, the
    one every later statement of the transaction reads.
    """
    return str(conn.execute(_EXPORT_SQL).scalar_one())


def compute_in_snapshot(
    engine: Engine,
    snapshot_id: str,
    feature_set: FeatureSet,
    refs: Sequence[tuple[str, str]],
    *,
    path: Path | None = None,
) -> Batch:
    """:func:`compute` on a connection of its own that imports an exported snapshot
    (:func:`export_snapshot`; ``SET TRANSACTION SNAPSHOT``).

    It sees exactly the rows the exporting transaction sees, so its watermark has the
    same snapshot part (only the clock differs), as if computed on that connection.
    """
    if not _SNAPSHOT_ID.fullmatch(snapshot_id):  # inlined below: SET takes no parameter
        raise ValueError(f"not an exported snapshot id: {snapshot_id!r}")
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        conn.execute(sa.text(f"SET TRANSACTION SNAPSHOT '{snapshot_id}'"))
        batch = compute(conn, feature_set, refs, path=path)
        conn.rollback()
    return batch


def feature_statement(fs: FeatureSet, path: Path | None = None) -> sa.TextClause:
    """The feature query joined to the snapshot select: one statement, one snapshot;
    the WAL insert position read after the snapshot comes last (:attr:`Batch.lsn`)."""
    body = fs.sql(path)
    if fs.horizon is not None:  # its moment as the last column: see FeatureSet.horizon
        body = f"SELECT f.*, {fs.horizon} AS valid_until FROM ({body}) AS f"
    return sql_text(
        f"SELECT w.snapshot, w.us, w.invisible, f.*, w.as_of_us, w.lsn "
        f"FROM (SELECT s.*, {_AS_OF_US} AS as_of_us, {_INSERT_LSN} AS lsn "
        f"FROM ({_SNAPSHOT_SELECT}) AS s) AS w "
        f"LEFT JOIN ({body}) AS f ON true"
    )


def _definition_failed(fs: FeatureSet, exc: sa.exc.ProgrammingError) -> DefinitionFailed | None:
    """The definition's fault (a column, function or table its SQL names is not there, a
    syntax error), named with its file and line; a missing grant, or one of freshline's
    own tables missing (``db upgrade``), stays the database error it is."""
    orig = exc.orig
    detail = str(orig).strip().splitlines()[0] if orig else str(exc)
    state = getattr(orig, "sqlstate", None) or ""
    # Class 42: syntax error or access rule violation; 42501 is a missing grant.
    if not state.startswith("42") or state == "42501" or "freshline." in detail:
        return None
    return DefinitionFailed(fs.name, fs.origin, detail)


def _compute(
    conn: Connection,
    fs: FeatureSet,
    tenants: list[str],
    ids: list[int | str],
    as_of: dt.datetime | None,
    txids: Iterable[int],
    path: Path | None,
) -> Batch:
    try:
        rows = conn.execute(
            feature_statement(fs, path),
            {"tenants": tenants, "ids": ids, "as_of": as_of, "txids": sorted(set(txids))},
        ).all()
    except sa.exc.ProgrammingError as exc:
        failed = _definition_failed(fs, exc)
        if failed is None:
            raise
        raise failed from exc
    first = rows[0]
    snap = _snapshot(first[0], first[1], first[2]).require_visible()
    values: dict[tuple[str, str], FeatureValues] = {}
    valid_until: dict[tuple[str, str], int] = {}
    names = fs.field_names
    kinds = [f.type for f in fs.fields]
    tenanted = fs.entity.tenant is not None  # else: the key alone, of the one tenant
    start = 5 if tenanted else 4
    end = start + len(names)
    for row in rows:
        if row[3] is None:  # the LEFT JOIN's row when no entity has features
            continue
        key = (row[3], str(row[4])) if tenanted else (IMPLICIT_TENANT, str(row[3]))
        values[key] = {
            name: entry_value(v, kind)
            for name, kind, v in zip(names, kinds, row[start:end], strict=True)
        }
        if fs.horizon is not None and row[end] is not None:
            valid_until[key] = entry_value(row[end])
    return Batch(
        fs,
        values,
        snap.watermark,
        snap.now_ms,
        valid_until,
        int(first[-1] or 0),
        str(first[0]),
        int(first[-2]),
    )
