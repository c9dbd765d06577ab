"""What an audit found: mismatches, consistency per grace period, in nines.

An entry is *consistent* when it holds exactly what a recompute from Postgres gives,
or when there is none (absent or a tombstone: "correct or absent"). An entry that
mismatches at its first check is re-checked after each grace period; the consistency
at grace ``g`` is the fraction of checked entries that were consistent at the first
check or became so within ``g``. In nines: ``-log10(1 - fraction)``, so 99.9% is 3.

With no inconsistent entry at all the fraction is 1 and the nines infinite; a
sample of ``n`` entries can only show that the rate is below about ``1/n``, so the
nines are then reported as ``log10(n)`` and marked as a lower bound.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from freshline.pipeline.cache.recompute import unpack_watermark
from freshline.pipeline.core.codec import watermark_hex
from freshline.pipeline.core.types import EntityRef, FeatureValues, Watermark


def same(served: Any, recomputed: Any) -> bool:
    """Exact equality as the codec stores values: the same JSON, so ``1 != 1.0 != True``.

    Floats are compared after the codec's round trip (orjson writes the shortest text
    that reads back as the same double), never with a tolerance.
    """
    return orjson.dumps(served) == orjson.dumps(recomputed)


def grace_label(grace_s: float) -> str:
    """``1s``, ``10s``, ``60s``, ``250ms``: the ``grace`` label of the metrics."""
    if grace_s == int(grace_s):
        return f"{int(grace_s)}s"
    return f"{grace_s * 1000:g}ms"


def describe_watermark(watermark: Watermark | None) -> str:
    """A watermark as the codec writes it (30 hex digits) and its clock, UTC."""
    if watermark is None:
        return "-"
    try:
        when = dt.datetime.fromtimestamp(unpack_watermark(watermark)[1] / 1e6, dt.UTC)
        clock = when.strftime("%H:%M:%S.%f")[:-3]
    except (OverflowError, ValueError, OSError):
        clock = "?"
    return f"{_hex(watermark)}  {clock}"


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A served entry that differs from its recompute, as last checked."""

    key: str
    ref: EntityRef
    served: FeatureValues | None
    """The entry's values; ``None`` when it does not decode (see ``problem``)."""
    recomputed: FeatureValues | None
    """The recompute after the codec's JSON round trip; ``None`` if Postgres has no row."""
    served_watermark: Watermark | None
    recomputed_watermark: Watermark
    problem: str | None = None
    """Why the entry could not be compared field by field (corrupt, other version)."""

    @property
    def differing(self) -> dict[str, tuple[Any, Any]]:
        """``field -> (served, recomputed)`` for the fields that differ."""
        served, recomputed = self.served or {}, self.recomputed or {}
        names = list(dict.fromkeys([*recomputed, *served]))
        return {
            n: (served.get(n), recomputed.get(n))
            for n in names
            if n not in served or n not in recomputed or not same(served[n], recomputed[n])
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "feature_set": self.ref.feature_set,
            "tenant": self.ref.tenant,
            "entity": self.ref.entity,
            "problem": self.problem,
            "served_watermark": _hex(self.served_watermark),
            "recomputed_watermark": _hex(self.recomputed_watermark),
            "differing": {
                n: {"served": s, "recomputed": r} for n, (s, r) in self.differing.items()
            },
            "served": self.served,
            "recomputed": self.recomputed,
        }


@dataclass(frozen=True, slots=True)
class LateEntry:
    """An entry still inconsistent after a grace, as re-checked then, with when it was
    first found (Unix time) and its watermark at that first check."""

    mismatch: Mismatch
    first_checked_unix: float
    first_served_watermark: Watermark | None

    def as_json(self) -> dict[str, Any]:
        return {
            **self.mismatch.as_json(),
            "first_checked_unix": self.first_checked_unix,
            "first_served_watermark": _hex(self.first_served_watermark),
        }


def _hex(watermark: Watermark | None) -> str | None:
    # As the codec writes it: 30 hex digits, which JSON readers cannot round off.
    if watermark is None:
        return None
    try:
        return watermark_hex(watermark).decode()
    except ValueError:
        return f"{watermark:x}"


@dataclass(frozen=True, slots=True)
class GraceResult:
    """Consistency when mismatches may heal for ``grace_s`` seconds."""

    grace_s: float
    checked: int
    inconsistent: int

    @property
    def label(self) -> str:
        return grace_label(self.grace_s)

    @property
    def consistent_fraction(self) -> float | None:
        if self.checked == 0:
            return None
        return 1 - self.inconsistent / self.checked

    @property
    def nines(self) -> float | None:
        """``-log10(inconsistent / checked)``; ``log10(checked)`` when none were."""
        if self.checked == 0:
            return None
        if self.inconsistent == 0:
            return math.log10(self.checked)
        return -math.log10(self.inconsistent / self.checked)

    @property
    def lower_bound(self) -> bool:
        """True when :attr:`nines` is only what the sample size can show."""
        return self.inconsistent == 0


@dataclass(slots=True)
class AuditReport:
    """One audit's counts, consistency per grace, and the mismatches that persisted.

    ``inconsistent[g]`` counts the entries still inconsistent when re-checked after
    grace ``g``; ``mismatches`` holds those inconsistent after the last grace, as last
    seen (the first thousand in full; :attr:`persistent` counts them all). ``busy_s``
    is the time spent reading Redis and recomputing (not pacing or waiting out
    graces): ``checks / busy_s`` is what the auditor could do unthrottled.
    """

    schema_version: int
    graces: tuple[float, ...]
    checked: int = 0
    absent: int = 0
    """Checked keys with no entry: missing, expired, or a tombstone."""
    suspects: int = 0
    """Entries that mismatched at their first check."""
    skipped: int = 0
    """Sampled keys that are not this code's feature entries (unknown set, odd id)."""
    samples: int = 0
    """SCAN samples taken (0 for an audit of given keys)."""
    rechecks: int = 0
    caught_up: int = 0
    """Suspects consistent at a re-check by having caught up, though they differed
    again (rewritten from a snapshot that saw the first check's; newer changes in
    flight): see :mod:`freshline.pipeline.observe.audit`."""
    verified: int = 0
    """Of those caught up on their watermarks alone, the ones whose entry (or a later
    one) then matched a recompute: their values seen right."""
    unverified: int = 0
    """Caught up on their watermarks alone and never seen to match within the audit's
    bound, yet not shown wrong: their entity kept changing (or its entry went)."""
    wrong_after_catching_up: int = 0
    """Caught up on their watermarks alone, then still the same entry and still
    differing at the bound: counted inconsistent from the grace they were accepted at
    and listed with the mismatches."""
    unverified_entries: list[Mismatch] = field(default_factory=list)
    """The first unverified entries, as last seen."""
    checked_by_set: dict[str, int] = field(default_factory=dict)
    inconsistent: dict[float, int] = field(default_factory=dict)
    inconsistent_at: dict[float, dict[int, int]] = field(default_factory=dict)
    """Per grace, the entries inconsistent after it by the second of the audit (since
    its start) of their first check: when the inconsistency was found, which lines it up
    with what the system was doing then (a backlog, a restart)."""
    late: dict[float, list[LateEntry]] = field(default_factory=dict)
    """Per grace, the first entries inconsistent after it (up to a few dozen): which keys
    were late, when each was first checked, and the watermarks that tell what the
    consumer had written by then."""
    mismatches: list[Mismatch] = field(default_factory=list)
    checking_s: float = 0.0
    """Time until the last first check: the pass over the entries, paced."""
    elapsed_s: float = 0.0
    """The whole run, the wait for the last grace included."""
    busy_s: float = 0.0
    rate: float | None = None

    @property
    def persistent(self) -> int:
        """Entries still inconsistent when re-checked after the last grace."""
        counted = self.inconsistent.get(self.graces[-1], 0) if self.graces else 0
        return max(counted, len(self.mismatches))

    @property
    def consistent(self) -> bool:
        """No mismatch persisted past the last grace."""
        return self.persistent == 0

    def results(self) -> list[GraceResult]:
        return [GraceResult(g, self.checked, self.inconsistent.get(g, 0)) for g in self.graces]

    def result(self, grace_s: float) -> GraceResult:
        return GraceResult(grace_s, self.checked, self.inconsistent[grace_s])

    @property
    def unverified_fraction(self) -> float | None:
        """Unverified entries per checked entry."""
        return self.unverified / self.checked if self.checked else None

    @property
    def entries_per_s(self) -> float:
        """Entries checked per second of the pass over them (paced, graces not waited)."""
        return self.checked / self.checking_s if self.checking_s > 0 else 0.0

    @property
    def capacity_per_s(self) -> float:
        """Entries checked (and re-checked) per second of Redis and Postgres work."""
        return (self.checked + self.rechecks) / self.busy_s if self.busy_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "checked": self.checked,
            "absent": self.absent,
            "suspects": self.suspects,
            "skipped": self.skipped,
            "samples": self.samples,
            "rechecks": self.rechecks,
            "caught_up": self.caught_up,
            "verified": self.verified,
            "unverified": self.unverified,
            "unverified_fraction": self.unverified_fraction,
            "wrong_after_catching_up": self.wrong_after_catching_up,
            "unverified_entries": [m.as_json() for m in self.unverified_entries],
            "persistent": self.persistent,
            "checked_by_feature_set": self.checked_by_set,
            "consistent": self.consistent,
            "graces": [
                {
                    "grace": r.label,
                    "grace_s": r.grace_s,
                    "inconsistent": r.inconsistent,
                    "consistent_fraction": r.consistent_fraction,
                    "nines": r.nines,
                    "nines_lower_bound": r.lower_bound,
                }
                for r in self.results()
            ],
            "inconsistent_at_second": {
                grace_label(g): dict(sorted(by_s.items()))
                for g, by_s in self.inconsistent_at.items()
            },
            "late": {
                grace_label(g): [e.as_json() for e in entries] for g, entries in self.late.items()
            },
            "mismatches": [m.as_json() for m in self.mismatches],
            "checking_s": self.checking_s,
            "elapsed_s": self.elapsed_s,
            "busy_s": self.busy_s,
            "rate": self.rate,
            "entries_per_s": self.entries_per_s,
            "capacity_per_s": self.capacity_per_s,
        }
