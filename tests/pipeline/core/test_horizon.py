"""Features that change with time alone: an entry expires when its window moves past a row.

``txn_90d`` counts the transactions of the last 90 days. A transaction that turns 90
days old changes the count with no row changing and no event sent, so an entry
written before that moment would be served stale until its TTL (the consistency
benchmark's audit found such entries: a count one higher than Postgres's, with no
change of the user for 30 s and more). Each feature set with a window has a horizon
(``FeatureSet.horizon``): the compute returns, per entity, the first moment its
values may change with time alone, and the store cuts the entry's TTL to end then.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import TTL_JITTER, EntryStore, entry_ttl_ms
from freshline.pipeline.core.features import Path
from freshline.pipeline.core.keys import feature_key
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, wait_until

USER = 9001
"""Beyond the seeded users: only this module's rows are the user's."""


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=2, transactions=10).tenants[0]


def add_transaction(engine: Engine, tenant: str, created: str) -> dt.datetime:
    """A transaction of :data:`USER` created at the SQL expression ``created``."""
    with engine.begin() as conn:
        at: dt.datetime = conn.execute(
            sa.text(
                "INSERT INTO transactions "
                "(tenant_id, user_id, amount, merchant_id, ip, created_at) "
                f"VALUES (:t, :u, 10, 'm-h', '10.0.0.1', {created}) RETURNING created_at"
            ),
            {"t": tenant, "u": USER},
        ).scalar_one()
        return at


def ms(at: dt.datetime) -> int:
    return int(at.timestamp() * 1000)


@pytest.mark.parametrize("path", ["full", "incremental"])
def test_a_transaction_leaving_the_window_expires_the_entry_that_counted_it(
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    version: int,
    path: Path,
) -> None:
    leaving = add_transaction(engine, tenant, "now() - interval '90 days' + interval '3 s'")
    add_transaction(engine, tenant, "now() - interval '1 day'")
    fs = REGISTRY["txn_90d"].on_path(path)
    batch = compute(engine, fs, [(tenant, str(USER))])
    assert batch.values[(tenant, str(USER))]["txn_count"] == 2
    assert batch.valid_until_ms == {(tenant, str(USER)): ms(leaving + dt.timedelta(days=90))}

    EntryStore(redis_client, version, registry=REGISTRY).write(batch)
    key = feature_key(version, EntityRef("txn_90d", tenant, str(USER)))
    assert 0 < redis_client.pttl(key) <= 3000
    # Gone when the row leaves the window: what it counted is then no longer true.
    assert wait_until(lambda: not redis_client.exists(key), timeout=30)
    assert compute(engine, fs, [(tenant, str(USER))]).values[(tenant, str(USER))]["txn_count"] == 1


@pytest.mark.parametrize(
    ("name", "days", "path"),
    [
        (name, days, path)
        for name, days in [("txn_90d", 90), ("geo", 30)]
        for path in ("full", "incremental")
        if path == "full" or REGISTRY[name].incremental is not None  # geo: a plain query
    ],
)
def test_the_horizon_is_the_first_row_to_leave_or_enter_the_window(
    engine: Engine,
    tenant: str,
    name: str,
    days: int,
    path: Path,
) -> None:
    fs = REGISTRY[name].on_path(path)
    ref = (tenant, str(USER))
    add_transaction(engine, tenant, f"now() - interval '{days} days' - interval '1 hour'")
    # Only a row older than the window: nothing changes with time.
    assert compute(engine, fs, [ref]).valid_until_ms == {}
    newest = add_transaction(engine, tenant, "now() - interval '2 days'")
    oldest = add_transaction(engine, tenant, f"now() - interval '{days - 1} days'")
    assert compute(engine, fs, [ref]).valid_until_ms == {ref: ms(oldest + dt.timedelta(days))}
    # A row created in the future enters the window (and is the latest) when its time
    # comes, before the oldest leaves.
    future = add_transaction(engine, tenant, "now() + interval '1 hour'")
    batch = compute(engine, fs, [ref])
    assert batch.valid_until_ms == {ref: ms(future)}
    if name == "txn_90d":
        assert batch.values[ref]["txn_count"] == 2
        assert batch.values[ref]["last_txn_at"] == ms(newest)


def test_a_new_device_flag_expires_when_the_newest_device_is_a_day_old(
    engine: Engine,
    tenant: str,
) -> None:
    fs = REGISTRY["device_risk"]
    ref = (tenant, str(USER))
    with engine.begin() as conn:
        seen = {}
        for device, age in (("d-h-old", "30 hours"), ("d-h-a", "23 hours"), ("d-h-b", "20 hours")):
            seen[device] = conn.execute(
                sa.text(
                    "INSERT INTO devices (tenant_id, id, fingerprint, risk_score, first_seen) "
                    f"VALUES (:t, :d, 'fp', 0.5, now() - interval '{age}') RETURNING first_seen"
                ),
                {"t": tenant, "d": device},
            ).scalar_one()
            conn.execute(
                sa.text("INSERT INTO user_devices VALUES (:t, :u, :d)"),
                {"t": tenant, "u": USER, "d": device},
            )
    batch = compute(engine, fs, [ref])
    assert batch.values[ref]["new_device_24h"] is True
    # true until the newest of the devices first seen within a day is a day old
    assert batch.valid_until_ms == {ref: ms(seen["d-h-b"] + dt.timedelta(hours=24))}


def test_an_entry_ttl_ends_at_the_horizon_only_when_it_comes_first() -> None:
    ttl_s, at = 3600, 1_000_000
    assert entry_ttl_ms(ttl_s, at, at + 2500) == 2500
    assert entry_ttl_ms(ttl_s, at, at) == 1  # already due: as short as Redis allows
    for until in (None, at + 10 * ttl_s * 1000):
        assert ttl_s * 1000 * (1 - TTL_JITTER) <= entry_ttl_ms(ttl_s, at, until) <= ttl_s * 1000
