"""The demo's wait for the consumer group to catch up, against the real broker."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import Message
from confluent_kafka.admin import AdminClient

from fraud.demo import catch_up, queued
from freshline.consumers.kafka import Consumer, Producer, admin_client
from freshline.consumers.topics import ensure
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.observe.staleness import GroupLag
from tests.helpers import wait_until

pytestmark = pytest.mark.kafka

RECORDS = 25
PARTITIONS = 2


@pytest.fixture
def admin(base_settings: Settings) -> AdminClient:
    return admin_client(base_settings)


@pytest.fixture
def group_settings(base_settings: Settings, admin: AdminClient) -> Iterator[Settings]:
    """Settings with a fresh prefixed topic (``RECORDS`` records in it) and a fresh group."""
    tag = uuid.uuid4().hex[:10]
    local = base_settings.model_copy(
        update={"topic_prefix": f"test.demo{tag}.", "consumer_group": f"test-demo-{tag}"}
    )
    topic = f"{local.topic_prefix}lag"
    ensure(admin, PARTITIONS, topics=[topic])
    assert wait_until(lambda: topic in admin.list_topics(topic, timeout=5).topics, 30)
    with Producer(local) as producer:
        for i in range(RECORDS):
            producer.produce(topic, str(i).encode(), str(i).encode())
    yield local
    for future in admin.delete_topics([topic], operation_timeout=10).values():
        future.result()


def polling(consumer: Consumer, got: list[Message], done: Callable[[], bool]) -> Callable[[], bool]:
    """A condition for ``wait_until`` that consumes (into ``got``) while it waits."""

    def poll() -> bool:
        got.extend(consumer.consume(100, timeout=0.1))
        return done()

    return poll


def test_queued_counts_what_the_group_has_yet_to_commit(
    group_settings: Settings, admin: AdminClient
) -> None:
    topic = f"{group_settings.topic_prefix}lag"
    lag = GroupLag(group_settings)
    try:
        assert queued(admin, lag) is None  # no member: not known to be caught up
        with Consumer(group_settings) as consumer:
            consumer.subscribe([topic])
            got: list[Message] = []
            # Consumed but not committed: all of it is still queued for the group.
            assert wait_until(
                polling(consumer, got, lambda: len(consumer.assignment()) == PARTITIONS), 30
            )
            assert wait_until(lambda: queued(admin, lag) == RECORDS, 30)
            assert wait_until(polling(consumer, got, lambda: len(got) == RECORDS), 30)
            consumer.commit(got[:10])
            assert queued(admin, lag) == RECORDS - 10
            consumer.commit(got)
            assert queued(admin, lag) == 0
    finally:
        lag.close()


def test_catch_up_reports_progress_and_gives_up_at_its_deadline(
    group_settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    topic = f"{group_settings.topic_prefix}lag"
    with Consumer(group_settings) as consumer:
        consumer.subscribe([topic])
        got: list[Message] = []
        assert wait_until(polling(consumer, got, lambda: len(got) == RECORDS), 30)

        assert catch_up(group_settings, deadline_s=1.0) is False
        said = capsys.readouterr().out
        assert f"{RECORDS:,} events still queued" in said
        assert f"still has {RECORDS:,} events queued after 1 s" in said

        consumer.commit(got)
        assert catch_up(group_settings, deadline_s=30.0) is True
        assert capsys.readouterr().out == ""  # nothing queued: nothing to say
