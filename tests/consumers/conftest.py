"""Kafka fixtures on the real broker: unique topics per test, a producer, consumers.

Nothing here sleeps: every wait polls a condition until a deadline.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import redis
import sqlalchemy as sa
from confluent_kafka import Message, TopicPartition
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.kafka import Consumer, Producer, admin_client
from freshline.consumers.topics import ensure, managed_topics
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import qualified
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, fresh_version, wait_until

DEADLINE_S = 30.0
PARTITIONS = 4


def wait_for(condition: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` at the deadline."""
    if not wait_until(condition, deadline_s, interval=0.05):
        pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="session")
def admin(base_settings: Settings) -> AdminClient:
    return admin_client(base_settings)


def topic_exists(admin: AdminClient, name: str, partitions: int) -> bool:
    found = admin.list_topics(name, timeout=5).topics.get(name)
    return found is not None and found.error is None and len(found.partitions) == partitions


@pytest.fixture
def topic_factory(admin: AdminClient) -> Iterator[Callable[..., str]]:
    """``topic_factory("dlq", partitions=3)`` creates a uniquely named topic, deleted after."""
    made: list[str] = []

    def make(label: str = "t", partitions: int = 1) -> str:
        name = f"test.{label}.{uuid.uuid4().hex[:10]}"
        ensure(admin, partitions, topics=[name])
        made.append(name)
        wait_for(lambda: topic_exists(admin, name, partitions), f"topic {name}")
        return name

    yield make
    if made:
        for future in admin.delete_topics(made, operation_timeout=10).values():
            future.result()


@pytest.fixture
def producer(base_settings: Settings) -> Iterator[Producer]:
    with Producer(base_settings) as p:
        yield p


@pytest.fixture
def consumer_factory(base_settings: Settings) -> Iterator[Callable[..., Consumer]]:
    """Consumers in fresh groups (unless ``group`` is given), closed after the test."""
    made: list[Consumer] = []

    def make(group: str | None = None, **overrides: Any) -> Consumer:
        config = {"group.id": group or f"test-{uuid.uuid4().hex[:10]}", **overrides}
        consumer = Consumer(base_settings, **config)
        made.append(consumer)
        return consumer

    yield make
    for consumer in made:
        consumer.close()


def read_topic(
    consumer: Consumer, topic: str, count: int, partitions: int = 1, batch: int = 100
) -> list[Message]:
    """Assign every partition of ``topic`` from the start and read ``count`` records,
    ``batch`` at most at a time."""
    consumer.inner.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got: list[Message] = []

    def more() -> bool:
        got.extend(consumer.consume(batch, timeout=0.2))
        return len(got) >= count

    wait_for(more, f"{count} records on {topic}")
    return got


@dataclass
class Env:
    settings: Settings
    tenant: str
    users: int

    def topic(self, name: str) -> str:
        return qualified(self.settings, name)


def own_settings(settings: Settings, name: str, partitions: int = PARTITIONS) -> Settings:
    """``settings`` for consumers of a test's own: topics under a prefix of its own
    (``name`` and a random tag), its own consumer group and schema version, topics of
    ``partitions`` partitions, and batches that wait at most 20 ms."""
    tag = f"{name}{uuid.uuid4().hex[:8]}"
    return settings.model_copy(
        update={
            "topic_prefix": f"{tag}.",
            "consumer_group": f"test-{tag}",
            "schema_version": fresh_version(),
            "topic_partitions": partitions,
            "batch_max_wait_ms": 20,
        }
    )


@pytest.fixture
def env(
    settings: Settings, admin: AdminClient, tenant_factory: Callable[..., SeedSummary]
) -> Iterator[Env]:
    local = own_settings(settings, "test")
    topics = managed_topics(local)
    ensure(admin, PARTITIONS, topics=topics)
    seeded = tenant_factory(users=60, transactions=1500)
    yield Env(local, seeded.tenants[0], seeded.users)
    for future in admin.delete_topics(topics, operation_timeout=10).values():
        future.result()


@contextmanager
def own_topic(env: Env, admin: AdminClient, name: str) -> Iterator[str]:
    """The topic ``name`` under the test's prefix, of one partition, deleted after."""
    topic = env.topic(name)
    ensure(admin, 1, topics=[topic])
    yield topic
    admin.delete_topics([topic], operation_timeout=10)[topic].result()


def emit(
    producer: Producer,
    env: Env,
    topic: str,
    body: dict[str, object] | bytes,
    key: bytes | None = None,
) -> None:
    value = body if isinstance(body, bytes) else orjson.dumps(body)
    producer.produce(env.topic(topic), value, key)


def emit_per_user(
    producer: Producer,
    env: Env,
    topic: str,
    users: Iterable[int],
    key: Callable[[int], bytes | None] = lambda user: None,
) -> None:
    """One ``topic`` event per user, of a transaction whose id is the user's, keyed by
    ``key(user)``; then flush."""
    for user in users:
        body = {"tenant": env.tenant, "user_id": user, "transaction_id": user}
        emit(producer, env, topic, body, key(user))
    producer.flush()


def insert_transaction(
    conn: sa.Connection,
    tenant: str,
    user: int,
    amount: float,
    merchant: str,
    ip: str,
    device: str | None = None,
) -> int:
    """Insert one transaction of ``user`` in ``conn``'s transaction; its id."""
    return int(
        conn.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, device_id, ip) "
                "VALUES (:t, :u, :a, :m, :d, :ip) RETURNING id"
            ),
            {"t": tenant, "u": user, "a": amount, "m": merchant, "d": device, "ip": ip},
        ).scalar_one()
    )


def assert_redis_equals_postgres(
    engine: Engine, client: redis.Redis, env: Env, users: set[int]
) -> None:
    store = EntryStore(client, env.settings.schema_version, registry=REGISTRY)
    for name in ("txn_90d", "geo"):
        truth = compute(engine, REGISTRY[name], [(env.tenant, str(u)) for u in users])
        entries = store.read([EntityRef(name, env.tenant, str(u)) for u in sorted(users)])
        for user, entry in zip(sorted(users), entries, strict=True):
            assert entry is not None, (name, user)
            assert entry.values == truth.values[(env.tenant, str(user))], (name, user)
