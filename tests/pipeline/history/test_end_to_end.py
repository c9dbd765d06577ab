"""History end to end: plain SQL -> WAL -> Debezium (Kafka Connect) -> ``freshline
record``'s worker -> history tables, audited against the table.

One connector of the module's own (its own topic prefix, slot and topics) captures one
table of every type the recorder converts; the backfill runs while writers commit, then
a stream of inserts, updates (twice in one transaction, an unchanged TOASTed column),
deletes and a truncate follows. The history audit must find no difference, with the
real connector's encodings of timestamp, date, bytea, numeric and interval.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from freshline.consumers.history import HistoryWorker
from freshline.consumers.kafka import admin_client
from freshline.consumers.metrics import history_metrics
from freshline.consumers.topics import ensure_cdc_topics
from freshline.pipeline.cdc.connect import (
    ConnectClient,
    connector_config,
    drop_slot,
    names,
    streaming,
)
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.history.audit import audit
from freshline.pipeline.history.backfill import backfill
from freshline.pipeline.history.tables import create, layout, qualified, registered
from tests.consumers.conftest import own_settings, wait_for
from tests.pipeline.history.conftest import KEEP, History, Txn, sample

pytestmark = [pytest.mark.kafka, pytest.mark.connect]

DEADLINE_S = 90.0


@pytest.fixture(scope="module")
def admin(base_settings: Settings) -> AdminClient:
    return admin_client(base_settings)


@dataclass
class Live:
    history: History
    worker: HistoryWorker


@pytest.fixture
def live(
    settings: Settings,
    engine: Engine,
    admin: AdminClient,
    history_factory: Callable[[], History],
) -> Iterator[Live]:
    h = history_factory()
    local = own_settings(settings, "hist", 2)
    owned = names(local)
    client = ConnectClient(local.connect_url)
    with h.owner.begin() as conn:
        conn.execute(sa.text(f"ALTER PUBLICATION {owned.publication} ADD TABLE {h.table}"))
    topic = owned.topic(h.table)
    ensure_cdc_topics(local, [topic])
    client.put_config(
        owned.connector,
        connector_config(local, owned, snapshot_mode="no_data", tables=[h.table]),
    )
    worker = HistoryWorker(local, h.consumer)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:  # surfaced by the test, not lost in the thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="history-recorder", daemon=True)
    try:
        wait_for(lambda: streaming(client, engine, owned), "the connector's slot", DEADLINE_S)
        thread.start()
        yield Live(h, worker)
    finally:
        worker.stop()
        thread.join(timeout=30)
        client.delete(owned.connector)
        drop_slot(engine, owned.slot)
        with h.owner.begin() as conn:
            conn.execute(sa.text(f"ALTER PUBLICATION {owned.publication} DROP TABLE {h.table}"))
        topics = [topic, owned.heartbeat_topic]
        for future in admin.delete_topics(topics, operation_timeout=10).values():
            with contextlib.suppress(Exception):  # the heartbeat topic may never exist
                future.result()
    assert not failure, failure


def test_history_from_the_real_connector_audits_clean(live: Live) -> None:
    h = live.history
    h.writer.commit(Txn().insert(sample(1)).insert(sample(2)).insert(sample(3)))
    stop = threading.Event()

    def write() -> None:  # commits before, during and after S0
        n = 0
        while not stop.is_set() or n < 10:
            h.writer.commit(Txn().update(sample(1, note=f"w{n}")).insert(sample(100 + n)))
            n += 1

    writer = threading.Thread(target=write)
    writer.start()
    with h.owner.begin() as conn:
        h.found = layout(conn, "public", h.table)
        create(conn, h.found, None)
    h.s0 = backfill(h.owner, [h.found])
    stop.set()
    writer.join()
    h.writer.commit(Txn().update(sample(2, note="a")).update(sample(2, note="b")))
    h.writer.commit(Txn().update(sample(3, note="toast", big=KEEP)))
    h.writer.commit(Txn().delete(100).insert(sample(4)))
    h.writer.commit(Txn().truncate().insert(sample(5)).insert(sample(6)))
    last = h.writer.commit(Txn().update(sample(6, amount=-1, blob=b"\x00\x01")))

    results = audit(h.consumer, DEADLINE_S)
    mine = [r for r in results if r.table == h.table]
    assert mine and mine[0].ok, mine[0].samples
    assert live.worker.totals.malformed == 0
    with h.owner.connect() as conn:
        assert (
            conn.execute(
                sa.text(
                    f"SELECT count(*) FROM {qualified(h.found.history)} "
                    "WHERE id = 2 AND note IN ('a', 'b')"
                )
            ).scalar_one()
            == 1
        )  # two updates in one transaction: one version

    # Complete: every partition read to its end after a heartbeat later than the last commit.
    committed_us = last[0]["source"]["ts_us"]

    def complete() -> bool:
        with h.consumer.connect() as conn:
            found = registered(conn)[("public", h.table)]
        return found.complete_to_us is not None and found.complete_to_us >= committed_us

    wait_for(complete, "history complete past the last commit", DEADLINE_S)

    # What the recorder reports (its /metrics): versions made, size, completeness lag.
    metrics = history_metrics()
    table = f"public.{h.table}"
    assert metrics.versions.labels(table)._value.get() > 0
    live.worker.report()
    assert metrics.bytes.labels(table)._value.get() > 0
    assert metrics.broken.labels(table)._value.get() == 0
