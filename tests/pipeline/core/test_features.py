"""Each feature set computed in a batch equals a per-entity reference, value by value.

The reference reads the raw rows of one user and computes the features in Python, so
a mistake in the set-based SQL (a join that multiplies rows, a window off by one, a
lookup that misses its range) shows up as a difference.
"""

from __future__ import annotations

import ipaddress
import statistics
from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.core.errors import InvalidId, UnknownFeatureSet
from tests.helpers import ANCHOR, REGISTRY

DEVICE_RISK = REGISTRY["device_risk"]
GEO = REGISTRY["geo"]
TXN_90D = REGISTRY["txn_90d"]


def _ms(t: datetime | None) -> int | None:
    return None if t is None else int(t.timestamp() * 1000)


def _txns(conn: sa.Connection, tenant: str, user: int) -> list[Any]:
    return list(
        conn.execute(
            sa.text(
                "SELECT id, amount, merchant_id, device_id, host(ip) AS ip, created_at "
                "FROM transactions WHERE tenant_id = :t AND user_id = :u"
            ),
            {"t": tenant, "u": user},
        )
    )


def ref_txn_90d(conn: sa.Connection, tenant: str, user: int) -> dict[str, Any]:
    rows = [
        r for r in _txns(conn, tenant, user) if ANCHOR - timedelta(days=90) < r.created_at <= ANCHOR
    ]
    amounts = [r.amount for r in rows]  # Decimal, rounded as Postgres rounds numeric

    def r4(d: Decimal) -> float:
        return float(d.quantize(Decimal("0.0001"), rounding=ROUND_HALF_UP))

    return {
        "txn_count": len(rows),
        "txn_sum": float(sum(amounts, Decimal(0))),
        "txn_mean": r4(sum(amounts, Decimal(0)) / len(amounts)) if amounts else 0.0,
        "txn_max": float(max(amounts, default=Decimal(0))),
        "txn_std": r4(statistics.pstdev(amounts)) if amounts else 0.0,
        "distinct_merchants": len({r.merchant_id for r in rows}),
        "distinct_devices": len({r.device_id for r in rows if r.device_id}),
        "last_txn_at": _ms(max((r.created_at for r in rows), default=None)),
    }


def ref_device_risk(conn: sa.Connection, tenant: str, user: int) -> dict[str, Any]:
    devices = list(
        conn.execute(
            sa.text(
                """SELECT d.id, d.risk_score, d.first_seen,
                  (SELECT count(*) FROM user_devices o
                   WHERE o.tenant_id = d.tenant_id AND o.device_id = d.id) AS users
           FROM user_devices ud JOIN devices d
             ON d.tenant_id = ud.tenant_id AND d.id = ud.device_id
           WHERE ud.tenant_id = :t AND ud.user_id = :u"""
            ),
            {"t": tenant, "u": user},
        )
    )
    return {
        "device_count": len(devices),
        "max_device_risk": round(max((float(d.risk_score) for d in devices), default=0.0), 4),
        "new_device_24h": any(d.first_seen > ANCHOR - timedelta(hours=24) for d in devices),
        "shared_device_users": max((d.users for d in devices), default=0),
    }


def ref_geo(
    conn: sa.Connection, tenant: str, user: int, ranges: list[tuple[int, int, str, str]]
) -> dict[str, Any]:
    def locate(ip: str) -> tuple[str, str] | None:
        n = int(ipaddress.ip_address(ip))
        for lo, hi, country, city in ranges:
            if lo <= n <= hi:
                return country, city
        return None

    rows = [r for r in _txns(conn, tenant, user) if r.created_at <= ANCHOR]
    last = max(rows, key=lambda r: (r.created_at, r.id), default=None)
    where = locate(last.ip) if last is not None else None
    recent = {locate(r.ip) for r in rows if r.created_at > ANCHOR - timedelta(days=30)}
    return {
        "last_country": where[0] if where else None,
        "last_city": where[1] if where else None,
        "distinct_countries_30d": len({w[0] for w in recent if w}),
    }


@pytest.fixture(scope="module")
def seeded(engine: Engine, tenant_factory_module: Callable[..., SeedSummary]) -> SeedSummary:
    return tenant_factory_module(users=120, transactions=6000)


def test_each_feature_set_in_a_batch_equals_the_per_entity_reference(
    engine: Engine, seeded: SeedSummary
) -> None:
    tenant = seeded.tenants[0]
    users = [*range(1, seeded.users + 1), seeded.users + 5]  # the last has no rows
    refs = [(tenant, str(u)) for u in users]
    with engine.connect() as conn:
        ranges = [
            (int(ipaddress.ip_address(a)), int(ipaddress.ip_address(b)), c, city)
            for a, b, c, city in conn.execute(
                sa.text("SELECT host(ip_from), host(ip_to), country, city FROM geoip")
            )
        ]
        references = {
            TXN_90D.name: lambda u: ref_txn_90d(conn, tenant, u),
            DEVICE_RISK.name: lambda u: ref_device_risk(conn, tenant, u),
            GEO.name: lambda u: ref_geo(conn, tenant, u, ranges),
        }
        for fs in REGISTRY:
            batch = compute(engine, fs, refs, as_of=ANCHOR)
            assert set(batch.values) == set(refs)
            for user in users:
                got = batch.values[(tenant, str(user))]
                want = references[fs.name](user)
                assert set(got) == set(fs.field_names)
                for name in fs.field_names:
                    where = (fs.name, user, name)
                    if isinstance(want[name], float):
                        assert got[name] == pytest.approx(want[name], abs=1e-6), where
                    else:
                        assert got[name] == want[name], where
        # The data exercises the features: not everything is zero or empty.
        batch = compute(engine, TXN_90D, refs, as_of=ANCHOR)
        assert sum(v["txn_count"] for v in batch.values.values()) > 1000
        assert any(
            v["shared_device_users"] > 1
            for v in compute(engine, DEVICE_RISK, refs, as_of=ANCHOR).values.values()
        )


def test_batch_is_one_query_and_one_watermark(engine: Engine, seeded: SeedSummary) -> None:
    tenant = seeded.tenants[0]
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        batch = compute(engine, TXN_90D, [(tenant, str(u)) for u in range(1, 101)])
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert len(batch.values) == 100
    feature_queries = [s for s in statements if "FROM k CROSS JOIN t" in s]
    assert len(feature_queries) == 1
    # One statement: the watermark comes from the features' own snapshot.
    assert len(statements) == 1 and "pg_current_snapshot()" in statements[0]


def test_unknown_feature_set_and_bad_ids_are_refused() -> None:
    with pytest.raises(UnknownFeatureSet, match="nope"):
        REGISTRY["nope"]
    with pytest.raises(InvalidId):
        compute(None, TXN_90D, [("acme", "1:2")])  # type: ignore[arg-type]
    with pytest.raises(InvalidId):
        compute(None, TXN_90D, [("acme", "abc")])  # type: ignore[arg-type]
    with pytest.raises(InvalidId):  # "007" would be computed for 7 and answered as nobody
        compute(None, TXN_90D, [("acme", "007")])  # type: ignore[arg-type]
    with pytest.raises(InvalidId):
        compute(None, TXN_90D, [("ac*me", "1")])  # type: ignore[arg-type]


def test_fingerprint_changes_with_the_definition() -> None:
    from dataclasses import replace

    assert replace(TXN_90D, ttl_s=60).fingerprint() != TXN_90D.fingerprint()
    assert replace(TXN_90D, fields=TXN_90D.fields[:-1]).fingerprint() != TXN_90D.fingerprint()
    assert replace(TXN_90D, description="x").fingerprint() == TXN_90D.fingerprint()
