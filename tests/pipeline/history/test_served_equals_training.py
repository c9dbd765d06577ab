"""What was served equals the training set, with history from the real change stream.

The fraud tables are captured by a connector of the module's own (its topic prefix and
slot; the migrations' publication), history is created and backfilled from S0, and ``freshline
record``'s worker (:class:`freshline.consumers.history.HistoryWorker`) records every change. A
tenant's transactions then see an insert, a correction, a move to another user, a
delete, and a late commit (a read while the inserting transaction is still open). After
each, the online path computes the three feature sets as the consumers do
(:func:`~freshline.pipeline.cache.recompute.compute`, one statement each), naming the snapshot and
``as_of`` its entries carry. Once history is complete past the last read, the training
set gives every read back: ``AtSnapshot`` of the read's snapshot, and ``AtCommitTime``
of its ``as_of`` (commit times from the stream).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from freshline.consumers.history import HistoryWorker
from freshline.consumers.kafka import admin_client
from freshline.consumers.topics import ensure_cdc_topics
from freshline.pipeline.cache.recompute import Batch, compute
from freshline.pipeline.cdc.connect import (
    ConnectClient,
    ConnectError,
    connector_config,
    drop_slot,
    names,
    streaming,
)
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.history import tables
from freshline.pipeline.history.backfill import backfill
from freshline.pipeline.history.evaluator import AtCommitTime, AtSnapshot, Evaluator
from tests.consumers.conftest import own_settings, wait_for
from tests.helpers import REGISTRY, role_engine

pytestmark = [pytest.mark.kafka, pytest.mark.connect]

DEADLINE_S = 90.0
CAPTURED = ("transactions", "users", "user_devices", "devices", "geoip")


@pytest.fixture(scope="module")
def recorded(settings: Settings, engine: Engine) -> Iterator[None]:
    local = own_settings(settings, "train", 2)
    owned = names(local)
    client = ConnectClient(local.connect_url)
    try:
        client.request("GET", "/connectors")
    except ConnectError as exc:  # the stack's Connect refusing its own login is no test result
        if exc.status != 401:
            raise
        pytest.skip(f"Kafka Connect refuses the stack's login: {exc}")
    admin: AdminClient = admin_client(settings)
    consumer = role_engine(settings, "FRESHLINE_STACK_POSTGRES_CONSUMER_URL")
    cdc_topics = [owned.topic(t) for t in CAPTURED]
    ensure_cdc_topics(local, cdc_topics)
    client.put_config(
        owned.connector,
        connector_config(local, owned, snapshot_mode="no_data", tables=list(CAPTURED)),
    )
    worker = HistoryWorker(local, consumer)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:  # surfaced by the test, not lost in the thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="history-recorder", daemon=True)
    found = []
    try:
        wait_for(lambda: streaming(client, engine, owned), "the connector's slot", DEADLINE_S)
        with engine.begin() as conn:
            for table in CAPTURED:
                found.append(tables.layout(conn, "public", table))
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {tables.qualified(found[-1].history)}"))
                tables.create(conn, found[-1], None)
        backfill(engine, found)
        thread.start()
        yield
    finally:
        worker.stop()
        thread.join(timeout=30)
        client.delete(owned.connector)
        drop_slot(engine, owned.slot)
        with engine.begin() as conn:
            for layout in found:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {tables.qualified(layout.history)}"))
                conn.execute(
                    sa.text("DELETE FROM freshline.history_tables WHERE source_table = :t"),
                    {"t": layout.table},
                )
        for future in admin.delete_topics(
            [*cdc_topics, owned.heartbeat_topic], operation_timeout=10
        ).values():
            with contextlib.suppress(Exception):  # the heartbeat topic may never exist
                future.result()
        consumer.dispose()
    assert not failure, failure


def _serve(api: Engine, refs: list[tuple[str, str]]) -> list[Batch]:
    return [compute(api, fs, refs) for fs in REGISTRY]


def test_the_training_set_gives_back_every_served_value(
    recorded: None, engine: Engine, api: Engine
) -> None:
    tenant = f"e{uuid.uuid4().hex[:10]}"
    refs = [(tenant, "1"), (tenant, "2")]
    add = sa.text(
        "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, device_id, ip, "
        "created_at) VALUES (:t, :u, :a, 'm1', 'd1', '10.9.9.9', now() - interval '1 hour') "
        "RETURNING id"
    )
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO freshline.tenants (id, name) VALUES (:t, :t)"), {"t": tenant}
        )
        conn.execute(
            sa.text("INSERT INTO users (tenant_id, id) VALUES (:t, 1), (:t, 2)"), {"t": tenant}
        )
        conn.execute(
            sa.text(
                "INSERT INTO devices (tenant_id, id, fingerprint, first_seen) "
                "VALUES (:t, 'd1', 'f', now())"
            ),
            {"t": tenant},
        )
        conn.execute(sa.text("INSERT INTO user_devices VALUES (:t, 1, 'd1')"), {"t": tenant})
    served = _serve(api, refs)
    with engine.begin() as conn:
        first = conn.execute(add, {"t": tenant, "u": 1, "a": "10.00"}).scalar_one()
        conn.execute(add, {"t": tenant, "u": 1, "a": "20.00"})
    served += _serve(api, refs)
    changes: list[tuple[str, dict[str, Any]]] = [
        ("UPDATE transactions SET amount = 15 WHERE tenant_id = :t AND id = :i", {}),  # correction
        ("UPDATE transactions SET user_id = 2 WHERE tenant_id = :t AND id = :i", {}),  # move
        ("DELETE FROM transactions WHERE tenant_id = :t AND id = :i", {}),  # delete
    ]
    for statement, _ in changes:
        with engine.begin() as conn:
            conn.execute(sa.text(statement), {"t": tenant, "i": first})
        served += _serve(api, refs)
    with engine.begin() as conn:  # a late commit: read while it is open, and after
        conn.execute(add, {"t": tenant, "u": 2, "a": "7.00"})
        served += _serve(api, refs)
    served += _serve(api, refs)
    last = max(b.as_of_us for b in served)

    def complete() -> bool:
        with api.connect() as conn:
            found = tables.registered(conn)
        return all(
            (c := found[("public", t)]).complete_to_us is not None and c.complete_to_us >= last
            for t in CAPTURED
        )

    wait_for(complete, "history complete past the last read", DEADLINE_S)
    with api.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        evaluator = Evaluator.on(conn)
        for batch in served:
            as_of = tables.from_epoch_us(batch.as_of_us)
            snap = AtSnapshot(batch.snapshot, as_of)
            at_snapshot = evaluator.evaluate(batch.feature_set, {snap: refs})[snap]
            assert at_snapshot == batch.values, (batch.feature_set.name, batch.snapshot)
            # no transaction ran across the reads but the late one, which commits after
            # the read that saw it open: the commit-time reading is the same
            at = AtCommitTime(as_of)
            at_commit = evaluator.evaluate(batch.feature_set, {at: refs})[at]
            assert at_commit == batch.values, (batch.feature_set.name, as_of)
    assert {
        b.values[(tenant, "1")]["txn_count"] for b in served if b.feature_set.name == "txn_90d"
    } == {0, 1, 2}
