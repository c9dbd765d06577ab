"""What a running consumer reports about its reading: its lag, committed offset against
the partition's end, per group; and a subscription that matches no topic, until one
appears. Logged in as the consumers' Kafka login; no topic prefix, which the stack's
ACLs grant it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import REGISTRY as METRICS

from freshline.consumers.kafka import Consumer, Producer
from freshline.consumers.topics import ensure
from freshline.consumers.worker import Worker
from freshline.pipeline.core.settings import Settings
from tests.consumers.conftest import Env
from tests.consumers.test_loud_failures import as_consumer
from tests.consumers.test_worker_faults import Running

pytestmark = pytest.mark.kafka


def lag_samples(topic: str) -> dict[tuple[str, str], float]:
    """``freshline_consumer_lag`` of ``topic``: (group, partition) -> records."""
    out: dict[tuple[str, str], float] = {}
    for metric in METRICS.collect():
        if metric.name != "freshline_consumer_lag":
            continue
        for s in metric.samples:
            if s.labels.get("topic") == topic:
                out[s.labels.get("group", "?"), s.labels["partition"]] = s.value
    return out


def subscribed(group: str) -> float | None:
    return METRICS.get_sample_value("freshline_consumer_subscribed_topics", {"group": group})


def test_quiet_partitions_committed_to_their_end_lag_nothing(
    env: Env,
    topic_factory: Callable[..., str],
    producer: Producer,
) -> None:
    topic = topic_factory("lag", partitions=2)
    # Tombstones: records with nothing to apply, so the consumer writes no topic.
    for i in range(5):
        producer.produce(topic, None, str(i).encode(), partition=i % 2)
    producer.flush()
    settings = as_consumer(env.settings).model_copy(update={"topic_prefix": ""})
    group = settings.consumer_group
    # The group has read everything already: its offsets are the partitions' ends.
    with Consumer(settings) as earlier:
        ends = [
            earlier.inner.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(2)
        ]
        assert sorted(ends) == [2, 3]
        earlier.commit_offsets([TopicPartition(topic, p, ends[p]) for p in range(2)])
    running = Running(Worker(settings, topics=[topic]), timeout=120)
    try:
        running.wait(lambda: len(lag_samples(topic)) == 2, "the lag of both partitions")
        assert lag_samples(topic) == {(group, "0"): 0, (group, "1"): 0}
        assert running.worker.totals.consumed == 0
        # Two records more: the lag counts them until they are committed.
        producer.produce(topic, None, b"x", partition=0)
        producer.produce(topic, None, b"y", partition=0)
        producer.flush()
        running.wait(lambda: running.worker.totals.consumed == 2, "the two records")
        running.wait(
            lambda: lag_samples(topic) == {(group, "0"): 0, (group, "1"): 0},
            "the lag after the commit",
        )
    finally:
        running.stop()


def test_a_subscription_matching_no_topic_says_so_until_one_appears(
    env: Env, admin: AdminClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="freshline.consumer")
    tag = uuid.uuid4().hex[:10]
    pattern = f"^nomatch{tag}\\..*"
    settings: Settings = as_consumer(env.settings).model_copy(update={"topic_prefix": ""})
    group = settings.consumer_group
    running = Running(Worker(settings, topics=[pattern]), timeout=180)
    topic = f"nomatch{tag}.created"
    made: list[str] = []
    try:
        running.wait(lambda: subscribed(group) == 0, "the consumer to count no topic")
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("matches no topic" in m and group in m for m in said), said
        ensure(admin, 1, topics=[topic])
        made.append(topic)
        running.wait(lambda: subscribed(group) == 1, "the consumer to count the new topic", 60)
        said = [r.getMessage() for r in caplog.records]
        assert any(m == f"the subscription now matches {topic}" for m in said), said
    finally:
        running.stop()
        if made:
            for future in admin.delete_topics(made, operation_timeout=10).values():
                future.result()
