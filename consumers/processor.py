"""Applying a batch of change events: route, coalesce, recompute or invalidate, publish.

The order of side effects, per batch, all reads on one REPEATABLE READ snapshot:

0. take the snapshot and check that every CDC event's transaction is visible in it;
   if one is not yet (:class:`~freshline.pipeline.cache.recompute.NotYetVisible`), write
   nothing: the caller retries the batch;
1. for a TRUNCATE, raise the floor of every feature set the table feeds to the
   snapshot's watermark (every entry computed before it reads as absent), and tell
   in-process tiers to drop that set (an invalidation naming entity ``*``);
2. route every other event to the entries it affects (reverse lookups once per batch);
3. for each feature set, recompute all its affected entities in one query and write
   them with the conditional write (``recompute`` mode), or tombstone them
   (``invalidate`` mode), in every schema version being written (two during a deploy);
   the feature sets' queries run at the same time, each but the first on a connection
   of its own that imports the batch's snapshot (``SET TRANSACTION SNAPSHOT``), and
   the writes follow once all are computed;
4. publish one invalidation message per entry to the Redis channel, and hand the same
   messages to the Kafka producer.

Before the Redis writes: the WAL flushed past the snapshot (``wait_durable``), and the
snapshot's cluster and timeline those recorded (:class:`SourceChanged`). Step 4 may end
with ``WAIT n`` (:class:`ReplicasBehind`); a new Redis server raises every floor
(:meth:`Processor.raise_floors`). The caller then flushes the producer and only then
commits the offsets. Why each holds: docs/guarantees.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.consumers.routing import Router
from freshline.consumers.source import SourceRecord
from freshline.pipeline.cache.invalidation import ALL, Invalidation
from freshline.pipeline.cache.recompute import (
    Batch,
    Flusher,
    Snapshot,
    SourceIdentity,
    compute,
    compute_in_snapshot,
    export_snapshot,
    source_identity,
    take_snapshot,
    wait_durable,
)
from freshline.pipeline.cache.server import RedisIdentity, recorded_identity, redis_identity
from freshline.pipeline.cache.store import EntryStore, WriteResult
from freshline.pipeline.core.cluster import is_cluster, publish
from freshline.pipeline.core.db import own_connections
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.keys import INVALIDATION_CHANNEL, SERVER_KEY
from freshline.pipeline.core.types import ChangeEvent, EntityRef

logger = logging.getLogger("freshline.consumer")

SETS_BESIDE = 3
"""At most this many feature sets of a batch computed beside the batch's connection at
once, each on a connection of the engine's pool (the rest wait for one to finish)."""

XID_SPAN = 1 << 32
"""Ids below it are 32-bit (as Debezium reports them); from it up, full ``xid8``s."""

# The next transaction id to be assigned, without assigning one: age(xid) is that id
# minus xid (modulo 2**32), so xmax plus the age of xmax's low 32 bits (xmax is at most
# the next id, by far less than 2**31). None on a standby, whose next id trails the
# primary's until it replays: there every id may yet come.
_NEXT_XID = sa.text(
    "SELECT CASE WHEN pg_is_in_recovery() THEN NULL "
    "ELSE x.xmax + age(CAST(CAST(x.xmax % 4294967296 AS text) AS xid)) END "
    "FROM (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax) AS x"
)


def impossible_txids(engine: Engine, txids: Iterable[int]) -> tuple[int, frozenset[int]]:
    """The database's next transaction id, and which of ``txids`` it cannot have had.

    ``txids`` are ids a snapshot could not see
    (:class:`~freshline.pipeline.cache.recompute.NotYetVisible`). A change's
    transaction committed before its event was read, so its id was assigned before:
    an id at or past the next id to be assigned names no transaction, and waiting for
    it to become visible would wait for ever. A 32-bit id not visible lies less than
    ``2**31`` either side of the next id, so it is past it exactly when it is ahead of
    it modulo ``2**32``. An id in progress, or committed but not yet visible, is below
    the next id: never judged impossible. On a standby nothing is.
    """
    with engine.connect() as conn:
        found = conn.execute(_NEXT_XID).scalar()
        conn.rollback()
    if found is None:
        return 0, frozenset()
    next_xid = int(found)
    return next_xid, frozenset(
        t
        for t in txids
        if (t >= next_xid if t >= XID_SPAN else (t - next_xid) % XID_SPAN < XID_SPAN // 2)
    )


class ReplicasBehind(FreshlineError):
    """Fewer Redis replicas than asked acknowledged a batch's writes within the wait.

    Transient: the offsets are not committed and the batch is retried.
    """

    def __init__(self, acknowledged: int, wanted: int, timeout_ms: int) -> None:
        self.acknowledged, self.wanted = acknowledged, wanted
        super().__init__(
            f"{acknowledged} of {wanted} Redis replica(s) acknowledged the batch's writes "
            f"within {timeout_ms} ms (WAIT)"
        )


class PublishRefused(FreshlineError):
    """Redis refused the user publishing the batch's invalidations (an ACL): its entries
    are written but not announced, and no retry will announce them
    (:func:`freshline.consumers.access.publish_refused` says what to change)."""


class SourceChanged(FreshlineError):
    """The Postgres the consumer reads is not the history its earlier batches read: a
    new system identifier (another cluster) or a new timeline (a promoted standby, a
    point-in-time recovery).

    Commits the old primary had not shipped are gone, and transaction ids are issued
    again, so the new watermarks may rank below entries in Redis (the true recompute
    refused) and entries may hold transactions that never became durable. Floors cannot
    void entries whose watermarks rank above every new one, so the consumer writes
    nothing and holds its batch (a configuration failure, one log line and
    ``freshline_consumer_paused{cause="source"}``) until an operator purges the
    written versions (or deploys a new one) and restarts the consumers.
    """

    def __init__(self, before: SourceIdentity, now: SourceIdentity) -> None:
        self.before, self.now = before, now
        super().__init__(
            f"Postgres changed history under the consumer ({before} before, {now} now): "
            "entries in Redis may hold lost transactions and outrank new watermarks. Purge "
            "every written schema version (or deploy a new one), then restart the consumers"
        )


@dataclass(slots=True)
class BatchReport:
    """What one batch did, for counters and tests."""

    events: int = 0
    entries: int = 0
    writes: WriteResult = field(default_factory=WriteResult)
    invalidations: list[Invalidation] = field(default_factory=list)
    recompute_ms: dict[str, float] = field(default_factory=dict)
    write_ms: float = 0.0
    written_at_ms: int = 0
    lsn: int = 0
    """The snapshot's WAL position (past every commit it sees)."""
    flushed_lsn: int = 0
    """Postgres's WAL flush position read before the first write (0: none written)."""


class Processor:
    """Turns change events into fresh entries and invalidation messages."""

    def __init__(
        self,
        engine: Engine,
        client: redis.Redis,
        *,
        versions: Callable[[], Sequence[int]],
        registry: Registry,
        tombstone_ttl_s: int = 300,
        publish: Callable[[Invalidation], None] | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        durable_wait_ms: int = 2000,
        on_failover: Callable[[RedisIdentity, RedisIdentity], None] | None = None,
        on_computed: Callable[[Sequence[Batch]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_computed = on_computed
        """Called with a batch's computations before any of their entries is written
        (history keeps the snapshot each names: :mod:`freshline.pipeline.history.snapshots`)."""
        self.redis = client
        self.versions = versions
        self.registry = registry
        self.router = Router(registry)
        self.store = EntryStore(client, 1, registry=registry, tombstone_ttl_s=tombstone_ttl_s)
        self.publish = publish
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.durable_wait_ms = durable_wait_ms
        self.on_failover = on_failover
        self.cluster = is_cluster(client)
        # Connections of its own, not of ``engine``'s pool: the batch's thread holds one
        # of those while it waits for a flush, and no code path takes a second one from
        # a pool it holds one of (a pool of such waiters deadlocks). A forced flush is
        # rare (a commit's WAL not flushed within 20 ms): a connection each is cheap.
        self.flusher = Flusher(own_connections(engine), logger, "a batch")
        """Makes Postgres flush (:meth:`_force`), or knows the role may not."""
        self.source: SourceIdentity | None = None
        """The Postgres history of this processor's first batch; every later one must match."""
        self.record_ttl_ms = 2 * max((fs.ttl_s for fs in registry), default=3600) * 1000
        """How long Redis keeps what the consumers record (twice the longest TTL)."""
        self.record = SourceRecord(client, self.record_ttl_ms)
        """The history recorded in Redis for each version written."""
        self.server: RedisIdentity | None = None
        """The Redis server the last batch was written to (not watched on a cluster)."""

    def apply(self, events: Sequence[ChangeEvent]) -> BatchReport:
        report = BatchReport(events=len(events))
        versions = list(self.versions())
        txids = [e.txid for e in events if e.txid is not None]
        with self.engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            snapshot = take_snapshot(conn, txids).require_visible()
            self._check_source(conn, versions)
            report.lsn = snapshot.lsn
            durable = self._durable(conn, snapshot, report)
            for table in dict.fromkeys(e.table for e in events if e.op == "t"):
                for fs, _ in self.registry.affected_by(table):
                    for version in versions:
                        durable()
                        self.store.truncate(fs.name, snapshot.watermark, schema_version=version)
                        report.invalidations.append(
                            Invalidation(ALL, fs.name, ALL, snapshot.watermark, version)
                        )
            targets = self.router.route(conn, [e for e in events if e.op != "t"])
            batches = self._recompute(
                conn,
                {
                    name: sorted(pairs)
                    for name, pairs in targets.items()
                    if self.registry[name].mode == "recompute"
                },
                report,
            )
            if batches and self.on_computed is not None:
                self.on_computed(list(batches.values()))
            for name, pairs in targets.items():
                fs = self.registry[name]
                refs = sorted(pairs)
                report.entries += len(refs)
                if name in batches:
                    batch = batches[name]
                    watermark = batch.watermark
                    durable()
                    started = time.perf_counter()
                    report.writes.merge(self.store.write(batch, versions=versions))
                else:
                    watermark = snapshot.watermark
                    entity_refs = [EntityRef(name, t, e) for t, e in refs]
                    started = time.perf_counter()
                    durable()
                    report.writes.merge(
                        self.store.invalidate(entity_refs, watermark, versions=versions)
                    )
                report.write_ms += (time.perf_counter() - started) * 1000
                report.invalidations.extend(
                    Invalidation(t, name, e, watermark, v) for v in versions for t, e in refs
                )
            conn.rollback()
        self._announce(report.invalidations)
        report.written_at_ms = time.time_ns() // 1_000_000
        return report

    def _recompute(
        self, conn: Connection, work: dict[str, list[tuple[str, str]]], report: BatchReport
    ) -> dict[str, Batch]:
        """Compute each feature set in ``work`` for its entities, all from ``conn``'s
        snapshot: the first on ``conn``, the others at the same time, each on a
        connection of its own that imports the snapshot
        (:func:`~freshline.pipeline.cache.recompute.compute_in_snapshot`), so a batch takes its
        slowest set's time, not the sum. Each sees exactly the rows ``conn`` sees, and
        its watermark ranks the same."""

        def timed(name: str, compute_one: Callable[[], Batch]) -> Batch:
            started = time.perf_counter()
            batch = compute_one()
            report.recompute_ms[name] = (time.perf_counter() - started) * 1000
            return batch

        if not work:
            return {}
        first, *others = work
        here = partial(compute, conn, self.registry[first], work[first])
        if not others:
            return {first: timed(first, here)}
        snapshot_id = export_snapshot(conn)
        workers = min(len(others), SETS_BESIDE)
        with ThreadPoolExecutor(workers, thread_name_prefix="recompute") as pool:
            beside = {
                name: pool.submit(
                    timed,
                    name,
                    partial(
                        compute_in_snapshot,
                        conn.engine,  # the snapshot's own cluster, even if self.engine moved
                        snapshot_id,
                        self.registry[name],
                        work[name],
                    ),
                )
                for name in others
            }
            batches = {first: timed(first, here)}
            batches.update((name, future.result()) for name, future in beside.items())
        return batches

    def _durable(
        self, conn: Connection, snapshot: Snapshot, report: BatchReport
    ) -> Callable[[], None]:
        """A call that waits, the first time only, until ``snapshot``'s WAL position is
        flushed (see :func:`~freshline.pipeline.cache.recompute.wait_durable`): called before each
        write, so the WAL writer flushes while the batch computes."""
        done = not self.durable_wait_ms or not snapshot.lsn

        def durable() -> None:
            nonlocal done
            if not done:
                timeout_s = self.durable_wait_ms / 1000
                report.flushed_lsn = wait_durable(conn, snapshot.lsn, timeout_s, force=self._force)
                done = True

        return durable

    @property
    def can_force(self) -> bool:
        """Whether the role may force a WAL flush, as far as the last try told."""
        return self.flusher.allowed

    def _force(self) -> None:
        """:class:`~freshline.pipeline.cache.recompute.Flusher`: make Postgres flush, unless the
        role may not; then the batch waits for a commit to flush (any writing one does)."""
        self.flusher()

    def _check_source(self, conn: Connection, versions: Sequence[int]) -> None:
        """Raise :class:`SourceChanged` if ``conn``'s Postgres is another history than
        the first batch's, or than the one recorded for a version in ``versions`` (none
        recorded: record it)."""
        identity = source_identity(conn)
        before = self.source if self.source is not None else identity
        if before == identity:
            before = self.record.other(identity, versions) or identity
        if before != identity:
            raise SourceChanged(before, identity)
        self.source = identity

    def raise_floors(self) -> list[Invalidation]:
        """Void every entry written so far, in every version written: each feature set's
        floor goes to the watermark of a snapshot taken now (floors only rise, and live
        twice their set's TTL, longer than any entry they void). The invalidations name
        entity ``*``, as for a truncate; they are announced (and waited for) here."""
        versions = list(self.versions())
        with self.engine.connect() as conn:
            snapshot = take_snapshot(conn)
            wait_durable(conn, snapshot.lsn, max(self.durable_wait_ms, 1) / 1000, force=self._force)
            conn.rollback()
        invalidations = []
        for fs in self.registry:
            for version in versions:
                self.store.truncate(fs.name, snapshot.watermark, schema_version=version)
                invalidations.append(Invalidation(ALL, fs.name, ALL, snapshot.watermark, version))
        self._announce(invalidations, watch=False)
        return invalidations

    def watch(self) -> bool:
        """Read the Redis server's identity; True if it changed (the floors are then
        raised). For an idle consumer: a batch does this in its announce."""
        if self.cluster:
            return False
        pipe = self.redis.pipeline(transaction=False)
        pipe.info("server", "replication")
        pipe.get(SERVER_KEY)
        info, recorded = pipe.execute()
        return self._observe(info, recorded)

    def _observe(self, info: dict[str, Any], recorded: bytes | None) -> bool:
        """Compare the server's identity with the one the consumers recorded
        (:data:`~freshline.pipeline.core.keys.SERVER_KEY`, else this processor's last): on a
        change raise the floors, then record the new one. None recorded anywhere (a
        first start, or the key gone with its TTL): record it."""
        identity = redis_identity(info)
        noted = recorded_identity(recorded)
        before = noted if noted is not None else self.server
        if before is not None and before != identity:
            logger.error(
                "the Redis server written to changed (run id %s, replication id %s; was "
                "%s, %s): a failover or restart may have lost acknowledged writes, floors "
                "included; raising every feature set's floor, so every entry written "
                "before reads as absent",
                *identity,
                *before,
            )
            self.raise_floors()
        if noted != identity:  # only now: a failure above finds the change again
            self.redis.set(SERVER_KEY, ":".join(identity), px=self.record_ttl_ms)
        self.server = identity
        if before is None or before == identity:
            return False
        if self.on_failover is not None:
            self.on_failover((str(before[0]), str(before[1])), identity)
        return True

    def _announce(self, invalidations: list[Invalidation], *, watch: bool = True) -> None:
        """Publish ``invalidations``; with ``wait_replicas``, then WAIT for the replicas
        on the same connection (raising :class:`ReplicasBehind` before the Kafka copies
        are handed over); and, off a cluster, read the server's identity."""
        if not invalidations:
            return
        pipe = self.redis.pipeline(transaction=False)
        for message in invalidations:
            publish(pipe, INVALIDATION_CHANNEL, message.encode(), cluster=self.cluster)
        watched = watch and not self.cluster
        if watched:
            pipe.info("server", "replication")
            pipe.get(SERVER_KEY)
        if self.wait_replicas:
            pipe.wait(self.wait_replicas, self.wait_timeout_ms)
        try:
            replies = pipe.execute()
        except redis.exceptions.NoPermissionError as exc:
            # The user may write the entries but not announce them: the API's user, say.
            raise PublishRefused(str(exc)) from exc
        if self.wait_replicas and int(replies[-1]) < self.wait_replicas:
            raise ReplicasBehind(int(replies[-1]), self.wait_replicas, self.wait_timeout_ms)
        if watched:
            self._observe(replies[len(invalidations)], replies[len(invalidations) + 1])
        if self.publish is not None:
            for message in invalidations:
                self.publish(message)
