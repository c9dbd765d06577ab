"""The consumer run loop: a loop, a batch, a commit.

Each iteration (:meth:`Worker._iteration`):

1. consume up to ``batch_max_events`` records: those fetched already, or the first to
   come within ``batch_max_wait_ms`` and those fetched with it (a batch never waits to
   fill);
2. decode them; a record that cannot become an event goes to the dead-letter topic
   with its reason, and so does an event whose own data fails to apply;
3. apply the events as one batch (:class:`freshline.consumers.processor.Processor`): Redis
   writes, then invalidations on the Redis channel and handed to the producer; it ends
   with the waits that make the writes last (WAL flushed, Redis replicas' ``WAIT``);
4. flush the producer (dead letters and invalidations acknowledged by the broker);
5. commit the offsets after the batch, for partitions still assigned.

A crash anywhere before step 5 replays the batch; conditional writes make that
harmless. A failure that is not about one event's data (:mod:`freshline.consumers.failures`)
pauses the partitions and retries the batch with backoff; an ACL that refuses the
consumer ends the run with one line naming it (:mod:`freshline.consumers.access`). A
thread beside the loop folds the incremental path's pending changes.

Why, and the rest of the loop's rules (pauses, rebalances, forged transaction ids,
refused deliveries): docs/events.md, "The consumers: how events are applied".
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import sqlalchemy as sa
from confluent_kafka import KafkaError, Message, TopicPartition

from freshline.consumers.access import check_kafka, kafka_refusal, publish_refused, write_refusal
from freshline.consumers.dlq import DeadLetters, Record
from freshline.consumers.events import EventRejected, decode
from freshline.consumers.failures import (
    CONFIGURATION,
    DATA_ERRORS,
    FATAL,
    RETRIED,
    TRANSIENT,
    cause,
    remedy,
    service,
)
from freshline.consumers.kafka import (
    CommitNotYet,
    Consumer,
    Delivery,
    DeliveryFailed,
    NotAuthorized,
    Producer,
    check_message,
)
from freshline.consumers.metrics import consumer_metrics
from freshline.consumers.processor import BatchReport, Processor, PublishRefused, impossible_txids
from freshline.consumers.routing import Router
from freshline.consumers.topics import subscription
from freshline.pipeline.cache.invalidation import Invalidation
from freshline.pipeline.cache.recompute import NotYetVisible
from freshline.pipeline.cache.roster import Proc, Registration
from freshline.pipeline.cache.store import check_eviction_policy
from freshline.pipeline.cache.versions import WriteVersions
from freshline.pipeline.core.db import make_engine, own_pool
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.lock import Lock
from freshline.pipeline.core.repository import Repository, active
from freshline.pipeline.core.services import consumer_redis_client
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import DLQ, INVALIDATIONS, logical, qualified
from freshline.pipeline.core.types import ChangeEvent
from freshline.pipeline.history.snapshots import keeper

logger = logging.getLogger("freshline.consumer")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0
CLOSE_TIMEOUT_S = 10.0
"""How long closing the producer (its flush) and the consumer may each take."""
LAG_EVERY_S = 5.0
"""How often an idle consumer reports its lag and counts the topics it subscribes to."""
LAG_TIMEOUT_S = 2.0
UNMATCHED_LOG_EVERY_S = 300.0
WATCH_EVERY_S = 1.0
"""How often an idle consumer reads the Redis server's identity (a batch always does)."""
FOLD_USERS = 500
"""Users whose pending bucket deltas one fold takes (a few milliseconds each)."""
CHECK_TXIDS_AFTER = 5
"""Failures of a batch for changes not yet visible (0.75 s of backoff) from which on
its invisible transaction ids are checked against the database's next one. The usual
wait, for a commit to become visible, lasts milliseconds."""


E = TypeVar("E", bound=BaseException)


def retry(
    attempt: Callable[[], object],
    retried: type[E] | tuple[type[E], ...],
    failed: Callable[[E, float], bool],
    *,
    pause: Callable[[float], None],
    stop: threading.Event,
) -> None:
    """Call ``attempt()`` until it returns: the consumer's one backoff loop.

    A failure of a ``retried`` kind is raised again once a stop is requested; else
    ``failed(exc, delay)`` counts and logs it and says whether to ``pause(delay)``
    before the next attempt (False: try again at once). The delay doubles from
    :data:`FIRST_BACKOFF_S` to :data:`MAX_BACKOFF_S`. Any other failure is raised.
    """
    delay = FIRST_BACKOFF_S
    while True:
        try:
            attempt()
            return
        except retried as exc:
            if stop.is_set():
                raise
            if failed(exc, delay):
                pause(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)


@dataclass(slots=True)
class Totals:
    """The accounting identity: ``applied + dead_lettered + skipped == consumed``."""

    consumed: int = 0
    applied: int = 0
    dead_lettered: int = 0
    skipped: int = 0
    batches: int = 0
    retries: int = 0


HELD: tuple[type[BaseException], ...] = (*RETRIED, DeliveryFailed, CommitNotYet)
"""What the loop holds a batch for; a stop asked for meanwhile ends the run cleanly."""


def matching(subscription: Sequence[str], topics: Iterable[str]) -> set[str]:
    """The ``topics`` a subscription of names and ``^regex`` patterns matches, as
    librdkafka matches them (a pattern by a regex search; never ``__`` internal ones)."""
    patterns = [re.compile(s) for s in subscription if s.startswith("^")]
    names = set(subscription)
    return {
        t
        for t in topics
        if t in names or (not t.startswith("__") and any(p.search(t) for p in patterns))
    }


def check_durability_settings(settings: Settings) -> None:
    """Refuse a ``WAIT`` the consumer cannot do: on Redis Cluster (a batch's writes
    span masters, each with its own replication stream), or one that outlasts the
    socket timeout (the wait would be cut as a lost connection)."""
    if settings.redis_wait_replicas and settings.redis_cluster:
        raise ConfigError(
            "FRESHLINE_REDIS_WAIT_REPLICAS is not supported on Redis Cluster; set it to 0"
        )
    if (
        settings.redis_wait_replicas
        and settings.redis_wait_timeout_ms >= settings.consumer_redis_timeout_s * 1000
    ):
        raise ConfigError(
            f"FRESHLINE_REDIS_WAIT_TIMEOUT_MS ({settings.redis_wait_timeout_ms}) must be "
            f"below FRESHLINE_CONSUMER_REDIS_TIMEOUT_S ({settings.consumer_redis_timeout_s}s)"
        )


class Worker:
    """One member of the consumer group, for one feature repository.

    ``repository``: whose feature sets, tables and events it serves (``FeatureStore``
    passes its own; without one, the active repository, ``FRESHLINE_REPO``, as the
    command line finds it); ``topics``: what it reads (default: the repository's domain
    events and every CDC topic, :func:`freshline.consumers.topics.subscription`).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        repository: Repository | None = None,
        topics: Sequence[str] | None = None,
        group: str | None = None,
        versions: Callable[[], Sequence[int]] | None = None,
        client_overrides: dict[str, object] | None = None,
    ) -> None:
        check_durability_settings(settings)
        self.settings = settings
        self.repository = repository = repository or active()
        self.topics = list(topics or subscription(settings, repository))
        overrides = dict(client_overrides or {})
        if group:
            overrides["group.id"] = group
        self.consumer = Consumer(settings, **overrides)
        self.producer = Producer(settings)
        self.dead_letters = DeadLetters(
            self.producer, qualified(settings, DLQ), max_bytes=settings.max_message_bytes
        )
        self.invalidations_topic = qualified(settings, INVALIDATIONS)
        self.engine = make_engine(settings)
        self.snapshots_engine = own_pool(self.engine) if repository.history.enabled else None
        """Where history's snapshot of each computation is kept (None with history off)."""
        self.redis = consumer_redis_client(settings)
        self._policy_checked = False
        self.metrics = consumer_metrics()
        writes = versions or WriteVersions(
            self.redis, settings, lock=Lock.load(repository.lock_path), registry=repository.registry
        )
        self.processor = Processor(
            self.engine,
            self.redis,
            versions=writes,
            registry=repository.registry.with_paths(settings.recompute_paths),
            tombstone_ttl_s=settings.tombstone_ttl_s,
            publish=self._publish,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
            durable_wait_ms=settings.postgres_durable_wait_ms,
            on_failover=lambda *_: self.metrics.redis_failovers.inc(),
            # On a pool of its own: the batch holds a connection of self.engine then.
            on_computed=keeper(self.snapshots_engine) if self.snapshots_engine else None,
        )
        self.router = Router(repository.registry)
        self.totals = Totals()
        self._watch_due = 0.0
        self._stop = threading.Event()
        self.closed_cleanly = True
        self._revoked: set[tuple[str, int]] = set()
        self._lag_due = 0.0
        self._done: dict[tuple[str, int], int] = {}  # committed offsets, for the lag
        self._topics_due = 0.0
        self._unmatched_since: float | None = None
        self._unmatched_logged = 0.0
        self._folding = threading.Event()
        self._folder = threading.Thread(target=self._fold_deltas, name="bucket-fold", daemon=True)
        # Who runs what (freshline.pipeline.cache.roster): the versions it writes, for deploy flip.
        self.registration: Registration | None = None
        self.paused: str | None = None
        """What holds the batch (a configuration failure's cause and remedy), or None."""
        if isinstance(writes, WriteVersions):
            proc = Proc.of(
                "consume",
                writes.lock,
                writes.registry,
                group=self.consumer.group_id,
                pointer=writes.pointer,
            )
            self.registration = Registration(
                self.redis, proc, pointer=writes.pointer, paused=lambda: self.paused
            )

    # -- lifecycle -------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to stop after the batch in hand (signal-safe)."""
        self._stop.set()

    def run(
        self,
        *,
        max_messages: int | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> Totals:
        """Consume until stopped, ``max_messages`` consumed, ``timeout`` seconds passed,
        or nothing arrived for ``idle_timeout`` seconds. Then close cleanly."""
        deadline = None if timeout is None else time.monotonic() + timeout
        idle_since = time.monotonic()
        try:
            if self.registration is not None:
                self.registration.start()
            self._check_policy(at_start=True)
            check_kafka(self.settings, self.consumer.group_id, self._writes())
            self.consumer.subscribe(
                self.topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_revoke,
            )
            if self.settings.bucket_fold_interval_ms:
                self._folder.start()
            while not self._stop.is_set():
                if self._iteration():
                    idle_since = time.monotonic()
                elif idle_timeout is not None and time.monotonic() - idle_since > idle_timeout:
                    break
                if max_messages is not None and self.totals.consumed >= max_messages:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    break
        except NotAuthorized as exc:
            refused = kafka_refusal(
                self.settings, self.consumer.group_id, exc.error, exc.topic, writing=False
            )
            raise (refused or exc) from exc
        except PublishRefused as exc:
            raise publish_refused(self.settings, exc) from exc
        except HELD as exc:
            if not self._stop.is_set():
                raise
            # A stop asked for while a batch was held: its records stay uncommitted and
            # are read again at the next start (by this group's next member).
            logger.info("stopped with a batch held uncommitted (%s)", exc)
        finally:
            self.close()
        return self.totals

    def _exists(self, topic: str) -> bool:
        """Whether ``topic`` is on the broker (True if it cannot tell)."""
        try:
            found = self.consumer.inner.list_topics(topic, timeout=LAG_TIMEOUT_S).topics.get(topic)
        except Exception:  # only to word the message; the refusal stands either way
            return True
        if found is None:
            return False
        return found.error is None or found.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART

    def _writes(self) -> list[str]:
        """The topics this member writes: the invalidations and the dead letters."""
        return [self.invalidations_topic, self.dead_letters.topic]

    def close(self) -> None:
        """Flush the producer and leave the group, each within a bound.

        ``closed_cleanly`` is False when the Kafka consumer had to be abandoned (see
        :meth:`freshline.consumers.kafka.Consumer.close`); the process should then exit with
        ``os._exit``, since the interpreter's own teardown would wait on it again.
        """
        self._folding.set()
        if self.registration is not None:
            self.registration.close()
        if self._folder.is_alive():
            self._folder.join(CLOSE_TIMEOUT_S)
        try:
            self.producer.close(timeout=CLOSE_TIMEOUT_S)
        finally:
            self.closed_cleanly = self.consumer.close(timeout=CLOSE_TIMEOUT_S)
            self.redis.close()
            self.engine.dispose()
            if self.snapshots_engine is not None:
                self.snapshots_engine.dispose()

    # -- one batch -------------------------------------------------------------

    def _iteration(self) -> int:
        messages = self.consumer.consume(
            self.settings.batch_max_events, timeout=self.settings.batch_max_wait_ms / 1000
        )
        if not messages:
            self._report_lag()
            self._watch_subscription()
            self._watch_redis()
            return 0
        self._revoked.clear()
        events: list[tuple[Message, ChangeEvent]] = []
        for msg in messages:
            topic = msg.topic() or ""
            self.metrics.consumed.labels(topic).inc()
            try:
                event = decode(
                    logical(self.settings, topic),
                    msg.key(),
                    msg.value(),
                    max_bytes=self.settings.max_message_bytes,
                    repository=self.repository,
                )
            except EventRejected as exc:
                self._dead_letter(msg, exc)
                continue
            if event is None or not self.router.is_known(event.table):
                self.totals.skipped += 1
                self.metrics.skipped.labels(topic).inc()
                continue
            events.append((msg, event))
        if events:
            self._apply_with_retry(events)
        self._flush_with_retry()
        self._commit(messages)
        self.totals.consumed += len(messages)
        self.totals.batches += 1
        self.metrics.batch_size.observe(len(messages))
        self._report_lag()
        return len(messages)

    def _apply_with_retry(self, events: list[tuple[Message, ChangeEvent]]) -> None:
        """Apply the batch, holding it (uncommitted) while a failure that is not about
        its data lasts; both kinds are retried with the same backoff.

        A transient failure is logged at each retry. A configuration failure is logged
        once, naming the fix (again only if it changes), and shown by
        ``freshline_consumer_paused{cause}`` until the batch goes through.
        """
        held: tuple[str, str] | None = None  # the configuration failure's cause and remedy
        unseen = 0  # retries for changes not yet visible
        since = time.monotonic()

        def apply() -> None:
            if events:  # empty once every event was dead-lettered
                self._apply(events)

        def failed(exc: BaseException, delay: float) -> bool:
            nonlocal held, unseen
            if isinstance(exc, CONFIGURATION):  # first: Redis's AuthenticationError is both
                failure = (cause(exc), remedy(exc, role=self.engine.url.username))
                if failure != held:
                    if held is not None:
                        self.metrics.paused.labels(held[0]).set(0)
                    self.metrics.paused.labels(failure[0]).set(1)
                    logger.error(
                        "consumer paused by a configuration error (%s): %s. Not the "
                        "events' fault, so none is dead-lettered: the batch is held "
                        "uncommitted and retried, at most %.0fs apart, until it is fixed",
                        *failure,
                        MAX_BACKOFF_S,
                    )
                    held = failure
                    self.paused = f"{failure[0]}: {failure[1]}"  # the status page's problem
                self.totals.retries += 1
                self.metrics.config_retries.labels(failure[0]).inc()
                return True
            if isinstance(exc, NotYetVisible):
                unseen += 1
                if unseen >= CHECK_TXIDS_AFTER and self._drop_impossible(events, exc):
                    return False  # the rest of the batch, at once
            label = service(exc)
            self.totals.retries += 1
            self.metrics.retries.labels(label).inc()
            logger.warning("%s: %s; retrying the batch in %.2fs", label, exc, delay)
            return True

        try:
            retry(apply, RETRIED, failed, pause=self._pause_for, stop=self._stop)
        finally:
            if held is not None:
                self.metrics.paused.labels(held[0]).set(0)
                self.paused = None
        if held is not None:
            logger.info(
                "consumer resumed: the configuration error (%s) is fixed; the batch held "
                "for %.1fs is applied",
                held[0],
                time.monotonic() - since,
            )

    def _drop_impossible(
        self, events: list[tuple[Message, ChangeEvent]], exc: NotYetVisible
    ) -> bool:
        """Dead-letter (and remove from ``events``) the events whose transaction the
        database cannot have had; True if there were any.

        A failure to check is not the events' fault: nothing is dropped, and the next
        retry checks again.
        """
        try:
            next_xid, impossible = impossible_txids(self.engine, exc.txids)
        except RETRIED as failed:
            logger.warning("could not check transaction ids %s: %s", exc.txids, failed)
            return False
        if not impossible:
            return False
        kept: list[tuple[Message, ChangeEvent]] = []
        for msg, event in events:
            if event.txid not in impossible:
                kept.append((msg, event))
                continue
            reason = (
                f"source.txId {event.txid} is at or past the database's next transaction "
                f"id ({next_xid}): no transaction of this database has committed it"
            )
            self._dead_letter(msg, EventRejected(reason, kind="impossible_txid"))
        logger.error(
            "dead-lettered %d event(s) naming transaction ids this database cannot have "
            "had (%s; its next id is %d); the rest of the batch goes on",
            len(events) - len(kept),
            ", ".join(map(str, sorted(impossible))),
            next_xid,
        )
        events[:] = kept
        return True

    def _flush_with_retry(self) -> None:
        """Flush dead letters and invalidations; send refused ones again until they land.

        Never skips a record and never ends the loop: the offsets are committed only
        after every dead letter of the batch is acknowledged.
        """
        refused: list[Delivery] = []

        def flush() -> None:
            self.producer.resend(refused)  # those refused last time, after the wait
            refused.clear()
            self.producer.flush()

        def failed(exc: DeliveryFailed, delay: float) -> bool:
            if exc.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                raise write_refusal(self.settings, exc.topic, self._exists(exc.topic)) from exc
            self.totals.retries += 1
            self.metrics.delivery_failures.labels(exc.topic).inc()
            logger.error(
                "the broker refused %d message(s) to %s (%s); sending them again in %.2fs",
                len(exc.failed),
                exc.topic,
                exc.error.name(),
                delay,
            )
            refused.extend(exc.failed)
            return True

        retry(flush, DeliveryFailed, failed, pause=self._pause_for, stop=self._stop)

    def _pause_for(self, seconds: float) -> None:
        """Wait without leaving the group: pause the partitions and keep polling.

        Polling serves rebalances. A partition assigned during the wait is paused as
        soon as it is seen, and a record that a poll returns anyway (from a partition
        not yet paused) is not dropped: its partition is rewound to it and paused, so
        the record is consumed again after the wait.

        Every partition paused here is resumed at the end, also one revoked meanwhile:
        librdkafka keeps a partition's pause across a revoke and a later assignment,
        so one left paused would never be read again when it came back.
        """
        inner = self.consumer.inner
        paused: dict[tuple[str, int], TopicPartition] = {}

        def pause(partitions: list[TopicPartition]) -> None:
            inner.pause(partitions)
            paused.update(
                ((tp.topic, tp.partition), TopicPartition(tp.topic, tp.partition))
                for tp in partitions
            )

        try:
            if assigned := self.consumer.assignment():
                pause(assigned)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not self._stop.is_set():
                msg = check_message(inner.poll(min(0.1, max(0.0, deadline - time.monotonic()))))
                if msg is not None:
                    rewind = TopicPartition(
                        cast(str, msg.topic()), cast(int, msg.partition()), cast(int, msg.offset())
                    )
                    inner.seek(rewind)
                    pause([rewind])
                fresh = [
                    tp
                    for tp in self.consumer.assignment()
                    if (tp.topic, tp.partition) not in paused
                ]
                if fresh:
                    pause(fresh)
        finally:
            resume = {(tp.topic, tp.partition): tp for tp in self.consumer.assignment()}
            resume.update(paused)
            if resume:
                inner.resume(list(resume.values()))

    def _check_policy(self, *, at_start: bool) -> None:
        """Refuse an evicting Redis: at start-up, or before the first write if Redis was
        down at start-up (the check then fails like any write and is retried)."""
        if self._policy_checked:
            return
        try:
            check_eviction_policy(self.redis)
        except TRANSIENT:
            if not at_start:
                raise
            logger.warning(
                "Redis not reachable at start-up; its eviction policy is "
                "checked before the first write"
            )
            return
        self._policy_checked = True

    def _apply(self, events: list[tuple[Message, ChangeEvent]]) -> None:
        """Apply the batch; if it fails on bad data, find the culprits one by one.

        A transient or configuration failure, of the batch or of any one event, is
        raised before any event is counted or dead-lettered: the caller retries the
        whole batch, and the conditional writes make applying an event twice harmless.
        """
        self._check_policy(at_start=False)
        try:
            report = self.processor.apply([e for _, e in events])
        except FATAL + RETRIED:
            raise
        except DATA_ERRORS as exc:
            logger.info("batch failed (%s); applying its events one by one", exc)
            outcomes: list[BatchReport | BaseException] = []
            for _, event in events:
                try:
                    outcomes.append(self.processor.apply([event]))
                except FATAL + RETRIED:
                    raise
                except DATA_ERRORS as one:
                    outcomes.append(one)
            for (msg, event), outcome in zip(events, outcomes, strict=True):
                if isinstance(outcome, BatchReport):
                    self._applied(msg, event, outcome.written_at_ms)
                else:
                    self._dead_letter(msg, outcome)
            return
        for msg, event in events:
            self._applied(msg, event, report.written_at_ms)
        for name, ms in report.recompute_ms.items():
            self.metrics.recompute_seconds.labels(name).observe(ms / 1000)
        self.metrics.redis_write_seconds.observe(report.write_ms / 1000)

    def _applied(self, msg: Message, event: ChangeEvent, written_at_ms: int) -> None:
        self.totals.applied += 1
        self.metrics.applied.labels(msg.topic() or "").inc()
        if event.committed_at_ms:
            lag = max(0, written_at_ms - event.committed_at_ms) / 1000
            self.metrics.freshness_seconds.observe(lag)

    def _dead_letter(self, msg: Message, error: BaseException) -> None:
        self.dead_letters.send(cast(Record, msg), error)
        self.totals.dead_lettered += 1
        kind = error.kind if isinstance(error, EventRejected) else type(error).__name__
        self.metrics.dead_lettered.labels(msg.topic() or "", kind).inc()

    def _publish(self, message: Invalidation) -> None:
        self.producer.produce(self.invalidations_topic, message.encode(), message.kafka_key)

    def _commit(self, messages: list[Message]) -> None:
        """Commit the batch; while the coordinator is away (a broker restarting), wait and
        commit the same offsets again, polling to stay in the group."""

        def commit() -> None:
            keep = [m for m in messages if (m.topic(), m.partition()) not in self._revoked]
            if keep:
                for tp in self.consumer.commit(keep):
                    self._done[tp.topic, tp.partition] = tp.offset

        def failed(exc: CommitNotYet, delay: float) -> bool:
            self.totals.retries += 1
            self.metrics.retries.labels("kafka").inc()
            logger.warning("%s; committing again in %.2fs", exc, delay)
            return True

        retry(commit, CommitNotYet, failed, pause=self._pause_for, stop=self._stop)

    # -- rebalances and lag ----------------------------------------------------

    def _on_assign(self, _consumer: object, partitions: list[TopicPartition]) -> None:
        logger.info("assigned %s", ", ".join(f"{p.topic}[{p.partition}]" for p in partitions))

    def _on_revoke(self, _consumer: object, partitions: list[TopicPartition]) -> None:
        self._revoked.update((p.topic, p.partition) for p in partitions)
        group = self.consumer.group_id
        for p in partitions:  # its new owner commits, and reports the lag, from now on
            self._done.pop((p.topic, p.partition), None)
            # 0 first: with PROMETHEUS_MULTIPROC_DIR a removed value stays in the file
            self.metrics.consumer_lag.labels(group, p.topic, str(p.partition)).set(0)
            self.metrics.consumer_lag.remove(group, p.topic, str(p.partition))
        logger.info("revoked %s", ", ".join(f"{p.topic}[{p.partition}]" for p in partitions))

    def _watch_redis(self) -> None:
        """While idle, look for a change of the Redis server (a batch looks in its
        announce); a failure is left for the next batch, which retries it."""
        now = time.monotonic()
        if now < self._watch_due:
            return
        self._watch_due = now + WATCH_EVERY_S
        try:
            self.processor.watch()
        except RETRIED as exc:
            logger.warning("could not read the Redis server's identity: %s", exc)

    def _report_lag(self) -> None:
        """``freshline_consumer_lag``: per assigned partition, the end (high watermark)
        less the group's committed offset, which is what a restart would read again.

        The committed offsets are those this member committed, and for a partition it
        has committed nothing to yet, the group's, asked once after it is assigned.
        """
        now = time.monotonic()
        if now < self._lag_due:
            return
        self._lag_due = now + LAG_EVERY_S
        try:
            assignment = self.consumer.assignment()
            if not assignment:
                return
            inner = self.consumer.inner
            unknown = [tp for tp in assignment if (tp.topic, tp.partition) not in self._done]
            if unknown:
                for tp in inner.committed(unknown, timeout=LAG_TIMEOUT_S):
                    self._done.setdefault((tp.topic, tp.partition), tp.offset)
            group = self.consumer.group_id
            for tp in assignment:
                # Cached: the watermarks of the last fetch. Asking the broker would
                # queue behind the long-polling fetch and stall the loop for seconds.
                low, high = inner.get_watermark_offsets(tp, cached=True)
                done = self._done.get((tp.topic, tp.partition), -1)
                if done < 0:  # nothing committed: the group starts at the reset offset
                    done = low if self.settings.auto_offset_reset == "earliest" else high
                if high < 0 or done < 0:
                    continue
                self.metrics.consumer_lag.labels(group, tp.topic, str(tp.partition)).set(
                    max(0, high - done)
                )
        except Exception as exc:  # lag is advisory; never let it stop the loop
            logger.debug("consumer lag not available: %s", exc)

    def _watch_subscription(self) -> None:
        """While idle, count the topics the subscription matches: none is logged (again
        every :data:`UNMATCHED_LOG_EVERY_S`) and shown by
        ``freshline_consumer_subscribed_topics``, until one appears."""
        now = time.monotonic()
        if now < self._topics_due:
            return
        self._topics_due = now + LAG_EVERY_S
        try:
            names = self.consumer.inner.list_topics(timeout=LAG_TIMEOUT_S).topics
        except Exception as exc:  # advisory, as the lag is
            logger.debug("topics not listed: %s", exc)
            return
        matched = matching(self.topics, names)
        group = self.consumer.group_id
        if matched:
            if self._unmatched_since is not None:
                logger.info("the subscription now matches %s", ", ".join(sorted(matched)))
            self._unmatched_since = None
        elif self._unmatched_since is None or now - self._unmatched_logged > UNMATCHED_LOG_EVERY_S:
            self._unmatched_since = self._unmatched_since or now
            self._unmatched_logged = now
            logger.warning(
                "the subscription (%s) matches no topic: group %s reads nothing. Check "
                "FRESHLINE_TOPIC_PREFIX (%r), create the domain-event topics (freshline "
                "topics ensure) and register the connector (freshline cdc register)",
                ", ".join(self.topics),
                group,
                self.settings.topic_prefix,
            )
        self.metrics.subscribed_topics.labels(group).set(len(matched))  # after the log

    # -- bucket upkeep ---------------------------------------------------------

    def _fold_deltas(self) -> None:
        """The fold thread: fold at once, then every interval until the worker closes;
        while a fold takes a full ``FOLD_USERS``, the next follows without a pause. A
        fold leaves the current day (:meth:`IncrementalPath.fold_settled`) but once every
        ``bucket_fold_all_interval_ms``.

        Upkeep, like the lag: the values the incremental path returns are exact either
        way (it reads what is not folded yet from the source rows), so a failure is
        logged and tried again at the next interval. A role without EXECUTE on the fold
        stops trying.
        """
        interval = self.settings.bucket_fold_interval_ms / 1000
        every = self.settings.bucket_fold_all_interval_ms / 1000
        whole_at = time.monotonic() + every  # the first folds leave the current day
        while True:
            try:
                whole = time.monotonic() >= whole_at
                for path in self.repository.registry.maintenances():
                    fold = path.fold if whole else path.fold_settled
                    while (fold(self.engine, max_keys=FOLD_USERS, wait=False) or 0) >= FOLD_USERS:
                        if self._folding.is_set():
                            return
                if whole:
                    whole_at = time.monotonic() + every
            except sa.exc.ProgrammingError as exc:
                logger.error(
                    "cannot fold the incremental path's pending changes (%s); grant "
                    "this role what the repository's path needs (a derived path: "
                    "EXECUTE on its freshline.agg_..._fold function, which apply "
                    "grants), or run freshline buckets fold --follow",
                    exc.orig,
                )
                return
            except sa.exc.SQLAlchemyError as exc:
                logger.warning(
                    "pending changes not folded: %s; trying again in %.1fs", exc, interval
                )
            if self._folding.wait(interval):
                return
