"""What every part of the semantic cache shares: its settings and collaborators, the
checks a candidate must pass, and this process's pending counters."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis

from freshline.pipeline.core.budget import TenantBudget
from freshline.pipeline.core.keys import (
    semantic_ids_key,
    semantic_stats_key,
)
from freshline.pipeline.semantic import decision
from freshline.pipeline.semantic.decision import Learned
from freshline.pipeline.semantic.embed import Embedder, Vectors
from freshline.pipeline.semantic.entry import (
    CorruptSemanticEntry,
    Entry,
    InvalidPrompt,
    decode,
    literals_match,
    params_digest,
)
from freshline.pipeline.semantic.feedback import (
    Probes,
)
from freshline.pipeline.semantic.namespaces import (
    Limits,
)
from freshline.pipeline.semantic.pool import MAX_VECTORS, IndexPool

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.93

MAX_PENDING = 10_000
"""Namespaces whose counters this process holds before writing them; past it, those
held longest are dropped. Counters wait here while their namespace was never stored
into (:data:`_COUNT`): callers choose namespaces, and those must not grow the
process. A namespace that exists has its counters written by the request that made
them, so it is never the one held longest."""

# The counters are written only into a namespace that exists (its ids or its counters
# are in Redis): a caller's lookups and flags for namespaces never stored into must
# make no key. EVAL, not EVALSHA, so that it runs in any pipeline, a cluster's too.
_COUNT = """
if redis.call('EXISTS', KEYS[1], KEYS[2]) == 0 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


@dataclass(slots=True)
class Candidate:
    """An entry a lookup found, present in Redis, with its exact similarity."""

    similarity: float
    id: int
    raw: bytes
    outcomes: decision.Outcomes = decision.EMPTY
    known: bool = True
    """Whether its own outcomes were read (a lookup reads them only for candidates
    near enough to matter: :data:`freshline.pipeline.semantic.lookups.MARGIN`)."""
    """The entry's own: of every prompt it was explored or flagged for."""
    pair: decision.Outcomes = decision.EMPTY
    """Of every entry with its template, for prompts with the query's template."""
    entry: Entry | None = None
    """Decoded once it is checked (:meth:`CacheState.check`)."""


class CacheState:
    """The settings and collaborators of
    :class:`~freshline.pipeline.semantic.cache.SemanticCache`."""

    def __init__(
        self,
        client: redis.Redis,
        embedder: Embedder,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        thresholds: Mapping[str, float] | None = None,
        ttl_s: int = 86_400,
        max_prompt_chars: int = 32_000,
        guard_literals: bool = True,
        limits: Limits | None = None,
        max_index_vectors: int = MAX_VECTORS,
        decision: Learned | None = None,
        rng: random.Random | None = None,
        budget: TenantBudget | None = None,
    ) -> None:
        self.redis = client
        self.embedder = embedder
        self.threshold = threshold
        self.thresholds = dict(thresholds or {})
        self.decision = decision
        self.rng = rng or random.Random()
        self.probes = Probes(client)
        self.ttl_ms = ttl_s * 1000
        self.max_prompt_chars = max_prompt_chars
        self.guard_literals = guard_literals
        self.limits = limits or Limits()
        self.budget = budget
        self.background = ThreadPoolExecutor(1, thread_name_prefix="semantic")
        self.pool = IndexPool(client, embedder.dim, self.background, max_vectors=max_index_vectors)
        self._pending: dict[str, Counter[str]] = {}
        self._pending_lock = threading.Lock()
        self._evicting: set[str] = set()

    def threshold_for(self, model: str) -> float:
        """A fresh entry's threshold: the learned decision's start, or ``model``'s."""
        if self.decision is not None:
            return self.decision.start
        return self.thresholds.get(model, self.threshold)

    def embed(self, prompts: list[str]) -> tuple[Vectors, float]:
        """The prompts' vectors (one batch) and the seconds it took."""
        for p in prompts:
            self._check_text("prompt", p)
        started = time.perf_counter()
        vectors = self.embedder.embed(prompts)
        return vectors, time.perf_counter() - started

    def _check_text(self, what: str, value: object) -> None:
        if not isinstance(value, str) or not value.strip():
            raise InvalidPrompt(f"the {what} must be a non-empty string")
        if len(value) > self.max_prompt_chars:
            raise InvalidPrompt(
                f"the {what} is {len(value):,} characters, over the limit "
                f"of {self.max_prompt_chars:,}"
            )

    def _first_passing(
        self, candidates: list[Candidate], prompt: str, params: Mapping[str, Any], ns: str
    ) -> tuple[Candidate, Entry] | None:
        """The first candidate with the same parameters, numbers and names."""
        digest = params_digest(dict(params))
        for c in candidates:
            entry = self.check(c, prompt, digest, ns)
            if entry is not None:
                return c, entry
        return None

    def check(self, c: Candidate, prompt: str, digest: str, ns: str) -> Entry | None:
        """``c``'s entry if it has the same parameters, numbers and names as the query."""
        if c.entry is None:
            try:
                c.entry = decode(c.raw)
            except CorruptSemanticEntry:
                log.warning("corrupt semantic entry %s in %s", f"{c.id:016x}", ns)
                return None
        entry = c.entry
        if entry.params == digest and (
            not self.guard_literals or literals_match(prompt, entry.prompt)
        ):
            return entry
        return None

    def _count(self, ns: str, field: str, n: int = 1) -> None:
        with self._pending_lock:
            self._add_pending(ns, Counter({field: n}))

    def _add_pending(self, ns: str, counts: Counter[str]) -> None:
        """``counts`` into ``ns``'s pending counters (the lock held); past
        :data:`MAX_PENDING` namespaces, those of the one held longest are dropped."""
        held = self._pending.get(ns)
        if held is None:
            if len(self._pending) >= MAX_PENDING:
                del self._pending[next(iter(self._pending))]
            held = self._pending[ns] = Counter()
        held.update(counts)

    def _flush_into(self, pipe: Any, ns: str) -> Counter[str] | None:
        """Add this process's pending counters of ``ns`` to ``pipe``, written (with the
        key's TTL) only if the namespace exists (:data:`_COUNT`); returns them, for
        :meth:`_settle` once ``pipe`` ran, or None if there were none."""
        with self._pending_lock:
            pending = self._pending.pop(ns, None)
        if not pending:
            return None
        args: list[Any] = [self.ttl_ms]
        for field, n in pending.items():
            args += [field, n]
        pipe.eval(_COUNT, 2, semantic_stats_key(ns), semantic_ids_key(ns), *args)
        return pending

    def _settle(self, ns: str, pending: Counter[str] | None, written: Any) -> None:
        """Hold again the counters :meth:`_flush_into` took if its script wrote
        nothing (``written`` is its reply): the namespace was never stored into, and
        they count once it is."""
        if pending and not written:
            with self._pending_lock:
                self._add_pending(ns, pending)
