"""Three brokers: topics replicated 3 times (min.insync.replicas 2), and a broker
killed while a producer writes loses nothing (``-m cluster``; see conftest). The
operator makes the topic; the domain-event producer's and the consumers' logins write
and read it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource

from freshline.consumers.topics import ensure
from freshline.pipeline.core.settings import Settings
from tests.cluster.conftest import kafka_config, kafka_login, stack
from tests.helpers import kafka_value, wait_until

pytestmark = pytest.mark.cluster

N = 3000


def test_a_killed_broker_loses_no_acknowledged_message(
    cluster_settings: Settings, cluster_env: dict[str, str]
) -> None:
    admin = AdminClient(kafka_config(cluster_settings))
    topic = f"cluster-test-{uuid.uuid4().hex[:10]}"
    assert ensure(admin, 3, topics=[topic]).created == [topic]

    described: list[Any] = []

    def led() -> bool:
        # A freshly created topic's metadata reaches the brokers one by one: until
        # then a broker answers with no partitions, or a partition with no leader.
        meta = admin.list_topics(topic, timeout=15).topics.get(topic)
        if meta is None or meta.error is not None or 0 not in meta.partitions:
            return False
        if any(p.leader < 0 for p in meta.partitions.values()):
            return False
        described[:] = [meta]
        return True

    assert wait_until(led, 30)
    (meta,) = described
    assert all(len(p.replicas) == 3 for p in meta.partitions.values())

    def min_insync() -> str | None:
        # A broker may answer before the new topic's metadata has reached it.
        (future,) = admin.describe_configs([ConfigResource("topic", topic)]).values()
        try:
            return str(future.result()["min.insync.replicas"].value)
        except KafkaException:
            return None

    assert wait_until(lambda: min_insync() == "2", 30)

    leader = meta.partitions[0].leader
    producer = Producer(
        kafka_config(
            kafka_login(cluster_settings, cluster_env, "producer"),
            acks="all",
            **{"enable.idempotence": True, "message.timeout.ms": 120_000},
        )
    )
    acked: list[int] = []
    failed: list[Any] = []

    def report(err: Any, msg: Any) -> None:
        if err is None:
            acked.append(int(msg.value()))
        else:
            failed.append(err)

    def send(numbers: range) -> None:
        for i in numbers:
            producer.produce(topic, str(i).encode(), key=str(i % 97).encode(), on_delivery=report)
            producer.poll(0)

    send(range(N // 2))
    producer.flush(60)
    stack("kill", f"kafka-{leader}")
    try:
        send(range(N // 2, N))  # while partition 0's leader is gone
        assert producer.flush(120) == 0
    finally:
        stack("start", f"kafka-{leader}")
    assert failed == []
    assert sorted(acked) == list(range(N))

    consumer = Consumer(
        kafka_config(
            kafka_login(cluster_settings, cluster_env, "consumer"),
            **{
                "group.id": f"freshline-{topic}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            },
        )
    )
    consumer.subscribe([topic])
    seen: set[int] = set()

    def drained() -> bool:
        for msg in consumer.consume(500, timeout=0.5):
            if msg.error() is None:
                seen.add(int(kafka_value(msg)))
        return len(seen) == N

    try:
        assert wait_until(drained, 120)
    finally:
        consumer.close()
    admin.delete_topics([topic])
