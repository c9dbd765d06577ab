"""A CDC record naming a transaction the database cannot have had is dead-lettered.

An event's transaction committed before the event was read, so its id was assigned
before then: an id at or past the database's next transaction id names no transaction
at all. Waiting for it to become visible would hold the stream for ever; a change
that is merely slow to become visible (a transaction still committing) is waited for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from freshline.consumers.dlq import ERROR_KIND
from freshline.consumers.kafka import Consumer, Producer
from freshline.consumers.processor import XID_SPAN, impossible_txids
from freshline.consumers.topics import ensure
from freshline.consumers.worker import CHECK_TXIDS_AFTER, Worker
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.topics import DLQ
from freshline.pipeline.core.types import EntityRef
from tests.consumers.conftest import (
    PARTITIONS,
    Env,
    assert_redis_equals_postgres,
    emit,
    read_topic,
    wait_for,
)
from tests.helpers import REGISTRY, kafka_headers

pytestmark = pytest.mark.kafka

CDC_TRANSACTIONS = "freshline.public.transactions"


@pytest.fixture
def cdc_topic(env: Env, admin: AdminClient) -> Iterator[str]:
    """The transactions CDC topic of the test's prefix, which the worker's default
    subscription matches."""
    name = env.topic(CDC_TRANSACTIONS)
    ensure(admin, PARTITIONS, topics=[name])
    yield name
    admin.delete_topics([name], operation_timeout=10)[name].result()


@pytest.fixture
def running(env: Env) -> Iterator[Callable[[], Worker]]:
    """``running()`` starts a worker on the test's topics in a thread; it is stopped
    (and any error it raised surfaced) after the test."""
    started: list[tuple[Worker, threading.Thread]] = []
    failures: list[BaseException] = []
    stopping = threading.Event()  # a batch held when the worker is stopped raises

    def start() -> Worker:
        worker = Worker(env.settings)

        def run() -> None:
            try:
                worker.run()
            except BaseException as exc:
                if not stopping.is_set():
                    failures.append(exc)

        thread = threading.Thread(target=run, name="impossible-txid-worker", daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    stopping.set()
    for worker, thread in started:
        worker.stop()
        thread.join(30)
    assert not failures, failures


def envelope(env: Env, user: int, txid: int) -> dict[str, Any]:
    """A Debezium update envelope of one of ``user``'s transactions, claiming ``txid``
    (as Debezium reports it: the low 32 bits)."""
    return {
        "before": None,
        "after": {"tenant_id": env.tenant, "id": 1, "user_id": user},
        "source": {
            "connector": "postgresql",
            "table": "transactions",
            "txId": txid & 0xFFFFFFFF,
            "lsn": 1,
            "ts_ms": int(time.time() * 1000),
        },
        "op": "u",
    }


def change_user(conn: sa.Connection, tenant: str, user: int) -> int:
    """Change ``user``'s transactions in ``conn``'s transaction; its transaction id."""
    conn.execute(
        sa.text(
            "UPDATE transactions SET amount = amount + 1 WHERE tenant_id = :t AND user_id = :u"
        ),
        {"t": tenant, "u": user},
    )
    return int(conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one())


def snapshot_xmax(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
            ).scalar_one()
        )


@pytest.mark.parametrize("ahead", [1000, 2**30 - 1], ids=["1000-ahead", "2**30-1-ahead"])
def test_a_record_naming_a_transaction_not_yet_issued_is_dead_lettered(
    ahead: int,
    env: Env,
    cdc_topic: str,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
    running: Callable[[], Worker],
) -> None:
    with engine.begin() as conn:
        real = change_user(conn, env.tenant, 7)
    forged = snapshot_xmax(engine) + ahead
    # One partition, in this order: the forged record, then a real change behind it.
    emit(producer, env, CDC_TRANSACTIONS, envelope(env, 8, forged), b"k")
    emit(producer, env, CDC_TRANSACTIONS, envelope(env, 7, real), b"k")
    producer.flush()
    worker = running()
    wait_for(
        lambda: worker.totals.dead_lettered == 1 and worker.totals.applied == 1,
        "the forged record dead-lettered and the real one applied",
    )
    [dead] = read_topic(consumer_factory(), env.topic(DLQ), 1, PARTITIONS)
    assert kafka_headers(dead)[ERROR_KIND] == b"impossible_txid"
    assert_redis_equals_postgres(engine, redis_client, env, {7})
    store = EntryStore(redis_client, env.settings.schema_version, registry=REGISTRY)
    assert store.read([EntityRef("txn_90d", env.tenant, "8")]) == [None]  # nothing applied


def test_a_transaction_still_running_is_waited_for_not_dead_lettered(
    env: Env,
    cdc_topic: str,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    running: Callable[[], Worker],
) -> None:
    conn = engine.connect()
    conn.begin()
    try:
        slow = change_user(conn, env.tenant, 9)
        emit(producer, env, CDC_TRANSACTIONS, envelope(env, 9, slow), b"k")
        producer.flush()
        worker = running()
        # Past the retries after which ids are checked: this one is found possible.
        wait_for(
            lambda: worker.totals.retries >= CHECK_TXIDS_AFTER + 1,
            "the batch retried past the check",
        )
        assert worker.totals.dead_lettered == 0 and worker.totals.applied == 0
        conn.commit()
    finally:
        conn.close()
    wait_for(lambda: worker.totals.applied == 1, "the change applied once visible")
    assert worker.totals.dead_lettered == 0
    assert_redis_equals_postgres(engine, redis_client, env, {9})


def test_ids_at_or_past_the_next_transaction_id_are_the_impossible_ones(engine: Engine) -> None:
    with engine.begin() as conn:  # an id that exists: committed, below the next one
        committed = int(
            conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
        )
    next_xid, none = impossible_txids(engine, [])
    assert none == frozenset() and next_xid > committed
    ahead = next_xid + 1000
    edge = next_xid + 2**30 - 1  # the farthest ahead that still reads as not yet visible
    full = next_xid + 3 * XID_SPAN  # a full xid8, three epochs ahead
    ids = [committed & 0xFFFFFFFF, ahead & 0xFFFFFFFF, edge & 0xFFFFFFFF, full]
    later, impossible = impossible_txids(engine, ids)
    assert later >= next_xid
    assert impossible == {ahead & 0xFFFFFFFF, edge & 0xFFFFFFFF, full}
