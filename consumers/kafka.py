"""Thin wrappers over confluent-kafka: config from Settings, one error check, clean close.

Modelled on Quix Streams' ``kafka/consumer.py``: clients are created lazily, every
message's ``.error()`` is checked by one helper (:func:`check_message`), and the
wrappers are context managers so ``close()`` always runs. No framework on top: the
run loop polls, decodes, writes, then commits explicit offsets (auto-commit and
auto offset store are off).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, Self

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from freshline.pipeline.core.errors import FreshlineError, ServiceUnavailable
from freshline.pipeline.core.services import kafka_security_config
from freshline.pipeline.core.settings import Settings

logger = logging.getLogger("freshline.kafka")

Role = Literal["consumer", "producer", "admin"]
Headers = list[tuple[str, str | bytes | None]]
RebalanceCallback = Callable[[Any, list[TopicPartition]], None]

PING_TIMEOUT_S = 3.0
OWED_RETRY_S = 0.5
"""How often a member tries again to commit offsets a rebalance refused."""


class BrokerError(FreshlineError):
    """Kafka reported an error the caller cannot skip past."""

    def __init__(self, error: KafkaError, context: str = "") -> None:
        self.error = error
        self.code: int = error.code()
        self.fatal: bool = bool(error.fatal())
        where = f" ({context})" if context else ""
        super().__init__(f"Kafka error{where}: {error.name()}: {error.str()}")


class MissingTopic(BrokerError):
    """A subscribed topic does not exist; consumers never rely on auto-creation."""

    def __init__(self, error: KafkaError, topic: str | None) -> None:
        super().__init__(error, f"topic {topic!r}")
        self.topic = topic
        self.args = (f"{self.args[0]}; create the topics with: freshline topics ensure",)


class NotAuthorized(BrokerError):
    """The broker's ACLs refuse the login the group or a topic; waiting cannot help
    (:mod:`freshline.consumers.access` says which ACL or setting)."""

    def __init__(self, error: KafkaError, topic: str | None) -> None:
        super().__init__(error, f"topic {topic!r}" if topic else "")
        self.topic = topic


NOT_AUTHORIZED = frozenset(
    {KafkaError.GROUP_AUTHORIZATION_FAILED, KafkaError.TOPIC_AUTHORIZATION_FAILED}
)


class DeliveryFailed(FreshlineError):
    """A produced message was not acknowledged by the broker.

    ``failed`` holds every delivery of the flush that the broker refused, so a caller
    can send them again (:meth:`Producer.resend`) instead of losing them.
    """

    def __init__(self, topic: str, error: KafkaError, failed: Sequence[Delivery] = ()) -> None:
        self.topic = topic
        self.error = error
        self.failed = list(failed)
        super().__init__(f"delivery to {topic!r} failed: {error.name()}: {error.str()}")


REBALANCE_COMMIT_ERRORS = frozenset(
    {
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError._ASSIGNMENT_LOST,
        KafkaError._NO_OFFSET,
        KafkaError._STATE,
    }
)
"""Commit failures that a rebalance causes: the partitions' new owner replays from the
last committed offset, so they lose nothing and are logged, not raised."""


def client_config(
    settings: Settings, role: Role = "consumer", /, **overrides: Any
) -> dict[str, Any]:
    """The librdkafka configuration for one client, built from ``settings``.

    Consumers get ``group.id`` from settings, manual commits of explicitly stored
    offsets, ``auto.offset.reset`` from settings (a new group starts from the earliest
    offset by default, so nothing produced before it joined is lost) and the
    cooperative-sticky assignor. Producers are idempotent with ``acks=all``.
    ``overrides`` are librdkafka keys used verbatim: ``**{"group.id": "g"}``.
    """
    config: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "client.id": f"freshline-{role}",
        "logger": logger,
        **kafka_security_config(settings),
    }
    if role == "consumer":
        config.update(
            {
                "group.id": settings.consumer_group,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                # A dead member's partitions move on after 10 s, not the 45 s default.
                "session.timeout.ms": 10000,
                # Regex subscriptions (the CDC topics) notice a new topic at the next
                # metadata refresh: every 10 s rather than librdkafka's 5 minutes.
                "topic.metadata.refresh.interval.ms": 10000,
                "heartbeat.interval.ms": 2000,
                "auto.offset.reset": settings.auto_offset_reset,
                "partition.assignment.strategy": "cooperative-sticky",
                "fetch.max.bytes": max(settings.max_message_bytes * 2, 52_428_800),
            }
        )
    elif role == "producer":
        config.update(
            {
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "message.max.bytes": max(settings.max_message_bytes + 65_536, 1_000_000),
            }
        )
    config.update(overrides)
    return config


def admin_client(settings: Settings, **overrides: Any) -> AdminClient:
    """An AdminClient on the broker in ``settings``, after checking it answers."""
    admin = AdminClient(client_config(settings, "admin", **overrides))
    ping(admin, settings.kafka_bootstrap)
    return admin


def ping(admin: AdminClient, bootstrap: str, timeout_s: float = PING_TIMEOUT_S) -> None:
    """Raise :class:`ServiceUnavailable` unless a metadata request succeeds in time."""
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        detail = err.str() if isinstance(err, KafkaError) else str(exc)
        raise ServiceUnavailable("Kafka", bootstrap, detail) from exc


def check_message(msg: Message | None) -> Message | None:
    """Return ``msg`` if it carries a record, ``None`` if there is nothing to process.

    The one place every polled message's ``.error()`` is checked: partition EOF is not
    an error; a missing topic raises :class:`MissingTopic`; a fatal error raises
    :class:`BrokerError`; a refusal by the ACLs raises :class:`NotAuthorized`; other
    errors are ones librdkafka recovers from by itself,
    so they are logged and skipped.
    """
    if msg is None:
        return None
    err = msg.error()
    if err is None:
        return msg
    code = err.code()
    if code == KafkaError._PARTITION_EOF:
        return None
    if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
        if (msg.topic() or "").startswith("^"):
            # A pattern with no match yet (no CDC topics before Debezium runs).
            logger.debug("no topic matches %s yet", msg.topic())
            return None
        raise MissingTopic(err, msg.topic())
    if code in NOT_AUTHORIZED:
        raise NotAuthorized(err, msg.topic())
    if err.fatal():
        raise BrokerError(err, f"{msg.topic()}[{msg.partition()}]")
    logger.warning(
        "Kafka error on %s[%s], librdkafka recovers by itself: %s",
        msg.topic(),
        msg.partition(),
        err,
    )
    return None


def next_offsets(messages: Iterable[Message]) -> list[TopicPartition]:
    """The offsets to commit after processing ``messages``: per partition, highest + 1."""
    highest: dict[tuple[str, int], int] = {}
    for msg in messages:
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        if topic is None or partition is None or offset is None:
            continue
        if offset > highest.get((topic, partition), -1):
            highest[topic, partition] = offset
    return [TopicPartition(t, p, o + 1) for (t, p), o in sorted(highest.items())]


class Consumer:
    """A confluent-kafka consumer, created on first use and always closed.

    ::

        with Consumer(settings) as consumer:
            consumer.subscribe(topics, on_revoke=...)
            batch = consumer.consume(500, timeout=0.05)
            ...  # write Redis, publish invalidations
            consumer.commit(batch)
    """

    def __init__(self, settings: Settings, **overrides: Any) -> None:
        self._config = client_config(settings, "consumer", **overrides)
        self._config.setdefault("error_cb", self._on_error)
        self.bootstrap = settings.kafka_bootstrap
        self._inner: confluent_kafka.Consumer | None = None
        self._fatal: KafkaError | None = None
        # Offsets a rebalance refused to commit, for partitions this member may keep:
        # with the cooperative assignor it often does, and its position is already past
        # those records, so nothing would commit them unless they are sent again.
        self._owed: dict[tuple[str, int], int] = {}
        self._owed_due = 0.0

    @property
    def inner(self) -> confluent_kafka.Consumer:
        """The underlying client (created here on first access)."""
        if self._inner is None:
            self._inner = confluent_kafka.Consumer(self._config)
        return self._inner

    @property
    def group_id(self) -> str:
        return str(self._config["group.id"])

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal() or err.code() in NOT_AUTHORIZED:
            self._fatal = err
        else:
            logger.warning("Kafka consumer: %s", err)

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            if self._fatal.code() in NOT_AUTHORIZED:
                raise NotAuthorized(self._fatal, None)
            raise BrokerError(self._fatal, "consumer")

    def subscribe(
        self,
        topics: Sequence[str],
        *,
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
        on_lost: RebalanceCallback | None = None,
    ) -> None:
        """Subscribe to ``topics`` (names, or ``^regex`` patterns) with rebalance hooks."""

        def forget(then: RebalanceCallback | None) -> RebalanceCallback:
            def hook(consumer: Any, partitions: list[TopicPartition]) -> None:
                for tp in partitions:  # the new owner replays from the last commit
                    self._owed.pop((tp.topic, tp.partition), None)
                if then is not None:
                    then(consumer, partitions)

            return hook

        kwargs: dict[str, RebalanceCallback] = {
            "on_revoke": forget(on_revoke),
            "on_lost": forget(on_lost),
        }
        if on_assign is not None:
            kwargs["on_assign"] = on_assign
        self.inner.subscribe(list(topics), **kwargs)

    def poll(self, timeout: float) -> Message | None:
        """One record, or ``None`` when there is none within ``timeout`` seconds."""
        msg = check_message(self.inner.poll(timeout))
        self._raise_fatal()
        return msg

    def consume(self, max_messages: int, timeout: float) -> list[Message]:
        """Up to ``max_messages`` records: those fetched already, or else the first to
        arrive within ``timeout`` seconds and those fetched with it.

        librdkafka's batch call waits out its whole timeout unless ``max_messages``
        records come: a consumer keeping up with its partitions would hold every batch
        ``timeout`` long. So the records waiting are taken without a wait, and only an
        empty queue is waited on, until its first record.

        When a rebalance refused a commit and this member kept the partition, the
        offsets are committed again here once the group has settled
        (:meth:`commit_owed`), so a quiet partition does not stay uncommitted.
        """
        inner = self.inner
        raw = inner.consume(num_messages=max_messages, timeout=0)
        if not raw:
            first = inner.poll(timeout)
            if first is not None:
                raw = [first]
                if max_messages > 1:
                    raw += inner.consume(num_messages=max_messages - 1, timeout=0)
        self._raise_fatal()
        if self._owed:
            self.commit_owed()
        return [m for m in (check_message(msg) for msg in raw) if m is not None]

    def commit_owed(self) -> list[TopicPartition]:
        """Commit again the offsets a rebalance refused, for partitions still assigned
        here; at most once per :data:`OWED_RETRY_S`. Return what was committed."""
        now = time.monotonic()
        if not self._owed or now < self._owed_due:
            return []
        self._owed_due = now + OWED_RETRY_S
        mine = {(tp.topic, tp.partition) for tp in self.inner.assignment()}
        offsets = [TopicPartition(t, p, o) for (t, p), o in sorted(self._owed.items())]
        offsets = [tp for tp in offsets if (tp.topic, tp.partition) in mine]
        if not offsets:
            return []
        try:
            return self.commit_offsets(offsets)
        except CommitNotYet:
            return []  # the coordinator is away: the offsets stay owed

    def commit(self, messages: Iterable[Message]) -> list[TopicPartition]:
        """Synchronously commit the offsets after ``messages``; return what was committed."""
        offsets = next_offsets(messages)
        if not offsets:
            return []
        return self.commit_offsets(offsets)

    def commit_offsets(self, offsets: list[TopicPartition]) -> list[TopicPartition]:
        """Synchronously commit explicit offsets (the next offset to read per partition).

        A commit refused because of a rebalance (:data:`REBALANCE_COMMIT_ERRORS`) is
        logged and left out of the result: the partition's new owner reads from the
        last committed offset, so the records are applied again, never lost. Any other
        failure raises :class:`BrokerError`.
        """
        for tp in offsets:  # a newer offset for a partition settles what it owed
            owed = self._owed.get((tp.topic, tp.partition))
            if owed is not None and owed <= tp.offset:
                del self._owed[tp.topic, tp.partition]
        try:
            committed = self.inner.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0]
            if isinstance(err, KafkaError) and err.code() in REBALANCE_COMMIT_ERRORS:
                logger.warning(
                    "commit of %s skipped during a rebalance (%s); committed again if "
                    "this member keeps the partition, else its new owner replays them",
                    _names(offsets),
                    err.name(),
                )
                self._owe(offsets)
                return []
            if isinstance(err, KafkaError) and err.code() in RETRIABLE_COMMIT_ERRORS:
                raise CommitNotYet(err, "commit") from exc
            if isinstance(err, KafkaError) and err.code() in NOT_AUTHORIZED:
                raise NotAuthorized(err, None) from exc
            if isinstance(err, KafkaError):
                raise BrokerError(err, "commit") from exc
            raise
        done: list[TopicPartition] = []
        for tp in committed or []:
            if tp.error is None:
                done.append(tp)
            elif tp.error.code() in REBALANCE_COMMIT_ERRORS:
                logger.warning(
                    "commit of %s skipped during a rebalance (%s)", _names([tp]), tp.error.name()
                )
                self._owe([tp])
            elif tp.error.code() in RETRIABLE_COMMIT_ERRORS:
                raise CommitNotYet(tp.error, f"commit {tp.topic}[{tp.partition}]")
            else:
                raise BrokerError(tp.error, f"commit {tp.topic}[{tp.partition}]")
        return done

    def _owe(self, offsets: Iterable[TopicPartition]) -> None:
        for tp in offsets:
            key = (tp.topic, tp.partition)
            self._owed[key] = max(tp.offset, self._owed.get(key, tp.offset))

    def assignment(self) -> list[TopicPartition]:
        return list(self.inner.assignment())

    def close(self, timeout: float | None = None) -> bool:
        """Leave the group and release the client; safe to call twice.

        With ``timeout``, give up waiting after that many seconds and return False:
        librdkafka's close can block for good after a broker restart on a consumer
        that paused and resumed partitions (librdkafka issue 4674). The caller has
        committed what it applied, so leaving without a clean close loses nothing;
        the group evicts the member at its session timeout. True when closed.
        """
        inner, self._inner = self._inner, None
        if inner is None:
            return True
        if timeout is None:
            inner.close()
            return True
        closer = threading.Thread(target=inner.close, name="kafka-consumer-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            logger.warning(
                "the Kafka consumer did not close within %.0fs (a librdkafka hang "
                "after a broker restart); leaving without it: every applied "
                "offset is committed",
                timeout,
            )
            return False
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


RETRIABLE_COMMIT_ERRORS = frozenset(
    {
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._WAIT_COORD,
    }
)
"""Commit failures of a broker or coordinator that is moving or restarting: the same
commit succeeds once it is back (:class:`CommitNotYet`)."""


class CommitNotYet(BrokerError):
    """The group coordinator could not take the commit now; try the same one again."""


def _names(offsets: Iterable[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in offsets)


class Delivery:
    """One produced message and its outcome, filled in by the delivery callback.

    It keeps what was sent, so a refused message can be sent again.
    """

    __slots__ = (
        "done",
        "error",
        "headers",
        "key",
        "offset",
        "partition",
        "topic",
        "value",
        "wanted_partition",
    )

    def __init__(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> None:
        self.topic = topic
        self.value = value
        self.key = key
        self.headers = headers
        self.wanted_partition = partition
        self.done = False
        self.error: KafkaError | None = None
        self.partition: int | None = None
        self.offset: int | None = None

    def _callback(self, err: KafkaError | None, msg: Message) -> None:
        self.done = True
        self.error = err
        if err is None:
            self.partition = msg.partition()
            self.offset = msg.offset()

    def raise_for_error(self) -> None:
        """Raise :class:`DeliveryFailed` if the broker did not acknowledge the message."""
        if self.error is not None:
            raise DeliveryFailed(self.topic, self.error)
        if not self.done:
            raise DeliveryFailed(
                self.topic, KafkaError(KafkaError._MSG_TIMED_OUT, "not acknowledged yet")
            )


class Producer:
    """A confluent-kafka producer that flushes on close and reports failed deliveries.

    Every :meth:`produce` returns a :class:`Delivery`; :meth:`flush` waits for all of
    them and raises :class:`DeliveryFailed` for the first that failed, so a caller can
    produce a batch, flush, and only then commit its input offsets.
    """

    def __init__(self, settings: Settings, **overrides: Any) -> None:
        self._config = client_config(settings, "producer", **overrides)
        self.bootstrap = settings.kafka_bootstrap
        self._inner: confluent_kafka.Producer | None = None
        self._pending: list[Delivery] = []

    @property
    def inner(self) -> confluent_kafka.Producer:
        if self._inner is None:
            self._inner = confluent_kafka.Producer(self._config)
        return self._inner

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> Delivery:
        """Queue one message; the returned :class:`Delivery` is settled by :meth:`flush`."""
        delivery = Delivery(topic, value, key, headers, partition)
        kwargs: dict[str, Any] = {"on_delivery": delivery._callback}
        if headers:
            kwargs["headers"] = headers
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self.inner.produce(topic, value, key, **kwargs)
                break
            except BufferError:
                # The local queue is full: serve delivery callbacks to make room.
                self.inner.poll(0.1)
        self._pending.append(delivery)
        self.inner.poll(0)
        return delivery

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued message is acknowledged; raise if any delivery failed.

        The :class:`DeliveryFailed` raised lists every refused delivery; messages not
        settled in ``timeout`` stay pending for the next flush.
        """
        pending, self._pending = self._pending, []
        if self._inner is not None:
            remaining = self._inner.flush(timeout)
            if remaining:
                self._pending = [d for d in pending if not d.done]
                raise DeliveryFailed(
                    pending[0].topic if pending else "?",
                    KafkaError(
                        KafkaError._MSG_TIMED_OUT,
                        f"{remaining} message(s) not delivered in {timeout}s",
                    ),
                    [d for d in pending if d.done and d.error is not None],
                )
        failed = [d for d in pending if d.error is not None or not d.done]
        if failed:
            first = failed[0]
            raise DeliveryFailed(
                first.topic,
                first.error or KafkaError(KafkaError._MSG_TIMED_OUT, "not acknowledged yet"),
                failed,
            )

    def resend(self, deliveries: Iterable[Delivery]) -> list[Delivery]:
        """Queue the messages of failed deliveries again; settle them with :meth:`flush`."""
        return [
            self.produce(d.topic, d.value, d.key, d.headers, d.wanted_partition) for d in deliveries
        ]

    def close(self, timeout: float = 30.0) -> None:
        """Flush, then release the client; safe to call twice."""
        try:
            self.flush(timeout)
        finally:
            self._inner = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            # Already failing: still try to deliver what was queued, but let the
            # original error propagate rather than a delivery error it caused.
            try:
                self.close()
            except FreshlineError:
                logger.exception("flush on close failed")
