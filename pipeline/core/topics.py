"""Every Kafka topic name freshline uses: the contract names, and the prefix rule.

The Kafka side (creating topics, consuming) lives in :mod:`consumers`; these names are
here because the observers and the CDC administration speak of the same topics.
"""

from __future__ import annotations

import re

from pipeline.core.settings import Settings

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


def qualified(settings: Settings, topic: str) -> str:
    """The name on the broker: ``FRESHLINE_TOPIC_PREFIX`` + ``topic`` (no prefix by default).

    A prefix lets several environments (or test runs) share one cluster.
    """
    return settings.topic_prefix + topic


def logical(settings: Settings, topic: str) -> str:
    """The contract name of a broker topic: :func:`qualified` undone."""
    return topic.removeprefix(settings.topic_prefix)
