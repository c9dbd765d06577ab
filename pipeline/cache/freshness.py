"""Reads that ask for freshness: ``after`` a token, within ``max_staleness_ms``.

A :class:`Freshness` says which entries a read may serve: one whose watermark reaches
the token's rank (:mod:`freshline.pipeline.cache.tokens`), and, with a staleness bound, one
computed less than ``max_staleness_ms`` ago (so ``0`` takes no cached entry at all).

A read with one (:func:`read`; the API's coroutine twin is in
:mod:`freshline.pipeline.api.freshness`) goes, per entity:

1. to the in-process tier, then Redis (one MGET): an entry the freshness takes is served
   as ``local`` or ``hit``;
2. if the entry falls short of the token (or is missing), the consumer's write is on
   its way: the read waits for it, woken by the entity's invalidation
   (:mod:`freshline.pipeline.cache.arrivals`), until ``wait_ms`` after the read began; an entry
   taken then is served as ``waited``. An entry that reaches the token but is too old
   is not waited for: nothing is on its way;
3. the rest are computed anew under read-through leases
   (:meth:`freshline.pipeline.cache.readthrough.ReadThrough.recompute`): ``computed`` (or
   ``waited`` for another reader's fill, ``uncached`` when not stored). Such a result
   comes from a snapshot taken after the token's rank was known, so it reaches it;
   one that does not is refused (:class:`~freshline.pipeline.cache.tokens.TokenAhead`).

It never serves an entry the freshness does not take. The wait is bounded by
``wait_ms`` (ranking a transaction token that has not committed yet counts against it
too, then :class:`~freshline.pipeline.cache.tokens.TokenPending`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from freshline.pipeline.cache.arrivals import Arrivals
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.readthrough import ReadThrough, Result, Source
from freshline.pipeline.cache.recompute import CLOCK_BITS
from freshline.pipeline.cache.tokens import TokenAhead, TokenPending, Tokens
from freshline.pipeline.core.clock import now_ms
from freshline.pipeline.core.codec import Row, parse_watermark
from freshline.pipeline.core.types import EntityRef, Entry

DEFAULT_WAIT_MS = 100
"""How long a token read waits for the consumer's write unless told (the API's default
is ``FRESHLINE_TOKEN_WAIT_MS``)."""
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 0.001, 0.05


@dataclass(frozen=True, slots=True)
class Freshness:
    """What a read may serve: see the module docstring. ``rank`` is the token's."""

    rank: int | None = None
    max_staleness_ms: int | None = None
    wait_ms: int = DEFAULT_WAIT_MS

    def reaches(self, watermark: int) -> bool:
        """Whether a watermark is at or after the token."""
        return self.rank is None or watermark >> CLOCK_BITS >= self.rank

    def takes(self, entry: Entry, now: int) -> bool:
        """Whether ``entry`` may be served at ``now`` (epoch ms)."""
        return self.reaches(entry.watermark) and (
            self.max_staleness_ms is None or now - entry.computed_at_ms < self.max_staleness_ms
        )

    def takes_row(self, row: Row, now: int) -> bool:
        """:meth:`takes` of a decoded row (:data:`freshline.pipeline.core.codec.Row`)."""
        return self.reaches(parse_watermark(row[2])) and (
            self.max_staleness_ms is None or now - row[1] < self.max_staleness_ms
        )

    def awaits(self, entry: Entry | None) -> bool:
        """Whether a write that would be taken is on its way: the entry (or its
        absence) falls short of the token. Each read of an entity has one."""
        return self.rank is not None and (entry is None or not self.reaches(entry.watermark))

    def check(self, result: Result) -> Result:
        """``result``, if it reaches the token; :class:`TokenAhead` otherwise."""
        if not self.reaches(result.watermark):
            raise TokenAhead("the token names a state this database has not reached")
        return result


def rank_of(tokens: Tokens, text: str, deadline: float) -> int:
    """The rank of token ``text``, waiting (until ``deadline``, monotonic) for its
    transaction to end if it names one that has not."""
    token = tokens.parse(text)
    pause = _FIRST_PAUSE_S
    while True:
        rank = tokens.resolve(token)
        if rank is not None:
            return rank
        left = deadline - time.monotonic()
        if left <= 0:
            raise TokenPending(token.a)
        time.sleep(min(pause, left))  # backoff while the writer commits
        pause = min(pause * 2, _LONGEST_PAUSE_S)


def read(
    rt: ReadThrough,
    refs: Sequence[EntityRef],
    freshness: Freshness,
    *,
    arrivals: Arrivals,
    local: LocalTier | None = None,
    started: float | None = None,
    compute: bool = True,
) -> list[Result | None]:
    """Answer ``refs`` (of ``rt``'s schema version), each as ``freshness`` allows (module
    docstring); ``started`` (monotonic, default now) is when the wait began. Without
    ``compute`` (a cache-only read), what step 3 would compute is ``None``."""
    deadline = (time.monotonic() if started is None else started) + freshness.wait_ms / 1000
    store = rt.store
    version = store.schema_version
    answers: dict[EntityRef, Result] = {}
    pending: list[EntityRef] = []
    now = now_ms()
    for ref in dict.fromkeys(refs):
        entry = local.get(ref, version) if local is not None else None
        if entry is not None and freshness.takes(entry, now):
            answers[ref] = Result.served(ref, entry, "local", now)
        else:
            pending.append(ref)

    def take(todo: list[EntityRef], source: Source) -> tuple[list[EntityRef], list[EntityRef]]:
        """Serve what ``freshness`` takes of ``todo``; the rest, split into those worth
        waiting for and those to compute."""
        seal = local.token() if local is not None else 0
        now = now_ms()
        wait: list[EntityRef] = []
        compute: list[EntityRef] = []
        for ref, entry in zip(todo, store.read(todo), strict=True):
            if entry is not None and freshness.takes(entry, now):
                answers[ref] = Result.served(ref, entry, source, now)
                if local is not None:
                    local.put(ref, entry, seal)
            else:
                (wait if freshness.awaits(entry) else compute).append(ref)
        return wait, compute

    waiting, computing = take(pending, "hit") if pending else ([], [])
    if waiting and deadline > time.monotonic():
        with arrivals.watch(waiting) as watch:
            while waiting:
                watch.clear()
                waiting, more = take(waiting, "waited")  # first: any write since the MGET
                computing += more
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    break
                watch.wait(left)
    computing += waiting
    if computing and compute:
        seal = local.token() if local is not None else 0
        began = now_ms()
        for r in rt.recompute(computing, lambda e: freshness.takes(e, now_ms())):
            answers[r.ref] = freshness.check(r)
            if local is not None and r.source != "uncached":
                local.put(r.ref, Entry(r.values, version, began - r.age_ms, r.watermark), seal)
    return [answers.get(r) for r in refs]
