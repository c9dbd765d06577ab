"""The consumer run loop end to end: real broker, Postgres and Redis.

Each test gets its own topic prefix (so its own domain-event, dead-letter and
invalidation topics), its own consumer group and its own schema version (so its own
Redis namespace).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis
import sqlalchemy as sa
from confluent_kafka import Consumer as RawConsumer
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from freshline.consumers.dlq import (
    ERROR_KIND,
    ORIGINAL_SIZE,
    SOURCE_OFFSET,
    SOURCE_TOPIC,
    TRUNCATED,
    VALUE_SHA256,
)
from freshline.consumers.kafka import Consumer, Producer
from freshline.consumers.topics import ensure
from freshline.consumers.worker import Worker
from freshline.pipeline.core.keys import feature_pattern
from freshline.pipeline.core.maintenance import DerivedPath
from freshline.pipeline.core.services import kafka_security_config
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import DLQ, INVALIDATIONS
from tests.consumers.conftest import (
    PARTITIONS,
    Env,
    assert_redis_equals_postgres,
    emit,
    emit_per_user,
    insert_transaction,
    read_topic,
    wait_for,
)
from tests.helpers import FRESHLINE, REGISTRY, kafka_headers, kafka_value

pytestmark = pytest.mark.kafka


def change_user(engine: Engine, tenant: str, user: int, factor: float = 2.0) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE transactions SET amount = round(amount * CAST(:f AS "
                "numeric), 2) WHERE tenant_id = :t AND user_id = :u"
            ),
            {"f": factor, "t": tenant, "u": user},
        )


def test_a_change_and_its_event_yield_the_recomputed_entry(
    env: Env,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
) -> None:
    with engine.begin() as conn:
        txn = insert_transaction(conn, env.tenant, 4, 999.99, "m-x", "11.0.0.9")
    change_user(engine, env.tenant, 5)
    emit(
        producer,
        env,
        "transaction.created",
        {
            "tenant": env.tenant,
            "user_id": 4,
            "transaction_id": txn,
            "occurred_at": "2026-12-01T10:00:00Z",
        },
    )
    emit(
        producer,
        env,
        "transaction.updated",
        {"tenant": env.tenant, "user_id": "5", "transaction_id": 1},
    )
    producer.flush()
    totals = Worker(env.settings).run(max_messages=2, timeout=60)
    assert (totals.consumed, totals.applied, totals.dead_lettered) == (2, 2, 0)
    assert_redis_equals_postgres(engine, redis_client, env, {4, 5})
    # Invalidations went to Kafka too, one per written entry.
    got = read_topic(consumer_factory(), env.topic(INVALIDATIONS), 4, PARTITIONS)
    seen = {(m["feature_set"], m["entity"]) for m in (orjson.loads(kafka_value(x)) for x in got)}
    assert seen == {("txn_90d", "4"), ("geo", "4"), ("txn_90d", "5"), ("geo", "5")}


def test_the_worker_folds_logged_days_between_batches(env: Env, engine: Engine) -> None:
    """The derived path's triggers log the days a write changed; a consumer's fold thread
    folds them into the partials when it starts and then every interval, with nothing
    consumed: the days before the current UTC day at every fold, the current one only
    every ``bucket_fold_all_interval_ms``."""
    path = REGISTRY["txn_90d"].maintenance
    assert isinstance(path, DerivedPath)
    today = sa.text("SELECT (now() AT TIME ZONE 'UTC')::date")
    with engine.begin() as conn:
        started = conn.execute(today).scalar_one()
        conn.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, created_at) "
                "VALUES (:t, 6, 12.5, 'm-fold', now() - interval '1 day'), "
                "(:t, 6, 1.5, 'm-today', now())"
            ),
            {"t": env.tenant},
        )
    logged = sa.text(
        f"SELECT DISTINCT day FROM {path.log} WHERE tenant_id = :t AND user_id = 6 ORDER BY 1"
    )
    with engine.connect() as conn:
        assert len(conn.execute(logged, {"t": env.tenant}).all()) == 2
    settings = env.settings.model_copy(
        update={"bucket_fold_interval_ms": 60_000, "bucket_fold_all_interval_ms": 600_000}
    )
    Worker(settings).run(idle_timeout=0.2, timeout=60)
    with engine.connect() as conn:
        left = conn.execute(logged, {"t": env.tenant}).scalars().all()
        if conn.execute(today).scalar_one() != started:
            pytest.skip("the UTC day ended during the test")
    assert left == [started]
    settings = settings.model_copy(update={"bucket_fold_all_interval_ms": 0})
    Worker(settings).run(idle_timeout=0.2, timeout=60)
    (member,) = path.distinct[:1]
    with engine.connect() as conn:
        assert conn.execute(logged, {"t": env.tenant}).all() == []
        assert (
            conn.execute(
                sa.text(
                    f"SELECT count(*) FROM {path.members(member)} WHERE tenant_id = :t "
                    "AND user_id = 6 AND value = 'm-fold'"
                ),
                {"t": env.tenant},
            ).scalar_one()
            == 1
        )


def test_bad_input_is_dead_lettered_with_its_reason_and_nothing_is_lost(
    env: Env,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    admin: AdminClient,
) -> None:
    unknown = env.topic("freshline.public.payments")  # a CDC topic of an unknown table
    ensure(admin, 1, topics=[unknown])
    good = {"tenant": env.tenant, "user_id": 7, "transaction_id": 1}
    bad: list[tuple[str, bytes, str]] = [
        ("transaction.updated", b"{not json", "malformed_json"),
        ("transaction.updated", orjson.dumps({"tenant": env.tenant}), "missing_field"),
        ("transaction.updated", orjson.dumps({**good, "user_id": "7:*"}), "invalid_id"),
        ("transaction.updated", orjson.dumps({**good, "tenant": "a{b}"}), "invalid_id"),
        ("transaction.updated", b'{"tenant": "x", "pad": "' + b"x" * 5000 + b'"}', "oversized"),
    ]
    emit(producer, env, "transaction.updated", good, b"k1")
    for topic, value, _ in bad:
        emit(producer, env, topic, value, b"bad")
    producer.produce(unknown, orjson.dumps({"payload": {"op": "c", "after": {"id": 1}}}), b"u")
    emit(producer, env, "transaction.updated", {**good, "user_id": 8}, b"k2")
    producer.flush()
    settings = env.settings.model_copy(update={"max_message_bytes": 4096})
    worker = Worker(settings, topics=[env.topic("transaction.updated"), unknown])
    totals = worker.run(max_messages=8, timeout=60)
    assert totals.consumed == 8
    assert totals.applied == 2 and totals.dead_lettered == 6 and totals.skipped == 0
    assert totals.applied + totals.dead_lettered + totals.skipped == totals.consumed
    assert_redis_equals_postgres(engine, redis_client, env, {7, 8})
    dead = read_topic(consumer_factory(), env.topic(DLQ), 6, PARTITIONS)
    kinds = sorted(kafka_headers(m)[ERROR_KIND].decode() for m in dead)
    assert kinds == sorted([k for _, _, k in bad] + ["unknown_table"])
    originals = {v for _, v, _ in bad}
    for m in dead:
        headers = kafka_headers(m)
        assert headers[SOURCE_TOPIC].decode() in (env.topic("transaction.updated"), unknown)
        assert int(headers[SOURCE_OFFSET]) >= 0
        if headers[ERROR_KIND] == b"oversized":
            # Larger than the dead-letter limit: cut, with its size and digest.
            oversized = bad[-1][1]
            assert headers[TRUNCATED] == b"1"
            assert int(headers[ORIGINAL_SIZE]) == len(oversized)
            assert headers[VALUE_SHA256].decode() == hashlib.sha256(oversized).hexdigest()
            cut = kafka_value(m)
            assert oversized.startswith(cut) and len(cut) < len(oversized)
        else:
            assert m.value() in originals or m.key() == b"u"  # the record, unchanged
    admin.delete_topics([unknown], operation_timeout=10)[unknown].result()


def _group_caught_up(settings: Settings, topics: list[str]) -> bool:
    probe = RawConsumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            "group.id": settings.consumer_group,
            "enable.auto.commit": False,
            **kafka_security_config(settings),
        }
    )
    try:
        parts = [TopicPartition(t, p) for t in topics for p in range(PARTITIONS)]
        committed = probe.committed(parts, timeout=10)
        for tp in committed:
            _, high = probe.get_watermark_offsets(tp, timeout=10)
            if high > 0 and tp.offset < high:
                return False
        return True
    finally:
        probe.close()


def _spawn(env: Env, log: Path) -> subprocess.Popen[bytes]:
    s = env.settings
    child_env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": s.postgres_url,
        "FRESHLINE_REDIS_URL": s.redis_url,
        "FRESHLINE_TOPIC_PREFIX": s.topic_prefix,
        "FRESHLINE_SCHEMA_VERSION": str(s.schema_version),
        "FRESHLINE_CONSUMER_GROUP": s.consumer_group,
        "FRESHLINE_BATCH_MAX_EVENTS": "50",
        "FRESHLINE_BATCH_MAX_WAIT_MS": "20",
    }
    with log.open("ab") as sink:  # a file, not a pipe: a full pipe would block the child
        return subprocess.Popen(
            [FRESHLINE, "consume", "--metrics-port", "0"], env=child_env, stdout=sink, stderr=sink
        )


def _burst(engine: Engine, producer: Producer, env: Env, events: int) -> set[int]:
    """Change users in Postgres and emit one event per change, skewed to a few users."""
    touched: set[int] = set()
    for i in range(events):
        user = 1 + (i * 7) % 12 if i % 3 else 1 + i % env.users
        if i % 10 == 0:
            change_user(engine, env.tenant, user, 1.01)
        touched.add(user)
        emit(
            producer,
            env,
            "transaction.updated",
            {"tenant": env.tenant, "user_id": user, "transaction_id": i},
            f"{env.tenant}:{user}".encode(),
        )
    producer.flush()
    return touched


def _stored_count(client: redis.Redis, env: Env) -> int:
    return sum(1 for _ in client.scan_iter(match=feature_pattern(env.settings.schema_version)))


def test_sigkill_mid_stream_then_restart_converges(
    env: Env,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    tmp_path: Path,
) -> None:
    log = tmp_path / "consumer.log"
    touched = _burst(engine, producer, env, 3000)
    first = _spawn(env, log)
    try:
        wait_for(lambda: _stored_count(redis_client, env) > 0, "the first consumer to write")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert not _group_caught_up(env.settings, [env.topic("transaction.updated")]), (
        "the consumer finished before it was killed; the test proves nothing"
    )
    # More changes land while it is down.
    change_user(engine, env.tenant, 3, 3.0)
    emit(
        producer,
        env,
        "transaction.updated",
        {"tenant": env.tenant, "user_id": 3, "transaction_id": 1},
    )
    producer.flush()
    second = _spawn(env, log)
    try:
        wait_for(
            lambda: _group_caught_up(env.settings, [env.topic("transaction.updated")]),
            "the restarted consumer to catch up",
            deadline_s=120,
        )
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=60)
    assert second.returncode == 0, log.read_text()
    assert_redis_equals_postgres(engine, redis_client, env, touched | {3})


def test_two_processes_in_one_group_split_the_partitions(
    env: Env,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    admin: AdminClient,
    tmp_path: Path,
) -> None:
    log = tmp_path / "consumers.log"
    procs = [_spawn(env, log), _spawn(env, log)]
    try:

        def both_assigned() -> bool:
            group = admin.describe_consumer_groups([env.settings.consumer_group])
            desc = group[env.settings.consumer_group].result()
            owned = [len(m.assignment.topic_partitions) for m in desc.members]
            return len(owned) == 2 and all(n > 0 for n in owned)

        wait_for(both_assigned, "both consumers to own partitions", deadline_s=90)
        touched = _burst(engine, producer, env, 600)
        wait_for(
            lambda: _group_caught_up(env.settings, [env.topic("transaction.updated")]),
            "the group to catch up",
            deadline_s=120,
        )
        assert_redis_equals_postgres(engine, redis_client, env, touched)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
        assert [p.returncode for p in procs] == [0, 0], log.read_text()


def test_redis_down_pauses_and_retries_and_dead_letters_nothing(
    env: Env,
    engine: Engine,
    producer: Producer,
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
) -> None:
    """A real outage: the consumer's own redis-server is stopped, then started again."""
    url, stop, start = private_redis
    settings = env.settings.model_copy(update={"redis_url": url})
    emit_per_user(producer, env, "transaction.updated", (1, 2, 3))
    stop()
    worker = Worker(settings)
    done: list[object] = []
    runner = threading.Thread(target=lambda: done.append(worker.run(max_messages=3, timeout=120)))
    runner.start()
    wait_for(lambda: worker.totals.retries >= 2, "the consumer to retry while Redis is down")
    assert (worker.totals.applied, worker.totals.dead_lettered) == (0, 0)
    assert worker.totals.consumed == 0  # the batch is held, not committed
    start()
    runner.join(timeout=120)
    assert done, "the consumer did not finish after Redis came back"
    assert (worker.totals.applied, worker.totals.dead_lettered) == (3, 0)
    client = redis.Redis.from_url(url)
    assert_redis_equals_postgres(engine, client, env, {1, 2, 3})
    client.close()
