"""The consistency auditor against the real Postgres and Redis.

Every test writes entries of its own schema version through the real compute and
store path, for tenants of its own. What a re-check sees is decided by the
``before_recheck`` hook, never by racing a sleep; graces run either on a fake clock
(exact, instant) or are a few milliseconds long (where only the outcome matters).
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from rich.console import Console
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.recompute import Batch, compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.errors import ConfigError, InvalidId, UnknownFeatureSet
from freshline.pipeline.core.keys import feature_key, parse_feature_key
from freshline.pipeline.core.maintenance import DerivedPath
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.observe.audit import Auditor, RecheckHook, Suspect, sample_pattern
from freshline.pipeline.observe.audit_metrics import AuditMetrics
from freshline.pipeline.observe.consistency import AuditReport, GraceResult, Mismatch, same
from tests.helpers import REGISTRY, cli

USERS = 20
GRACES = (0.001, 0.002)  # real but tiny: these tests assert outcomes, not timings


class FakeClock:
    """A clock that moves only when the auditor sleeps: graces and pacing, exactly."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.rechecks: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def note_recheck(self, _grace: float, _suspects: Sequence[Mismatch]) -> None:
        """A ``before_recheck`` hook: when each re-check ran."""
        self.rechecks.append(self.now)


def materialize(
    engine: Engine, store: EntryStore, tenant: str, users: Sequence[int] = range(1, USERS + 1)
) -> list[EntityRef]:
    """Compute and write every feature set for ``users``: what a consumer does."""
    pairs = [(tenant, str(u)) for u in users]
    for fs in REGISTRY:
        assert store.write(compute(engine, fs, pairs)).written == len(pairs)
    return [EntityRef(fs.name, tenant, str(u)) for fs in REGISTRY for u in users]


FAR_AHEAD = 1 << 100
"""Added to a watermark: one that claims a snapshot 2**32 transactions in the future."""


def corrupt(
    engine: Engine, store: EntryStore, ref: EntityRef, field: str, value: object, ahead: int = 1
) -> Batch:
    """Overwrite ``ref``'s entry with a wrong ``field``, under a higher watermark."""
    truth = compute(engine, REGISTRY[ref.feature_set], [(ref.tenant, ref.entity)])
    wrong = {**truth.values[(ref.tenant, ref.entity)], field: value}
    bad = Batch(
        truth.feature_set,
        {(ref.tenant, ref.entity): wrong},
        truth.watermark + ahead,
        truth.computed_at_ms,
    )
    assert store.write(bad).written == 1
    return bad


def rewrite_truth(engine: Engine, store: EntryStore, ref: EntityRef) -> None:
    """What a consumer catching up does: recompute now and write (a newer watermark)."""
    batch = compute(engine, REGISTRY[ref.feature_set], [(ref.tenant, ref.entity)])
    assert store.write(batch).written == 1


def change(engine: Engine, ref: EntityRef) -> None:
    """Commit a change to ``ref``'s user's transactions of the last 90 days."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE transactions SET amount = amount + 100 WHERE tenant_id = :t "
                "AND user_id = :u AND created_at > now() - interval '90 days'"
            ),
            {"t": ref.tenant, "u": int(ref.entity)},
        )


def active(store: EntryStore, refs: Sequence[EntityRef]) -> EntityRef:
    """A txn_90d entity with transactions in its window, so a change shows."""
    txn = [r for r in refs if r.feature_set == "txn_90d"]
    return next(
        r
        for r, e in zip(txn, store.read(txn), strict=True)
        if e is not None and e.values["txn_count"] > 0
    )


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=USERS, transactions=400).tenants[0]


@pytest.fixture
def store(redis_client: redis.Redis, version: int) -> EntryStore:
    return EntryStore(redis_client, version, registry=REGISTRY)


@pytest.fixture
def refs(engine: Engine, store: EntryStore, tenant: str) -> list[EntityRef]:
    """The tenant's entries of every feature set, written by the pipeline: 60 of them."""
    return materialize(engine, store, tenant)


AuditorFactory = Callable[..., Auditor]


@pytest.fixture
def auditor(redis_client: redis.Redis, engine: Engine, version: int) -> AuditorFactory:
    """Auditors of the test's schema version, unthrottled unless given a ``rate``: most
    tests are about verdicts, not pacing. Given a :class:`FakeClock`, they sleep on it."""

    def make(*, clock: FakeClock | None = None, **kwargs: Any) -> Auditor:
        if clock is not None:
            kwargs.update(clock=clock, sleep=clock.sleep)
        return Auditor(
            redis_client, engine, version, **{"rate": None, "registry": REGISTRY, **kwargs}
        )

    return make


def audit_rechecked(
    auditor: AuditorFactory, refs: Sequence[EntityRef], before_recheck: RecheckHook
) -> AuditReport:
    """Audit ``refs`` at graces of 1 s and 10 s on a fake clock, ``before_recheck``
    deciding what each re-check sees."""
    clock = FakeClock()
    return auditor(before_recheck=before_recheck, clock=clock).audit_refs(refs, graces=(1.0, 10.0))


# -- keys and comparisons -------------------------------------------------------------


def test_feature_keys_parse_back_into_refs() -> None:
    ref = EntityRef("txn_90d", "acme-eu.1", "42")
    assert parse_feature_key(feature_key(7, ref)) == (7, ref)
    assert parse_feature_key(feature_key(7, ref).encode()) == (7, ref)
    for bad in (
        "lease:7:txn_90d:{acme:42}",
        "feat:07:txn_90d:{acme:42}",
        "feat:x:txn_90d:{acme:42}",
        "feat:7:txn_90d:acme:42",
        "feat:7:txn_90d",
        "feat:7:txn_90d:{acme:4*2}",
        "feat:7:Txn:{acme:42}",
        "feat:7:geo:{acme:1}x",
        "feat:7:geo:{acme}",
        "feat:7:geo:{:1}",
    ):
        with pytest.raises(InvalidId):
            parse_feature_key(bad)


def test_values_compare_exactly_as_the_codec_stores_them() -> None:
    assert same(0.1 + 0.2, 0.30000000000000004)
    assert not same(0.1 + 0.2, 0.3)
    assert not same(1, 1.0) and not same(True, 1) and not same(None, 0)
    assert same("Lisbon", "Lisbon") and not same("Lisbon", "lisbon")


def test_nines_per_grace() -> None:
    assert GraceResult(1.0, 1000, 1).nines == pytest.approx(3.0)
    assert GraceResult(1.0, 1000, 1).consistent_fraction == pytest.approx(0.999)
    perfect = GraceResult(10.0, 1000, 0)
    assert perfect.nines == pytest.approx(3.0) and perfect.lower_bound
    assert GraceResult(60.0, 0, 0).nines is None
    assert GraceResult(0.25, 1, 0).label == "250ms" and GraceResult(60, 1, 0).label == "60s"


# -- audits ---------------------------------------------------------------------------


def test_entries_written_by_the_pipeline_are_consistent(
    version: int, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    registry = CollectorRegistry()
    report = auditor(metrics=AuditMetrics(registry)).audit_refs(refs)
    assert report.checked == 3 * USERS and report.absent == 0
    assert report.suspects == 0 and report.consistent and report.mismatches == []
    assert report.checked_by_set == dict.fromkeys(REGISTRY.names(), USERS)
    assert [r.inconsistent for r in report.results()] == [0, 0, 0]
    assert all(
        r.lower_bound and r.nines == pytest.approx(math.log10(3 * USERS)) for r in report.results()
    )
    assert report.capacity_per_s > 0
    assert registry.get_sample_value(
        "freshline_audit_consistency_nines", {"grace": "10s"}
    ) == pytest.approx(math.log10(3 * USERS))

    keys = [feature_key(version, r) for r in refs]
    assert auditor().audit_keys(keys).checked == 3 * USERS
    sampled = auditor().audit_sample(1000)
    assert sampled.checked == 3 * USERS and sampled.consistent and sampled.skipped == 0


def test_bucket_drift_is_a_mismatch_since_the_audit_recomputes_in_full(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """A consumer on the incremental path writes what drifted partials say; the audit
    recomputes with the defining full query, never that path, so it finds the drift
    (the incremental path, reading the same partials, agrees with the entry)."""
    ref = active(store, refs)
    path = REGISTRY["txn_90d"].maintenance
    assert isinstance(path, DerivedPath)
    path.fold_all(engine)  # so that the whole days are read from the partials
    with engine.begin() as conn:  # drift no fold would make (mx3: txn_max's partial)
        drifted = conn.execute(
            sa.text(
                f"UPDATE {path.days} SET mx3 = 99999 WHERE tenant_id = :t AND user_id = :u "
                "AND day > current_date - 80 AND day < current_date"
            ),
            {"t": ref.tenant, "u": int(ref.entity)},
        ).rowcount
    assert drifted >= 1
    rewrite_truth(engine, store, ref)  # on txn_90d's own path: the incremental one
    (entry,) = store.read([ref])
    assert entry is not None and entry.values["txn_max"] == 99999.0
    full = auditor().audit_refs([ref], graces=GRACES)
    assert not full.consistent
    (found,) = full.mismatches
    assert set(found.differing) == {"txn_max"} and found.differing["txn_max"][0] == 99999.0
    own = compute(engine, REGISTRY["txn_90d"], [(ref.tenant, ref.entity)], path="incremental")
    assert own.values[(ref.tenant, ref.entity)] == entry.values


def test_a_corrupted_entry_is_reported_with_both_values_and_watermarks(
    engine: Engine,
    store: EntryStore,
    version: int,
    auditor: AuditorFactory,
    refs: list[EntityRef],
) -> None:
    target = next(r for r in refs if r.feature_set == "txn_90d")
    bad = corrupt(engine, store, target, "txn_sum", 123456.78)
    truth = bad.values[(target.tenant, target.entity)]
    registry = CollectorRegistry()
    report = auditor(metrics=AuditMetrics(registry)).audit_refs(refs, graces=GRACES)

    assert report.checked == 3 * USERS and report.suspects == 1
    assert report.inconsistent == {GRACES[0]: 1, GRACES[1]: 1} and not report.consistent
    [m] = report.mismatches
    assert m.key == feature_key(version, target) and m.ref == target
    assert m.served is not None and m.recomputed is not None
    assert m.served["txn_sum"] == 123456.78
    assert m.recomputed["txn_sum"] != 123456.78
    assert set(m.differing) == {"txn_sum"}
    assert m.differing["txn_sum"] == (123456.78, m.recomputed["txn_sum"])
    assert {k: v for k, v in m.served.items() if k != "txn_sum"} == {
        k: v for k, v in truth.items() if k != "txn_sum"
    }
    assert m.served_watermark == bad.watermark
    assert m.recomputed_watermark > bad.watermark

    nines = -math.log10(1 / (3 * USERS))
    assert report.result(GRACES[1]).nines == pytest.approx(nines)
    sample = registry.get_sample_value
    assert sample("freshline_audit_consistency_nines", {"grace": "2ms"}) == pytest.approx(nines)
    assert (
        sample("freshline_audit_inconsistent_total", {"feature_set": "txn_90d", "grace": "1ms"})
        == 1
    )
    assert sample("freshline_audit_checked_total", {"feature_set": "geo"}) == USERS
    as_json = json.loads(json.dumps(report.as_json()))
    assert as_json["mismatches"][0]["differing"]["txn_sum"]["served"] == 123456.78
    assert int(as_json["mismatches"][0]["served_watermark"], 16) == bad.watermark


@pytest.mark.parametrize("fixed_at", [0, 1])
def test_a_mismatch_healed_within_a_grace_counts_only_before_it(
    engine: Engine,
    store: EntryStore,
    version: int,
    auditor: AuditorFactory,
    refs: list[EntityRef],
    fixed_at: int,
) -> None:
    """A change in flight: Postgres moved, the consumer writes the new entry late."""
    target = active(store, refs)
    change(engine, target)
    graces = (1.0, 10.0)
    seen: list[tuple[float, list[Mismatch]]] = []

    def before_recheck(grace: float, suspects: Sequence[Mismatch]) -> None:
        seen.append((grace, list(suspects)))
        if grace == graces[fixed_at]:
            rewrite_truth(engine, store, target)

    report = audit_rechecked(auditor, refs, before_recheck)

    assert report.suspects == 1 and report.consistent and report.caught_up == 0
    assert report.inconsistent == {1.0: fixed_at, 10.0: 0}
    # when it was found: the second of the audit of its first check
    assert report.inconsistent_at == ({1.0: {0: 1}} if fixed_at else {})
    assert report.as_json()["inconsistent_at_second"] == ({"1s": {0: 1}} if fixed_at else {})
    # which entry was late, and its watermark when found, for lining up with other logs
    late = report.as_json()["late"]
    assert {g: len(entries) for g, entries in late.items()} == ({"1s": 1} if fixed_at else {})
    if fixed_at:
        [entry] = report.late[1.0]
        assert entry.mismatch.ref == target and entry.first_checked_unix > 0
        assert entry.first_served_watermark == entry.mismatch.served_watermark
        assert late["1s"][0]["key"] == feature_key(version, target)
    assert [g for g, _ in seen] == list(graces[: fixed_at + 1])
    first = seen[0][1][0]
    assert first.ref == target and set(first.differing) >= {"txn_sum"}
    served = store.read([target])[0]
    assert served is not None and first.recomputed is not None
    assert served.values["txn_sum"] == first.recomputed["txn_sum"]


def test_an_entry_that_caught_up_and_changed_again_is_consistent_at_that_grace(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """A busy entity: by the re-check the consumer applied the change the first check
    saw, and a newer one is in flight. The entry differs again, yet it is fresh."""
    target = active(store, refs)
    change(engine, target)  # in flight at the first check

    def before_recheck(grace: float, suspects: Sequence[Mismatch]) -> None:
        assert grace == 1.0 and [s.ref for s in suspects] == [target]
        rewrite_truth(engine, store, target)  # the consumer applies it...
        change(engine, target)  # ...and the next change is in flight

    report = audit_rechecked(auditor, refs, before_recheck)
    assert report.suspects == 1 and report.caught_up == 1 and report.rechecks == 1
    assert report.inconsistent == {1.0: 0, 10.0: 0} and report.consistent


def audit_verified(
    auditor: AuditorFactory,
    refs: Sequence[EntityRef],
    before_recheck: RecheckHook,
    before_verify: Callable[[Sequence[EntityRef]], None],
    clock: FakeClock,
    registry: CollectorRegistry | None = None,
) -> AuditReport:
    """As :func:`audit_rechecked` on ``clock``, ``before_verify`` deciding what each pass
    over the entries caught up on their watermarks alone sees (one a second, for 10 s)."""
    metrics = AuditMetrics(registry) if registry is not None else None
    return auditor(
        before_recheck=before_recheck, before_verify=before_verify, clock=clock, metrics=metrics
    ).audit_refs(refs, graces=(1.0, 10.0))


def test_a_wrong_entry_whose_watermark_caught_up_ends_a_mismatch_never_verified(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """A writer that computes wrong values from a fresh snapshot: by its watermark the
    entry caught up; by its values it never does. Re-checked on every pass, unchanged
    and still differing at the bound, it is a mismatch from the grace it was accepted at."""
    target = active(store, refs)
    change(engine, target)  # in flight at the first check
    clock = FakeClock()
    passes: list[float] = []

    def before_recheck(grace: float, _suspects: Sequence[Mismatch]) -> None:
        if grace == 1.0:  # the consumer's write lands, fresh and wrong
            corrupt(engine, store, target, "txn_sum", -1.0)

    def before_verify(pending: Sequence[EntityRef]) -> None:
        assert list(pending) == [target]
        passes.append(clock.now)

    registry = CollectorRegistry()
    report = audit_verified(auditor, refs, before_recheck, before_verify, clock, registry)

    assert report.suspects == 1 and report.caught_up == 1  # on its watermark, at 1 s
    assert report.verified == 0 and report.unverified == 0
    assert report.wrong_after_catching_up == 1
    assert report.inconsistent == {1.0: 1, 10.0: 1} and not report.consistent
    [m] = report.mismatches
    assert m.ref == target and m.served is not None and m.served["txn_sum"] == -1.0
    assert passes == [float(t) for t in range(2, 12)]  # every second until 10 s after
    sample = registry.get_sample_value
    assert sample("freshline_audit_inconsistent_total", {"feature_set": "txn_90d", "grace": "10s"})
    assert report.as_json()["wrong_after_catching_up"] == 1


def test_a_wrong_entry_rewritten_under_fresh_watermarks_ends_unverified(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """Wrong values under a watermark that keeps moving: never seen right, never the
    same entry twice, so neither verified nor shown wrong: unverified, apart."""
    target = active(store, refs)
    change(engine, target)

    def before_recheck(grace: float, _suspects: Sequence[Mismatch]) -> None:
        if grace == 1.0:
            corrupt(engine, store, target, "txn_sum", -1.0)

    def before_verify(_pending: Sequence[EntityRef]) -> None:
        corrupt(engine, store, target, "txn_sum", -1.0)  # a fresh watermark each time

    registry = CollectorRegistry()
    report = audit_verified(auditor, refs, before_recheck, before_verify, FakeClock(), registry)
    assert report.caught_up == 1 and report.verified == 0 and report.unverified == 1
    assert report.wrong_after_catching_up == 0 and report.persistent == 0
    assert report.unverified_fraction == pytest.approx(1 / len(refs))
    [entry] = report.unverified_entries
    assert entry.ref == target and entry.served is not None and entry.served["txn_sum"] == -1.0
    doc = report.as_json()
    assert doc["unverified"] == 1 and doc["unverified_entries"][0]["key"] == entry.key
    sample = registry.get_sample_value
    assert sample("freshline_audit_unverified_ratio") == pytest.approx(1 / len(refs))
    from freshline.pipeline.cli.audit import summary

    shown = io.StringIO()
    Console(file=shown, width=80).print(summary(report, "test"))
    text = shown.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    head = next(i for i, line in enumerate(lines) if line.startswith("caught up on watermark"))
    assert lines[head].split()[-3:] == ["verified", "unverified", "mismatched"], text
    assert lines[head + 1].split() == ["1", "0", "1", "0"], text
    assert (
        sample(
            "freshline_audit_caught_up_settled_total",
            {"feature_set": "txn_90d", "outcome": "unverified"},
        )
        == 1
    )


def test_an_entry_left_behind_by_a_newer_change_ends_unverified_not_a_mismatch(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """Accepted on its watermark, then the entity changes and the consumer is late
    past the bound: the entry is unchanged and differs, but from a value Postgres has
    not held for the whole bound, so it is not shown wrong: unverified."""
    target = active(store, refs)
    change(engine, target)
    clock = FakeClock()
    passes: list[float] = []

    def before_recheck(grace: float, _suspects: Sequence[Mismatch]) -> None:
        if grace == 1.0:
            change(engine, target)
            rewrite_truth(engine, store, target)  # fresh, and right at this instant...
            change(engine, target)  # ...with a change in flight

    def before_verify(_pending: Sequence[EntityRef]) -> None:
        passes.append(clock.now)
        if len(passes) == 5:
            change(engine, target)  # another, mid-way; none is applied in time

    report = audit_verified(auditor, refs, before_recheck, before_verify, clock)
    assert report.caught_up == 1 and report.verified == 0 and report.unverified == 1
    assert report.wrong_after_catching_up == 0 and report.consistent
    assert report.inconsistent == {1.0: 0, 10.0: 0}


def test_a_correct_entry_of_a_hot_entity_ends_verified(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """A hot entity: at the re-check and at the next passes the consumer has applied
    a change newer than the first check saw and the next is in flight, so its entry
    never matches at that instant, nor shows the first check's values; once the entity
    pauses, the entry matches the pass's recompute: verified."""
    target = active(store, refs)
    change(engine, target)
    clock = FakeClock()
    passes: list[float] = []

    def busy() -> None:
        rewrite_truth(engine, store, target)  # the consumer applies a change...
        change(engine, target)  # ...and the next is in flight

    def before_recheck(grace: float, _suspects: Sequence[Mismatch]) -> None:
        if grace == 1.0:
            change(engine, target)  # changed again since the first check
            busy()

    def before_verify(_pending: Sequence[EntityRef]) -> None:
        passes.append(clock.now)
        if len(passes) < 3:
            busy()
        else:  # the entity pauses: the consumer applies its last change
            rewrite_truth(engine, store, target)

    registry = CollectorRegistry()
    report = audit_verified(auditor, refs, before_recheck, before_verify, clock, registry)
    assert report.suspects == 1 and report.caught_up == 1
    assert report.verified == 1 and report.unverified == 0
    assert report.wrong_after_catching_up == 0
    assert report.inconsistent == {1.0: 0, 10.0: 0} and report.consistent
    assert passes == [2.0, 3.0, 4.0]  # verified at the third pass, none after
    assert (
        registry.get_sample_value(
            "freshline_audit_caught_up_settled_total",
            {"feature_set": "txn_90d", "outcome": "verified"},
        )
        == 1
    )
    assert registry.get_sample_value("freshline_audit_unverified_ratio") == 0


def test_an_entry_rewritten_from_a_snapshot_older_than_the_first_check_has_not_caught_up(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    target = active(store, refs)
    before = compute(engine, REGISTRY["txn_90d"], [(target.tenant, target.entity)])
    change(engine, target)  # committed after ``before`` was computed

    def before_recheck(grace: float, _suspects: Sequence[Mismatch]) -> None:
        if grace == 1.0:  # a slow worker lands its computation from before the change
            assert store.write(before).written == 1

    report = audit_rechecked(auditor, refs, before_recheck)
    assert report.caught_up == 0 and report.inconsistent == {1.0: 1, 10.0: 1}
    [m] = report.mismatches
    assert m.served_watermark == before.watermark and m.ref == target


def test_an_entry_showing_the_first_checks_truth_from_a_moment_before_it_is_consistent(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """The consumer computed after the change but a moment before the first check's
    recompute, and wrote late; by the re-check a newer change is in flight. The entry
    shows what Postgres held when the mismatch was found: at most the grace behind."""
    target = active(store, refs)
    change(engine, target)  # committed, its event in flight
    seen = compute(engine, REGISTRY["txn_90d"], [(target.tenant, target.entity)])

    def before_recheck(grace: float, suspects: Sequence[Mismatch]) -> None:
        assert grace == 1.0 and [s.ref for s in suspects] == [target]
        assert seen.watermark < suspects[0].recomputed_watermark  # an older snapshot
        assert store.write(seen).written == 1  # the consumer's write lands...
        change(engine, target)  # ...and the next change is in flight

    report = audit_rechecked(auditor, refs, before_recheck)
    assert report.suspects == 1 and report.caught_up == 1
    assert report.inconsistent == {1.0: 0, 10.0: 0} and report.consistent


def test_an_entry_claiming_a_snapshot_it_cannot_have_seen_never_catches_up(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """Wrong values under a watermark beyond the re-check's own recompute (a writer
    with a bad clock or a bug): rewritten since the first check, but not caught up."""
    target = active(store, refs)
    change(engine, target)

    def before_recheck(grace: float, _suspects: Sequence[Mismatch]) -> None:
        if grace == 1.0:
            corrupt(engine, store, target, "txn_count", 0, ahead=FAR_AHEAD)

    report = audit_rechecked(auditor, refs, before_recheck)
    assert report.caught_up == 0 and report.inconsistent == {1.0: 1, 10.0: 1}
    [m] = report.mismatches
    assert m.served is not None and m.served["txn_count"] == 0
    assert m.served_watermark is not None and m.served_watermark > m.recomputed_watermark


def test_an_entry_wrong_from_the_start_under_a_future_watermark_stays_inconsistent(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    target = active(store, refs)
    corrupt(engine, store, target, "txn_sum", -1.0, ahead=FAR_AHEAD)
    report = auditor().audit_refs(refs, graces=GRACES)
    assert report.suspects == 1 and report.caught_up == 0
    assert report.inconsistent == dict.fromkeys(GRACES, 1) and report.persistent == 1


def _mismatch(
    served: int | None,
    recomputed: int,
    problem: str | None = None,
    *,
    shows: str = "x",
    truth: str = "y",
) -> Mismatch:
    ref = EntityRef("geo", "acme", "1")
    return Mismatch(
        feature_key(1, ref),
        ref,
        {"last_city": shows},
        {"last_city": truth},
        served,
        recomputed,
        problem,
    )


def test_the_rules_of_catching_up() -> None:
    """First check: entry at 10, recompute at 20; the re-check's recompute is at 30."""
    suspect = Suspect.of(_mismatch(10, 20), first_at=0.0)
    assert suspect.caught_up(_mismatch(20, 30))  # rewritten from the first check's state
    assert suspect.caught_up(_mismatch(29, 30))
    assert not suspect.caught_up(_mismatch(10, 30))  # unchanged
    assert not suspect.caught_up(_mismatch(19, 30))  # rewritten, from an older snapshot
    assert not suspect.caught_up(_mismatch(30, 30))  # claims the re-check's own snapshot
    assert not suspect.caught_up(_mismatch(40, 30))
    assert not suspect.caught_up(_mismatch(None, 30, problem="corrupt"))
    assert not suspect.caught_up(_mismatch(25, 30, problem="other schema version"))
    ahead = Suspect.of(_mismatch(25, 20), first_at=0.0)  # wrong under a future watermark
    assert not ahead.caught_up(_mismatch(25, 30))  # and unchanged since
    corrupt_at_first = Suspect.of(_mismatch(None, 20, problem="corrupt"), first_at=0.0)
    assert corrupt_at_first.caught_up(_mismatch(21, 30))
    # Showing the first check's truth ("y") under an older snapshot, with a newer change
    # ("z") in flight: what Postgres held when the mismatch was found.
    assert suspect.caught_up(_mismatch(15, 30, shows="y", truth="z"))
    assert not suspect.caught_up(_mismatch(15, 30, shows="x", truth="z"))
    assert not suspect.caught_up(_mismatch(30, 30, shows="y", truth="z"))  # impossible claim
    assert not suspect.caught_up(_mismatch(15, 30, "corrupt", shows="y", truth="z"))


def test_rechecks_run_at_each_grace_after_the_first_check(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    corrupt(engine, store, refs[0], "txn_count", 999_999)
    clock = FakeClock()
    report = auditor(clock=clock, before_recheck=clock.note_recheck).audit_refs(
        refs, graces=(60, 1, 10)
    )
    assert report.graces == (1.0, 10.0, 60.0)
    assert clock.rechecks == [1.0, 10.0, 60.0]
    assert report.inconsistent == {1.0: 1, 10.0: 1, 60.0: 1}
    assert [m.ref for m in report.mismatches] == [refs[0]]
    assert report.rechecks == 3 and report.elapsed_s == 60.0


class CountingAuditor(Auditor):
    """An auditor that records the size of every read-and-recompute it makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list[int] = []

    def _check(self, refs: Sequence[EntityRef], report: Any) -> Any:
        self.checks.append(len(refs))
        return super()._check(refs, report)


def test_rechecks_ride_with_the_first_checks_never_late(
    redis_client: redis.Redis,
    engine: Engine,
    store: EntryStore,
    version: int,
    refs: list[EntityRef],
) -> None:
    """At 100 entries/s, batches of 10 start every 0.1 s; a suspect of the first batch
    due 0.25 s later is re-checked with the batch of 0.2 s (whose slice holds 0.25 s),
    in the same read and recompute, rather than alone at 0.25 s."""
    corrupt(engine, store, refs[0], "txn_count", 999_999)

    def audit_at(rate: float | None) -> tuple[list[int], list[float], AuditReport]:
        """The sizes of its checks, the times of its re-checks, and its report."""
        clock = FakeClock()
        audit = CountingAuditor(
            redis_client,
            engine,
            version,
            rate=rate,
            clock=clock,
            sleep=clock.sleep,
            before_recheck=clock.note_recheck,
            registry=REGISTRY,
        )
        report = audit.audit_refs(refs, graces=(0.25,))
        return audit.checks, clock.rechecks, report

    checks, rechecked_at, report = audit_at(100)
    assert checks == [10, 10, 11, 10, 10, 10]
    assert rechecked_at == pytest.approx([0.2])
    assert report.rechecks == 1 and report.inconsistent == {0.25: 1}
    # Unthrottled there is no slice: the re-check comes alone, exactly when due.
    checks, rechecked_at, _ = audit_at(None)
    assert checks == [60, 1] and rechecked_at == [0.25]


def test_a_value_of_another_json_type_is_a_mismatch(
    engine: Engine, store: EntryStore, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """1.0 is not 1: the comparison is of the codec's JSON, not of Python equality."""
    target = active(store, refs)
    entry = store.read([target])[0]
    assert entry is not None and isinstance(entry.values["txn_count"], int)
    corrupt(engine, store, target, "txn_count", float(entry.values["txn_count"]))
    report = auditor().audit_refs(refs, graces=GRACES)
    [m] = report.mismatches
    assert set(m.differing) == {"txn_count"} and m.ref == target


def test_tombstones_and_absent_entries_are_consistent(
    engine: Engine, store: EntryStore, tenant: str, auditor: AuditorFactory
) -> None:
    from freshline.pipeline.cache.recompute import current_watermark

    written = materialize(engine, store, tenant, users=range(1, 6))
    store.invalidate(written[:3], current_watermark(engine))
    never = [EntityRef(fs.name, tenant, str(u)) for fs in REGISTRY for u in range(6, 9)]
    report = auditor().audit_refs([*written, *never])
    assert report.checked == 15 + 9 and report.absent == 3 + 9
    assert report.suspects == 0 and report.consistent


def test_entries_below_a_truncate_floor_read_as_absent(
    engine: Engine, store: EntryStore, tenant: str, refs: list[EntityRef], auditor: AuditorFactory
) -> None:
    """A truncate voids a feature set's older entries for readers, and so for the audit."""
    from freshline.pipeline.cache.recompute import current_watermark

    refs = materialize(engine, store, tenant, users=range(1, 6))
    wrong = next(r for r in refs if r.feature_set == "device_risk")
    corrupt(engine, store, wrong, "device_count", 99)
    assert not auditor().audit_refs(refs, graces=(0,)).consistent
    store.truncate("device_risk", current_watermark(engine))
    report = auditor().audit_refs(refs, graces=(0,))
    assert report.absent == 5 and report.suspects == 0 and report.consistent


def test_samples_one_feature_set_or_tenant_and_skips_foreign_keys(
    redis_client: redis.Redis,
    engine: Engine,
    store: EntryStore,
    version: int,
    auditor: AuditorFactory,
    tenant_factory: Callable[..., SeedSummary],
) -> None:
    one, two = (tenant_factory(users=USERS, transactions=400).tenants[0] for _ in range(2))
    materialize(engine, store, one)
    materialize(engine, store, two)
    redis_client.set(f"feat:{version}:nope:{{{one}:1}}", b"x", px=60_000)
    redis_client.set(f"feat:{version}:geo:{{{one}:u1}}", b"x", px=60_000)
    audit = auditor()

    by_set = audit.audit_sample(1000, feature_set="device_risk")
    assert by_set.checked_by_set == {"device_risk": 2 * USERS} and by_set.consistent
    by_tenant = audit.audit_sample(1000, tenant=two)
    assert by_tenant.checked == 3 * USERS and by_tenant.skipped == 0
    everything = audit.audit_sample(1000)
    assert everything.checked == 6 * USERS and everything.skipped == 2
    few = audit.audit_sample(7)
    assert few.checked + few.skipped == 7
    assert sample_pattern(version, "geo", one) == f"feat:{version}:geo:{{{one}:*}}"


def test_the_rate_limit_paces_checks_and_rechecks(
    auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    clock = FakeClock()
    report = auditor(rate=100, clock=clock).audit_refs(refs)
    # Batches of a tenth of a second's worth (10 entries), one every 0.1 s.
    assert report.checked == 60 and report.consistent
    assert report.elapsed_s == pytest.approx(0.5)
    assert clock.sleeps == pytest.approx([0.1] * 5)


def test_a_stall_builds_no_credit_above_the_rate(
    auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """After a second lost to a stall, batches stay 0.1 s apart: no burst to catch up
    (60 entries: 6 batches of 10 at 100/s)."""
    clock = FakeClock()
    starts: list[float] = []

    def progress(done: int, _total: int | None, _note: str) -> None:
        starts.append(clock.now)
        if done == 20:
            clock.now += 1.0  # Postgres stalls for a second after the second batch

    report = auditor(rate=100, clock=clock, progress=progress).audit_refs(refs)
    assert report.checked == 60
    batch_times = starts[:6]
    assert batch_times == pytest.approx([0.0, 0.1, 1.1, 1.2, 1.3, 1.4])
    assert clock.sleeps == pytest.approx([0.1] * 4)


def test_a_timed_audit_samples_until_its_duration_and_rechecks_meanwhile(
    engine: Engine, store: EntryStore, tenant: str, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    target = next(r for r in refs if r.feature_set == "geo")
    corrupt(engine, store, target, "last_city", "Atlantis")
    clock = FakeClock()
    report = auditor(rate=640, clock=clock, before_recheck=clock.note_recheck).audit_sample(
        60, tenant=tenant, graces=(1.0, 10.0), duration_s=3.0
    )
    # One batch of 60 per sample, 60/640 s apart: samples start at 0, 3/32, ..., 93/32 s.
    assert report.samples >= 31 and report.checked == 60 * report.samples
    assert report.checked_by_set == dict.fromkeys(REGISTRY.names(), 20 * report.samples)
    assert 3.0 - 2 * 60 / 640 <= report.checking_s < 3.0
    # The entry is wrong in every sample, and re-checked while sampling goes on.
    assert report.suspects == report.samples
    assert report.inconsistent == {1.0: report.samples, 10.0: report.samples}
    assert report.persistent == report.samples and not report.consistent
    assert min(clock.rechecks) < 3.0
    assert report.elapsed_s >= report.checking_s + 10.0 - 60 / 640 - 0.01


def test_a_timed_audit_checks_its_first_sample_however_short_its_duration(
    tenant: str, auditor: AuditorFactory, refs: list[EntityRef]
) -> None:
    """A duration shorter than the first SCAN (a loaded machine, or 0 s) still audits a
    sample: an audit that checked nothing and exits 0 would vouch for nothing."""
    report = auditor(clock=FakeClock()).audit_sample(60, tenant=tenant, duration_s=0.0)
    assert report.samples == 1 and report.checked == 60 and report.consistent


def test_a_timed_audit_of_nothing_waits_between_samples(
    tenant: str, auditor: AuditorFactory
) -> None:
    clock = FakeClock()
    report = auditor(clock=clock).audit_sample(100, tenant=tenant, duration_s=5.0)
    assert report.checked == 0 and report.samples == 5 and report.consistent
    assert clock.sleeps == [1.0] * 5
    with pytest.raises(ConfigError):
        auditor().audit_sample(1, duration_s=-1.0)


def test_a_report_keeps_the_first_mismatches_and_counts_them_all(
    engine: Engine,
    store: EntryStore,
    auditor: AuditorFactory,
    refs: list[EntityRef],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import freshline.pipeline.observe.audit as audit_module
    from freshline.pipeline.cli.audit import summary

    monkeypatch.setattr(audit_module, "KEPT_MISMATCHES", 2)
    for ref in [r for r in refs if r.feature_set == "geo"][:3]:
        corrupt(engine, store, ref, "last_city", "Atlantis")
    report = auditor().audit_refs(refs, graces=GRACES)
    assert report.persistent == 3 and len(report.mismatches) == 2 and not report.consistent
    assert report.as_json()["persistent"] == 3
    monkeypatch.setattr("freshline.pipeline.cli.audit.SHOWN_MISMATCHES", 1)
    shown = io.StringIO()
    Console(file=shown, width=80).print(summary(report, "test"))
    text = shown.getvalue()
    assert "3 mismatched after 2ms (persistent)" in text
    assert "... and 2 more (--json lists the first 2)" in text


def test_bad_requests_raise(version: int, auditor: AuditorFactory) -> None:
    audit = auditor()
    with pytest.raises(UnknownFeatureSet):
        audit.audit_refs([EntityRef("nope", "acme", "1")])
    with pytest.raises(InvalidId):
        audit.audit_refs([EntityRef("geo", "acme", "not-a-user")])
    with pytest.raises(ConfigError):
        audit.audit_keys([feature_key(version + 1, EntityRef("geo", "acme", "1"))])
    with pytest.raises(ConfigError):
        audit.audit_refs([], graces=())
    with pytest.raises(ConfigError):
        audit.audit_refs([], graces=(-1,))


# -- the command ------------------------------------------------------------------------


def run_audit(settings: Settings, version: int, *args: str) -> subprocess.CompletedProcess[str]:
    return cli(
        "audit",
        *args,
        FRESHLINE_POSTGRES_URL=settings.postgres_url,
        FRESHLINE_REDIS_URL=settings.redis_url,
        FRESHLINE_SCHEMA_VERSION=str(version),
        COLUMNS="80",
    )


def test_the_command_prints_a_summary_at_80_columns(
    settings: Settings, refs: list[EntityRef], version: int, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# entries to audit\n" + "".join(f"{feature_key(version, r)}\n" for r in refs))
    done = run_audit(settings, version, "--keys-file", str(keys), "--grace", "0s,1ms")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, done.stdout
    assert lines[0].startswith(f"audit of schema version {version}: 60 keys from")
    assert "checked     60 entries" in done.stdout
    assert "no mismatch persisted past 1ms" in done.stdout
    assert "entries/s" in done.stdout

    sampled = run_audit(
        settings,
        version,
        "--version",
        str(version),
        "--sample",
        "5",
        "--feature-set",
        "geo",
        "--rate",
        "0",
    )
    assert sampled.returncode == 0, sampled.stdout + sampled.stderr
    assert "checked     5 entries (geo 5)" in sampled.stdout


def test_the_command_exits_1_on_a_persistent_mismatch_and_prints_json(
    settings: Settings,
    engine: Engine,
    store: EntryStore,
    refs: list[EntityRef],
    version: int,
    tmp_path: Path,
) -> None:
    target = next(r for r in refs if r.feature_set == "geo")
    bad = corrupt(engine, store, target, "last_city", "Atlantis")
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"{feature_key(version, r)}\n" for r in refs))

    done = run_audit(settings, version, "--keys-file", str(keys), "--grace", "1ms")
    assert done.returncode == 1, done.stdout + done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 80, done.stdout
    assert "1 mismatched after 1ms (persistent):" in done.stdout
    assert feature_key(version, target) in done.stdout
    city = next(line for line in done.stdout.splitlines() if line.strip().startswith("last_city"))
    assert '"Atlantis"' in city
    assert "watermark" in done.stdout and "Traceback" not in done.stderr

    as_json = run_audit(settings, version, "--keys-file", str(keys), "--grace", "1ms", "--json")
    assert as_json.returncode == 1, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["checked"] == 60 and doc["consistent"] is False
    assert doc["graces"][0]["grace"] == "1ms" and doc["graces"][0]["inconsistent"] == 1
    [m] = doc["mismatches"]
    assert m["key"] == feature_key(version, target)
    assert m["differing"]["last_city"]["served"] == "Atlantis"
    assert int(m["served_watermark"], 16) == bad.watermark
    assert int(m["recomputed_watermark"], 16) > bad.watermark

    bad_grace = run_audit(settings, version, "--keys-file", str(keys), "--grace", "soon")
    assert bad_grace.returncode == 2 and "Traceback" not in bad_grace.stderr


def test_the_command_audits_sample_after_sample_for_a_duration(
    settings: Settings,
    engine: Engine,
    store: EntryStore,
    version: int,
    tenant: str,
    tmp_path: Path,
) -> None:
    materialize(engine, store, tenant)  # 60 entries: all of them in every sample
    done = run_audit(
        settings,
        version,
        "--tenant",
        tenant,
        "--sample",
        "60",
        "--duration",
        "300ms",
        "--rate",
        "600",
        "--grace",
        "1ms",
        "--json",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["source"]["duration_s"] == 0.3
    assert doc["samples"] >= 1 and doc["checked"] == 60 * doc["samples"]
    assert doc["consistent"] is True and doc["persistent"] == 0

    keys = tmp_path / "keys.txt"
    keys.write_text(feature_key(version, EntityRef("geo", tenant, "1")) + "\n")
    both = run_audit(settings, version, "--keys-file", str(keys), "--duration", "1s")
    assert both.returncode == 2 and "--duration" in both.stderr
    assert "Traceback" not in both.stderr
    bad = run_audit(settings, version, "--duration", "forever")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_the_command_leaves_prometheus_client_unimported_until_it_runs() -> None:
    """``freshline serve`` sets PROMETHEUS_MULTIPROC_DIR after the CLI's modules load;
    prometheus_client fixes its mode when first imported, so none of them may import it."""
    code = "import sys, freshline.pipeline.cli; print('prometheus_client' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
