"""The consumer under faults it must survive without losing a record.

Each test causes its fault for real on the local broker (or a private redis-server):
a rebalance that invalidates a pending commit, a partition assigned while a batch is
being retried, a record too large to dead-letter whole, and a dead-letter topic that
refuses writes.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypedDict, Unpack

import confluent_kafka
import pytest
import redis
from confluent_kafka import Consumer as RawConsumer
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource
from sqlalchemy.engine import Engine

from freshline.consumers.dlq import ERROR_KIND, ORIGINAL_SIZE, TRUNCATED, VALUE_SHA256
from freshline.consumers.kafka import Consumer, Producer
from freshline.consumers.worker import Totals, Worker
from freshline.pipeline.core.services import kafka_security_config
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import DLQ
from tests.consumers.conftest import (
    DEADLINE_S,
    PARTITIONS,
    Env,
    assert_redis_equals_postgres,
    emit,
    emit_per_user,
    read_topic,
    wait_for,
)
from tests.helpers import kafka_headers, kafka_value

pytestmark = pytest.mark.kafka

BROKER_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588


class RunArgs(TypedDict, total=False):
    """:meth:`Worker.run`'s keyword arguments."""

    max_messages: int | None
    timeout: float | None
    idle_timeout: float | None


class Running:
    """A worker's ``run`` in a thread: its totals, or the exception that ended it."""

    def __init__(self, worker: Worker, **run_args: Unpack[RunArgs]) -> None:
        self.worker = worker
        self.totals: Totals | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, kwargs=run_args, daemon=True)
        self.thread.start()

    def _run(self, **run_args: Unpack[RunArgs]) -> None:
        try:
            self.totals = self.worker.run(**run_args)
        except BaseException as exc:  # reported to the test, which asserts on it
            self.error = exc

    def wait(self, done: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
        """Wait until ``done()`` holds (:func:`wait_for`); fail at once if the worker dies."""
        wait_for(lambda: done() or self.error is not None, what, deadline_s)
        assert self.error is None, f"the worker died: {self.error!r}"

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the worker did not stop"
        assert self.error is None, f"the worker died: {self.error!r}"


def committed(group: str, settings: Settings, topic: str) -> list[int]:
    """The group's committed offset per partition of ``topic`` (negative: none)."""
    raw = RawConsumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            **kafka_security_config(settings),
        }
    )
    try:
        parts = raw.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
        return [tp.offset for tp in parts]
    finally:
        raw.close()


def set_topic_max_bytes(admin: AdminClient, topic: str, value: int) -> None:
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry(
                "max.message.bytes", str(value), incremental_operation=AlterConfigOpType.SET
            )
        ],
    )
    for future in admin.incremental_alter_configs([resource]).values():
        future.result()


def test_a_record_too_big_to_dead_letter_whole_is_cut_and_the_stream_goes_on(
    env: Env,
    engine: Engine,
    redis_client: redis.Redis,
    consumer_factory: Callable[..., Consumer],
) -> None:
    # Big enough that the broker takes it, too big to take it again with the
    # dead-letter headers added (the broker's limit is 1,048,588 bytes a record).
    huge = b'{"tenant": "' + b"x" * 1_048_400 + b'"}'
    with Producer(env.settings, **{"message.max.bytes": 2_000_000}) as big:
        emit(
            big,
            env,
            "transaction.updated",
            {"tenant": env.tenant, "user_id": 3, "transaction_id": 1},
            b"k",
        )
        big.produce(env.topic("transaction.updated"), huge, b"k")
        emit(
            big,
            env,
            "transaction.updated",
            {"tenant": env.tenant, "user_id": 4, "transaction_id": 2},
            b"k",
        )
        big.flush()
    worker = Worker(env.settings, topics=[env.topic("transaction.updated")])
    totals = worker.run(max_messages=3, timeout=60)
    assert (totals.consumed, totals.applied, totals.dead_lettered) == (3, 2, 1)
    assert_redis_equals_postgres(engine, redis_client, env, {3, 4})
    [copy] = read_topic(consumer_factory(), env.topic(DLQ), 1, PARTITIONS)
    headers = kafka_headers(copy)
    assert headers[ERROR_KIND] == b"oversized"
    assert headers[TRUNCATED] == b"1"
    assert int(headers[ORIGINAL_SIZE]) == len(huge)
    assert headers[VALUE_SHA256].decode() == hashlib.sha256(huge).hexdigest()
    assert copy.key() == b"k" and huge.startswith(kafka_value(copy))


def test_a_dead_letter_topic_that_refuses_writes_is_retried_and_nothing_is_skipped(
    env: Env,
    admin: AdminClient,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
) -> None:
    dlq = env.topic(DLQ)
    set_topic_max_bytes(admin, dlq, 64)  # every dead letter is now refused by the broker
    emit(producer, env, "transaction.updated", b"{not json", b"bad")
    producer.flush()
    worker = Worker(env.settings, topics=[env.topic("transaction.updated")])
    running = Running(worker, timeout=120)
    try:
        running.wait(
            lambda: worker.totals.retries >= 2,
            "the worker to retry the refused dead letter",
        )
        assert worker.totals.consumed == 0  # the batch is still in hand, uncommitted
        assert all(
            o < 0
            for o in committed(
                env.settings.consumer_group,
                env.settings,
                env.topic("transaction.updated"),
            )
        )
        set_topic_max_bytes(admin, dlq, BROKER_DEFAULT_MAX_MESSAGE_BYTES)
        running.wait(
            lambda: worker.totals.consumed == 1,
            "the batch to complete once the topic takes writes again",
        )
    finally:
        running.stop()
    assert worker.totals.dead_lettered == 1
    [copy] = read_topic(consumer_factory(), dlq, 1, PARTITIONS)
    assert copy.value() == b"{not json"


def one_record_per_partition(producer: Producer, topic: str) -> str:
    """Put one record in each of ``topic``'s two partitions; the topic."""
    for p in range(2):
        producer.produce(topic, b"x", partition=p)
    producer.flush()
    return topic


def take_both(first: Consumer, topic: str) -> list[Message]:
    """Subscribe the group's first member and consume until it holds both records."""
    first.subscribe([topic])
    batch: list[Message] = []

    def both() -> bool:
        batch.extend(first.consume(10, timeout=0.2))
        return len(batch) == 2

    wait_for(both, "the first member's batch")
    return batch


def test_a_commit_refused_by_a_rebalance_is_not_fatal(
    env: Env,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    topic_factory: Callable[..., str],
) -> None:
    topic = one_record_per_partition(producer, topic_factory("rebalance", partitions=2))
    group = f"test-{uuid.uuid4().hex[:10]}"
    # The shortest poll interval librdkafka allows with the broker's minimum session.
    first = consumer_factory(group, **{"session.timeout.ms": 6000, "max.poll.interval.ms": 6000})
    batch = take_both(first, topic)
    # The first member stops polling (a long batch): it leaves the group, and a second
    # member takes its partitions. Its pending commit is then refused.
    second = consumer_factory(group)
    second.subscribe([topic])
    wait_for(
        lambda: second.poll(0.2) is not None or len(second.assignment()) == 2,
        "the second member to own both partitions",
    )
    assert first.commit(batch) == []


class RefusingOnce(confluent_kafka.Consumer):
    """A real consumer whose first commit fails as a rebalance makes it fail.

    A fake fault, said so: the broker refuses a commit (ILLEGAL_GENERATION) only when
    the commit races a generation change by milliseconds, which no test can time; the
    commit is refused here instead, and everything after it is the real broker's."""

    refused = False

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        if not self.refused:
            self.refused = True
            raise KafkaException(KafkaError(KafkaError.ILLEGAL_GENERATION))
        return super().commit(*args, **kwargs)


def test_a_refused_commit_is_sent_again_for_the_partitions_the_member_keeps(
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    topic_factory: Callable[..., str],
) -> None:
    topic = one_record_per_partition(producer, topic_factory("owed", partitions=2))
    group = f"test-{uuid.uuid4().hex[:10]}"
    first = consumer_factory(group)
    first._inner = RefusingOnce(first._config)
    batch = take_both(first, topic)
    assert first.commit(batch) == []
    # The member keeps both partitions (as the cooperative assignor often lets it), its
    # position past their records. Nothing more arrives, so only the refused offsets
    # sent again commit them; before they were, the group's lag stayed at 2 for good.
    kept = first.assignment()
    assert len(kept) == 2

    def committed() -> list[int]:
        first.consume(10, timeout=0.1)
        return [int(tp.offset) for tp in first.inner.committed(kept, timeout=5)]

    wait_for(lambda: committed() == [1, 1], "the kept partitions' offsets to commit")


class IdleMember:
    """Another member of the worker's group, polling in a thread of its own: it stays in
    the group, holding partitions, and never commits their records."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.leaving = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.leaving.is_set():
            self.consumer.poll(0.1)

    def start(self) -> None:
        self.thread.start()

    def leave(self, worker: Worker, what: str) -> None:
        """Stop polling and close, without committing; wait for ``worker`` to own every
        partition again."""
        self.leaving.set()
        self.thread.join(10)
        self.consumer.close()
        wait_for(lambda: len(worker.consumer.assignment()) == PARTITIONS, what, deadline_s=60)


def wait_more_retries(worker: Worker, more: int, what: str) -> None:
    """Wait for ``worker`` to retry its batch ``more`` times from now."""
    retries = worker.totals.retries
    wait_for(lambda: worker.totals.retries >= retries + more, what)


@pytest.fixture
def worker_on_private_redis(
    env: Env,
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
) -> Iterator[tuple[Worker, Callable[[], None], Callable[[], None]]]:
    url, stop, start = private_redis
    worker = Worker(
        env.settings.model_copy(update={"redis_url": url}),
        topics=[env.topic("transaction.updated")],
    )
    yield worker, stop, start


def test_a_partition_assigned_during_a_retry_loses_no_record(
    env: Env,
    engine: Engine,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    worker_on_private_redis: tuple[Worker, Callable[[], None], Callable[[], None]],
) -> None:
    worker, stop_redis, start_redis = worker_on_private_redis
    users = set(range(1, 41))
    emit_per_user(producer, env, "transaction.updated", sorted(users), lambda u: str(u).encode())
    # Another member of the group holds some partitions; it reads without committing.
    other = consumer_factory(env.settings.consumer_group)
    other.subscribe([env.topic("transaction.updated")])
    wait_for(
        lambda: other.poll(0.1) is not None or len(other.assignment()) == PARTITIONS,
        "the other member's assignment",
    )
    stop_redis()
    running = Running(worker, timeout=180)
    member = IdleMember(other)
    member.start()
    try:
        running.wait(
            lambda: worker.totals.retries >= 1,
            "the worker to retry its batch while Redis is down",
        )
        # The other member leaves: its partitions move to the worker mid-retry.
        member.leave(worker, "the worker to own every partition")
        wait_more_retries(worker, 2, "the worker to poll through two more retries")
        start_redis()
        running.wait(
            lambda: worker.totals.applied >= len(users),
            f"all {len(users)} events applied",
            deadline_s=60,
        )
    finally:
        running.stop()
    client = redis.Redis.from_url(worker.settings.redis_url)
    try:
        assert_redis_equals_postgres(engine, client, env, users)
    finally:
        client.close()


def end_offsets(settings: Settings, topic: str) -> list[int]:
    raw = RawConsumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            "group.id": "test-watermarks",
            **kafka_security_config(settings),
        }
    )
    try:
        return [
            raw.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(PARTITIONS)
        ]
    finally:
        raw.close()


def test_a_partition_paused_for_a_retry_then_revoked_is_read_when_it_comes_back(
    env: Env,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    worker_on_private_redis: tuple[Worker, Callable[[], None], Callable[[], None]],
) -> None:
    # librdkafka keeps a partition's pause across a revoke and a later assignment: a
    # partition the worker paused for a retry and lost meanwhile must come back unpaused.
    worker, stop_redis, start_redis = worker_on_private_redis
    topic = env.topic("transaction.updated")
    group = env.settings.consumer_group
    emit_per_user(producer, env, "transaction.updated", range(1, 41), lambda u: str(u).encode())
    stop_redis()
    running = Running(worker, timeout=240)
    other = consumer_factory(group)
    member = IdleMember(other)
    try:
        running.wait(
            lambda: worker.totals.retries >= 1,
            "the worker to pause every partition for a retry (Redis down)",
        )
        assert len(worker.consumer.assignment()) == PARTITIONS
        # A second member joins mid-retry: the worker gives up paused partitions.
        other.subscribe([topic])
        member.start()
        wait_for(
            lambda: 0 < len(worker.consumer.assignment()) < PARTITIONS,
            "the worker to hand partitions to the new member",
            deadline_s=60,
        )
        wait_more_retries(worker, 1, "the worker to end one more wait after the rebalance")
        start_redis()
        running.wait(
            lambda: worker.totals.batches >= 1,
            "the worker to finish the retried batch once Redis is back",
        )
        # The new member leaves, without committing: its partitions come back while the
        # worker is between retries.
        member.leave(worker, "the worker to own every partition again")
        ends = end_offsets(env.settings, topic)
        running.wait(
            lambda: committed(group, env.settings, topic) == ends,
            f"the worker to read and commit every partition to its end {ends}",
            deadline_s=60,
        )
    finally:
        member.leaving.set()
        running.stop()
