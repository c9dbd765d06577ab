"""``freshline topics ensure``: idempotent creation with the configured partitions."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka.admin import AdminClient

from freshline.consumers.topics import ensure, event_topics, managed, partition_count
from freshline.pipeline.core.topics import (
    CDC_SUBSCRIPTION,
    CDC_TOPIC_PATTERN,
    DLQ,
    INVALIDATIONS,
    SERVED,
)
from tests.helpers import cli, error_line

pytestmark = pytest.mark.kafka


def test_topic_names_are_the_documented_ones() -> None:
    assert set(event_topics()) == {
        "transaction.created",
        "transaction.updated",
        "device.updated",
        "user.updated",
    }
    assert (INVALIDATIONS, DLQ) == ("freshline.invalidations", "freshline.dlq")
    assert managed() == [*event_topics(), INVALIDATIONS, DLQ, SERVED]
    match = CDC_TOPIC_PATTERN.fullmatch("freshline.public.transactions")
    assert match is not None and match["table"] == "transactions"
    assert CDC_TOPIC_PATTERN.fullmatch("transaction.updated") is None
    assert CDC_SUBSCRIPTION.startswith("^")  # a regex subscription in librdkafka


@pytest.fixture
def names(admin: AdminClient) -> Iterator[list[str]]:
    made = [f"test.ensure.{uuid.uuid4().hex[:10]}.{i}" for i in range(3)]
    yield made
    existing = [n for n in made if partition_count(admin, n)]
    if existing:
        for future in admin.delete_topics(existing, operation_timeout=10).values():
            future.result()


def test_ensure_creates_then_reports_existing(admin: AdminClient, names: list[str]) -> None:
    first = ensure(admin, 4, topics=names)
    assert sorted(first.created) == sorted(names) and first.existing == {}
    assert [partition_count(admin, n) for n in names] == [4, 4, 4]

    second = ensure(admin, 4, topics=names)
    assert second.created == [] and second.existing == dict.fromkeys(names, 4)

    # a different configured count never alters an existing topic
    third = ensure(admin, 8, topics=names)
    assert third.created == [] and third.existing == dict.fromkeys(names, 4)


def test_ensure_creates_only_the_missing(admin: AdminClient, names: list[str]) -> None:
    ensure(admin, 2, topics=names[:1])
    report = ensure(admin, 3, topics=names)
    assert sorted(report.created) == sorted(names[1:])
    assert report.existing == {names[0]: 2}
    assert [partition_count(admin, n) for n in names] == [2, 3, 3]


def test_cli_is_idempotent(admin: AdminClient) -> None:
    """Runs on the managed topics themselves: ``ensure`` is what scripts/test runs too."""
    cli("topics", "ensure")
    r = cli("topics", "ensure")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == len(managed())
    assert all(line.startswith("existing ") for line in lines), r.stderr
    for name in managed():
        assert partition_count(admin, name) >= 1
        assert any(f" {name} (" in line for line in lines)


def test_cli_unreachable_broker_is_one_line() -> None:
    line = error_line(cli("topics", "ensure", FRESHLINE_KAFKA_BOOTSTRAP="127.0.0.1:1"))
    assert "Kafka" in line and "127.0.0.1:1" in line
    assert "scripts/stack up" in line
