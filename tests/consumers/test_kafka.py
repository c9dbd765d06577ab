"""The confluent-kafka wrappers against the real broker."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from confluent_kafka import KafkaError, Message, TopicPartition

from freshline.consumers.kafka import (
    Consumer,
    DeliveryFailed,
    MissingTopic,
    Producer,
    admin_client,
    client_config,
)
from freshline.pipeline.core.errors import ServiceUnavailable
from freshline.pipeline.core.settings import Settings
from tests.consumers.conftest import read_topic, wait_for

pytestmark = pytest.mark.kafka


def test_consumer_config_from_settings() -> None:
    settings = Settings(kafka_bootstrap="k:1", consumer_group="g", auto_offset_reset="latest")
    config = client_config(settings)
    assert config["bootstrap.servers"] == "k:1"
    assert config["group.id"] == "g"
    assert config["enable.auto.commit"] is False
    assert config["enable.auto.offset.store"] is False
    assert config["auto.offset.reset"] == "latest"
    assert config["partition.assignment.strategy"] == "cooperative-sticky"
    assert client_config(settings, **{"group.id": "other"})["group.id"] == "other"
    producer = client_config(settings, "producer")
    assert "group.id" not in producer and producer["enable.idempotence"] is True


def test_unreachable_broker_is_service_unavailable() -> None:
    with pytest.raises(ServiceUnavailable) as info:
        admin_client(Settings(kafka_bootstrap="127.0.0.1:1"))
    assert "Kafka" in str(info.value) and "127.0.0.1:1" in str(info.value)


def test_commit_resumes_the_group_after_the_last_processed_record(
    topic_factory: Callable[..., str],
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
) -> None:
    topic = topic_factory("commit", partitions=2)
    for i in range(10):
        producer.produce(topic, str(i).encode(), str(i % 2).encode())
    producer.flush()

    first = consumer_factory("g-" + topic)
    records = read_topic(first, topic, 10, partitions=2)
    processed = [m for m in records if int(m.value() or b"0") < 6]
    committed = first.commit(processed)
    assert {tp.partition for tp in committed} == {m.partition() for m in processed}
    first.close()

    second = consumer_factory("g-" + topic)
    second.subscribe([topic])
    rest: list[bytes] = []

    def more() -> bool:
        rest.extend(m.value() or b"" for m in second.consume(100, timeout=0.2))
        return len(rest) >= 4

    wait_for(more, "the uncommitted records")
    assert sorted(rest) == [b"6", b"7", b"8", b"9"]


LONG_WAIT_S = 300.0
"""A batch's wait far longer than any deadline below: a consume that waited it out fails."""


def _within(
    consume: Callable[[], list[Message]], what: str, meanwhile: Callable[[], None] = lambda: None
) -> list[bytes | None]:
    """The values ``consume()`` returns, which must come within the usual 30 s deadline
    (``meanwhile()`` runs while it waits)."""
    pool = ThreadPoolExecutor(1)
    try:
        waiting = pool.submit(consume)
        meanwhile()
        return [m.value() for m in waiting.result(timeout=30)]
    except TimeoutError:
        pytest.fail(f"{what} waited out its timeout")
    finally:
        pool.shutdown(wait=False)


def test_a_batch_takes_the_records_fetched_without_waiting_to_fill(
    topic_factory: Callable[..., str],
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
) -> None:
    """librdkafka's batch call waits out its timeout unless it fills: a consumer keeping
    up would hold every batch that long. Records fetched already come at once."""
    topic = topic_factory("eager")
    for i in range(3):
        producer.produce(topic, str(i).encode(), None)
    producer.flush()  # one batch on the broker, so one fetch brings all three
    consumer = consumer_factory()
    [first] = read_topic(consumer, topic, 1, batch=1)
    assert first.value() == b"0"
    rest = _within(
        lambda: consumer.consume(100, timeout=LONG_WAIT_S), "a batch of the records fetched"
    )
    assert rest == [b"1", b"2"]


def test_an_idle_consumer_takes_the_first_record_as_it_comes(
    topic_factory: Callable[..., str],
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
) -> None:
    topic = topic_factory("first")
    consumer = consumer_factory()
    consumer.inner.assign([TopicPartition(topic, 0, 0)])
    assert consumer.consume(100, timeout=0.2) == []  # nothing there: the wait, then empty

    def late() -> None:
        producer.produce(topic, b"late", None)
        producer.flush()

    got = _within(
        lambda: consumer.consume(100, timeout=LONG_WAIT_S), "an idle consumer's poll", late
    )
    assert got == [b"late"]


def test_partition_eof_is_not_an_error(
    topic_factory: Callable[..., str],
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
) -> None:
    topic = topic_factory("eof")
    producer.produce(topic, b"only", None)
    producer.flush()
    consumer = consumer_factory(**{"enable.partition.eof": True})
    consumer.inner.assign([TopicPartition(topic, 0, 0)])
    seen: list[bytes | None] = []
    polls = 0

    def drained() -> bool:
        nonlocal polls
        polls += 1
        seen.extend(m.value() for m in consumer.consume(10, timeout=0.2))
        # past the record, librdkafka reports EOF on every poll: it must not surface
        return seen == [b"only"] and polls > 3

    wait_for(drained, "the record and EOF")


def test_missing_topic_names_the_fix(consumer_factory: Callable[..., Consumer]) -> None:
    consumer = consumer_factory(**{"allow.auto.create.topics": False})
    consumer.subscribe(["test.never.created.topic"])

    def raised() -> bool:
        try:
            consumer.poll(0.2)
        except MissingTopic as exc:
            assert "freshline topics ensure" in str(exc)
            return True
        return False

    wait_for(raised, "a missing-topic error")


def test_failed_delivery_raises_on_flush(base_settings: Settings) -> None:
    producer = Producer(
        base_settings, **{"message.timeout.ms": 1000, "bootstrap.servers": "127.0.0.1:1"}
    )
    delivery = producer.produce("nowhere", b"x")
    with pytest.raises(DeliveryFailed):
        producer.flush(timeout=10)
    assert delivery.done
    assert delivery.error is not None and delivery.error.code() == KafkaError._MSG_TIMED_OUT


class _StuckClient:
    """Stands in for librdkafka's close blocking for good after a broker restart
    (librdkafka issue 4674): a hang that cannot be caused on demand."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def close(self) -> None:
        self.release.wait(30)


def test_a_close_that_hangs_is_abandoned_at_its_deadline(base_settings: Settings) -> None:
    consumer = Consumer(base_settings)
    stuck = _StuckClient()
    consumer._inner = stuck  # type: ignore[assignment]
    try:
        assert consumer.close(timeout=0.2) is False
        assert not stuck.release.is_set()  # returned while the client was still stuck
        assert consumer.close(timeout=0.2) is True  # released: a second close is a no-op
    finally:
        stuck.release.set()


def test_a_close_that_finishes_reports_a_clean_close(
    consumer_factory: Callable[..., Consumer],
) -> None:
    consumer = consumer_factory()
    consumer.inner.list_topics(timeout=10)
    assert consumer.close(timeout=10) is True
