"""The readers' rule, on rows made by hand: an answer passes if its value was the
reference's at some moment within its grace, absent passes, and a value that was true
only earlier, or never, fails, with the moment a window edge passes taken into account.
Pure Python: no stack."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from ipaddress import IPv4Address

from tests.faults.readers import Answer, Timeline, judge
from tests.faults.reference import Range, Rows, Txn, one
from tests.faults.workload import Observation

T0 = 1_800_000_000.0
REF = ("t1", "7")
OTHER = ("t1", "8")
RANGES = [Range(IPv4Address("11.0.0.0"), IPv4Address("11.0.15.255"), "FR", "Paris")]


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def rows(*txns: Txn) -> Rows:
    return Rows(txns={REF: list(txns)} if txns else {}, ranges=RANGES)


# A row created 90 days and 5 s before T0: in txn_90d until T0 + 5 s.
EDGE = Txn(
    1, Decimal("12.50"), "m1", None, IPv4Address("11.0.0.9"), at(T0 + 5) - timedelta(days=90)
)
BEFORE, AFTER = rows(), rows(EDGE)
OBSERVATIONS = [
    Observation(T0 - 10, T0 - 9.9, BEFORE),
    Observation(T0 - 5, T0 - 4.9, AFTER),  # the change that inserted it
    Observation(T0 + 60, T0 + 60.1, AFTER),  # the last look, after the case
]


def count(n: int, received: float, grace: float = 2.0) -> Answer:
    """An API answer of ``txn_90d`` with ``n`` transactions: 0 and 1 are the two states'
    values, anything else no state's."""
    values = dict(one(BEFORE if n == 0 else AFTER, REF, at(T0))["txn_90d"])
    values["txn_count"] = n
    return Answer("api", "txn_90d", REF, values, received - 0.01, received, grace)


def test_the_value_while_the_row_is_inside_passes_and_after_its_edge_fails() -> None:
    got = judge(
        [
            count(1, T0),  # inside: true
            count(0, T0 + 30),  # aged out: true
            count(1, T0 + 30),  # served 25 s after the edge passed: stale
            count(1, T0 + 6.5),  # 1.5 s after the edge, within the 2 s grace
            count(0, T0 - 4.95),  # before the insert's commit was certain: true
            count(7, T0),  # never true
            Answer("client", "txn_90d", REF, None, T0, T0, 2.0),  # absent
        ],
        OBSERVATIONS,
        [REF],
    )
    assert (got.answers, got.present, got.absent) == (7, 6, 1)
    assert [m["served"]["txn_count"] for m in got.mismatches] == [1, 7]
    stale, never = got.mismatches
    assert 24.9 < stale["last_true_s_before"] < 25.1
    assert stale["reference_then"]["txn_count"] == 0
    assert never["last_true_s_before"] is None
    assert one(AFTER, REF, at(T0))["txn_90d"] in never["reference_in_window"]
    assert never["unsure_attempts_before"] == 0
    assert got.by_reader["api"] == {"answers": 6, "present": 6, "mismatches": 2}


def test_a_long_grace_allows_a_value_from_before_an_outage() -> None:
    got = judge([count(1, T0 + 30, grace=120.0)], OBSERVATIONS, [REF])
    assert not got.mismatches
    assert got.within == {"1s": 0, "10s": 0}
    assert 24.9 < got.max_staleness_s < 25.1


def test_a_state_is_held_from_the_previous_look_to_the_next() -> None:
    timeline = Timeline(OBSERVATIONS, [REF, OTHER])
    before, after = timeline.states[REF]
    assert before.start < T0 - 1000 and T0 - 4.9 < before.end < T0 - 4.8
    assert T0 - 10.1 < after.start < T0 - 9.9 and after.end > T0 + 1000
    assert len(timeline.states[OTHER]) == 1  # no rows, never changed: one state
