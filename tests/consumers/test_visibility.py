"""The commit-visibility window: an event can arrive before its change is visible.

Postgres flushes a commit record (which logical decoding ships to Debezium) before the
transaction is visible to new snapshots; with a synchronous standby the gap lasts the
whole wait for the standby. A recompute from a snapshot that cannot see the change
must write nothing. Here the transaction is held open, which is what such a change
looks like to every other snapshot: it has an id, its rows are not visible. (The
fault-injection suite causes the real gap, with a standby that never answers.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.events import decode
from freshline.consumers.processor import Processor
from freshline.pipeline.cache.recompute import (
    NotYetVisible,
    compute,
    snapshot_watermark,
    take_snapshot,
    unpack_watermark,
)
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.types import ChangeEvent, EntityRef
from tests.helpers import REGISTRY

TXN_90D = REGISTRY["txn_90d"]

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=10, transactions=200).tenants[0]


def open_change(engine: Engine, tenant: str, user: int) -> tuple[sa.Connection, int]:
    """An UPDATE of ``user``'s transactions, not committed; and its transaction id."""
    conn = engine.connect()
    conn.begin()
    conn.execute(
        sa.text(
            "UPDATE transactions SET amount = amount + 1000 WHERE tenant_id = :t AND user_id = :u"
        ),
        {"t": tenant, "u": user},
    )
    txid = int(conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one())
    return conn, txid


def test_debezium_events_keep_their_transaction_id() -> None:
    # Captured from Debezium (see fixtures/README.md).
    captured = json.loads((FIXTURES / "transactions_update_default_u.json").read_text())
    value = captured["value"]
    event = decode("freshline.public.transactions", None, json.dumps(value).encode())
    assert event is not None and event.txid == value["payload"]["source"]["txId"] > 0


def test_a_change_not_yet_visible_is_retried_and_never_written_stale(
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    version: int,
) -> None:
    store = EntryStore(redis_client, version, registry=REGISTRY)
    ref = EntityRef("txn_90d", tenant, "3")
    conn, txid = open_change(engine, tenant, 3)
    # The low 32 bits, as Debezium reports a transaction id.
    event = ChangeEvent(
        "transactions",
        "u",
        tenant,
        {"tenant_id": tenant, "user_id": 3, "id": 1},
        txid=txid & 0xFFFFFFFF,
    )
    processor = Processor(engine, redis_client, versions=lambda: [version], registry=REGISTRY)
    try:
        with pytest.raises(NotYetVisible) as refused:
            processor.apply([event])
        assert refused.value.txids == (txid & 0xFFFFFFFF,)
        assert store.read([ref]) == [None]  # nothing was written from the old snapshot
        conn.commit()
    finally:
        conn.close()
    processor.apply([event])  # the retry, once the change is visible
    [entry] = store.read([ref])
    assert entry is not None
    assert entry.values == compute(engine, TXN_90D, [(tenant, "3")]).values[(tenant, "3")]


def test_compute_refuses_a_snapshot_that_cannot_see_a_named_change(
    engine: Engine,
    tenant: str,
) -> None:
    conn, txid = open_change(engine, tenant, 4)
    try:
        with pytest.raises(NotYetVisible):
            compute(engine, TXN_90D, [(tenant, "4")], txids=[txid])
    finally:
        conn.rollback()
        conn.close()
    compute(engine, TXN_90D, [(tenant, "4")], txids=[txid])  # ended: nothing to wait for


def test_a_snapshot_that_sees_more_has_the_greater_watermark(
    engine: Engine,
    tenant: str,
) -> None:
    # A and B both write; B ends first, so xmax moves past both. A then ends below
    # xmax: xmax stands still, and only the in-progress list shrinks.
    a, _ = open_change(engine, tenant, 5)
    b, _ = open_change(engine, tenant, 6)
    b.commit()
    b.close()
    with engine.connect() as reader:
        before = take_snapshot(reader)
    a.commit()
    a.close()
    with engine.connect() as reader:
        after = take_snapshot(reader)
    assert after.watermark > before.watermark
    assert unpack_watermark(after.watermark)[0] > unpack_watermark(before.watermark)[0]


def test_watermarks_order_by_xmax_then_fewer_in_progress_then_clock() -> None:
    assert snapshot_watermark("10:20:", 5) > snapshot_watermark("10:19:", 9)
    assert snapshot_watermark("10:20:", 5) > snapshot_watermark("10:20:12", 9)
    assert snapshot_watermark("10:20:12", 9) > snapshot_watermark("10:20:12,15", 9)
    assert snapshot_watermark("10:20:12", 9) > snapshot_watermark("10:20:12", 5)
    # Above every LSN-based watermark written before (their top hex digit is 0).
    assert f"{snapshot_watermark('1:1:', 0):030x}"[0] == "1"
