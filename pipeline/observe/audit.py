"""The consistency auditor: does Redis serve what Postgres says? (Meta's Polaris)

:class:`Auditor` reads a batch of entries (a SCAN sample, a list of keys or entity
refs), recomputes those present from Postgres with each feature set's full query (never
the incremental path under test), its snapshot taken after the read, and compares field
by field as the codec stores values. A mismatch is a suspect, re-checked after each
grace; one that *caught up* on its watermark stays pending until its values match
(verified), or is settled as unverified or a mismatch. Reads only; paced by ``rate``.
``before_recheck`` and ``before_verify`` let tests decide what a re-check sees.

The rules, why each holds, and what the summary counts: docs/audit.md.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

import orjson
import redis
from sqlalchemy.engine import Engine

from freshline.pipeline.cache.recompute import Batch, compute, entity_ids
from freshline.pipeline.core.cluster import is_cluster, mget
from freshline.pipeline.core.codec import ENTRY_TAG, HEADER, TOMBSTONE_TAG, decode_entry
from freshline.pipeline.core.errors import (
    ConfigError,
    CorruptEntry,
    InvalidId,
    SchemaVersionMismatch,
)
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.keys import (
    entity_tag,
    feature_key,
    feature_pattern,
    floor_key,
    parse_feature_key,
    validate_id,
)
from freshline.pipeline.core.types import EntityRef, FeatureValues, Watermark
from freshline.pipeline.observe.consistency import (
    AuditReport,
    LateEntry,
    Mismatch,
    grace_label,
    same,
)
from freshline.pipeline.observe.staleness import scan_sample

if TYPE_CHECKING:
    # Only a type here: importing prometheus_client fixes its multiprocess mode, which
    # `freshline serve` sets for its workers after the CLI's modules are imported.
    from freshline.pipeline.observe.audit_metrics import AuditMetrics

log = logging.getLogger(__name__)

DEFAULT_RATE: Final = 500.0
DEFAULT_GRACES: Final = (1.0, 10.0, 60.0)
DEFAULT_BATCH: Final = 500
MGET_CHUNK: Final = 100
PACE_SLICES: Final = 10
"""A batch holds at most 1/PACE_SLICES of a second's worth of the rate."""
MAX_SCAN_CALLS: Final = 100_000
PARSED_KEYS: Final = 100_000
"""Sampled keys remembered as parsed (a continuous audit samples the same keys again);
the memory is cleared when full."""
KEPT_MISMATCHES: Final = 1000
KEPT_LATE: Final = 50
"""Entries kept per grace as examples of the late ones (``AuditReport.late``)."""
"""Persistent mismatches kept in full in a report; every one is counted."""
MAX_EARLY_S: Final = 1 / PACE_SLICES
"""How early a re-check may ride along with a batch of first checks."""
EMPTY_ROUND_WAIT_S: Final = 1.0
"""How long a timed audit waits after a sample that found no entry."""
VERIFY_EVERY_S: Final = 1.0
"""How often an entity whose entry caught up on its watermark alone is re-checked."""
KEPT_UNVERIFIED: Final = 50
"""Unverified entries kept as examples (``AuditReport.unverified_entries``)."""

RecheckHook = Callable[[float, Sequence[Mismatch]], None]
"""Called with ``(grace_s, suspects)`` just before those suspects are re-checked."""
VerifyHook = Callable[[Sequence[EntityRef]], None]
"""Called with the entities about to be re-checked in a pending pass."""
ProgressHook = Callable[[int, int | None, str], None]
"""Called with ``(first checks done, total, note)`` after each batch and while waiting;
``total`` is None in a timed audit."""

Outcome = Mismatch | Literal["absent", "match"]
CaughtUp = Literal["values", "watermark"]


def sample_pattern(
    schema_version: int, feature_set: str | None = None, tenant: str | None = None
) -> str:
    """The SCAN MATCH pattern for a version's entries, of one set and/or one tenant."""
    pattern = feature_pattern(schema_version, feature_set)
    if tenant is None:
        return pattern
    return pattern.removesuffix("*") + entity_tag(validate_id("tenant", tenant), "*")


def check_graces(graces: Iterable[float]) -> tuple[float, ...]:
    """Graces sorted and deduplicated; at least one, none negative."""
    out = tuple(sorted({float(g) for g in graces}))
    if not out or out[0] < 0 or not all(math.isfinite(g) for g in out):
        raise ConfigError(f"graces must be one or more durations of 0 s or more, not {out}")
    return out


@dataclass(slots=True)
class Suspect:
    """A mismatch found at a first check, waiting for its re-checks."""

    mismatch: Mismatch
    """As last checked."""
    first_at: float
    first_served: Watermark
    """The entry's watermark at the first check (-1 if it had none)."""
    target: Watermark
    """The first check's recompute watermark: what the entry has to catch up with."""
    truth: FeatureValues | None
    """The first check's recompute: what Postgres held when the mismatch was found."""
    first_unix: float = 0.0
    """Wall-clock time of the first check, to line it up with other processes' logs."""
    stage: int = 0
    """Index of the grace this suspect is re-checked at next."""

    @classmethod
    def of(cls, mismatch: Mismatch, first_at: float, first_unix: float = 0.0) -> Suspect:
        served = mismatch.served_watermark
        return cls(
            mismatch,
            first_at,
            -1 if served is None else served,
            mismatch.recomputed_watermark,
            mismatch.recomputed,
            first_unix,
        )

    def caught_up(self, now: Mismatch) -> bool:
        """Not claiming more than the re-check's recompute, and either rewritten since
        the first check from a snapshot that saw what its recompute saw, or showing
        that recompute's values (docs/audit.md)."""
        return self.caught_up_by(now) is not None

    def caught_up_by(self, now: Mismatch) -> CaughtUp | None:
        """How the entry caught up: ``"values"`` when it shows the first check's
        recompute, ``"watermark"`` when only its watermark says so (its values are
        then still to be verified), ``None`` when it has not."""
        served = now.served_watermark
        if now.problem is not None or served is None or served >= now.recomputed_watermark:
            return None
        if self.truth is not None and same(now.served, self.truth):
            return "values"
        if self.first_served < served and self.target <= served:
            return "watermark"
        return None


@dataclass(slots=True)
class Pending:
    """An entity whose entries caught up on their watermarks alone, awaiting a pass
    whose recompute its served entry matches (docs/audit.md)."""

    ref: EntityRef
    served: Watermark
    """The watermark of the entry accepted last."""
    stages: list[int]
    """Per acceptance, the index of the grace it was accepted at."""
    first_at: list[float]
    """Per acceptance, when its suspect was first checked."""
    due: float
    deadline: float
    last: Mismatch
    truth: FeatureValues | None
    """The recompute at the latest acceptance."""
    quiet: bool = True
    """Every pass since the latest acceptance recomputed :attr:`truth`: the entity
    has not changed since (as far as the passes can tell)."""


@dataclass(slots=True)
class _Run:
    report: AuditReport
    total: int | None
    started: float
    pending: list[Suspect] = field(default_factory=list)
    verifying: dict[EntityRef, Pending] = field(default_factory=dict)
    """Entities with entries caught up on their watermarks alone, not yet verified."""
    next_at: float = -math.inf
    """When the rate allows the next batch (see :meth:`Auditor._spent`)."""
    last_check_s: float = 0.0
    """How long the last first check took: when the next batch starts, at capacity."""
    first_checked: int = 0


class Auditor:
    """Checks one schema version's entries against Postgres (module docstring, docs/audit.md).

    ``rate`` caps entries per second (first checks and re-checks), ``None`` or ``0``
    for no cap. ``verify_s`` bounds how long an entry caught up on its watermark alone
    may take to be verified (the last grace by default). ``clock`` and ``sleep`` are
    for tests that want to run the graces on a clock of their own.
    """

    def __init__(
        self,
        client: redis.Redis,
        engine: Engine,
        schema_version: int,
        *,
        registry: Registry,
        rate: float | None = DEFAULT_RATE,
        batch_size: int = DEFAULT_BATCH,
        metrics: AuditMetrics | None = None,
        before_recheck: RecheckHook | None = None,
        before_verify: VerifyHook | None = None,
        verify_s: float | None = None,
        progress: ProgressHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch size must be at least 1, not {batch_size}")
        if verify_s is not None and not (math.isfinite(verify_s) and verify_s >= 0):
            raise ConfigError(f"the bound to verify an entry is 0 s or more, not {verify_s}")
        self.redis = client
        self.engine = engine
        self.schema_version = schema_version
        self.registry = registry
        self.rate = rate or None
        self.batch_size = batch_size
        if self.rate is not None:
            self.batch_size = min(batch_size, max(1, math.ceil(self.rate / PACE_SLICES)))
        self.metrics = metrics
        self.before_recheck = before_recheck
        self.before_verify = before_verify
        self.verify_s = verify_s
        self.progress = progress
        self.clock = clock
        self.sleep = sleep
        self._parsed: dict[bytes, EntityRef | None] = {}
        """Sampled key -> its ref, or None if this code cannot audit it."""
        self._keys: dict[EntityRef, str] = {}

    # -- what to audit ----------------------------------------------------------------

    def audit_refs(
        self, refs: Iterable[EntityRef], graces: Sequence[float] = DEFAULT_GRACES
    ) -> AuditReport:
        """Audit these entities (duplicates once). Unknown sets or bad ids raise."""
        wanted = list(dict.fromkeys(refs))
        for ref in wanted:
            entity_ids([(ref.tenant, ref.entity)], self.registry[ref.feature_set].entity)
        run = self._start(check_graces(graces), total=len(wanted))
        return self._run(run, self._batches(wanted))

    def audit_keys(
        self, keys: Iterable[str | bytes], graces: Sequence[float] = DEFAULT_GRACES
    ) -> AuditReport:
        """Audit these feature keys, which must all be of this auditor's schema version."""
        refs: list[EntityRef] = []
        for key in keys:
            version, ref = parse_feature_key(key)
            if version != self.schema_version:
                raise ConfigError(
                    f"key {feature_key(version, ref)} is of schema version "
                    f"{version}; this audit checks version {self.schema_version}"
                )
            refs.append(ref)
        return self.audit_refs(refs, graces)

    def audit_sample(
        self,
        n: int,
        *,
        feature_set: str | None = None,
        tenant: str | None = None,
        graces: Sequence[float] = DEFAULT_GRACES,
        rng: random.Random | None = None,
        duration_s: float | None = None,
    ) -> AuditReport:
        """Audit up to ``n`` keys walked by SCAN from a random cursor.

        With ``duration_s``, keep auditing samples of ``n`` (each from a new random
        cursor) until that long has passed, then wait out the last re-checks. Suspects
        are re-checked as they fall due while first checks go on, so a long run checks
        at its rate throughout. A key sampled twice is checked twice.

        Keys this code cannot recompute (a feature set it does not know, an entity id
        that is not a user id) are counted in ``skipped``, not audited.
        """
        if feature_set is not None:
            self.registry[feature_set]
        if duration_s is not None and not (math.isfinite(duration_s) and duration_s >= 0):
            raise ConfigError(f"an audit's duration is 0 s or more, not {duration_s}")
        checked_graces = check_graces(graces)
        pattern = sample_pattern(self.schema_version, feature_set, tenant)
        rng = rng or random.Random()
        if duration_s is None:
            report = self._report(checked_graces)
            refs = self._sample(n, pattern, rng, report)
            report.samples += 1
            run = self._start(checked_graces, total=len(refs), report=report)
            return self._run(run, self._batches(refs))
        run = self._start(checked_graces, total=None)
        return self._run(run, self._samples(n, pattern, rng, run, run.started + duration_s))

    def _batches(self, refs: list[EntityRef]) -> Iterator[list[EntityRef]]:
        size = self.batch_size
        return (refs[i : i + size] for i in range(0, len(refs), size))

    def _samples(
        self, n: int, pattern: str, rng: random.Random, run: _Run, until: float
    ) -> Iterator[list[EntityRef]]:
        """Batches of samples taken one after another while the next batch would start
        before ``until``; the first batch always, however short the duration (an audit
        that checked nothing would say nothing). An empty batch stands for a sample that
        found nothing to audit (see :meth:`_run`)."""

        def before_until() -> bool:
            return max(self.clock(), run.next_at) < until

        started = False
        while not started or before_until():
            refs = self._sample(n, pattern, rng, run.report)
            if not refs:
                run.report.samples += 1
                started = True
                yield []
            for i, batch in enumerate(self._batches(refs)):
                if started and not before_until():
                    return  # (a sample none of which was checked is not counted)
                if i == 0:
                    run.report.samples += 1
                started = True
                yield batch

    def _sample(
        self, n: int, pattern: str, rng: random.Random, report: AuditReport
    ) -> list[EntityRef]:
        """Up to ``n`` auditable refs by SCAN from a random cursor; the rest are skipped."""
        keys, _, _ = scan_sample(self.redis, pattern, want=n, max_calls=MAX_SCAN_CALLS, rng=rng)
        return self._auditable(keys, report)

    def _auditable(self, keys: Iterable[bytes], report: AuditReport) -> list[EntityRef]:
        refs: list[EntityRef] = []
        parsed = self._parsed
        for key in keys:
            if key in parsed:
                ref = parsed[key]
            else:
                ref = self._parse(key)
                if len(parsed) >= PARSED_KEYS:
                    parsed.clear()
                parsed[key] = ref
            if ref is None:
                report.skipped += 1
            else:
                refs.append(ref)
        return refs

    def _parse(self, key: bytes) -> EntityRef | None:
        """The ref of a sampled key, or None if this code cannot recompute it."""
        try:
            version, ref = parse_feature_key(key)
            if ref.feature_set not in self.registry:
                return None
            entity_ids([(ref.tenant, ref.entity)], self.registry[ref.feature_set].entity)
        except InvalidId:
            return None
        if version == self.schema_version and len(self._keys) < PARSED_KEYS:
            self._keys[ref] = key.decode()  # canonical: parse_feature_key checked it
        return ref

    def _key(self, ref: EntityRef) -> str:
        key = self._keys.get(ref)
        if key is None:
            if len(self._keys) >= PARSED_KEYS:
                self._keys.clear()
            key = self._keys[ref] = feature_key(self.schema_version, ref)
        return key

    # -- the run ------------------------------------------------------------------------

    def _report(self, graces: tuple[float, ...]) -> AuditReport:
        return AuditReport(
            self.schema_version, graces, rate=self.rate, inconsistent=dict.fromkeys(graces, 0)
        )

    def _start(
        self, graces: tuple[float, ...], total: int | None, report: AuditReport | None = None
    ) -> _Run:
        return _Run(report or self._report(graces), total=total, started=self.clock())

    def _run(self, run: _Run, batches: Iterable[list[EntityRef]]) -> AuditReport:
        """First-check each batch at the paced rate, re-checking suspects as they fall
        due; then wait out the re-checks still pending. An empty batch (a sample that
        found nothing) waits :data:`EMPTY_ROUND_WAIT_S` before the next sample."""
        report = run.report
        for batch in batches:
            if not batch:
                self._wait_until(self.clock() + EMPTY_ROUND_WAIT_S, run)
                continue
            self._wait_until(run.next_at, run)
            self._first_check(batch, run)
            self._recheck_due(run)
            self._progress(run, "")
        report.checking_s = self.clock() - run.started
        while run.pending or run.verifying:
            waiting = len(run.pending) + len(run.verifying)
            self._progress(run, f"{waiting} to re-check")
            self._wait_until(self._next_due(run), run)
        report.elapsed_s = self.clock() - run.started
        self._progress(run, "")
        if self.metrics is not None:
            self.metrics.finished(report)
        return report

    def _spent(self, run: _Run, n: int, started: float) -> None:
        """Count ``n`` entries read by a check begun at ``started`` against the rate.

        The next batch may start ``n / rate`` after this one did, or after the last
        allowance ran out if that is later: time spent stalled (a slow Postgres, a
        re-check burst) builds no credit, so a run never catches up above its rate.
        """
        if self.rate is not None:
            run.next_at = max(run.next_at, started) + n / self.rate

    @staticmethod
    def _due(suspect: Suspect, graces: tuple[float, ...]) -> float:
        return suspect.first_at + graces[suspect.stage]

    def _next_due(self, run: _Run) -> float:
        """When the next re-check (of a suspect or a pending entity) falls due."""
        graces = run.report.graces
        return min(
            min((self._due(s, graces) for s in run.pending), default=math.inf),
            min((p.due for p in run.verifying.values()), default=math.inf),
        )

    def _wait_until(self, when: float, run: _Run) -> None:
        """Sleep until ``when``, re-checking suspects as they fall due meanwhile."""
        while True:
            self._recheck_due(run)
            now = self.clock()
            if now >= when:
                return
            self.sleep(max(0.0, min(when, self._next_due(run)) - now))

    def _progress(self, run: _Run, note: str) -> None:
        if self.progress is not None:
            self.progress(run.first_checked, run.total, note)

    def _first_check(self, refs: list[EntityRef], run: _Run) -> None:
        """First-check ``refs`` and, in the same read and recompute, re-check the
        suspects that fall due before the next batch is likely to start (a pace
        slice, or the last check's duration when running at capacity): at most
        ``batch_size`` of them, each at most :data:`MAX_EARLY_S` early (stricter),
        never late. One round trip to Redis and one statement per feature set serve
        both."""
        report = run.report
        first_at, first_unix = self.clock(), time.time()
        slice_s = len(refs) / self.rate if self.rate is not None else 0.0
        early_s = min(MAX_EARLY_S, max(slice_s, run.last_check_s))
        due = self._take_due(run, first_at + early_s, limit=self.batch_size)
        outcomes = self._check([*refs, *(s.mismatch.ref for s in due)], report)
        run.last_check_s = self.clock() - first_at
        self._spent(run, len(refs) + len(due), first_at)
        self._rechecked(due, outcomes[len(refs) :], run)
        run.first_checked += len(refs)
        report.checked += len(refs)
        per_set: dict[str, int] = defaultdict(int)
        for ref, outcome in zip(refs, outcomes[: len(refs)], strict=True):
            per_set[ref.feature_set] += 1
            if outcome == "match" and ref in run.verifying:
                # A later entry (watermarks only grow) that matches: it supersedes them.
                self._verified(run.verifying.pop(ref), run)
            if outcome == "absent":
                report.absent += 1
            elif isinstance(outcome, Mismatch):
                report.suspects += 1
                run.pending.append(Suspect.of(outcome, first_at, first_unix))
        for name, n in per_set.items():
            report.checked_by_set[name] = report.checked_by_set.get(name, 0) + n
            if self.metrics is not None:
                self.metrics.checked_batch(name, n)

    def _take_due(self, run: _Run, by: float, limit: int | None = None) -> list[Suspect]:
        """Remove from ``pending`` the suspects due by ``by`` (the earliest ``limit``),
        and run the ``before_recheck`` hook for them."""
        graces = run.report.graces
        due = [s for s in run.pending if self._due(s, graces) <= by]
        if not due:
            return []
        if limit is not None and len(due) > limit:
            due = sorted(due, key=lambda s: self._due(s, graces))[:limit]
        taken = {id(s) for s in due}
        run.pending = [s for s in run.pending if id(s) not in taken]
        if self.before_recheck is not None:
            for stage in sorted({s.stage for s in due}):
                self.before_recheck(graces[stage], [s.mismatch for s in due if s.stage == stage])
        return due

    def _recheck_due(self, run: _Run) -> None:
        """Re-check every suspect whose next grace has passed, then every pending
        entity whose next pass has come (docs/audit.md)."""
        due = self._take_due(run, self.clock())
        for i in range(0, len(due), self.batch_size):
            chunk = due[i : i + self.batch_size]
            started = self.clock()
            outcomes = self._check([s.mismatch.ref for s in chunk], run.report)
            self._spent(run, len(chunk), started)
            self._rechecked(chunk, outcomes, run)
        now = self.clock()
        passing = [p for p in run.verifying.values() if p.due <= now]
        if passing and self.before_verify is not None:
            self.before_verify([p.ref for p in passing])
        for i in range(0, len(passing), self.batch_size):
            entities = passing[i : i + self.batch_size]
            started = self.clock()
            outcomes = self._check([p.ref for p in entities], run.report)
            self._spent(run, len(entities), started)
            run.report.rechecks += len(entities)
            for p, outcome in zip(entities, outcomes, strict=True):
                self._verify_pass(p, outcome, started, run)

    def _pend(self, suspect: Suspect, now: Mismatch, run: _Run) -> None:
        """Keep an entry caught up on its watermark alone pending (docs/audit.md):
        its entity joins the pending set, or its acceptance joins those
        already pending there, and the deadline moves to this acceptance's."""
        at = self.clock()
        bound = self._verify_bound(run.report)
        served = now.served_watermark
        if served is None:  # caught_up_by accepts none such
            return
        pending = run.verifying.get(now.ref)
        if pending is None:
            run.verifying[now.ref] = Pending(
                now.ref,
                served,
                [suspect.stage],
                [suspect.first_at],
                at + min(VERIFY_EVERY_S, bound),
                at + bound,
                now,
                now.recomputed,
            )
            return
        pending.served = max(pending.served, served)
        pending.stages.append(suspect.stage)
        pending.first_at.append(suspect.first_at)
        pending.deadline = max(pending.deadline, at + bound)
        pending.last, pending.truth, pending.quiet = now, now.recomputed, True

    def _verify_pass(self, pending: Pending, outcome: Outcome, at: float, run: _Run) -> None:
        """One pass over a pending entity: verified on a match; at its deadline, a
        mismatch if it still serves the accepted entry and the entity was quiet
        throughout, else unverified."""
        if outcome == "match":
            self._verified(run.verifying.pop(pending.ref), run)
            return
        if isinstance(outcome, Mismatch):
            pending.last = outcome
            pending.quiet = pending.quiet and same(outcome.recomputed, pending.truth)
        else:
            pending.quiet = False
        if at < pending.deadline:
            pending.due = min(at + VERIFY_EVERY_S, pending.deadline)
            return
        del run.verifying[pending.ref]
        report = run.report
        last = pending.last
        name = pending.ref.feature_set
        n = len(pending.stages)
        if (
            isinstance(outcome, Mismatch)
            and outcome.served_watermark == pending.served
            and pending.quiet
        ):
            # Differing, for the whole bound, from what Postgres held all that time:
            # inconsistent at every grace up to the bound.
            bound = self._verify_bound(report)
            for stage, first_at in zip(pending.stages, pending.first_at, strict=True):
                for grace in report.graces[stage:]:
                    if grace <= bound:
                        self._count_inconsistent(grace, first_at, name, run)
            if len(report.mismatches) < KEPT_MISMATCHES:
                report.mismatches.append(outcome)
            report.wrong_after_catching_up += n
            log.info(
                "%s caught up on its watermark %s, then differed unchanged while its "
                "entity was quiet: %s",
                outcome.key,
                outcome.served_watermark,
                outcome.problem or outcome.differing,
            )
            return
        report.unverified += n
        if len(report.unverified_entries) < KEPT_UNVERIFIED:
            report.unverified_entries.append(last)
        if self.metrics is not None:
            self.metrics.settled(name, verified=0, unverified=n)

    def _verify_bound(self, report: AuditReport) -> float:
        return self.verify_s if self.verify_s is not None else report.graces[-1]

    def _verified(self, pending: Pending, run: _Run) -> None:
        n = len(pending.stages)
        run.report.verified += n
        if self.metrics is not None:
            self.metrics.settled(pending.ref.feature_set, verified=n, unverified=0)

    def _rechecked(
        self, suspects: Sequence[Suspect], outcomes: Sequence[Outcome], run: _Run
    ) -> None:
        run.report.rechecks += len(suspects)
        for suspect, outcome in zip(suspects, outcomes, strict=True):
            if not isinstance(outcome, Mismatch):
                if outcome == "match" and suspect.mismatch.ref in run.verifying:
                    self._verified(run.verifying.pop(suspect.mismatch.ref), run)
                continue
            how = suspect.caught_up_by(outcome)
            if how is None:
                self._still_inconsistent(suspect, outcome, run)
                continue
            run.report.caught_up += 1
            if how == "watermark":
                self._pend(suspect, outcome, run)

    def _count_inconsistent(self, grace: float, first_at: float, name: str, run: _Run) -> None:
        report = run.report
        report.inconsistent[grace] += 1
        at = report.inconsistent_at.setdefault(grace, {})
        second = int(first_at - run.started)
        at[second] = at.get(second, 0) + 1
        if self.metrics is not None:
            self.metrics.still_inconsistent(name, grace)

    def _still_inconsistent(self, suspect: Suspect, mismatch: Mismatch, run: _Run) -> None:
        report = run.report
        grace = report.graces[suspect.stage]
        self._count_inconsistent(grace, suspect.first_at, mismatch.ref.feature_set, run)
        late = report.late.setdefault(grace, [])
        if len(late) < KEPT_LATE:
            late.append(
                LateEntry(
                    mismatch,
                    round(suspect.first_unix, 3),
                    None if suspect.first_served < 0 else suspect.first_served,
                )
            )
        suspect.mismatch = mismatch
        suspect.stage += 1
        if suspect.stage < len(report.graces):
            run.pending.append(suspect)
            return
        if len(report.mismatches) < KEPT_MISMATCHES:
            report.mismatches.append(mismatch)
        log.info(
            "%s inconsistent after %s: served watermark %s, recomputed %s, differing %s",
            mismatch.key,
            grace_label(grace),
            mismatch.served_watermark,
            mismatch.recomputed_watermark,
            mismatch.problem or mismatch.differing,
        )

    # -- one check ----------------------------------------------------------------------

    def _check(self, refs: Sequence[EntityRef], report: AuditReport) -> list[Outcome]:
        """Read the entries, then recompute those present, then compare."""
        started = self.clock()
        keys = [self._key(ref) for ref in refs]
        raws = self._read(keys, [ref.feature_set for ref in refs])
        present: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for ref, raw in zip(refs, raws, strict=True):
            if _present(raw):
                present[ref.feature_set].append((ref.tenant, ref.entity))
        batches: dict[str, Batch] = {}
        if present:
            # One connection for every feature set: each statement takes its own
            # snapshot (after the read), as compute() on the engine would.
            with self.engine.connect() as conn:
                for name, pairs in present.items():
                    batches[name] = compute(conn, self.registry[name], pairs, path="full")
                conn.rollback()
        outcomes = [
            self._compare(ref, key, raw, batches.get(ref.feature_set))
            for ref, key, raw in zip(refs, keys, raws, strict=True)
        ]
        report.busy_s += self.clock() - started
        return outcomes

    def _read(self, keys: list[str], feature_sets: list[str]) -> list[bytes | None]:
        """Every key's raw value, in pipelined MGETs of ``MGET_CHUNK`` keys.

        The feature sets' floors come in the same round trip: an entry below its set's
        floor (a truncate voided it) reads as absent, as it does to every reader.
        """
        sets = list(dict.fromkeys(feature_sets))
        floor_keys = [floor_key(self.schema_version, name) for name in sets]
        if is_cluster(self.redis):  # one MGET per slot, pipelined per node
            both = mget(self.redis, [*keys, *floor_keys])
            replies, floor_reply = [both[: len(keys)]], both[len(keys) :]
        else:
            pipe = self.redis.pipeline(transaction=False)
            for i in range(0, len(keys), MGET_CHUNK):
                pipe.mget(keys[i : i + MGET_CHUNK])
            pipe.mget(floor_keys)
            *replies, floor_reply = pipe.execute()
        floors = {name: _bytes(f) for name, f in zip(sets, floor_reply, strict=True)}
        raws = [_bytes(r) for reply in replies for r in reply]
        return [
            None if _voided(raw, floors[name]) else raw
            for raw, name in zip(raws, feature_sets, strict=True)
        ]

    def _compare(self, ref: EntityRef, key: str, raw: bytes | None, batch: Batch | None) -> Outcome:
        if raw is None or raw[:1] == TOMBSTONE_TAG or batch is None:
            return "absent"  # (``batch`` is there for every entry that is present)
        fields = self.registry[ref.feature_set].field_names
        values = batch.values.get((ref.tenant, ref.entity))
        try:
            entry = decode_entry(raw, fields, self.schema_version)
        except (CorruptEntry, SchemaVersionMismatch) as exc:
            return Mismatch(
                key,
                ref,
                None,
                _stored(values, fields),
                _watermark_of(raw),
                batch.watermark,
                problem=str(exc),
            )
        if entry is None:
            return "absent"
        if values is not None:
            # The codec's JSON of both value lists: equal exactly when every field is
            # (:func:`~freshline.pipeline.observe.consistency.same`), scalars being one token each.
            served = orjson.dumps([entry.values[f] for f in fields])
            if served == orjson.dumps([values[f] for f in fields]):
                return "match"
        return Mismatch(
            key, ref, entry.values, _stored(values, fields), entry.watermark, batch.watermark
        )


def _stored(values: FeatureValues | None, fields: Sequence[str]) -> FeatureValues | None:
    """A recompute as the codec would store it: the same JSON round trip."""
    if values is None:
        return None
    return dict(zip(fields, orjson.loads(orjson.dumps([values[f] for f in fields])), strict=True))


def _bytes(raw: bytes | str | None) -> bytes | None:
    return raw.encode() if isinstance(raw, str) else raw


def _voided(raw: bytes | None, floor: bytes | None) -> bool:
    """An entry computed before its feature set's floor (compared as the store does)."""
    return raw is not None and floor is not None and raw[:1] == ENTRY_TAG and raw[1:HEADER] < floor


def _present(raw: bytes | None) -> bool:
    return raw is not None and raw[:1] != TOMBSTONE_TAG


def _watermark_of(raw: bytes) -> Watermark | None:
    try:
        return int(raw[1:HEADER], 16)
    except ValueError:
        return None
