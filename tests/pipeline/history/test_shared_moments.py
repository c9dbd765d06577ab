"""Spine rows that share one evaluation of a declared aggregation
(:mod:`freshline.pipeline.history.intervals`) get exactly what one statement per row
gives them, on random histories: corrections, deletes, late commits, rows entering and
leaving windows, a lookup table that changes, and moments on every edge."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from freshline.pipeline.history.intervals import declaration
from freshline.pipeline.history.training import training_set
from tests.helpers import REGISTRY, ROOT
from tests.pipeline.history import recording
from tests.pipeline.history.test_evaluator import txn
from tests.pipeline.history.test_online_offline import EXAMPLES

pa = pytest.importorskip("pyarrow")

FRAUD = ROOT / "examples" / "fraud"
SECOND = dt.timedelta(seconds=1)
HOUR = dt.timedelta(hours=1)
USERS = (1, 2, 3)
WINDOWS = (dt.timedelta(days=90), dt.timedelta(days=30))

# Offsets in seconds from a base moment: few, so change points and moments coincide.
offsets = st.integers(min_value=-6, max_value=6)
# created_at: near the base, or near where a window's edge falls on a moment.
created = st.tuples(st.sampled_from([dt.timedelta(0), *WINDOWS]), offsets)
version = st.fixed_dictionaries(
    {
        "user": st.sampled_from(USERS),
        "created": created,
        "amount": st.sampled_from(["1.00", "2.50", "7.00", "0.10"]),
        "merchant": st.sampled_from(["m1", "m2"]),
        "country": st.sampled_from([0, 1, None]),  # the ip of range 0, of range 1, none
        # an hour before the base, or late: after created_at, by up to 12 s
        "committed": st.one_of(st.none(), offsets),
        "ends": st.one_of(st.none(), st.integers(min_value=0, max_value=6)),
        "corrected": st.booleans(),  # an end with a new version (else a delete)
    }
)
histories = st.fixed_dictionaries(
    {
        "rows": st.lists(version, min_size=1, max_size=12),
        "moments": st.lists(st.tuples(st.sampled_from(USERS), offsets), min_size=1, max_size=40),
        "geoip_change": st.one_of(st.none(), offsets),
    }
)


def test_the_fraud_declarations_are_shared_and_device_risk_is_not() -> None:
    assert declaration(REGISTRY["txn_90d"]) is not None
    assert declaration(REGISTRY["geo"]) is not None
    assert declaration(REGISTRY["device_risk"]) is None


def _write(engine: Engine, tenant: str, base: dt.datetime, history: dict[str, Any]) -> None:
    block = uuid.uuid4().hex[:4]
    ranges = [f"2001:db8:{block}:{n}::" for n in range(2)]
    change = history["geoip_change"]
    with engine.begin() as conn:
        for n, start in enumerate(ranges):
            row = {"ip_from": start, "ip_to": start + "ffff", "asn": 1}
            first = {**row, "country": f"C{n}", "city": f"c{n}"}
            if change is None:
                recording.version(conn, "geoip", first, recording.LONG_AGO)
            else:
                moved = base + change * SECOND
                recording.version(conn, "geoip", first, recording.LONG_AGO, moved)
                later = {**row, "country": f"D{n}", "city": f"d{n}"}
                recording.version(conn, "geoip", later, moved)
        for id_, v in enumerate(history["rows"], start=1):
            window, off = v["created"]
            at = base - window + off * SECOND
            ip = None if v["country"] is None else ranges[v["country"]] + "1"
            row = txn(tenant, id_, v["user"], at, v["amount"], merchant_id=v["merchant"], ip=ip)
            if v["committed"] is None:
                committed = base - HOUR
            else:
                committed = max(at, base - 6 * SECOND) + (v["committed"] + 6) * SECOND
            ended = None if v["ends"] is None else committed + v["ends"] * SECOND
            recording.version(conn, "transactions", row, committed, ended)
            if ended is not None and v["corrected"]:
                fixed = {**row, "amount": "99.00", "user_id": USERS[id_ % len(USERS)]}
                recording.version(conn, "transactions", fixed, ended)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(history=histories)
def test_shared_evaluation_equals_one_statement_per_spine_row(
    engine: Engine, api: Engine, captured: None, t: dt.datetime, history: dict[str, Any]
) -> None:
    tenant = f"s{uuid.uuid4().hex[:10]}"
    _write(engine, tenant, t, history)
    moments = [t + off * SECOND for _, off in history["moments"]]
    moments += [t + dt.timedelta(microseconds=1), t - dt.timedelta(microseconds=1)]
    users = [u for u, _ in history["moments"]] + [USERS[0], USERS[0]]
    spine = pa.table(
        {
            "tenant_id": [tenant] * len(users),
            "user_id": pa.array(users, pa.int64()),
            "timestamp": pa.array(moments, pa.timestamp("us", tz="UTC")),
        }
    )
    features = ["txn_90d", "geo"]
    shared = training_set(FRAUD, spine, features, engine=api)
    each = training_set(FRAUD, spine, features, engine=api, chunk=1, share=False)
    assert shared.to_pylist() == each.to_pylist()
