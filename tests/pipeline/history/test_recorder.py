"""The recorder on real transactions: every version once, whatever the delivery order,
and the history audit equal after each case."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from freshline.consumers.history import prune
from freshline.pipeline.history.audit import audit_table
from freshline.pipeline.history.recorder import HistoryBehind, widen
from freshline.pipeline.history.tables import follow, layout, qualified, registered
from tests.pipeline.history.conftest import KEEP, History, Txn, sample

HistoryFactory = Callable[[], History]


def assert_audit(h: History) -> None:
    with h.consumer.connect() as conn:
        found = registered(conn)[("public", h.table)]
    result = audit_table(h.consumer, found)
    assert result.ok, result.samples
    assert result.missing == result.extra == 0


def stream(h: History) -> list[dict[str, Any]]:
    """Inserts, updates, a delete and a re-insert of a deleted key, as envelopes."""
    out: list[dict[str, Any]] = []
    out += h.writer.commit(Txn().insert(sample(10)).insert(sample(11)))
    out += h.writer.commit(Txn().update(sample(1, note="corrected")))
    out += h.writer.commit(Txn().delete(2))
    out += h.writer.commit(Txn().update(sample(10, note="second")))
    out += h.writer.commit(Txn().insert(sample(2, note="back")))
    out += h.writer.commit(Txn().update(sample(11, amount=0)).delete(10))
    return out


def test_backfill_then_changes_in_order(history_factory: HistoryFactory) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)).insert(sample(2)).insert(sample(3)))
    s0 = h.enable()
    assert s0.rows == {h.table: 3}
    assert_audit(h)  # the backfill alone
    h.record(stream(h))
    assert_audit(h)
    one = h.versions(1)
    assert [v["note"] for v in one] == ["note 1", "corrected"]
    assert one[0]["xmin"] == "3" and one[0]["xmax"] == one[1]["xmin"]
    assert one[0]["_fl_to"] == one[1]["_fl_from"] and one[1]["_fl_to"] is None
    two = h.versions(2)
    assert [v["note"] for v in two] == ["note 2", "back"]
    assert two[0]["xmax"] is not None and two[0]["_fl_to"] < two[1]["_fl_from"]  # a gap: deleted


def test_redelivered_reordered_and_duplicated_records(history_factory: HistoryFactory) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)).insert(sample(2)))
    h.enable()
    records = stream(h)
    h.record(records)
    once = h.versions()
    h.record(records)  # redelivered after a restart
    h.record(records[::-1])  # every one again, backwards
    shuffled = records * 2
    random.Random(51).shuffle(shuffled)
    h.record(shuffled)
    assert h.versions() == once
    assert_audit(h)


def test_reordered_before_first_delivery(history_factory: HistoryFactory) -> None:
    """A history recorded from records delivered out of order equals the in-order one."""
    ordered, shuffled = history_factory(), history_factory()
    for h in (ordered, shuffled):
        h.writer.commit(Txn().insert(sample(1)).insert(sample(2)))
        h.enable()
    records = stream(ordered)
    ordered.record(records)
    mixed = stream(shuffled)
    random.Random(7).shuffle(mixed)
    for record in mixed:  # one batch per record: no batch-level ordering to lean on
        shuffled.record([record])
    assert_audit(shuffled)

    def shape(h: History) -> list[tuple[Any, ...]]:
        return [(v["id"], v["note"], v["xmax"] is None) for v in h.versions()]

    assert shape(shuffled) == shape(ordered)


def test_a_row_changed_twice_in_one_transaction_is_one_version(
    history_factory: HistoryFactory,
) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)))
    h.enable()
    records = h.writer.commit(
        Txn().update(sample(1, note="a")).update(sample(1, note="b")).insert(sample(5))
    )
    records += h.writer.commit(Txn().insert(sample(6)).update(sample(6, note="6b")).delete(6))
    h.record(records)
    h.record(records[:1])  # the first change again, after the second
    assert [v["note"] for v in h.versions(1)] == ["note 1", "b"]
    assert h.versions(6) == []
    six = h.versions(6, empty=True)
    assert len(six) == 1 and six[0]["_fl_to"] == six[0]["_fl_from"]  # born and gone: empty
    assert_audit(h)


def test_truncate_closes_every_open_version(history_factory: HistoryFactory) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)).insert(sample(2)))
    h.enable()
    records = h.writer.commit(Txn().insert(sample(3)))
    records += h.writer.commit(Txn().insert(sample(4)).truncate().insert(sample(5)))
    h.record(records)
    h.record(records)
    assert all(v["xmax"] is not None for v in h.versions() if v["id"] != 5)
    assert [v["xmax"] for v in h.versions(5)] == [None]
    assert_audit(h)


def test_unchanged_toasted_column_keeps_the_previous_value(
    history_factory: HistoryFactory,
) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1, big="y" * 9000)))
    h.enable()
    h.record(h.writer.commit(Txn().update(sample(1, note="toast", big=KEEP))))
    with h.owner.connect() as conn:
        assert conn.execute(sa.text(f"SELECT big FROM {h.table}")).scalar() == "y" * 9000
    assert_audit(h)  # the new version holds the old TOASTed value, as the table does


def test_backfill_while_writes_go_on(history_factory: HistoryFactory) -> None:
    """Writers commit before, during and after the backfill's snapshot: every change
    S0 saw is skipped, every other one recorded; nothing missing, nothing twice."""
    h = history_factory()
    h.writer.commit(Txn().insert(sample(0)))
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def write(worker: int) -> None:
        n = 0
        while not stop.is_set() or n < 20:
            key = 1000 * (worker + 1) + n % 7
            txn = Txn().insert(sample(key)) if n < 7 else Txn().update(sample(key, note=str(n)))
            got = h.writer.commit(txn)
            with lock:
                records.extend(got)
            n += 1

    threads = [threading.Thread(target=write, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    h.enable()
    stop.set()
    for t in threads:
        t.join()
    h.record(records)
    assert_audit(h)


def test_an_added_column_waits_for_apply_then_earlier_versions_hold_its_default(
    history_factory: HistoryFactory,
) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)).insert(sample(2)))
    h.enable()
    before = h.writer.commit(Txn().update(sample(2, note="before ddl")))
    with h.owner.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {h.table} ADD COLUMN extra integer DEFAULT 7"))
    after = h.writer.commit(Txn().update(sample(1, note="after ddl", extra=8)))
    with pytest.raises(HistoryBehind, match="extra"):
        h.record(before + after)
    with h.owner.begin() as conn:  # what apply does
        assert h.found is not None
        h.found = layout(conn, "public", h.table)
        assert [s.split(" ADD COLUMN ")[1] for s in follow(conn, h.found)] == [
            '"extra" integer DEFAULT 7'
        ]
    h.recorder.refresh()
    h.record(before + after)
    assert_audit(h)
    with h.owner.connect() as conn:
        extras = conn.execute(
            sa.text(
                f"SELECT id, note, extra FROM {qualified(h.found.history)} ORDER BY id, _fl_change"
            )
        ).all()
    assert [tuple(r) for r in extras] == [
        (1, "note 1", 7),
        (1, "after ddl", 8),
        (2, "note 2", 7),
        (2, "before ddl", 7),
    ]


def test_a_dropped_column_marks_history_broken(history_factory: HistoryFactory) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)))
    h.enable()
    with h.owner.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {h.table} DROP COLUMN span"))
    row = {k: v for k, v in sample(1, note="after ddl").items() if k != "span"}
    records = h.writer.commit(Txn().update(row))
    h.record(records)
    with h.consumer.connect() as conn:
        found = registered(conn)[("public", h.table)]
    assert found.broken_from_us is not None
    assert "span" in (found.broken_reason or "")


def test_widen_matches_the_snapshot_select() -> None:
    xmax = (5 << 32) + 100
    assert widen(99, xmax) == (5 << 32) + 99
    assert widen(150, xmax) == (5 << 32) + 150  # just committed, above the old xmax
    assert widen((1 << 32) - 5, xmax) == (4 << 32) + (1 << 32) - 5  # last epoch
    assert widen((7 << 32) + 1, xmax) == (7 << 32) + 1  # already wide


def test_a_truncate_read_before_the_changes_it_follows(history_factory: HistoryFactory) -> None:
    """A truncate has no key, so it can come from another partition, ahead of records
    committed before it: the versions they make still end at the truncate."""
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)))
    h.enable()
    before = h.writer.commit(Txn().insert(sample(2)))
    before += h.writer.commit(Txn().update(sample(1, note="late")))
    truncate = h.writer.commit(Txn().truncate())
    after = h.writer.commit(Txn().insert(sample(3)))
    h.record(truncate)
    h.record(after)
    h.record(before)
    assert [v["xmax"] is None for v in h.versions()] == [False, False, False, True]
    assert_audit(h)


def test_retention_drops_versions_that_ended_long_ago(history_factory: HistoryFactory) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)).insert(sample(2)))
    h.enable()
    h.record(h.writer.commit(Txn().update(sample(1, note="new"))))
    assert h.found is not None
    with h.owner.begin() as conn:  # the first version ended a year ago; keep 30 days
        conn.execute(
            sa.text(
                f"UPDATE {qualified(h.found.history)} SET _fl_to = now() - interval '1 year' "
                "WHERE id = 1 AND _fl_xmax IS NOT NULL"
            )
        )
        conn.execute(
            sa.text(
                "UPDATE freshline.history_tables SET retention_s = 2592000 WHERE source_table = :t"
            ),
            {"t": h.table},
        )
    assert prune(h.consumer) >= 1
    assert [v["note"] for v in h.versions(1)] == ["new"]  # the current one stays
    assert [v["note"] for v in h.versions(2)] == ["note 2"]


def test_a_timestamptz_key_finds_its_versions(history_factory: HistoryFactory) -> None:
    h = history_factory()
    with h.owner.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {h.table} DROP CONSTRAINT {h.table}_pkey"))
        conn.execute(sa.text(f"ALTER TABLE {h.table} ADD PRIMARY KEY (at_tz)"))
    h.writer.commit(Txn().insert(sample(1)))
    h.enable()
    records = h.writer.commit(Txn().update(sample(1, note="once")))
    h.record(records)
    h.record(records)
    assert [v["note"] for v in h.versions()] == ["note 1", "once"]
    assert_audit(h)


def test_a_table_registered_while_the_recorder_runs_is_recorded(
    history_factory: HistoryFactory,
) -> None:
    h = history_factory()
    before = h.writer.commit(Txn().insert(sample(1)))
    h.record(before)  # history is not on for it yet: nothing to do
    h.enable()
    h.record(h.writer.commit(Txn().update(sample(1, note="after"))))  # the same recorder
    assert [v["note"] for v in h.versions(1)] == ["note 1", "after"]
    assert_audit(h)
