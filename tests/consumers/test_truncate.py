"""A TRUNCATE of a source table voids every entry of the feature sets it feeds.

Runs on a database of its own: the table is truncated for real, which the rest of the
session's tests must not see.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import seed
from freshline.consumers.events import decode
from freshline.consumers.processor import Processor
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import ANCHOR, REGISTRY, drop_database, migrate, recreate_database

DEVICE_RISK = REGISTRY["device_risk"]
TXN_90D = REGISTRY["txn_90d"]

FIXTURES = Path(__file__).parent / "fixtures"
USERS = [str(u) for u in range(1, 21)]


@pytest.fixture(scope="module")
def own_engine(base_settings: Settings) -> Iterator[Engine]:
    name = f"freshline_truncate_{uuid.uuid4().hex[:8]}"
    url = recreate_database(base_settings, name)
    migrate(url)
    engine = make_engine(base_settings.model_copy(update={"postgres_url": url}))
    seed(engine, users=len(USERS), transactions=600, tenant_prefix="trunc-", anchor=ANCHOR)
    yield engine
    engine.dispose()
    drop_database(base_settings, name)


def truncate_event() -> object:
    captured = json.loads((FIXTURES / "user_devices_truncate_t.json").read_text())
    event = decode("freshline.public.user_devices", None, json.dumps(captured["value"]).encode())
    assert event is not None and event.op == "t"
    return event


def test_a_truncate_voids_every_entry_it_makes_stale_and_nothing_else(
    own_engine: Engine,
    redis_client: redis.Redis,
    version: int,
) -> None:
    with own_engine.connect() as conn:
        tenant = conn.execute(sa.text("SELECT id FROM freshline.tenants")).scalar_one()
    store = EntryStore(redis_client, version, registry=REGISTRY)
    refs = [(tenant, u) for u in USERS]
    before = compute(own_engine, DEVICE_RISK, refs)
    assert any(v["device_count"] > 0 for v in before.values.values())
    store.write(before)
    store.write(compute(own_engine, TXN_90D, refs))
    with own_engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE user_devices"))
    processor = Processor(own_engine, redis_client, versions=lambda: [version], registry=REGISTRY)
    report = processor.apply([truncate_event()])  # type: ignore[list-item]
    risk = [EntityRef("device_risk", tenant, u) for u in USERS]
    assert store.read(risk) == [None] * len(USERS)  # every entry the truncate made stale
    assert None not in store.read([EntityRef("txn_90d", tenant, u) for u in USERS])
    assert {(i.feature_set, i.entity) for i in report.invalidations} == {("device_risk", "*")}
    # An entry computed before the truncate is refused; one computed after is served.
    assert store.write(before).written == 0
    after = compute(own_engine, DEVICE_RISK, refs)
    assert store.write(after).written == len(USERS)
    served = store.read(risk)
    assert [e.values if e else None for e in served] == [after.values[r] for r in refs]
    assert all(e is not None and e.values["device_count"] == 0 for e in served)
    # A lease finds no voided entry either (an early entry landing since the miss).
    redis_client.delete(store.key(risk[0]))
    store.write(before)  # refused, so nothing to find
    [(_, found)] = store.lease([risk[0]], "token", 1000, [False])
    assert found is None
