"""The dead-letter topic, through the real broker: original record and the reason."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from freshline.consumers.dlq import DeadLetters
from freshline.consumers.events import EventRejected, decode
from freshline.consumers.kafka import Consumer, Producer
from tests.consumers.conftest import read_topic

pytestmark = pytest.mark.kafka


def test_round_trip_keeps_key_value_and_headers(
    topic_factory: Callable[..., str],
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
) -> None:
    source = topic_factory("src", partitions=3)
    dlq = topic_factory("dlq")
    value = b'{"tenant": "ac:me", "user_id": 1}\xff'
    producer.produce(source, b'{"tenant": "acme", "user_id": 1}', b"acme:1")  # good
    producer.produce(
        source, value, b"acme:1", headers=[("trace-id", b"abc"), ("x-freshline-error", b"old")]
    )
    producer.flush()

    records = read_topic(consumer_factory(), source, 2, partitions=3)
    bad = next(m for m in records if m.value() == value)
    with pytest.raises(EventRejected) as info:
        decode("user.updated", bad.key(), bad.value())

    delivery = DeadLetters(producer, dlq).send(bad, info.value)
    producer.flush()
    delivery.raise_for_error()
    assert delivery.done and delivery.offset == 0

    [dead] = read_topic(consumer_factory(), dlq, 1)
    assert dead.key() == b"acme:1"
    assert dead.value() == value
    headers = dead.headers()
    assert headers is not None
    assert headers == [
        ("trace-id", b"abc"),
        ("x-freshline-error-class", b"EventRejected"),
        ("x-freshline-error-kind", b"malformed_json"),
        ("x-freshline-error", info.value.reason.encode()),
        ("x-freshline-source-topic", source.encode()),
        ("x-freshline-source-partition", str(bad.partition()).encode()),
        ("x-freshline-source-offset", str(bad.offset()).encode()),
    ]


def test_any_exception_and_a_null_key(
    topic_factory: Callable[..., str],
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
) -> None:
    source, dlq = topic_factory("src"), topic_factory("dlq")
    producer.produce(source, b"payload", None)
    producer.flush()
    [msg] = read_topic(consumer_factory(), source, 1)

    DeadLetters(producer, dlq).send(msg, ValueError("boom"))
    producer.flush()

    [dead] = read_topic(consumer_factory(), dlq, 1)
    assert dead.key() is None and dead.value() == b"payload"
    headers = dict(dead.headers() or [])
    assert headers["x-freshline-error-class"] == b"ValueError"
    assert headers["x-freshline-error"] == b"boom"
    assert "x-freshline-error-kind" not in headers
    assert headers["x-freshline-source-offset"] == b"0"
