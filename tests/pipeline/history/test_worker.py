"""``freshline record``'s loop on real Kafka without Connect: the envelopes of real
transactions produced to a CDC topic (twice: a redelivery), recorded by the worker's
consumer group, audited, and counted in its metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import orjson
import pytest
import sqlalchemy as sa
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from freshline.consumers.history import HistoryWorker, group
from freshline.consumers.kafka import Consumer, Producer, admin_client
from freshline.consumers.metrics import history_metrics
from freshline.consumers.topics import ensure
from freshline.pipeline.cdc.connect import names
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.history.audit import audit
from freshline.pipeline.history.tables import follow, layout, registered
from tests.consumers.conftest import own_settings
from tests.pipeline.history.conftest import KEEP, History, Txn, sample

pytestmark = [pytest.mark.kafka]


def test_the_worker_records_a_topic_and_its_redelivery(
    settings: Settings, base_settings: Settings, history_factory: Callable[[], History]
) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)).insert(sample(2)))
    h.enable()
    records = h.writer.commit(Txn().update(sample(1, note="a")).update(sample(1, note="b")))
    records += h.writer.commit(Txn().update(sample(2, big=KEEP, note="toast")).insert(sample(3)))
    records += h.writer.commit(Txn().delete(1))
    local = own_settings(settings, "hrec", 1)
    topic = names(local).topic(h.table)
    admin: AdminClient = admin_client(base_settings)
    ensure(admin, 1, topics=[topic])
    try:
        with Producer(base_settings) as producer:
            for record in records * 2:  # and every one again
                producer.produce(topic, orjson.dumps(record), key=None)
            producer.flush()
        worker = HistoryWorker(local, h.consumer)
        totals = worker.run(max_messages=len(records) * 2, timeout=60)
        assert totals.consumed == len(records) * 2
        assert totals.duplicates == len(records)
        [result] = [r for r in audit(h.consumer) if r.table == h.table]
        assert result.ok, result.samples
        assert history_metrics().versions.labels(f"public.{h.table}")._value.get() == len(records)
        worker.report()
        assert history_metrics().bytes.labels(f"public.{h.table}")._value.get() > 0
    finally:
        for future in admin.delete_topics([topic], operation_timeout=10).values():
            with contextlib.suppress(Exception):
                future.result()


def test_records_lost_to_retention_mark_history_broken(
    settings: Settings, base_settings: Settings, history_factory: Callable[[], History]
) -> None:
    """The group read one record, then the topic's retention deleted the next ones before
    it came back: history has a gap, and says so."""
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)))
    h.enable()
    records = [r for n in range(3) for r in h.writer.commit(Txn().update(sample(1, note=str(n))))]
    local = own_settings(settings, "hgap", 1)
    topic = names(local).topic(h.table)
    admin: AdminClient = admin_client(base_settings)
    ensure(admin, 1, topics=[topic])
    try:
        with Producer(base_settings) as producer:
            for record in records:
                producer.produce(topic, orjson.dumps(record), key=None)
            producer.flush()
        with Consumer(local, **{"group.id": group(local)}) as reader:  # read one, then stopped
            reader.commit_offsets([TopicPartition(topic, 0, 1)])
        gone = admin.delete_records([TopicPartition(topic, 0, 3)], operation_timeout=10)
        for future in gone.values():
            future.result()
        HistoryWorker(local, h.consumer).run(timeout=5)
        with h.consumer.connect() as conn:
            found = registered(conn)[("public", h.table)]
        assert found.broken_from_us is not None
        assert "deleted by the topic's retention" in (found.broken_reason or "")
    finally:
        for future in admin.delete_topics([topic], operation_timeout=10).values():
            with contextlib.suppress(Exception):
                future.result()


def test_the_worker_waits_for_apply_to_follow_an_added_column(
    settings: Settings, base_settings: Settings, history_factory: Callable[[], History]
) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)))
    h.enable()
    with h.owner.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {h.table} ADD COLUMN extra text DEFAULT 'x'"))
    records = h.writer.commit(Txn().update(sample(1, note="new", extra="y")))
    local = own_settings(settings, "hadd", 1)
    topic = names(local).topic(h.table)
    admin: AdminClient = admin_client(base_settings)
    ensure(admin, 1, topics=[topic])
    try:
        with Producer(base_settings) as producer:
            producer.produce(topic, orjson.dumps(records[0]), key=None)
            producer.flush()
        waiting = HistoryWorker(local, h.consumer).run(timeout=5)
        assert waiting.consumed == 0 and waiting.versions == 0  # held, nothing committed
        with h.owner.begin() as conn:  # what apply does
            follow(conn, layout(conn, "public", h.table))
        done = HistoryWorker(local, h.consumer).run(max_messages=1, timeout=60)
        assert done.versions == 1
        [result] = [r for r in audit(h.consumer) if r.table == h.table]
        assert result.ok, result.samples
    finally:
        for future in admin.delete_topics([topic], operation_timeout=10).values():
            with contextlib.suppress(Exception):
                future.result()
