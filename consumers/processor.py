"""Applying a batch of change events: route, coalesce, recompute or invalidate, publish.

The order of side effects, per batch, all reads on one REPEATABLE READ snapshot:

0. take the snapshot and check that every CDC event's transaction is visible in it;
   if one is not yet (:class:`~pipeline.cache.recompute.NotYetVisible`), write
   nothing: the caller retries the batch;
1. for a TRUNCATE, raise the floor of every feature set the table feeds to the
   snapshot's watermark (every entry computed before it reads as absent), and tell
   in-process tiers to drop that set (an invalidation naming entity ``*``);
2. route every other event to the entries it affects (reverse lookups once per batch);
3. for each feature set, recompute all its affected entities in one query and write
   them with the conditional write (``recompute`` mode), or tombstone them
   (``invalidate`` mode), in every schema version being written (two during a deploy);
4. publish one invalidation message per entry to the Redis channel, and hand the same
   messages to the Kafka producer.

The caller (:class:`consumers.worker.Worker`) then flushes the producer and only then
commits the offsets, so a crash anywhere before the commit replays the batch, which
the conditional writes make harmless.

A transaction id that stays invisible may name no transaction at all: the caller asks
:func:`impossible_txids` which ones the database cannot have had.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from consumers.routing import Router
from pipeline.cache.invalidation import ALL, Invalidation
from pipeline.cache.recompute import compute, take_snapshot
from pipeline.cache.store import FeatureStore, WriteResult
from pipeline.core.cluster import is_cluster, publish
from pipeline.core.features import Registry
from pipeline.core.keys import INVALIDATION_CHANNEL
from pipeline.core.repository import REGISTRY
from pipeline.core.types import ChangeEvent, EntityRef

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
    (:class:`~pipeline.cache.recompute.NotYetVisible`). A change's
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


class Processor:
    """Turns change events into fresh entries and invalidation messages."""

    def __init__(
        self,
        engine: Engine,
        client: redis.Redis,
        *,
        versions: Callable[[], Sequence[int]],
        registry: Registry = REGISTRY,
        tombstone_ttl_s: int = 300,
        publish: Callable[[Invalidation], None] | None = None,
    ) -> None:
        self.engine = engine
        self.redis = client
        self.versions = versions
        self.registry = registry
        self.router = Router(registry)
        self.store = FeatureStore(client, 1, registry=registry, tombstone_ttl_s=tombstone_ttl_s)
        self.publish = publish

    def apply(self, events: Sequence[ChangeEvent]) -> BatchReport:
        report = BatchReport(events=len(events))
        versions = list(self.versions())
        txids = [e.txid for e in events if e.txid is not None]
        with self.engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            snapshot = take_snapshot(conn, txids).require_visible()
            for table in dict.fromkeys(e.table for e in events if e.op == "t"):
                for fs, _ in self.registry.affected_by(table):
                    for version in versions:
                        self.store.truncate(fs.name, snapshot.watermark, schema_version=version)
                        report.invalidations.append(
                            Invalidation(ALL, fs.name, ALL, snapshot.watermark, version)
                        )
            targets = self.router.route(conn, [e for e in events if e.op != "t"])
            for name, pairs in targets.items():
                fs = self.registry[name]
                refs = sorted(pairs)
                report.entries += len(refs)
                started = time.perf_counter()
                if fs.mode == "recompute":
                    batch = compute(conn, fs, refs)
                    watermark = batch.watermark
                    report.recompute_ms[name] = (time.perf_counter() - started) * 1000
                    started = time.perf_counter()
                    for version in versions:
                        report.writes.merge(self.store.write(batch, schema_version=version))
                else:
                    watermark = snapshot.watermark
                    entity_refs = [EntityRef(name, t, e) for t, e in refs]
                    for version in versions:
                        report.writes.merge(
                            self.store.invalidate(entity_refs, watermark, schema_version=version)
                        )
                report.write_ms += (time.perf_counter() - started) * 1000
                report.invalidations.extend(
                    Invalidation(t, name, e, watermark, v) for v in versions for t, e in refs
                )
            conn.rollback()
        self._announce(report.invalidations)
        report.written_at_ms = time.time_ns() // 1_000_000
        return report

    def _announce(self, invalidations: list[Invalidation]) -> None:
        if not invalidations:
            return
        cluster = is_cluster(self.redis)
        pipe = self.redis.pipeline(transaction=False)
        for message in invalidations:
            publish(pipe, INVALIDATION_CHANNEL, message.encode(), cluster=cluster)
        pipe.execute()
        if self.publish is not None:
            for message in invalidations:
                self.publish(message)
