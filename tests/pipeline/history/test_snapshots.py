"""Entries name their snapshot: every computation keeps its full ``pg_current_snapshot()``
and ``as_of`` by watermark, and every session freshline opens is in UTC."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.processor import Processor
from freshline.pipeline.cache.readthrough import Hooks, ReadThrough
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.keys import feature_pattern
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import ChangeEvent, EntityRef
from freshline.pipeline.history.snapshots import keeper, snapshot_of, snapshots_of
from freshline.pipeline.history.tables import epoch_us
from tests.consumers.conftest import insert_transaction
from tests.helpers import REGISTRY, drop_database, recreate_database, role_engine


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=20, transactions=300).tenants[0]


def test_a_computation_names_its_full_snapshot_and_as_of(engine: Engine, tenant: str) -> None:
    with engine.connect() as running:  # a transaction in progress: in the snapshot's xip
        running.execute(sa.text("SELECT pg_current_xact_id()"))
        txid = running.execute(sa.text("SELECT pg_current_xact_id()::text")).scalar_one()
        batch = compute(engine, REGISTRY["txn_90d"], [(tenant, "1")])
        running.rollback()
    _, xmax, xip = batch.snapshot.split(":")
    assert txid in xip.split(",") or int(txid) >= int(xmax), batch.snapshot
    as_of = dt.datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=dt.UTC)
    pinned = compute(engine, REGISTRY["txn_90d"], [(tenant, "1")], as_of=as_of)
    assert pinned.as_of_us == epoch_us(as_of)
    keeper(engine)([batch, pinned])
    kept = snapshot_of(engine, batch.watermark)
    assert kept is not None and kept.snapshot == batch.snapshot
    assert kept.as_of_us == batch.as_of_us
    with engine.connect() as conn:  # what the evaluator asks of it
        assert not conn.execute(
            sa.text("SELECT pg_visible_in_snapshot(CAST(:x AS xid8), CAST(:s AS pg_snapshot))"),
            {"x": txid, "s": kept.snapshot},
        ).scalar()


def test_every_entry_a_consumer_writes_names_a_kept_snapshot(
    settings: Settings, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    consumer = role_engine(settings, "FRESHLINE_STACK_POSTGRES_CONSUMER_URL")
    processor = Processor(
        consumer,
        redis_client,
        versions=lambda: [version],
        on_computed=keeper(consumer),
        registry=REGISTRY,
    )
    with consumer.begin() as conn:
        conn.execute(sa.text("SELECT 1"))
    owner = make_engine(settings)
    with owner.begin() as conn:
        txn_id = insert_transaction(conn, tenant, 3, 12.5, "m-snap", "10.0.0.1", device="d9")
    owner.dispose()
    event = ChangeEvent(
        "transactions", "c", tenant, {"tenant_id": tenant, "user_id": 3, "id": txn_id}
    )
    processor.apply([event])
    store = EntryStore(redis_client, version, registry=REGISTRY)
    keys = list(redis_client.scan_iter(match=feature_pattern(version), count=1000))
    refs = []
    for key in keys:
        name = key.decode().split(":")[2]
        t, e = key.decode().split("{")[1].rstrip("}").split(":")
        refs.append(EntityRef(name, t, e))
    entries = [e for e in store.read(refs) if e is not None]
    assert entries
    kept = snapshots_of(consumer, [e.watermark for e in entries])
    assert {e.watermark for e in entries} <= set(kept)
    consumer.dispose()


def test_a_read_through_fill_names_a_kept_snapshot(
    engine: Engine, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    store = EntryStore(redis_client, version, registry=REGISTRY)
    rt = ReadThrough(store, engine, hooks=Hooks(on_computed=keeper(engine)))
    [result] = rt.get_many([EntityRef("txn_90d", tenant, "2")])
    assert result.source == "computed"
    assert snapshot_of(engine, result.watermark) is not None


@pytest.fixture
def new_york(base_settings: Settings) -> Iterator[Settings]:
    """A database whose default time zone is not UTC."""
    name = "freshline_tz_test"
    url = recreate_database(base_settings, name)
    admin = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with admin.begin() as conn:
        conn.execute(sa.text(f"ALTER DATABASE {name} SET TimeZone = 'America/New_York'"))
    admin.dispose()
    yield base_settings.model_copy(update={"postgres_url": url})
    drop_database(base_settings, name)


def test_every_session_is_utc_on_a_database_that_is_not(new_york: Settings) -> None:
    raw = sa.create_engine(new_york.postgres_url, poolclass=sa.pool.NullPool)
    with raw.connect() as conn:  # the database's own default, as any client gets it
        assert conn.execute(sa.text("SHOW TimeZone")).scalar() == "America/New_York"
    raw.dispose()
    engine = make_engine(new_york)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW TimeZone")).scalar() == "UTC"
            # a timestamp without zone read from a timestamptz is the UTC wall clock
            wall = conn.execute(
                sa.text("SELECT CAST(TIMESTAMPTZ '2026-11-30 12:00:00+00' AS timestamp)")
            ).scalar()
            assert wall == dt.datetime(2026, 11, 30, 12, 0)
    finally:
        engine.dispose()
