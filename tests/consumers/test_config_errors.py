"""A configuration error pauses the consumer; only an event's own bad data is dead-lettered.

A deploy pointer that does not parse, or a grant the consumers' role lacks, is not the
events' fault: the worker holds the batch (nothing dead-lettered, nothing committed),
says so once with the fix, and applies the same events once it is fixed. In the same
run an event whose own data is bad is still dead-lettered, whether decoding refuses it
or Postgres does, and counted once however often its batch was held.
Each test uses a pointer of its own (``Pointer.scoped``), never the shared one, and
changes grants only in this session's own database.
"""

from __future__ import annotations

import logging
import operator
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import orjson
import pytest
import redis
import sqlalchemy as sa
from confluent_kafka import Consumer as RawConsumer
from confluent_kafka import Message, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import REGISTRY as METRICS
from sqlalchemy.engine import Engine, make_url

from freshline.consumers.dlq import ERROR_CLASS, ERROR_KIND
from freshline.consumers.failures import CONFIGURATION, DATA_ERRORS, RETRIED, cause
from freshline.consumers.kafka import Consumer, Producer
from freshline.consumers.worker import Worker
from freshline.pipeline.cache.versions import Pointer, WriteVersions
from freshline.pipeline.core.errors import ConfigError, DeployError, InvalidId, LockMismatch
from freshline.pipeline.core.services import kafka_security_config
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import DLQ
from tests.consumers.conftest import (
    PARTITIONS,
    Env,
    assert_redis_equals_postgres,
    emit,
    emit_per_user,
    own_topic,
    read_topic,
    wait_for,
)
from tests.consumers.test_worker_faults import Running
from tests.helpers import REGISTRY, role_url

pytestmark = pytest.mark.kafka

PAUSED = "freshline_consumer_paused"
CONFIG_RETRIES = "freshline_config_retries_total"
BAD_RANGE = orjson.dumps(
    {
        "payload": {
            "op": "c",
            "after": {"ip_from": "not-an-ip", "ip_to": "10.0.0.1", "country": "AA"},
            "source": {"table": "geoip"},
        }
    }
)
"""A geoip row that decodes (no id in it is bad) but Postgres refuses: its own bad data."""


def sample(name: str, cause: str) -> float:
    return METRICS.get_sample_value(name, {"cause": cause}) or 0.0


def offsets(env: Env, topic: str, partitions: int) -> tuple[list[int], list[int]]:
    """The group's committed offset (0: none) and the end offset, per partition."""
    raw = RawConsumer(
        {
            "bootstrap.servers": env.settings.kafka_bootstrap,
            "group.id": env.settings.consumer_group,
            "enable.auto.commit": False,
            **kafka_security_config(env.settings),
        }
    )
    try:
        parts = [TopicPartition(topic, p) for p in range(partitions)]
        done = [max(tp.offset, 0) for tp in raw.committed(parts, timeout=10)]
        ends = [raw.get_watermark_offsets(tp, timeout=10)[1] for tp in parts]
        return done, ends
    finally:
        raw.close()


def headers(msg: Message) -> dict[str, bytes | None]:
    raw = msg.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return {k: v.encode() if isinstance(v, str) else v for k, v in pairs}


def paused_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "freshline.consumer" and r.levelno >= logging.ERROR
    ]


@contextmanager
def held(worker: Worker, label: str, retries: int, what: str) -> Iterator[Running]:
    """Run ``worker`` until it has retried its batch ``retries`` times for a ``label``
    cause, check it held the batch (nothing consumed, applied or dead-lettered), and
    yield it running; it is stopped on the way out."""
    retried = sample(CONFIG_RETRIES, label)
    running = Running(worker, timeout=180)
    try:
        running.wait(
            lambda: (
                sample(CONFIG_RETRIES, label) >= retried + retries or worker.totals.consumed > 0
            ),
            what,
        )
        totals = worker.totals
        assert (totals.consumed, totals.applied, totals.dead_lettered) == (0, 0, 0)
        yield running
    finally:
        running.stop()


def paused_once(env: Env, topic: str, label: str, caplog: pytest.LogCaptureFixture) -> str:
    """Check the pause shows: nothing of ``topic`` committed, the paused gauge up for
    ``label``, and one error line for the whole pause (not one per retry); that line."""
    assert offsets(env, topic, PARTITIONS)[0] == [0] * PARTITIONS
    assert sample(PAUSED, label) == 1
    said = paused_lines(caplog)
    assert len(said) == 1, said
    return said[0]


@contextmanager
def without_select(engine: Engine, table: str, role: str) -> Iterator[Callable[[], None]]:
    """``role`` loses SELECT on ``table``; yields the function that grants it back, which
    also runs on the way out."""

    def grant() -> None:
        with engine.begin() as conn:
            conn.execute(sa.text(f'GRANT SELECT ON {table} TO "{role}"'))

    with engine.begin() as conn:
        conn.execute(sa.text(f'REVOKE SELECT ON {table} FROM "{role}"'))
    try:
        yield grant
    finally:
        grant()


@pytest.fixture
def geoip_topic(env: Env, admin: AdminClient) -> Iterator[str]:
    """The geoip table's CDC topic under the test's prefix."""
    with own_topic(env, admin, "freshline.public.geoip") as topic:
        yield topic


def test_a_malformed_deploy_pointer_pauses_the_stream_and_dead_letters_nothing(
    env: Env,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    geoip_topic: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="freshline.consumer")
    pointer = Pointer.scoped(f"test-{uuid.uuid4().hex[:10]}")
    redis_client.set(pointer.active_key, "2 ")  # a trailing space: not a schema version
    created = env.topic("transaction.created")
    users = {4, 5, 6}
    emit_per_user(
        producer, env, "transaction.created", sorted(users), lambda u: f"{env.tenant}:{u}".encode()
    )
    worker = Worker(
        env.settings,
        topics=[created, geoip_topic],
        versions=WriteVersions(redis_client, env.settings, pointer=pointer, registry=REGISTRY),
    )
    with held(
        worker,
        "deploy",
        3,
        "the worker to hold its batch and retry it while the pointer is malformed",
    ) as running:
        said = paused_once(env, created, "deploy", caplog)
        assert pointer.active_key in said and "freshline deploy flip" in said

        # The operator sets the pointer right. Meanwhile two records with bad data of
        # their own arrive: an id decoding refuses, and a geoip row Postgres refuses.
        redis_client.set(pointer.active_key, str(env.settings.schema_version))
        emit(
            producer,
            env,
            "transaction.created",
            {"tenant": env.tenant, "user_id": "7:*", "transaction_id": 7},
            b"bad-id",
        )
        producer.produce(geoip_topic, BAD_RANGE, b"bad-range")
        producer.flush()
        running.wait(
            lambda: worker.totals.consumed >= 5,
            "the held events applied once the pointer is fixed",
        )
        for topic, partitions in ((created, PARTITIONS), (geoip_topic, 1)):
            wait_for(
                lambda t=topic, p=partitions: operator.eq(*offsets(env, t, p)),  # type: ignore[misc]
                f"the group's offsets on {topic} to reach its end",
            )
    totals = worker.totals
    assert (totals.consumed, totals.applied, totals.dead_lettered, totals.skipped) == (5, 3, 2, 0)
    assert totals.applied + totals.dead_lettered + totals.skipped == totals.consumed
    assert sample(PAUSED, "deploy") == 0
    assert_redis_equals_postgres(engine, redis_client, env, users)
    dead = read_topic(consumer_factory(), env.topic(DLQ), 2, PARTITIONS)
    reasons = sorted((headers(m).get(ERROR_CLASS), headers(m).get(ERROR_KIND)) for m in dead)
    assert reasons == [(b"DataError", None), (b"EventRejected", b"invalid_id")]
    assert {m.key() for m in dead} == {b"bad-id", b"bad-range"}


def as_consumer_role(env: Env, **update: object) -> tuple[Settings, str]:
    """The test's settings logged in to its database as the consumers' least-privilege
    role, folding buckets at once, with ``update``; and that role."""
    url = role_url(env.settings, "FRESHLINE_STACK_POSTGRES_CONSUMER_URL")
    settings = env.settings.model_copy(
        update={"postgres_url": url, "bucket_fold_interval_ms": 0, **update}
    )
    return settings, str(make_url(url).username)


def test_a_missing_grant_pauses_the_stream_until_it_is_granted(
    env: Env,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="freshline.consumer")
    settings, role = as_consumer_role(env)
    created = env.topic("transaction.created")
    users = {8, 9}
    emit_per_user(
        producer, env, "transaction.created", sorted(users), lambda u: f"{env.tenant}:{u}".encode()
    )
    worker = Worker(settings, topics=[created])
    what = "the worker to hold its batch and retry it while the grant is missing"
    with (
        without_select(engine, "transactions", role) as grant,
        held(worker, "permission", 2, what) as running,
    ):
        said = paused_once(env, created, "permission", caplog)
        assert "permission denied for table transactions" in said
        assert f"grant the role {role} (FRESHLINE_POSTGRES_URL)" in said
        grant()
        running.wait(
            lambda: worker.totals.consumed >= len(users),
            "the held events applied once the grant is back",
        )
    totals = worker.totals
    assert (totals.consumed, totals.applied, totals.dead_lettered) == (2, 2, 0)
    assert sample(PAUSED, "permission") == 0
    assert_redis_equals_postgres(engine, redis_client, env, users)


def test_a_grant_missing_while_a_bad_event_is_isolated_holds_the_batch_and_counts_once(
    env: Env,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    geoip_topic: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The batch fails on the bad geoip row (data), so its events are applied one by
    one: the bad row fails alone, then the good change fails on a missing grant
    (configuration). The whole batch is held, the bad row not yet dead-lettered nor
    counted; once the grant is back it is dead-lettered once and the change applied."""
    caplog.set_level(logging.INFO, logger="freshline.consumer")
    settings, role = as_consumer_role(
        env,
        batch_max_events=2,  # one batch of both records, taken as soon as both are in
        batch_max_wait_ms=5_000,
    )
    # One partition, in this order: the bad row is isolated first. The good change is
    # a transactions row on the same topic (Debezium's source.table names the table).
    good = {"id": 10, "tenant_id": env.tenant, "user_id": 10, "amount": 1.0}
    producer.produce(geoip_topic, BAD_RANGE, b"bad-range")
    producer.produce(
        geoip_topic,
        orjson.dumps({"payload": {"op": "c", "after": good, "source": {"table": "transactions"}}}),
        b"good",
    )
    producer.flush()
    worker = Worker(settings, topics=[geoip_topic])
    what = "the worker to hold its batch while the grant is missing"
    with (
        without_select(engine, "geoip", role) as grant,  # the geo set reads geoip; routing does not
        held(worker, "permission", 3, what) as running,
    ):
        said = [r.getMessage() for r in caplog.records if r.name == "freshline.consumer"]
        assert any(m.startswith("batch failed") for m in said), said  # one by one
        assert "permission denied for table geoip" in paused_lines(caplog)[0]
        grant()
        running.wait(
            lambda: worker.totals.consumed >= 2,
            "the held batch applied once the grant is back",
        )
    totals = worker.totals
    assert (totals.consumed, totals.applied, totals.dead_lettered, totals.skipped) == (2, 1, 1, 0)
    assert_redis_equals_postgres(engine, redis_client, env, {10})
    [dead] = read_topic(consumer_factory(), env.topic(DLQ), 1, PARTITIONS)
    assert dead.key() == b"bad-range" and headers(dead).get(ERROR_CLASS) == b"DataError"


@pytest.mark.parametrize(
    ("error", "label"),
    [
        (DeployError("the pointer"), "deploy"),
        (LockMismatch("the lock"), "lock"),
        (ConfigError("maxmemory-policy allkeys-lru"), "settings"),
        (redis.exceptions.NoPermissionError("NOPERM"), "permission"),
        (redis.exceptions.AuthenticationError("WRONGPASS"), "permission"),
    ],
)
def test_what_is_not_an_events_fault_is_held_not_dead_lettered(
    error: BaseException, label: str
) -> None:
    assert isinstance(error, RETRIED) and cause(error) == label
    # Redis's AuthenticationError is a ConnectionError too: the worker catches
    # configuration first, so it is labelled and logged as one.
    assert isinstance(error, CONFIGURATION)


def test_an_events_own_bad_data_is_dead_lettered() -> None:
    bad = InvalidId("entity", "7:*", "not a key")
    assert isinstance(bad, DATA_ERRORS) and not isinstance(bad, RETRIED)
