"""The evaluator reads history as it was at a moment: no row from after it leaks in.

Each test writes row versions with chosen commit times (:func:`recording.version`) for a
tenant of its own and asks the evaluator, logged in as the API role, for the values at
moments around them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.core.features import FeatureSet, Field
from freshline.pipeline.core.types import FeatureValues
from freshline.pipeline.history.evaluator import (
    AtCommitTime,
    AtSnapshot,
    Evaluator,
    HistoryRefused,
    _array,
    history_sql,
)
from tests.helpers import REGISTRY
from tests.pipeline.history import recording

HOUR = dt.timedelta(hours=1)
US = dt.timedelta(microseconds=1)


def at(
    api: Engine, fs: str | FeatureSet, tenant: str, user: int, moment: dt.datetime
) -> FeatureValues:
    feature_set = REGISTRY[fs] if isinstance(fs, str) else fs
    with api.connect() as conn:
        got = Evaluator.on(conn).evaluate(
            feature_set, {AtCommitTime(moment): [(tenant, str(user))]}
        )
    return got[AtCommitTime(moment)][(tenant, str(user))]


def txn(
    tenant: str, id_: int, user: int, created_at: dt.datetime, amount: str = "10.00", **more: object
) -> dict[str, object]:
    return {
        "tenant_id": tenant,
        "id": id_,
        "user_id": user,
        "amount": amount,
        "currency": "USD",
        "merchant_id": "m1",
        "device_id": None,
        "ip": None,
        "status": "approved",
        "created_at": created_at,
        "updated_at": created_at,
        **more,
    }


def test_a_row_committed_after_t_is_absent_at_t_though_its_event_time_is_before(
    engine: Engine, api: Engine, captured: None, tenant: str, t: dt.datetime
) -> None:
    with engine.begin() as conn:
        recording.version(conn, "transactions", txn(tenant, 1, 7, t - HOUR), t + US)
    assert at(api, "txn_90d", tenant, 7, t)["txn_count"] == 0
    assert at(api, "txn_90d", tenant, 7, t + US)["txn_count"] == 1


def test_a_correction_after_t_leaves_t_unchanged(
    engine: Engine, api: Engine, captured: None, tenant: str, t: dt.datetime
) -> None:
    with engine.begin() as conn:
        recording.version(
            conn, "transactions", txn(tenant, 1, 7, t - 2 * HOUR, "10.00"), t - HOUR, t + HOUR
        )
        recording.version(conn, "transactions", txn(tenant, 1, 7, t - 2 * HOUR, "50.00"), t + HOUR)
    assert at(api, "txn_90d", tenant, 7, t)["txn_sum"] == 10.0
    assert at(api, "txn_90d", tenant, 7, t + HOUR - US)["txn_sum"] == 10.0
    assert at(api, "txn_90d", tenant, 7, t + HOUR)["txn_sum"] == 50.0


def test_a_row_deleted_after_t_still_counts_at_t(
    engine: Engine, api: Engine, captured: None, tenant: str, t: dt.datetime
) -> None:
    with engine.begin() as conn:
        recording.version(conn, "transactions", txn(tenant, 1, 7, t - 2 * HOUR), t - HOUR, t + HOUR)
    assert at(api, "txn_90d", tenant, 7, t)["txn_count"] == 1
    assert at(api, "txn_90d", tenant, 7, t + HOUR)["txn_count"] == 0


def test_a_row_moved_between_entities_counts_for_each_on_its_side_of_the_move(
    engine: Engine, api: Engine, captured: None, tenant: str, t: dt.datetime
) -> None:
    with engine.begin() as conn:
        recording.version(conn, "transactions", txn(tenant, 1, 7, t - 2 * HOUR), t - HOUR, t + HOUR)
        recording.version(conn, "transactions", txn(tenant, 1, 8, t - 2 * HOUR), t + HOUR)
    assert (
        at(api, "txn_90d", tenant, 7, t)["txn_count"],
        at(api, "txn_90d", tenant, 8, t)["txn_count"],
    ) == (1, 0)
    later = t + HOUR
    assert (
        at(api, "txn_90d", tenant, 7, later)["txn_count"],
        at(api, "txn_90d", tenant, 8, later)["txn_count"],
    ) == (0, 1)


WINDOWS = [
    ("txn_90d", "txn_count", dt.timedelta(days=90), 0, 1, 0),
    ("geo", "distinct_countries_30d", dt.timedelta(days=30), 0, 1, 0),
    # new_device_24h has no upper edge: a device first seen after t is new (the query's
    # own words, tests/faults/reference.py's too); history decides whether it exists
    ("device_risk", "new_device_24h", dt.timedelta(hours=24), False, True, True),
]


@pytest.mark.parametrize(
    ("fs", "field", "window", "out", "inside", "after"), WINDOWS, ids=[w[0] for w in WINDOWS]
)
def test_window_edges_at_t_minus_window_and_at_t(
    engine: Engine,
    api: Engine,
    captured: None,
    tenant: str,
    t: dt.datetime,
    fs: str,
    field: str,
    window: dt.timedelta,
    out: object,
    inside: object,
    after: object,
) -> None:
    """A window is ``t - window < moment <= t``: a row at ``t - window`` is out, one a
    microsecond later is in, one at ``t`` is in, one a microsecond after ``t`` is out
    (where the window has that edge)."""
    long_before = t - window - 10 * HOUR
    cases = {1: t - window, 2: t - window + US, 3: t, 4: t + US}
    expected = {1: out, 2: inside, 3: inside, 4: after}
    with engine.begin() as conn:
        if fs == "device_risk":
            for user, moment in cases.items():
                device = f"d{user}"
                recording.version(
                    conn,
                    "user_devices",
                    {"tenant_id": tenant, "user_id": user, "device_id": device},
                    long_before,
                )
                recording.version(
                    conn,
                    "devices",
                    {
                        "tenant_id": tenant,
                        "id": device,
                        "fingerprint": "f",
                        "risk_score": 0.5,
                        "first_seen": moment,
                    },
                    long_before,
                )
        else:
            ip_from = f"2001:db8:{uuid.uuid4().hex[:4]}::"
            recording.version(
                conn,
                "geoip",
                {
                    "ip_from": ip_from,
                    "ip_to": ip_from + "ffff",
                    "country": "ZZ",
                    "city": "Z",
                    "asn": 1,
                },
                long_before,
            )
            for user, moment in cases.items():
                recording.version(
                    conn,
                    "transactions",
                    txn(tenant, user, user, moment, ip=ip_from + "1"),
                    long_before,
                )
    got = {user: at(api, fs, tenant, user, t)[field] for user in cases}
    assert got == expected


def test_many_moments_and_keys_in_one_statement_each_see_their_own(
    engine: Engine, api: Engine, captured: None, tenant: str, t: dt.datetime
) -> None:
    with engine.begin() as conn:
        for n in range(1, 4):
            recording.version(
                conn, "transactions", txn(tenant, n, 7, t - 9 * HOUR), t - 4 * HOUR + n * HOUR
            )
    moments = {
        AtCommitTime(t - 4 * HOUR + n * HOUR): [(tenant, "7"), (tenant, "8")] for n in range(4)
    }
    with api.connect() as conn:
        got = Evaluator.on(conn).evaluate(REGISTRY["txn_90d"], moments)
    assert [got[m][(tenant, "7")]["txn_count"] for m in moments] == [0, 1, 2, 3]
    assert [got[m][(tenant, "8")]["txn_count"] for m in moments] == [0, 0, 0, 0]


def test_each_moment_of_a_statement_answers_for_its_own_keys_only(
    engine: Engine, api: Engine, captured: None, tenant: str, t: dt.datetime
) -> None:
    """Moments with different keys, a key at several moments and twice at one: each
    moment's keys travel with it, and no key of one moment is evaluated at another."""
    with engine.begin() as conn:
        for user in (7, 8, 9):
            recording.version(conn, "transactions", txn(tenant, user, user, t - 9 * HOUR), t - HOUR)
    moments = {
        AtCommitTime(t - 2 * HOUR): [(tenant, "7")],
        AtCommitTime(t): [(tenant, "8"), (tenant, "7"), (tenant, "8")],
        AtCommitTime(t + US): [(tenant, "9")],
    }
    with api.connect() as conn:
        got = Evaluator.on(conn).evaluate(REGISTRY["txn_90d"], moments)
    counts = {m.at: {ref: v["txn_count"] for ref, v in got[m].items()} for m in moments}
    assert counts == {
        t - 2 * HOUR: {(tenant, "7"): 0},
        t: {(tenant, "7"): 1, (tenant, "8"): 1},
        t + US: {(tenant, "9"): 1},
    }


@pytest.mark.parametrize(
    "values",
    [["a", "b"], ['say "hi"', "back\\slash", "a,b", "{x}", "NULL", " pad ", ""], [1, 22]],
)
def test_a_moments_keys_reach_postgres_as_they_are(api: Engine, values: list[int | str]) -> None:
    with api.connect() as conn:
        got = conn.execute(sa.text("SELECT CAST(:a AS text[])"), {"a": _array(values)}).scalar()
    assert got == [str(v) for v in values]


def test_at_snapshot_sees_what_the_snapshot_saw(
    engine: Engine, api: Engine, captured: None, tenant: str
) -> None:
    """Versions with real transaction ids: a snapshot taken between two commits sees the
    first only, whatever their commit times say."""
    with engine.begin() as conn:
        recording.record(conn, "transactions")
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO freshline.tenants (id, name) VALUES (:t, :t) "
                    "ON CONFLICT DO NOTHING"
                ),
                {"t": tenant},
            )
            conn.execute(sa.text("INSERT INTO users (tenant_id, id) VALUES (:t, 7)"), {"t": tenant})
            conn.execute(
                sa.text(
                    "INSERT INTO transactions "
                    "(tenant_id, user_id, amount, merchant_id, created_at) "
                    "VALUES (:t, 7, 5, 'm', now() - interval '1 hour')"
                ),
                {"t": tenant},
            )
        with api.connect() as conn:
            snap, as_of = conn.execute(sa.text("SELECT pg_current_snapshot()::text, now()")).one()
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE transactions SET amount = 9 WHERE tenant_id = :t"), {"t": tenant}
            )
        moment = AtSnapshot(snap, as_of)
        with api.connect() as conn:
            got = Evaluator.on(conn).evaluate(REGISTRY["txn_90d"], {moment: [(tenant, "7")]})
        assert got[moment][(tenant, "7")]["txn_sum"] == 5.0
    finally:
        with engine.begin() as conn:
            recording.unrecord(conn, "transactions")


def test_refuses_a_future_moment(api: Engine, captured: None, tenant: str) -> None:
    with pytest.raises(HistoryRefused, match="in the future"):
        at(api, "txn_90d", tenant, 7, dt.datetime.now(dt.UTC) + HOUR)


def test_refuses_a_moment_before_history_starts(api: Engine, captured: None, tenant: str) -> None:
    with pytest.raises(HistoryRefused, match=r"history of table .* starts at"):
        at(api, "txn_90d", tenant, 7, recording.LONG_AGO - HOUR)


def test_refuses_moments_past_complete_to_where_broken_and_beyond_retention(
    engine: Engine, api: Engine, captured: None, tenant: str, t: dt.datetime
) -> None:
    updates = {
        "complete_to = :m": "is complete to",
        "broken_from = :m": "is broken from",
        "retention_s = 60": "beyond the retention",
    }
    for update, message in updates.items():
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"UPDATE freshline.history_tables SET {update} "
                    "WHERE source_table = 'transactions'"
                ),
                {"m": t - HOUR},
            )
        try:
            with pytest.raises(HistoryRefused, match=message):
                at(api, "txn_90d", tenant, 7, t)
        finally:
            with engine.begin() as conn:
                recording_reset(conn)


def recording_reset(conn: sa.Connection) -> None:
    conn.execute(
        sa.text(
            "UPDATE freshline.history_tables SET complete_to = '9999-01-01 00:00+00', "
            "broken_from = NULL, "
            "retention_s = NULL WHERE source_table = 'transactions'"
        )
    )


def test_refuses_a_query_that_reads_a_table_history_does_not_capture(
    api: Engine, captured: None, tenant: str, t: dt.datetime
) -> None:
    """The schema-qualified name is not shadowed by the history CTE: the plan scans the
    user table, and the evaluator refuses before it runs."""
    base = REGISTRY["txn_90d"]
    qualified = dataclasses.replace(
        base, query=base.query.replace("LEFT JOIN transactions", "LEFT JOIN public.transactions")
    )
    with pytest.raises(HistoryRefused, match=r"reads public\.transactions"):
        at(api, qualified, tenant, 7, t)


def test_refuses_a_query_that_reads_the_clock(
    api: Engine, captured: None, tenant: str, t: dt.datetime
) -> None:
    user_entity = REGISTRY["txn_90d"].entity
    clocked = FeatureSet(
        "clocked",
        entity=user_entity,
        fields=(Field("n", "int"),),
        ttl_s=60,
        query="SELECT k.tenant_id, k.user_id, count(x.id) AS n FROM k LEFT JOIN transactions x "
        "ON x.tenant_id = k.tenant_id AND x.user_id = k.user_id "
        "AND x.created_at > now() - interval '1 day' "
        "GROUP BY 1, 2",
    )
    with pytest.raises(HistoryRefused, match=r"reads the clock \(now\("):
        at(api, clocked, tenant, 7, t)


def test_the_defining_query_text_is_in_the_statement_unmodified(captured: None) -> None:
    for fs in REGISTRY:
        assert fs.query in history_sql(fs, {}, snapshots=False)
