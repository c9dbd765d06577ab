"""The Kafka ACL checks both topologies run: tests/test_stack_security.py on the single
stack's broker, tests/cluster/test_cluster_security.py on the cluster's three.

``scripts/stack up`` grants the same ACLs on both (its ``kafka_acls``) for the default
topic layout (no ``FRESHLINE_TOPIC_PREFIX``): CDC topics are
``freshline.public.<table>``, and a domain-event topic is any name outside
``freshline.*``, ``_connect-*`` and ``__*``. A prefix's grants are ``freshline apply``'s
(``tests/consumers/test_prefix_acls.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition
from pydantic import SecretStr

from freshline.consumers.kafka import Consumer, DeliveryFailed, Producer, admin_client
from freshline.consumers.topics import ensure
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import INVALIDATIONS
from tests.helpers import wait_until

KINDS = ("domain", "cdc")
"""The kinds of topic an outsider tries to write."""

REFUSED_S = 10.0
"""How long a producer tries to deliver before it reports the message as failed."""

FORBIDDEN_WRITES = [
    ("producer", "cdc"),
    ("producer", "invalidations"),
    ("connect", "domain"),
    ("consumer", "cdc"),
    ("consumer", "domain"),
]
"""(login, kind of topic) pairs the ACLs refuse: the domain-event producer forges no CDC
record or invalidation, Debezium's login writes no domain event, the consumers write
neither (they write only the dead letters and invalidations)."""


@contextmanager
def acl_topics(operator: Settings) -> Iterator[dict[str, str]]:
    """A domain-event topic and a CDC topic of their own, made (and deleted after) by
    the ``operator``'s login, and the invalidations topic."""
    tag = uuid.uuid4().hex[:10]
    topics = {
        "domain": f"acltest{tag}.created",
        "cdc": f"freshline.public.acltest_{tag}",
        "invalidations": INVALIDATIONS,
    }
    admin = admin_client(operator)
    ensure(admin, 1, topics=topics.values())
    yield topics
    for future in admin.delete_topics([topics["domain"], topics["cdc"]]).values():
        future.result()


def anonymous(settings: Settings) -> Settings:
    """``settings`` with no Kafka login at all (PLAINTEXT)."""
    return settings.model_copy(
        update={
            "kafka_security_protocol": "plaintext",
            "kafka_sasl_mechanism": "",
            "kafka_sasl_username": "",
            "kafka_sasl_password": SecretStr(""),
        }
    )


def produce_one(settings: Settings, topic: str) -> KafkaError | None:
    """Produce one record to ``topic``; the error it failed with, or None."""
    producer = Producer(settings, **{"message.timeout.ms": int(REFUSED_S * 1000)})
    producer.produce(topic, b"forged", key=b"k")
    try:
        producer.flush(REFUSED_S * 3)
    except DeliveryFailed as exc:
        return exc.error
    return None


def end_offset(settings: Settings, topic: str) -> int:
    """The end offset of ``topic``'s partition 0, read with ``settings``' login."""
    with Consumer(settings, **{"group.id": "freshline-acltest"}) as consumer:
        return int(consumer.inner.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1])


def assert_refused_everything(
    operator: Settings, outsider: Settings, topics: dict[str, str]
) -> None:
    """The ``outsider`` can produce neither a domain event nor a CDC record, and cannot
    read the invalidations (not even their offsets); the ``operator`` sees nothing got in.

    Each refusal is a client giving up at its timeout (about :data:`REFUSED_S`), so the
    three are tried side by side, each with its own client: one wait, not three."""
    with ThreadPoolExecutor(3) as pool:
        produced = {kind: pool.submit(produce_one, outsider, topics[kind]) for kind in KINDS}
        read = pool.submit(end_offset, outsider, topics["invalidations"])
        for kind, error in produced.items():
            assert error.result() is not None, kind
        with pytest.raises(KafkaException):
            read.result()
    for kind in KINDS:
        assert end_offset(operator, topics[kind]) == 0, f"{kind}: a record got in"


def assert_write_refused(login: Settings, topic: str) -> None:
    error = produce_one(login, topic)
    assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, error


def assert_each_writer_writes_its_topics(
    login: Callable[[str], Settings], topics: dict[str, str]
) -> None:
    """The ``login("producer")`` writes a domain event, ``login("connect")`` a CDC record,
    and ``login("consumer")`` reads both, in a group of its own (``freshline*``)."""
    assert produce_one(login("producer"), topics["domain"]) is None
    assert produce_one(login("connect"), topics["cdc"]) is None
    group = f"freshline-acltest-{uuid.uuid4().hex[:8]}"
    got: list[str] = []
    with Consumer(login("consumer"), **{"group.id": group}) as reader:
        reader.subscribe([topics["domain"], topics["cdc"]])

        def received() -> bool:
            msg: Message | None = reader.poll(0.5)
            if msg is not None:
                got.append(str(msg.topic()))
            return len(got) == 2

        assert wait_until(received, timeout=60), got
    assert sorted(got) == sorted([topics["domain"], topics["cdc"]])


def assert_group_refused(login: Settings, group: str, topic: str) -> None:
    """``login`` subscribing to ``topic`` in ``group`` is told GROUP_AUTHORIZATION_FAILED."""
    errors: list[KafkaError] = []
    with Consumer(login, **{"group.id": group}) as consumer:
        consumer.subscribe([topic])

        def refused() -> bool:
            msg = consumer.inner.poll(0.5)
            if msg is not None and (error := msg.error()) is not None:
                errors.append(error)
            return any(e.code() == KafkaError.GROUP_AUTHORIZATION_FAILED for e in errors)

        assert wait_until(refused, timeout=60), errors
