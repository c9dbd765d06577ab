"""The consistency auditor: does Redis serve what Postgres says? (Meta's Polaris)

:class:`Auditor` takes entries (a random SCAN sample of one schema version's
namespace, a list of keys, or a list of entity refs) and checks each against a
recompute from Postgres. One check of a batch, in this order:

1. read every entry of the batch (pipelined MGETs, one round trip);
2. recompute the entries that exist: one :func:`~pipeline.cache.recompute.compute` per
   feature set, so its snapshot is taken after the entries were read;
3. compare field by field, exactly, as the codec stores values
   (:func:`~pipeline.observe.consistency.same`). An absent key, a tombstone or an
   entry below its feature set's floor (voided by a truncate) is consistent: every
   entry must be correct *or absent*, as readers see it.

A change committed between steps 1 and 3 that a consumer has not yet applied makes a
correct pipeline look wrong for a moment, so a mismatch is only a suspect. It is
checked again, entry and recompute both, after each grace period (by default 1 s,
10 s and 60 s after its first check); once it matches (or is gone) it is consistent
at that grace and every longer one. A mismatch that persists past the last grace is
reported with both values and both watermarks. Between the first check and each
re-check the ``before_recheck`` hook runs, which lets tests decide deterministically
what the re-check sees.

Safe on a live system: reads only, never writes Redis; Postgres sees set-based
queries of at most a tenth of a second's worth of entries at the configured rate
(500 entries/s by default, re-checks included); SCAN walks from a random cursor,
never KEYS.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

import orjson
import redis
from sqlalchemy.engine import Engine

from pipeline.cache.recompute import Batch, compute, entity_ids
from pipeline.core.cluster import is_cluster, mget
from pipeline.core.codec import ENTRY_TAG, HEADER, TOMBSTONE_TAG, decode_entry
from pipeline.core.errors import ConfigError, CorruptEntry, InvalidId, SchemaVersionMismatch
from pipeline.core.features import REGISTRY, Registry
from pipeline.core.keys import (
    entity_tag,
    feature_key,
    feature_pattern,
    floor_key,
    parse_feature_key,
    validate_id,
)
from pipeline.core.types import EntityRef, Watermark
from pipeline.observe.consistency import AuditReport, Mismatch, grace_label, same
from pipeline.observe.staleness import scan_sample

if TYPE_CHECKING:
    # Only a type here: importing prometheus_client fixes its multiprocess mode, which
    # `freshline serve` sets for its workers after the CLI's modules are imported.
    from pipeline.observe.audit_metrics import AuditMetrics

log = logging.getLogger(__name__)

DEFAULT_RATE: Final = 500.0
DEFAULT_GRACES: Final = (1.0, 10.0, 60.0)
DEFAULT_BATCH: Final = 500
MGET_CHUNK: Final = 100
PACE_SLICES: Final = 10
"""A batch holds at most 1/PACE_SLICES of a second's worth of the rate."""
MAX_SCAN_CALLS: Final = 100_000

RecheckHook = Callable[[float, Sequence[Mismatch]], None]
"""Called with ``(grace_s, suspects)`` just before those suspects are re-checked."""
ProgressHook = Callable[[int, int, str], None]
"""Called with ``(first checks done, total, note)`` after each batch and while waiting."""

Outcome = Mismatch | Literal["absent", "match"]


def sample_pattern(schema_version: int, feature_set: str | None = None,
                   tenant: str | None = None) -> str:
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
class _Suspect:
    mismatch: Mismatch
    first_at: float
    stage: int = 0
    """Index of the grace this suspect is re-checked at next."""


@dataclass(slots=True)
class _Run:
    report: AuditReport
    total: int
    started: float
    pending: list[_Suspect] = field(default_factory=list)
    paced: int = 0
    """Entries read so far, first checks and re-checks: what the rate limit counts."""
    first_checked: int = 0


class Auditor:
    """Checks one schema version's entries against Postgres; see the module docstring.

    ``rate`` caps entries per second (first checks and re-checks), ``None`` or ``0``
    for no cap. ``clock`` and ``sleep`` are for tests that want to run the graces
    on a clock of their own.
    """

    def __init__(self, client: redis.Redis, engine: Engine, schema_version: int, *,
                 registry: Registry = REGISTRY, rate: float | None = DEFAULT_RATE,
                 batch_size: int = DEFAULT_BATCH, metrics: AuditMetrics | None = None,
                 before_recheck: RecheckHook | None = None,
                 progress: ProgressHook | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch size must be at least 1, not {batch_size}")
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
        self.progress = progress
        self.clock = clock
        self.sleep = sleep

    # -- what to audit ----------------------------------------------------------------

    def audit_refs(self, refs: Iterable[EntityRef],
                   graces: Sequence[float] = DEFAULT_GRACES) -> AuditReport:
        """Audit these entities (duplicates once). Unknown sets or bad ids raise."""
        wanted = list(dict.fromkeys(refs))
        for ref in wanted:
            self.registry[ref.feature_set]
            entity_ids([(ref.tenant, ref.entity)])
        return self._run(wanted, check_graces(graces))

    def audit_keys(self, keys: Iterable[str | bytes],
                   graces: Sequence[float] = DEFAULT_GRACES) -> AuditReport:
        """Audit these feature keys, which must all be of this auditor's schema version."""
        refs: list[EntityRef] = []
        for key in keys:
            version, ref = parse_feature_key(key)
            if version != self.schema_version:
                raise ConfigError(f"key {feature_key(version, ref)} is of schema version "
                                  f"{version}; this audit checks version {self.schema_version}")
            refs.append(ref)
        return self.audit_refs(refs, graces)

    def audit_sample(self, n: int, *, feature_set: str | None = None, tenant: str | None = None,
                     graces: Sequence[float] = DEFAULT_GRACES,
                     rng: random.Random | None = None) -> AuditReport:
        """Audit up to ``n`` keys walked by SCAN from a random cursor.

        Keys this code cannot recompute (a feature set it does not know, an entity id
        that is not a user id) are counted in ``skipped``, not audited.
        """
        if feature_set is not None:
            self.registry[feature_set]
        checked_graces = check_graces(graces)
        pattern = sample_pattern(self.schema_version, feature_set, tenant)
        keys, _, _ = scan_sample(self.redis, pattern, want=n, max_calls=MAX_SCAN_CALLS,
                                 rng=rng)
        refs: list[EntityRef] = []
        skipped = 0
        for key in keys:
            try:
                _, ref = parse_feature_key(key)
                entity_ids([(ref.tenant, ref.entity)])
            except InvalidId:
                skipped += 1
                continue
            if ref.feature_set not in self.registry:
                skipped += 1
                continue
            refs.append(ref)
        report = self._run(refs, checked_graces)
        report.skipped = skipped
        return report

    # -- the run ------------------------------------------------------------------------

    def _run(self, refs: list[EntityRef], graces: tuple[float, ...]) -> AuditReport:
        report = AuditReport(self.schema_version, graces, rate=self.rate,
                             inconsistent=dict.fromkeys(graces, 0))
        run = _Run(report, total=len(refs), started=self.clock())
        for i in range(0, len(refs), self.batch_size):
            batch = refs[i:i + self.batch_size]
            self._wait_until(self._paced_at(run), run)
            self._first_check(batch, run)
            self._recheck_due(run)
            self._progress(run, "")
        report.checking_s = self.clock() - run.started
        while run.pending:
            self._progress(run, f"{len(run.pending)} to re-check")
            self._wait_until(min(self._due(s, graces) for s in run.pending), run)
        report.elapsed_s = self.clock() - run.started
        self._progress(run, "")
        if self.metrics is not None:
            self.metrics.finished(report)
        return report

    def _paced_at(self, run: _Run) -> float:
        """When the rate allows the next batch: ``started + paced / rate``."""
        return -math.inf if self.rate is None else run.started + run.paced / self.rate

    @staticmethod
    def _due(suspect: _Suspect, graces: tuple[float, ...]) -> float:
        return suspect.first_at + graces[suspect.stage]

    def _wait_until(self, when: float, run: _Run) -> None:
        """Sleep until ``when``, re-checking suspects as they fall due meanwhile."""
        while True:
            self._recheck_due(run)
            now = self.clock()
            if now >= when:
                return
            next_due = min((self._due(s, run.report.graces) for s in run.pending),
                           default=math.inf)
            self.sleep(max(0.0, min(when, next_due) - now))

    def _progress(self, run: _Run, note: str) -> None:
        if self.progress is not None:
            self.progress(run.first_checked, run.total, note)

    def _first_check(self, refs: list[EntityRef], run: _Run) -> None:
        report = run.report
        first_at = self.clock()
        outcomes = self._check(refs, report)
        run.paced += len(refs)
        run.first_checked += len(refs)
        report.checked += len(refs)
        per_set: dict[str, int] = defaultdict(int)
        for ref, outcome in zip(refs, outcomes, strict=True):
            per_set[ref.feature_set] += 1
            if outcome == "absent":
                report.absent += 1
            elif isinstance(outcome, Mismatch):
                report.suspects += 1
                run.pending.append(_Suspect(outcome, first_at))
        for name, n in per_set.items():
            report.checked_by_set[name] = report.checked_by_set.get(name, 0) + n
            if self.metrics is not None:
                self.metrics.checked_batch(name, n)

    def _recheck_due(self, run: _Run) -> None:
        """Re-check every suspect whose next grace has passed; see the module docstring."""
        graces = run.report.graces
        now = self.clock()
        due = [s for s in run.pending if self._due(s, graces) <= now]
        if not due:
            return
        run.pending = [s for s in run.pending if self._due(s, graces) > now]
        if self.before_recheck is not None:
            for stage in sorted({s.stage for s in due}):
                self.before_recheck(graces[stage], [s.mismatch for s in due if s.stage == stage])
        for i in range(0, len(due), self.batch_size):
            chunk = due[i:i + self.batch_size]
            outcomes = self._check([s.mismatch.ref for s in chunk], run.report)
            run.paced += len(chunk)
            run.report.rechecks += len(chunk)
            for suspect, outcome in zip(chunk, outcomes, strict=True):
                if isinstance(outcome, Mismatch):
                    self._still_inconsistent(suspect, outcome, run)

    def _still_inconsistent(self, suspect: _Suspect, mismatch: Mismatch, run: _Run) -> None:
        report = run.report
        grace = report.graces[suspect.stage]
        report.inconsistent[grace] += 1
        if self.metrics is not None:
            self.metrics.still_inconsistent(mismatch.ref.feature_set, grace)
        suspect.mismatch = mismatch
        suspect.stage += 1
        if suspect.stage < len(report.graces):
            run.pending.append(suspect)
            return
        report.mismatches.append(mismatch)
        log.info("%s inconsistent after %s: served watermark %s, recomputed %s, differing %s",
                 mismatch.key, grace_label(grace), mismatch.served_watermark,
                 mismatch.recomputed_watermark, mismatch.problem or mismatch.differing)

    # -- one check ----------------------------------------------------------------------

    def _check(self, refs: Sequence[EntityRef], report: AuditReport) -> list[Outcome]:
        """Read the entries, then recompute those present, then compare."""
        started = self.clock()
        keys = [feature_key(self.schema_version, ref) for ref in refs]
        raws = self._read(keys, [ref.feature_set for ref in refs])
        present: dict[str, list[EntityRef]] = defaultdict(list)
        for ref, raw in zip(refs, raws, strict=True):
            if _present(raw):
                present[ref.feature_set].append(ref)
        batches = {name: compute(self.engine, self.registry[name],
                                 [(r.tenant, r.entity) for r in group])
                   for name, group in present.items()}
        outcomes = [self._compare(ref, key, raw, batches.get(ref.feature_set))
                    for ref, key, raw in zip(refs, keys, raws, strict=True)]
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
            replies, floor_reply = [both[:len(keys)]], both[len(keys):]
        else:
            pipe = self.redis.pipeline(transaction=False)
            for i in range(0, len(keys), MGET_CHUNK):
                pipe.mget(keys[i:i + MGET_CHUNK])
            pipe.mget(floor_keys)
            *replies, floor_reply = pipe.execute()
        floors = {name: _bytes(f) for name, f in zip(sets, floor_reply, strict=True)}
        raws = [_bytes(r) for reply in replies for r in reply]
        return [None if _voided(raw, floors[name]) else raw
                for raw, name in zip(raws, feature_sets, strict=True)]

    def _compare(self, ref: EntityRef, key: str, raw: bytes | None,
                 batch: Batch | None) -> Outcome:
        if raw is None or raw[:1] == TOMBSTONE_TAG or batch is None:
            return "absent"  # (``batch`` is there for every entry that is present)
        fields = self.registry[ref.feature_set].field_names
        values = batch.values.get((ref.tenant, ref.entity))
        # The recompute as the codec would store it: the same JSON round trip.
        recomputed = None if values is None else dict(zip(
            fields, orjson.loads(orjson.dumps([values[f] for f in fields])), strict=True))
        try:
            entry = decode_entry(raw, fields, self.schema_version)
        except (CorruptEntry, SchemaVersionMismatch) as exc:
            return Mismatch(key, ref, None, recomputed, _watermark_of(raw), batch.watermark,
                            problem=str(exc))
        if entry is None:
            return "absent"
        if recomputed is not None and all(same(entry.values[f], recomputed[f]) for f in fields):
            return "match"
        return Mismatch(key, ref, entry.values, recomputed, entry.watermark, batch.watermark)


def _bytes(raw: bytes | str | None) -> bytes | None:
    return raw.encode() if isinstance(raw, str) else raw


def _voided(raw: bytes | None, floor: bytes | None) -> bool:
    """An entry computed before its feature set's floor (compared as the store does)."""
    return (raw is not None and floor is not None and raw[:1] == ENTRY_TAG
            and raw[1:HEADER] < floor)


def _present(raw: bytes | None) -> bool:
    return raw is not None and raw[:1] != TOMBSTONE_TAG


def _watermark_of(raw: bytes) -> Watermark | None:
    try:
        return int(raw[1:HEADER], 16)
    except ValueError:
        return None
