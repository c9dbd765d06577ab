"""Reading the dead-letter topic back: ``freshline dlq list`` and ``freshline dlq replay``,
on the real broker, Postgres and Redis."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import orjson
import pytest
import redis
import sqlalchemy as sa
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from freshline.consumers.dlq import REPLAY_OF, DeadLetters
from freshline.consumers.events import EventRejected
from freshline.consumers.kafka import Consumer, Producer
from freshline.consumers.replay import DeadLetter, choose, replay
from freshline.consumers.topics import ensure
from freshline.consumers.worker import Worker
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cli.dlq import parse_since
from freshline.pipeline.core.keys import dlq_replayed_key
from freshline.pipeline.core.topics import DLQ
from freshline.pipeline.core.types import EntityRef
from tests.consumers.conftest import (
    PARTITIONS,
    Env,
    assert_redis_equals_postgres,
    emit,
    insert_transaction,
    read_topic,
)
from tests.helpers import REGISTRY, ROOT, cli, kafka_header_pairs

SETS = ("txn_90d", "geo")

pytestmark = pytest.mark.kafka


@pytest.fixture
def cdc_topic(env: Env, admin: AdminClient) -> Iterator[str]:
    """The transactions table's CDC topic under the test's prefix."""
    topic = env.topic("freshline.public.transactions")
    ensure(admin, PARTITIONS, topics=[topic])
    yield topic
    admin.delete_topics([topic], operation_timeout=10)[topic].result()


def freshline(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    """``freshline <args>`` on the test's topics and Redis database."""
    done = cli(
        *args,
        FRESHLINE_TOPIC_PREFIX=env.settings.topic_prefix,
        FRESHLINE_REDIS_URL=env.settings.redis_url,
        COLUMNS="200",
    )
    assert done.returncode == 0, done.stderr
    return done


def end_offsets(consumer: Consumer, topic: str, partition: int | None = None) -> int:
    """The end offset of ``partition`` of ``topic``, or their sum: how many records it
    ever took."""
    return sum(
        consumer.inner.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
        for p in (range(PARTITIONS) if partition is None else [partition])
    )


def envelope(tenant: str, row: dict[str, object], op: str = "c") -> dict[str, object]:
    """A Debezium change of one ``transactions`` row, as the connector writes it."""
    return {
        "payload": {
            "op": op,
            "after": {"tenant_id": tenant, **row},
            "source": {"table": "transactions", "ts_ms": int(time.time() * 1000)},
        }
    }


def stale(engine: Engine, client: redis.Redis, env: Env, users: list[int]) -> set[int]:
    """The users whose served txn_90d entry differs from Postgres's value now."""
    store = EntryStore(client, env.settings.schema_version, registry=REGISTRY)
    truth = compute(engine, REGISTRY["txn_90d"], [(env.tenant, str(u)) for u in users])
    entries = store.read([EntityRef("txn_90d", env.tenant, str(u)) for u in users])
    return {
        u
        for u, entry in zip(users, entries, strict=True)
        if entry is None or entry.values != truth.values[(env.tenant, str(u))]
    }


def test_a_consumer_on_the_wrong_repository_dead_letters_cdc_and_a_replay_repairs_it_once(
    env: Env,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    cdc_topic: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer started with FRESHLINE_REPO naming another repository knows none of
    the CDC tables: each change is dead-lettered (``unknown_table``) and committed,
    and the served entries stay stale. Once the setting is fixed, the replay sends
    the records back, the consumer applies them and the entries are right; a second
    replay sends nothing."""
    users = [4, 5]
    store = EntryStore(redis_client, env.settings.schema_version, registry=REGISTRY)
    for name in SETS:  # served and right
        store.write(compute(engine, REGISTRY[name], [(env.tenant, str(u)) for u in users]))
    assert stale(engine, redis_client, env, users) == set()
    with engine.begin() as conn:  # then both users change
        added = insert_transaction(conn, env.tenant, 4, 999.99, "m-replay", "11.0.0.9")
        moved = conn.execute(
            sa.text(
                "UPDATE transactions SET amount = amount + 1000 WHERE id = (SELECT min(id) "
                "FROM transactions WHERE tenant_id = :t AND user_id = 5) RETURNING id"
            ),
            {"t": env.tenant},
        ).scalar_one()
    for user, row_id, op in ((4, added, "c"), (5, moved, "u")):
        body = envelope(env.tenant, {"id": row_id, "user_id": user}, op)
        producer.produce(cdc_topic, orjson.dumps(body), f"{env.tenant}:{row_id}".encode())
    producer.flush()

    monkeypatch.setenv("FRESHLINE_REPO", str(ROOT / "tests" / "repos" / "shop"))
    totals = Worker(env.settings, topics=[cdc_topic]).run(max_messages=2, timeout=60)
    monkeypatch.setenv("FRESHLINE_REPO", str(ROOT / "examples" / "fraud"))  # fixed
    assert (totals.consumed, totals.dead_lettered) == (2, 2)
    assert stale(engine, redis_client, env, users) == {4, 5}

    listed = freshline(env, "dlq", "list").stdout
    [row] = [line for line in listed.splitlines() if "unknown_table" in line]
    assert cdc_topic in row and " 2 " in row, listed

    checker = consumer_factory()
    before = end_offsets(checker, cdc_topic)
    dry = freshline(env, "dlq", "replay", "--reason", "unknown_table", "--dry-run").stdout
    assert "would replay 2 dead letter(s)" in dry, dry
    assert end_offsets(checker, cdc_topic) == before
    assert not redis_client.exists(dlq_replayed_key(env.topic(DLQ)))

    done = freshline(env, "dlq", "replay", "--reason", "unknown_table").stdout
    assert f"replayed 2 to {cdc_topic}" in done and "replayed 2 dead letter(s)" in done, done
    assert end_offsets(checker, cdc_topic) == before + 2

    totals = Worker(env.settings, topics=[cdc_topic]).run(max_messages=2, timeout=60)
    assert (totals.consumed, totals.applied, totals.dead_lettered) == (2, 2, 0)
    assert_redis_equals_postgres(engine, redis_client, env, set(users))

    again = freshline(env, "dlq", "replay").stdout
    assert "replayed 0 dead letter(s); skipped 2 replayed before" in again, again
    assert end_offsets(checker, cdc_topic) == before + 2
    assert "unknown_table" in freshline(env, "dlq", "list").stdout


def test_a_cut_copy_is_never_replayed_and_a_replay_keeps_key_value_and_headers(
    env: Env,
    redis_client: redis.Redis,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    admin: AdminClient,
) -> None:
    source = env.topic("transaction.updated")
    small = {"tenant": env.tenant, "user_id": 9, "transaction_id": 1}
    emit(producer, env, "transaction.updated", small, b"k-small")
    emit(producer, env, "transaction.updated", {**small, "pad": "x" * 2000}, b"k-big")
    producer.produce(source, b"{}", b"k-headers", headers=[("trace-id", b"t1")])
    producer.flush()
    records = {m.key(): m for m in read_topic(consumer_factory(), source, 3, PARTITIONS)}
    dlq = env.topic(DLQ)
    DeadLetters(producer, dlq, max_bytes=1000).send(
        records[b"k-big"], EventRejected("2100 bytes, over the limit", kind="oversized")
    )
    DeadLetters(producer, dlq).send(records[b"k-small"], ValueError("boom"))
    DeadLetters(producer, dlq).send(records[b"k-headers"], ValueError("boom"))
    producer.flush()

    settings = env.settings
    cut = replay(settings, redis_client, reason="oversized")
    assert (sum(cut.replayed.values()), cut.not_replayable) == (0, 1)
    dry = replay(settings, redis_client, reason="ValueError", dry_run=True)
    assert dict(dry.replayed) == {source: 2}
    later = int(time.time() * 1000) + 60_000
    assert not replay(settings, redis_client, since_ms=later).replayed  # none that recent
    done = replay(settings, redis_client, reason="ValueError")
    assert dict(done.replayed) == {source: 2} and done.already == 0
    again = replay(settings, redis_client)
    assert not again.replayed and (again.already, again.not_replayable) == (2, 1)

    back = [
        m for m in read_topic(consumer_factory(), source, 5, PARTITIONS) if (m.offset() or 0) > 0
    ]
    back = [m for m in back if any(k == REPLAY_OF for k, _ in kafka_header_pairs(m))]
    assert sorted(m.key() or b"" for m in back) == [b"k-headers", b"k-small"]
    for m in back:
        original = records[m.key()]
        assert m.value() == original.value()
        headers = kafka_header_pairs(m)
        assert headers[:-1] == kafka_header_pairs(original)  # freshline's are gone
        name, value = headers[-1]
        assert name == REPLAY_OF and isinstance(value, bytes)
        assert value.decode().startswith(f"{dlq}:")

    # Once the dead letters leave the topic (retention), the next replay forgets them.
    ledger = dlq_replayed_key(dlq)
    assert redis_client.hlen(ledger) == 2
    ends = [
        TopicPartition(dlq, p, end_offsets(consumer_factory(), dlq, p)) for p in range(PARTITIONS)
    ]
    for future in admin.delete_records(ends).values():
        future.result()
    assert replay(settings, redis_client).pruned == 2
    assert not redis_client.exists(ledger)


def test_reason_matches_the_kind_or_the_class_and_since_is_inclusive() -> None:
    letter = DeadLetter(
        partition=0,
        offset=3,
        timestamp_ms=1_000,
        error_class="EventRejected",
        kind="unknown_table",
        source_topic="t",
        truncated=False,
        key=None,
        value=b"{}",
        headers=[],
    )
    assert choose(letter, None, None)
    assert choose(letter, "unknown_table", 1_000) and choose(letter, "EventRejected", None)
    assert not choose(letter, "DataError", None) and not choose(letter, None, 1_001)
    now = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
    assert parse_since("2h", now) == datetime(2026, 12, 5, 10, 0, tzinfo=UTC)
    assert parse_since("2026-12-05T09:30", now) == datetime(2026, 12, 5, 9, 30, tzinfo=UTC)
    assert parse_since("2026-12-05T09:30+01:00", now).hour == 9
