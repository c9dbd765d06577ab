"""The oracle's two answers agree, and a served value that either contradicts fails.

The plain Python reference (:mod:`tests.faults.reference`) equals each feature set's
defining full query on seeded data with the cases that are easy to get wrong: a user
with many rows, rows exactly at and just inside every window edge, rows after the
moment computed for, ties on the latest row, IPs with no range or none at all, a
device first seen exactly a day before, a risk score whose rounding depends on
Postgres's ``real`` to ``numeric`` conversion, a link to a missing device, a rounding
tie, and users with no rows; and, as a property, over any rows hypothesis draws around
those edges. Then :func:`tests.faults.oracle.compare` catches a value that went stale
when a row changed, and says which answer a wrong value contradicts. Not part of the
fault suite's run: it needs only the session's Postgres.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from decimal import Decimal

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.core.types import Entry, FeatureValues
from tests.faults.oracle import Truth, Verdict, compare, truth
from tests.faults.reference import FEATURE_SETS, Ref, load, one, pieces
from tests.helpers import ANCHOR, examples

US = timedelta(microseconds=1)
DAY = timedelta(days=1)
IN_RANGE = ("11.0.0.9", "11.0.16.9", "11.0.32.9")
"""IPs in three seeded geoip ranges (of 4,096 addresses each, from 11.0.0.0)."""
NO_RANGE = ("10.0.0.1", "12.0.0.1")
"""Below every range; above the last one's start but past its end."""


def add_txn(
    engine: Engine,
    tenant: str,
    user: int,
    at: datetime,
    amount: str = "10.00",
    ip: str | None = IN_RANGE[0],
    merchant: str = "m-edge",
) -> int:
    with engine.begin() as conn:
        return int(
            conn.execute(
                sa.text(
                    "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, "
                    "device_id, ip, created_at, updated_at) VALUES (:t, :u, :a, :m, 'd-edge', "
                    "CAST(:ip AS inet), :at, :at) RETURNING id"
                ),
                {"t": tenant, "u": user, "a": Decimal(amount), "m": merchant, "ip": ip, "at": at},
            ).scalar_one()
        )


def add_user(engine: Engine, tenant: str, user: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO users (tenant_id, id) VALUES (:t, :u)"), {"t": tenant, "u": user}
        )


def add_device(
    engine: Engine, tenant: str, user: int, device: str, first_seen: datetime, risk: float
) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO devices (tenant_id, id, fingerprint, risk_score, first_seen) "
                "VALUES (:t, :d, 'f', :r, :at)"
            ),
            {"t": tenant, "d": device, "r": risk, "at": first_seen},
        )
        link(conn, tenant, user, device)


def link(conn: sa.Connection, tenant: str, user: int, device: str) -> None:
    conn.execute(
        sa.text("INSERT INTO user_devices (tenant_id, user_id, device_id) VALUES (:t, :u, :d)"),
        {"t": tenant, "u": user, "d": device},
    )


def seeded(tenant_factory: Callable[..., SeedSummary], engine: Engine) -> tuple[str, list[Ref]]:
    """A seeded tenant with the edge cases added; every user of it, and one unknown."""
    tenant = tenant_factory(users=30, transactions=1500).tenants[0]
    edge, tie, blank, tiny, fresh, stale, ghost, empty = range(101, 109)
    for user in (edge, tie, blank, tiny, fresh, stale, ghost, empty):
        add_user(engine, tenant, user)
    # Every window's edge: exactly at it (out), a microsecond inside (in), the moment
    # itself (in), a microsecond after it (out until then).
    for window in (90 * DAY, 30 * DAY):
        add_txn(engine, tenant, edge, ANCHOR - window, "1.00", IN_RANGE[1], "m-out")
        add_txn(engine, tenant, edge, ANCHOR - window + US, "2.00", IN_RANGE[2], "m-in")
    add_txn(engine, tenant, edge, ANCHOR, "3.00", IN_RANGE[0])
    add_txn(engine, tenant, edge, ANCHOR + US, "4.00", IN_RANGE[1], "m-later")
    # Two latest rows at one moment: the greater id decides the last country.
    add_txn(engine, tenant, tie, ANCHOR - DAY, ip=IN_RANGE[1])
    add_txn(engine, tenant, tie, ANCHOR - DAY, ip=IN_RANGE[2])
    # IPs in no range, and a latest row without one.
    add_txn(engine, tenant, blank, ANCHOR - 3 * DAY, ip=NO_RANGE[0])
    add_txn(engine, tenant, blank, ANCHOR - 2 * DAY, ip=NO_RANGE[1])
    add_txn(engine, tenant, blank, ANCHOR - DAY, ip=None)
    # A mean of 0.00125: rounds half away from zero to 0.0013 (half-even would not).
    add_txn(engine, tenant, tiny, ANCHOR - DAY, "0.01")
    for _ in range(7):
        add_txn(engine, tenant, tiny, ANCHOR - DAY, "0.00")
    # First seen a day before (not new) and a microsecond later (new). 0.99344996 as a
    # real is 0.99344998...; Postgres's numeric of it is 0.99345, which rounds to 0.9935.
    add_device(engine, tenant, stale, "d-day", ANCHOR - DAY, 0.5)
    add_device(engine, tenant, fresh, "d-new", ANCHOR - DAY + US, 0.99344996)
    with engine.begin() as conn:
        link(conn, tenant, ghost, "d-missing")  # no devices row: counted as shared only
        link(conn, tenant, stale, "d-missing")
    users = range(1, 31)
    refs = [(tenant, str(u)) for u in (*users, edge, tie, blank, tiny, fresh, stale, ghost, empty)]
    return tenant, [*refs, (tenant, "999999999")]


def test_the_reference_equals_the_full_query_at_and_around_the_edges(
    tenant_factory: Callable[..., SeedSummary], engine: Engine
) -> None:
    tenant, refs = seeded(tenant_factory, engine)
    with engine.connect() as conn:
        most = conn.execute(
            sa.text(
                "SELECT count(*) FROM transactions WHERE tenant_id = :t "
                "GROUP BY user_id ORDER BY 1 DESC LIMIT 1"
            ),
            {"t": tenant},
        ).scalar_one()
    assert most >= 100  # a user with many rows (Zipf)
    for at in (ANCHOR - 60 * DAY, ANCHOR - US, ANCHOR, ANCHOR + US, ANCHOR + 30 * DAY):
        got = truth(engine, refs, as_of=at)
        for name in FEATURE_SETS:
            for ref in refs:
                assert got.reference[name][ref] == got.full[name][ref], (at, name, ref)
    # The edges did what they were put there for: the cases are live, not vacuous.
    now = truth(engine, refs, as_of=ANCHOR)
    txn, geo, device = now.reference["txn_90d"], now.reference["geo"], now.reference["device_risk"]
    assert txn[(tenant, "101")]["txn_count"] == 4  # 90d-1us, 30d, 30d-1us, 0 before
    assert txn[(tenant, "101")]["distinct_merchants"] == 3
    assert geo[(tenant, "101")]["distinct_countries_30d"] in (1, 2)
    assert txn[(tenant, "104")]["txn_mean"] == 0.0013
    assert geo[(tenant, "103")] == {
        "last_country": None,
        "last_city": None,
        "distinct_countries_30d": 0,
    }
    assert device[(tenant, "105")]["new_device_24h"] is True
    assert device[(tenant, "105")]["max_device_risk"] == 0.9935
    assert device[(tenant, "106")]["new_device_24h"] is False
    assert device[(tenant, "106")]["device_count"] == 1
    assert device[(tenant, "106")]["shared_device_users"] == 2
    assert device[(tenant, "107")] == {
        "device_count": 0,
        "max_device_risk": 0.0,
        "new_device_24h": False,
        "shared_device_users": 2,
    }
    for name in FEATURE_SETS:  # no rows at all: the same values, in or out of users
        assert now.reference[name][(tenant, "108")] == now.reference[name][(tenant, "999999999")]
    assert txn[(tenant, "108")]["last_txn_at"] is None


def test_values_change_only_at_the_breakpoints(
    tenant_factory: Callable[..., SeedSummary], engine: Engine
) -> None:
    """What the readers' check rests on: over each piece :func:`pieces` cuts, every
    value is the one at its start, which is the full query's there too."""
    tenant, _ = seeded(tenant_factory, engine)
    refs = [(tenant, u) for u in ("101", "105", "106")]
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        rows = load(conn, refs)
        conn.rollback()
    for ref in refs:
        cut = pieces(rows, ref, ANCHOR - 2 * DAY, ANCHOR + 95 * DAY)
        assert len(cut) >= (6 if ref[1] == "101" else 2), cut  # the edges are live
        changed = 0
        for start, end in cut:
            at_start = one(rows, ref, start)
            inside = [start + (end - start) / 2, max(start, end - US)]
            for at in inside:
                assert one(rows, ref, at) == at_start, (ref, start, at)
            full = truth(engine, [ref], as_of=inside[0]).full
            assert {name: full[name][ref] for name in FEATURE_SETS} == at_start, (ref, start)
            changed += start > ANCHOR - 2 * DAY and at_start != one(rows, ref, start - US)
        assert changed, ref  # some breakpoint changed a value


def served(
    refs: list[Ref], values: Mapping[str, Mapping[Ref, FeatureValues]]
) -> dict[str, list[Entry | None]]:
    """Entries holding ``values``, as the store would read them."""
    return {
        name: [Entry(dict(values[name][ref]), 1, 0, 1) for ref in refs] for name in FEATURE_SETS
    }


def test_a_value_gone_stale_differs_from_both_answers_until_it_is_recomputed(
    tenant_factory: Callable[..., SeedSummary], engine: Engine
) -> None:
    tenant, refs = seeded(tenant_factory, engine)
    before = truth(engine, refs, as_of=ANCHOR)
    verdict = Verdict()
    compare(refs, served(refs, before.full), before, verdict)
    assert (verdict.mismatches, verdict.disagreements, verdict.failures) == ([], [], [])
    assert verdict.present == verdict.checked == len(refs) * len(FEATURE_SETS)

    # One row of the busiest user changes; its entry is not recomputed.
    with engine.begin() as conn:
        user = conn.execute(
            sa.text(
                "SELECT user_id FROM transactions WHERE tenant_id = :t "
                "GROUP BY user_id ORDER BY count(*) DESC, user_id LIMIT 1"
            ),
            {"t": tenant},
        ).scalar_one()
        conn.execute(
            sa.text(
                "UPDATE transactions SET amount = amount + 1 WHERE tenant_id = :t AND id = "
                "(SELECT max(id) FROM transactions WHERE tenant_id = :t AND user_id = :u "
                "AND created_at > :at - interval '30 days' AND created_at <= :at)"
            ),
            {"t": tenant, "u": user, "at": ANCHOR},
        )
    after = truth(engine, refs, as_of=ANCHOR)
    stale = Verdict()
    compare(refs, served(refs, before.full), after, stale)
    assert [(m["feature_set"], m["entity"], m["differs_from"]) for m in stale.mismatches] == [
        ("txn_90d", str(user), ["full query", "reference"])
    ]
    assert stale.failures and "from the full query: 1, from the reference: 1" in stale.failures[0]
    assert stale.disagreements == []

    recomputed = Verdict()
    compare(refs, served(refs, after.full), after, recomputed)
    assert recomputed.failures == []


def test_a_value_only_the_reference_contradicts_fails_and_names_it(
    tenant_factory: Callable[..., SeedSummary], engine: Engine
) -> None:
    """As if the defining query (and so every path computing from it) were wrong."""
    tenant, refs = seeded(tenant_factory, engine)
    now = truth(engine, refs, as_of=ANCHOR)
    ref = (tenant, "101")
    wrong = {**now.full["txn_90d"], ref: {**now.full["txn_90d"][ref], "txn_count": 5}}
    broken = Truth(now.as_of, {**now.full, "txn_90d": wrong}, now.reference)
    verdict = Verdict()
    compare(refs, served(refs, broken.full), broken, verdict)
    assert [(m["entity"], m["differs_from"]) for m in verdict.mismatches] == [
        ("101", ["reference"])
    ]
    assert [(d["feature_set"], d["entity"]) for d in verdict.disagreements] == [("txn_90d", "101")]
    assert len(verdict.failures) == 2


# -- the property: any rows ------------------------------------------------------------

EDGES = (
    ANCHOR - 90 * DAY,
    ANCHOR - 90 * DAY + US,
    ANCHOR - 30 * DAY,
    ANCHOR - 30 * DAY + US,
    ANCHOR - DAY,
    ANCHOR - DAY + US,
    ANCHOR,
    ANCHOR + US,
)
_times = st.one_of(
    st.sampled_from(EDGES),
    st.integers(-100 * 86400, 2 * 86400).map(lambda s: ANCHOR + timedelta(seconds=s)),
)
_ips = st.sampled_from(
    # a range's first and last address, the next range's first, one past the last
    # range (11.128.0.0), below every range, and none
    ["11.0.0.0", "11.0.15.255", "11.0.16.0", "11.0.16.9", "11.128.0.0", "10.0.0.1", None]
)
_txn = st.tuples(
    st.sampled_from([1, 2, 3]),
    _times,
    st.decimals(min_value=0, max_value=999, places=2).map(str),
    st.sampled_from(["m1", "m2", "m3"]),
    st.sampled_from(["d1", "d2", None]),
    _ips,
)
_device = st.tuples(
    _times,
    st.one_of(
        st.sampled_from([0.0, 0.99344996, 0.12345, 1.0]),
        st.floats(0, 1, width=32, allow_subnormal=False),
    ),
)


@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    txns=st.lists(_txn, max_size=14),
    links=st.sets(st.tuples(st.sampled_from([1, 2, 3, 4]), st.sampled_from(["d1", "d2", "d3"]))),
    devices=st.dictionaries(st.sampled_from(["d1", "d2", "d3"]), _device),
    as_of=st.sampled_from(EDGES),
)
def test_the_reference_equals_the_full_query_over_any_rows(
    tenant_factory_module: Callable[..., SeedSummary],
    engine: Engine,
    txns: list[tuple[int, datetime, str, str, str | None, str | None]],
    links: set[tuple[int, str]],
    devices: dict[str, tuple[datetime, float]],
    as_of: datetime,
) -> None:
    geoip_loaded(tenant_factory_module)
    tenant = f"p{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        for user, at, amount, merchant, device, ip in txns:
            conn.execute(
                sa.text(
                    "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, "
                    "device_id, ip, created_at) VALUES (:t, :u, CAST(:a AS numeric), :m, :d, "
                    "CAST(:ip AS inet), :at)"
                ),
                {
                    "t": tenant,
                    "u": user,
                    "a": amount,
                    "m": merchant,
                    "d": device,
                    "ip": ip,
                    "at": at,
                },
            )
        for user, device in links:
            link(conn, tenant, user, device)
        for device, (first_seen, risk) in devices.items():
            conn.execute(
                sa.text(
                    "INSERT INTO devices (tenant_id, id, fingerprint, risk_score, first_seen) "
                    "VALUES (:t, :d, 'f', :r, :at)"
                ),
                {"t": tenant, "d": device, "r": risk, "at": first_seen},
            )
    refs = [(tenant, str(u)) for u in (1, 2, 3, 4, 5)]
    got = truth(engine, refs, as_of=as_of)
    for name in FEATURE_SETS:
        for ref in refs:
            assert got.reference[name][ref] == got.full[name][ref], (name, ref)


_geoip: list[bool] = []


def geoip_loaded(tenant_factory_module: Callable[..., SeedSummary]) -> None:
    """The seeded geoip ranges (global; a first seed loads them), once per module."""
    if not _geoip:
        tenant_factory_module(users=1, transactions=0)
        _geoip.append(True)
