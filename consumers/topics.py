"""Every Kafka topic name freshline uses, and ``ensure``, which creates them.

Consumers never rely on broker-side auto-creation: ``freshline topics ensure`` creates
the domain-event, invalidation and dead-letter topics with the configured partition
count before anything produces to them. Debezium's CDC topics
(``freshline.public.<table>``) are created by Kafka Connect, not here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from pipeline.errors import FreshlineError
from pipeline.settings import Settings

TRANSACTION_CREATED = "transaction.created"
TRANSACTION_UPDATED = "transaction.updated"
DEVICE_UPDATED = "device.updated"
USER_UPDATED = "user.updated"

DOMAIN_TOPICS: dict[str, str] = {
    TRANSACTION_CREATED: "transactions",
    TRANSACTION_UPDATED: "transactions",
    DEVICE_UPDATED: "devices",
    USER_UPDATED: "users",
}
"""Each domain-event topic and the source table its events describe."""

INVALIDATIONS = "freshline.invalidations"
DLQ = "freshline.dlq"

CDC_PREFIX = "freshline"
CDC_TOPIC_PATTERN = re.compile(r"(?P<prefix>[^.]+)\.(?P<schema>[^.]+)\.(?P<table>[^.]+)")
"""``<prefix>.<schema>.<table>``: the topic names Debezium's Postgres connector uses."""
CDC_SUBSCRIPTION = rf"^{re.escape(CDC_PREFIX)}\.public\..*"
"""A librdkafka regex subscription matching every CDC topic of our database."""

MANAGED_TOPICS: tuple[str, ...] = (*DOMAIN_TOPICS, INVALIDATIONS, DLQ)
"""The topics ``freshline topics ensure`` creates."""

ADMIN_TIMEOUT_S = 15.0


class TopicError(FreshlineError):
    """The broker refused to create a topic."""


@dataclass
class EnsureReport:
    """What :func:`ensure` found: topics it created and topics that already existed."""

    created: list[str] = field(default_factory=list)
    existing: dict[str, int] = field(default_factory=dict)
    """Existing topic -> its partition count (which may differ from the configured one)."""


def ensure(
    admin: AdminClient,
    partitions: int,
    *,
    replication_factor: int = 1,
    topics: Iterable[str] = MANAGED_TOPICS,
    config: dict[str, str] | None = None,
) -> EnsureReport:
    """Create each of ``topics`` that does not exist yet; leave existing ones alone.

    Idempotent and safe to run concurrently with another ``ensure``: a topic created
    by someone else between the listing and the creation is reported as existing.
    """
    wanted = list(dict.fromkeys(topics))
    metadata = admin.list_topics(timeout=ADMIN_TIMEOUT_S)
    report = EnsureReport()
    missing: list[NewTopic] = []
    for name in wanted:
        found = metadata.topics.get(name)
        if found is not None and found.error is None:
            report.existing[name] = len(found.partitions)
        else:
            missing.append(NewTopic(name, num_partitions=partitions,
                                    replication_factor=replication_factor,
                                    config=dict(config or {})))
    if not missing:
        return report
    futures: dict[str, Any] = admin.create_topics(missing, request_timeout=ADMIN_TIMEOUT_S)
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            err = exc.args[0]
            if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                report.existing[name] = partition_count(admin, name)
                continue
            raise TopicError(f"could not create topic {name!r}: {err}") from exc
        report.created.append(name)
    return report


def partition_count(admin: AdminClient, topic: str) -> int:
    """The number of partitions of ``topic``, 0 if it does not exist."""
    found = admin.list_topics(topic, timeout=ADMIN_TIMEOUT_S).topics.get(topic)
    if found is None or found.error is not None:
        return 0
    return len(found.partitions)


def qualified(settings: Settings, topic: str) -> str:
    """The name on the broker: ``FRESHLINE_TOPIC_PREFIX`` + ``topic`` (no prefix by default).

    A prefix lets several environments (or test runs) share one cluster.
    """
    return settings.topic_prefix + topic


def logical(settings: Settings, topic: str) -> str:
    """The contract name of a broker topic: :func:`qualified` undone."""
    return topic.removeprefix(settings.topic_prefix)


def managed_topics(settings: Settings) -> list[str]:
    return [qualified(settings, t) for t in MANAGED_TOPICS]


def subscription(settings: Settings) -> list[str]:
    """What ``freshline consume`` reads by default: the domain events and every CDC topic."""
    cdc = rf"^{re.escape(settings.topic_prefix + CDC_PREFIX)}\.public\..*"
    return [*(qualified(settings, t) for t in DOMAIN_TOPICS), cdc]


def ensure_from_settings(settings: Settings, *, replication_factor: int = 1) -> EnsureReport:
    """:func:`ensure` with the partition count, broker and prefix from ``settings``."""
    from consumers.kafka import admin_client

    return ensure(admin_client(settings), settings.topic_partitions,
                  replication_factor=replication_factor, topics=managed_topics(settings))
