"""A topic prefix works with the stack's ACLs (issue 49): ``freshline apply``'s grants
(:func:`freshline.consumers.topics.allow_consumer`, :func:`allow_writer`) let the consumers' own
login do what its prefix needs and no more, and its regex subscription finds the CDC
topics Connect's login writes under that prefix. The README's quick start
(``tests/test_quickstart.py``) runs the same end to end.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import KafkaError, Message

from freshline.consumers.kafka import Consumer, admin_client
from freshline.consumers.topics import (
    allow_consumer,
    allow_writer,
    ensure,
    managed_topics,
    subscription,
)
from freshline.pipeline.cdc.connect import names
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import INVALIDATIONS, qualified
from tests.helpers import forget_prefix, kafka_login, need, wait_until
from tests.kafka_acls import assert_write_refused, produce_one

pytestmark = [pytest.mark.kafka]


@pytest.fixture
def prefixed(settings: Settings) -> Iterator[tuple[Settings, Settings]]:
    """Two repositories' settings, ``pfx<tag>.`` and ``oth<tag>.``, their topics made
    by the operator; the first one's grants given as ``apply`` gives them, the other's
    not (nobody applied it yet); all removed afterwards."""
    tag = uuid.uuid4().hex[:8]
    pairs = []
    admin = admin_client(settings)
    for name in ("pfx", "oth"):
        local = Settings(
            **{
                **settings.model_dump(),
                "topic_prefix": f"{name}{tag}.",
                "consumer_group": f"{name}{tag}.freshline",
            }
        )
        cdc = names(local).topic("loans")
        ensure(admin, 1, topics=[*managed_topics(local), cdc])
        if name == "pfx":
            allow_consumer(admin, need("FRESHLINE_STACK_KAFKA_CONSUMER_USER"), local)
            allow_writer(admin, need("FRESHLINE_STACK_KAFKA_CONNECT_USER"), [cdc])
        pairs.append(local)
    try:
        yield pairs[0], pairs[1]
    finally:
        for local in pairs:
            forget_prefix(admin, local.topic_prefix)


def test_the_consumers_login_does_what_its_prefix_needs_and_no_more(
    prefixed: tuple[Settings, Settings],
) -> None:
    ours, theirs = prefixed
    consumer, connect = kafka_login(ours, "consumer"), kafka_login(ours, "connect")
    cdc = names(ours).topic("loans")
    assert produce_one(consumer, qualified(ours, INVALIDATIONS)) is None
    assert_write_refused(consumer, cdc)  # no forged change event
    assert_write_refused(consumer, qualified(theirs, INVALIDATIONS))  # nor one not applied
    assert produce_one(connect, cdc) is None
    assert_write_refused(connect, names(theirs).topic("loans"))

    # The consumer's own regex subscription, in its prefix's default group, reads it.
    pattern = subscription(ours)[-1]
    assert pattern == rf"^{re.escape(ours.topic_prefix)}freshline\.public\..*"
    got: list[str] = []
    errors: list[KafkaError] = []
    with Consumer(consumer) as reader:
        reader.subscribe([pattern])

        def received() -> bool:
            msg: Message | None = reader.inner.poll(0.5)
            if msg is not None:
                if (error := msg.error()) is not None:
                    errors.append(error)
                else:
                    got.append(str(msg.topic()))
            return bool(got)

        assert wait_until(received, timeout=60), errors
    assert got == [cdc]
