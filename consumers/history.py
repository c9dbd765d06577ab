"""The history recorder's run loop: a consumer group of its own on the CDC topics.

Why its own group (``<FRESHLINE_CONSUMER_GROUP>-history``, ``freshline record``) and
not the feature consumers: history must begin before S0, the backfill's snapshot,
whatever the feature consumers had read by then, so its group starts at the earliest
offsets the topics hold (changes S0 already saw are skipped exactly:
:mod:`freshline.pipeline.history.backfill`); a history write that fails (DDL, a full disk) must
not hold fresh features back, nor a Redis outage hold history back; and it reads every
column of every record, where the consumers decode only what routes.

Each iteration: consume up to ``BATCH`` records; read each CDC record as a
:class:`~freshline.pipeline.history.recorder.Change` (a malformed one is logged and counted, not
recorded); record the batch in one Postgres transaction; then commit the offsets. A
failure before the commit (Postgres away) rewinds the batch's partitions and tries
again with backoff, so nothing is skipped; the recorder's idempotence makes the replay
harmless. A table registered but not backfilled yet, or a change with a column its
history table lacks, holds the batch (rewound, offsets kept) until ``freshline apply``
has done its part, however long.

Completeness: a heartbeat record (Debezium's ``__debezium-heartbeat.<prefix>``) is
remembered; once every assigned CDC partition has been read to its end after it, every
history table is complete to the heartbeat's time (``complete_to``). Retention: every
``PRUNE_EVERY_S``, versions that ended longer ago than a table's retention, and
snapshots older than the longest retention, are deleted.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa
from confluent_kafka import Message, TopicPartition
from sqlalchemy.engine import Engine

from freshline.consumers.kafka import Consumer
from freshline.consumers.metrics import history_metrics
from freshline.pipeline.core.db import SCHEMA, make_engine
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import CDC_PREFIX
from freshline.pipeline.history.recorder import (
    HistoryBehind,
    MalformedChange,
    NotBackfilled,
    Outcome,
    Recorder,
    parse,
)
from freshline.pipeline.history.snapshots import prune as prune_snapshots
from freshline.pipeline.history.status import lag_s, sizes
from freshline.pipeline.history.tables import from_epoch_us, qualified, registered

logger = logging.getLogger("freshline.history")

BATCH = 500
WAIT_S = 0.2
BACKOFF_S = (0.1, 0.5, 2.0, 5.0)
PRUNE_EVERY_S = 600.0
BEHIND_WAIT_S = 2.0
"""How long the recorder waits before it looks again for columns apply has to add."""
BEHIND_LOG_S = 60.0
GROUP_SUFFIX = "-history"


def group(settings: Settings) -> str:
    """The recorder's consumer group."""
    return settings.consumer_group + GROUP_SUFFIX


def topics(settings: Settings) -> list[str]:
    """Every CDC topic of the prefix, and the connector's heartbeats."""
    prefix = re.escape(settings.topic_prefix + CDC_PREFIX)
    # Patterns both: the heartbeat topic appears with the first heartbeat.
    return [rf"^{prefix}\.public\..*", rf"^__debezium-heartbeat\.{prefix}$"]


@dataclass
class Totals:
    consumed: int = 0
    versions: int = 0
    duplicates: int = 0
    skipped_s0: int = 0
    malformed: int = 0
    retries: int = 0


class HistoryWorker:
    """``freshline record``: one member of the recorder's group (see the module)."""

    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.engine = engine or make_engine(settings)
        self.recorder = Recorder(self.engine)
        self.totals = Totals()
        self._stop = threading.Event()
        self._heartbeat_ms: int | None = None
        self._pruned_at = 0.0
        self._behind_logged = -BEHIND_LOG_S

    def stop(self) -> None:
        """Ask the loop to stop after the batch in hand."""
        self._stop.set()

    def run(self, *, max_messages: int | None = None, timeout: float | None = None) -> Totals:
        """Record until :meth:`stop`, ``max_messages`` records, or ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        overrides = {"group.id": group(self.settings), "auto.offset.reset": "earliest"}
        with Consumer(self.settings, **overrides) as consumer:
            consumer.subscribe(
                topics(self.settings),
                on_assign=self._check_gaps,
            )
            while not self._stop.is_set():
                if max_messages is not None and self.totals.consumed >= max_messages:
                    break
                if end is not None and time.monotonic() >= end:
                    break
                self._iteration(consumer)
        return self.totals

    def _iteration(self, consumer: Consumer) -> None:
        batch = consumer.consume(BATCH, WAIT_S)
        for attempt in range(len(BACKOFF_S) + 1):
            try:
                self._record(batch)
                break
            except (HistoryBehind, NotBackfilled) as exc:  # waits for apply, however long
                now = time.monotonic()
                if now - self._behind_logged > BEHIND_LOG_S:
                    self._behind_logged = now
                    logger.error("history: %s", exc)
                _rewind(consumer, batch)
                self.recorder.refresh()
                self._stop.wait(BEHIND_WAIT_S)
                return
            except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
                if attempt == len(BACKOFF_S) or self._stop.is_set():
                    _rewind(consumer, batch)
                    raise
                self.totals.retries += 1
                logger.warning("history: batch not recorded (%s); retrying", exc)
                self.recorder.refresh()
                time.sleep(BACKOFF_S[attempt])  # backoff before the retry
        if batch:
            consumer.commit(batch)
            self.totals.consumed += len(batch)
        self._complete(consumer)
        if time.monotonic() - self._pruned_at > PRUNE_EVERY_S:
            self._pruned_at = time.monotonic()
            prune(self.engine)
            self.report()

    def report(self) -> None:
        """Set the gauges: completeness lag, broken tables, sizes (every
        ``PRUNE_EVERY_S``, and once history completes further)."""
        metrics = history_metrics()
        with self.engine.connect() as conn:
            found = list(registered(conn).values())
        lags = [lag for r in found if (lag := lag_s(r)) is not None]
        if lags:
            metrics.complete_lag.set(max(lags))
        on_disk = sizes(self.engine) if found else {}
        for r in found:
            name = f"{r.schema}.{r.table}"
            metrics.broken.labels(name).set(0 if r.broken_from_us is None else 1)
            metrics.bytes.labels(name).set(on_disk.get(r.history, (0, 0))[0])

    def _check_gaps(self, inner: Any, partitions: list[TopicPartition]) -> None:
        """A partition whose committed offset is below its first record lost records to
        the topic's retention before history read them: its table's history has a gap,
        and is marked broken (loudly) from now."""
        cdc = [tp for tp in partitions if not (tp.topic or "").startswith("__debezium")]
        if not cdc:
            return
        for tp in inner.committed(cdc, timeout=10):
            if tp.offset < 0:
                continue  # never read: it starts at the first record the topic holds
            low, _ = inner.get_watermark_offsets(tp, timeout=10, cached=False)
            if tp.offset >= low:
                continue
            table = (tp.topic or "").rsplit(".", 1)[-1]
            reason = (
                f"records {tp.offset}..{low - 1} of {tp.topic}[{tp.partition}] were deleted "
                "by the topic's retention before history read them"
            )
            with self.engine.begin() as conn:
                marked = conn.execute(
                    sa.text(
                        f"UPDATE {SCHEMA}.history_tables SET broken_from = now(), "
                        "broken_reason = :why WHERE source_schema = 'public' "
                        "AND source_table = :table AND broken_from IS NULL"
                    ),
                    {"why": reason, "table": table},
                ).rowcount
            if marked:
                logger.error("history of public.%s is BROKEN: %s", table, reason)

    def _record(self, batch: Sequence[Message]) -> Outcome:
        changes = []
        for msg in batch:
            topic = msg.topic() or ""
            if topic.startswith("__debezium-heartbeat."):
                self._heartbeat(msg.value())
                continue
            try:
                change = parse(msg.value())
            except MalformedChange as exc:
                self.totals.malformed += 1
                history_metrics().malformed.inc()
                logger.error(
                    "history: %s[%s]@%s skipped: %s", topic, msg.partition(), msg.offset(), exc
                )
                continue
            if change is not None:
                changes.append(change)
        outcome = self.recorder.record(changes)
        self.totals.versions += outcome.versions
        self.totals.duplicates += outcome.duplicates
        self.totals.skipped_s0 += outcome.skipped_s0
        metrics = history_metrics()
        for table, (made, repeated, before) in outcome.tables.items():
            metrics.versions.labels(table).inc(made)
            metrics.duplicates.labels(table).inc(repeated)
            metrics.skipped_s0.labels(table).inc(before)
        return outcome

    def _heartbeat(self, value: bytes | None) -> None:
        try:
            ts = orjson.loads(value or b"{}").get("ts_ms")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(ts, int) and not isinstance(ts, bool):
            self._heartbeat_ms = max(ts, self._heartbeat_ms or 0)

    def _complete(self, consumer: Consumer) -> None:
        """After a heartbeat, once every assigned partition is read to its end, history
        is complete to the heartbeat's time."""
        if self._heartbeat_ms is None:
            return
        inner = consumer.inner
        assigned = inner.assignment()
        if not assigned:
            return
        positions = inner.position(assigned)
        # A partition this process has read nothing of since it was assigned has no
        # position (a quiet table's topic, or any after a restart): it resumes at its
        # committed offset, else at its start (the recorder reads from the earliest).
        unread = [tp for tp in positions if tp.offset < 0]
        committed = {
            (tp.topic, tp.partition): tp.offset
            for tp in (inner.committed(unread, timeout=5) if unread else [])
        }
        for tp in positions:
            low, high = inner.get_watermark_offsets(tp, timeout=5, cached=False)
            offset = tp.offset if tp.offset >= 0 else committed.get((tp.topic, tp.partition), -1)
            if (offset if offset >= 0 else low) < high:
                return
        at = from_epoch_us(self._heartbeat_ms * 1000)
        self._heartbeat_ms = None
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"UPDATE {SCHEMA}.history_tables SET complete_to = :at "
                    "WHERE s0_at IS NOT NULL AND (complete_to IS NULL OR complete_to < :at)"
                ),
                {"at": at},
            )
        history_metrics().complete_lag.set(
            max(0.0, time.time() - at.timestamp())  # just completed: the heartbeat's age
        )


def _rewind(consumer: Consumer, batch: Sequence[Message]) -> None:
    first: dict[tuple[str, int], int] = {}
    for msg in batch:
        key = (msg.topic() or "", msg.partition() or 0)
        first[key] = min(first.get(key, msg.offset() or 0), msg.offset() or 0)
    for (topic, partition), offset in first.items():
        consumer.inner.seek(TopicPartition(topic, partition, offset))


def prune(engine: Engine) -> int:
    """Delete what is past retention: versions ended longer ago than their table's
    retention, and snapshots older than the longest one (none while some table keeps
    its history for ever). Returns how many versions went."""
    gone = 0
    with engine.begin() as conn:
        tables = list(registered(conn).values())
        for found in tables:
            if found.retention_s is None:
                continue
            gone += conn.execute(
                sa.text(
                    f"DELETE FROM {qualified(found.history)} WHERE _fl_to IS NOT NULL "
                    "AND _fl_to < now() - make_interval(secs => :keep)"
                ),
                {"keep": found.retention_s},
            ).rowcount
        kept = [t.retention_s for t in tables]
        if kept and all(k is not None for k in kept):
            prune_snapshots(conn, max(k for k in kept if k is not None))
    return gone
