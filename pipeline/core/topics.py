"""freshline's own Kafka topic names, the CDC naming rule, and the prefix rule.

The domain-event topics are the active repository's (:class:`freshline.pipeline.core.events.Event`).
The Kafka side (creating topics, consuming) lives in :mod:`consumers`; these names are
here because the observers and the CDC administration speak of the same topics.
"""

from __future__ import annotations

import re

from freshline.pipeline.core.settings import Settings

INVALIDATIONS = "freshline.invalidations"
DLQ = "freshline.dlq"
SERVED = "freshline.served"
"""The served log (:mod:`freshline.pipeline.observe.served`)."""

CDC_PREFIX = "freshline"
CDC_TOPIC_PATTERN = re.compile(r"(?P<prefix>[^.]+)\.(?P<schema>[^.]+)\.(?P<table>[^.]+)")
"""``<prefix>.<schema>.<table>``: the topic names Debezium's Postgres connector uses."""
CDC_SUBSCRIPTION = rf"^{re.escape(CDC_PREFIX)}\.public\..*"
"""A librdkafka regex subscription matching every CDC topic of our database."""


def qualified(settings: Settings, topic: str) -> str:
    """The name on the broker: ``FRESHLINE_TOPIC_PREFIX`` + ``topic`` (no prefix by default).

    A prefix lets several environments (or test runs) share one cluster.
    """
    return settings.topic_prefix + topic


def logical(settings: Settings, topic: str) -> str:
    """The contract name of a broker topic: :func:`qualified` undone."""
    return topic.removeprefix(settings.topic_prefix)
