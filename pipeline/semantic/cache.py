"""The semantic response cache: a prompt close enough to a cached one gets its response.

Scope
-----
Every entry lives in a namespace ``{<tenant>:<model>:<model_version>:<template_version>}``
(:func:`pipeline.core.keys.semantic_namespace`), and every namespace has an index of
its own (:mod:`pipeline.semantic.index`). A lookup searches only its own namespace:
another tenant's, model's, model version's or template version's entries are never
even candidates. How much a namespace and a tenant keep is bounded
(:mod:`pipeline.semantic.namespaces`).

What may be cached
------------------
Only deterministic generations: ``params["temperature"] == 0``, or
``params["deterministic"] is True`` (a seeded, pinned backend that says so). Anything
else is refused with :class:`NonDeterministicParams`, on lookup as on store: a
sampled response served again is not what the caller asked for.

A lookup, in order
------------------
1. Refuse non-deterministic parameters; embed the prompt (once, in the caller's batch).
2. Take this process's index of the namespace (:mod:`pipeline.semantic.pool`). If it
   is not ready (a large namespace still building), answer a miss, ``warming``.
3. Search it for the :data:`CANDIDATES` nearest ids.
4. One round trip: ``MGET`` their entries, ``XREAD`` the namespace's stream since the
   index's position, and this process's pending counters. Changes read are applied;
   when they added entries, steps 3-4 run once more so a new entry can win.
5. Check each candidate present in Redis *exactly*: the same generation parameters,
   the same numbers in both prompts (:func:`pipeline.semantic.entry.literals_match`),
   and its cosine similarity with the query (float64) good enough to serve:
   with a :class:`~pipeline.semantic.decision.Learned` decision, the entry's own
   estimated error at that similarity (from its outcomes, read in step 4's round
   trip, and the embedding model's prior) at most ``max_error``; without one, at or
   above the model's fixed threshold. The candidate with the lowest estimated error
   is served, unless it is audited.
6. With no candidate served, the nearest that passes the checks may be explored: a
   miss that names it (``Lookup.candidate_id``), remembered so that the caller's
   store of the model's response labels it (:mod:`pipeline.semantic.feedback`).
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import redis

from pipeline.core.errors import FreshlineError
from pipeline.core.keys import (
    semantic_entry_key,
    semantic_ids_key,
    semantic_log_key,
    semantic_namespace,
    semantic_outcomes_key,
    semantic_registry_key,
    semantic_stats_key,
)
from pipeline.semantic import decision
from pipeline.semantic.decision import Learned
from pipeline.semantic.embed import Embedder, Vectors
from pipeline.semantic.entry import (
    CorruptSemanticEntry,
    Entry,
    InvalidPrompt,
    cosine,
    decode,
    encode,
    entry_id,
    literals_match,
    pair_id,
    params_digest,
    vector_bytes,
)
from pipeline.semantic.feedback import (
    MAX_PAIRS,
    PROBE_TTL_MS,
    Probe,
    Probes,
    pairs_key,
    same_response,
)
from pipeline.semantic.index import NamespaceIndex
from pipeline.semantic.namespaces import (
    Limits,
    evict_namespaces,
    evict_oldest,
    live_namespaces,
    purge_keys,
    trim_minid,
)
from pipeline.semantic.pool import MAX_VECTORS, STREAM_BATCH, IndexPool

log = logging.getLogger(__name__)

CANDIDATES = 8
DEFAULT_THRESHOLD = 0.93
_HEX16 = re.compile(r"[0-9a-fA-F]{16}")
_MIN_EXPLORE = 0.001  # below this chance, a candidate is not even checked for exploring
SAME_PROMPT = 0.999
"""A flag at or above this similarity is about the entry's own prompt: the response
itself is wrong, and the entry is removed."""

__all__ = [
    "CANDIDATES",
    "DEFAULT_THRESHOLD",
    "Flagged",
    "InvalidPrompt",
    "Learned",
    "Limits",
    "Lookup",
    "NonDeterministicParams",
    "Scope",
    "SemanticCache",
    "Stored",
    "check_deterministic",
]


class NonDeterministicParams(FreshlineError):
    """A generation that may differ for the same prompt: never stored nor served."""


@dataclass(frozen=True, slots=True)
class Scope:
    """Who asks and for what: the parts of a namespace."""

    tenant: str
    model: str
    model_version: str
    template_version: str

    @property
    def namespace(self) -> str:
        return semantic_namespace(
            self.tenant, self.model, self.model_version, self.template_version
        )


@dataclass(frozen=True, slots=True)
class Lookup:
    """A lookup's answer. ``response`` is None on a miss.

    ``similarity`` is the served entry's exact cosine similarity (on a miss, the best
    candidate's, or None without one); ``lookup_s`` excludes ``embed_s``. ``warming``:
    a miss because this process's index of the namespace is still being built.
    ``threshold`` is the similarity the deciding entry is served at (with a learned
    decision, that entry's own; without a candidate, a fresh entry's).
    ``candidate_id``: on an exploration, the entry the caller's store will label
    (``audit``: one that would have been served). ``estimated_error``: the served (or
    explored) entry's estimated error.
    """

    hit: bool
    response: str | None
    similarity: float | None
    age_ms: int | None
    entry_id: str | None
    threshold: float
    embed_s: float
    lookup_s: float
    warming: bool = False
    candidate_id: str | None = None
    estimated_error: float | None = None
    audit: bool = False


@dataclass(frozen=True, slots=True)
class Stored:
    """``agreed``: when the store answered an exploration, whether the model's
    response was the candidate's (None otherwise)."""

    entry_id: str
    embed_s: float
    agreed: bool | None = None


@dataclass(frozen=True, slots=True)
class Flagged:
    """A flag's effect: the entry removed, or a wrong outcome recorded for it at
    ``similarity`` (then ``threshold`` is the similarity it is served at now)."""

    removed: bool
    similarity: float | None = None
    threshold: float | None = None


@dataclass(slots=True)
class _Candidate:
    similarity: float
    id: int
    raw: bytes
    outcomes: decision.Outcomes = decision.EMPTY
    """The entry's own: of every prompt it was explored or flagged for."""
    pair: decision.Outcomes = decision.EMPTY
    """Of every entry with its template, for prompts with the query's template."""
    entry: Entry | None = None
    """Decoded once it is checked (:meth:`SemanticCache._check`)."""


def _entry_id(entry: object) -> int:
    """An entry id as the caller sent it (16 hex digits, any case) as a number."""
    if not isinstance(entry, str) or _HEX16.fullmatch(entry) is None:
        raise InvalidPrompt(f"entry id {entry!r} is not 16 hex digits")
    return int(entry, 16)


def check_deterministic(params: Mapping[str, Any]) -> None:
    """Raise :class:`NonDeterministicParams` unless the generation is deterministic."""
    if not isinstance(params, Mapping):
        raise NonDeterministicParams('params must be an object such as {"temperature": 0}')
    declared = params.get("deterministic")
    if declared is not None and not isinstance(declared, bool):
        raise NonDeterministicParams("params.deterministic must be true or false")
    if declared is True:
        return
    temperature = params.get("temperature")
    if temperature is None:
        raise NonDeterministicParams(
            "params.temperature is required: only temperature 0 (or params.deterministic "
            "= true) responses are cached"
        )
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise NonDeterministicParams(f"params.temperature {temperature!r} is not a number >= 0")
    if temperature != 0:
        raise NonDeterministicParams(
            f"temperature {temperature:g} is not deterministic: only temperature 0 (or "
            "params.deterministic = true) responses are cached; call the model directly"
        )


class SemanticCache:
    """Tenant-scoped, version-scoped semantic cache of deterministic LLM responses.

    ``decision`` serves each entry under an error bound it learns
    (:class:`~pipeline.semantic.decision.Learned`); without one, ``thresholds`` maps
    a model to its fixed similarity threshold (default ``threshold``). ``rng`` draws
    the explorations (seed it for repeatable runs). ``ttl_s`` bounds every key's
    life; ``limits`` bounds entries per namespace and namespaces per tenant;
    ``max_index_vectors`` bounds the vectors this process's indexes hold. Thread-safe;
    share one per process, since it holds this process's indexes and their background
    builder. :meth:`close` stops it.
    """

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
        self.background = ThreadPoolExecutor(1, thread_name_prefix="semantic")
        self.pool = IndexPool(client, embedder.dim, self.background, max_vectors=max_index_vectors)
        self._pending: dict[str, Counter[str]] = {}
        self._pending_lock = threading.Lock()
        self._evicting: set[str] = set()

    # -- the public API ----------------------------------------------------------------

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

    def warm(self, namespaces: Sequence[tuple[str, int]] | None = None) -> int:
        """Build, in the background, the indexes of the namespaces in Redis (or of
        ``(namespace, entries)`` given), most recently stored first, as many as the
        index budget holds; returns how many were queued. The API calls it at start-up."""
        found = live_namespaces(self.redis) if namespaces is None else namespaces
        return self.pool.warm(found)

    def lookup(self, scope: Scope, prompt: str, params: Mapping[str, Any]) -> Lookup:
        """The cached response for ``prompt``, or a miss (module docstring)."""
        ns = scope.namespace
        try:
            check_deterministic(params)
        except NonDeterministicParams:
            self._count(ns, "refused")
            raise
        vectors, embed_s = self.embed([prompt])
        return self.lookup_vector(scope, prompt, params, vectors[0], embed_s=embed_s)

    def lookup_vector(
        self,
        scope: Scope,
        prompt: str,
        params: Mapping[str, Any],
        vector: Vectors,
        *,
        embed_s: float = 0.0,
    ) -> Lookup:
        """:meth:`lookup` with the prompt already embedded (batches, benchmarks)."""
        check_deterministic(params)
        started = time.perf_counter()
        ns = scope.namespace
        threshold = self.threshold_for(scope.model)
        idx = self.pool.get(ns)
        if not idx.ready:
            self._count(ns, "misses")
            return Lookup(
                False,
                None,
                None,
                None,
                None,
                threshold,
                embed_s,
                time.perf_counter() - started,
                warming=True,
            )
        query = vector[None, :]
        with idx.lock:
            candidates = idx.search(query, CANDIDATES)[0]
            position = idx.stream_id
        learned = self.decision is not None
        raws, outcomes, events = self._fetch(ns, [e for e, _ in candidates], position, learned)
        if events:
            with idx.lock:
                added = self._apply(idx, events)
                if added:
                    candidates = idx.search(query, CANDIDATES)[0]
            if added:
                raws, outcomes, _ = self._fetch(ns, [e for e, _ in candidates], None, learned)
        found = self._candidates(idx, candidates, raws, outcomes, vector)
        best_seen = found[0].similarity if found else None
        if self.decision is not None:
            found = self._with_outcomes(ns, self.decision, found, prompt, params)
            return self._decide(
                ns, self.decision, found, prompt, params, embed_s, started, best_seen
            )
        served = self._first_passing(
            [c for c in found if c.similarity >= threshold], prompt, params, idx.namespace
        )
        elapsed = time.perf_counter() - started
        if served is None:
            self._count(ns, "misses")
            return Lookup(False, None, best_seen, None, None, threshold, embed_s, elapsed)
        c, entry = served
        self._count(ns, "hits")
        age = max(0, int(time.time() * 1000) - entry.created_at_ms)
        return Lookup(
            True, entry.response, c.similarity, age, f"{c.id:016x}", threshold, embed_s, elapsed
        )

    def _decide(
        self,
        ns: str,
        learned: Learned,
        found: list[_Candidate],
        prompt: str,
        params: Mapping[str, Any],
        embed_s: float,
        started: float,
        best_seen: float | None,
    ) -> Lookup:
        """Serve, audit, explore or miss (module docstring, steps 5 and 6)."""
        estimates = {c.id: learned.estimate_both(c.outcomes, c.pair, c.similarity) for c in found}
        servable = sorted(
            (c for c in found if estimates[c.id].serve),
            key=lambda c: (estimates[c.id].error, -c.similarity),
        )
        chosen = self._first_passing(servable, prompt, params, ns)
        if chosen is not None:
            c, entry = chosen
            est = estimates[c.id]
            # An audit the namespace has no room to remember is served instead.
            audited = self.rng.random() < est.explore and (
                self._explore(ns, prompt, params, c, audit=True) is not None
            )
            if not audited:
                self._count(ns, "hits")
                self._count(ns, "scored")
                self._count(ns, "risk_ppm", round(est.error * 1e6))
                age = max(0, int(time.time() * 1000) - entry.created_at_ms)
                return Lookup(
                    True,
                    entry.response,
                    c.similarity,
                    age,
                    f"{c.id:016x}",
                    est.threshold,
                    embed_s,
                    time.perf_counter() - started,
                    estimated_error=est.error,
                )
            explored: _Candidate | None = c
        else:
            worth = [c for c in found if estimates[c.id].explore >= _MIN_EXPLORE]
            nearest = self._first_passing(worth, prompt, params, ns)
            explored = None
            if nearest is not None:
                c = nearest[0]
                if self.rng.random() < estimates[c.id].explore:
                    explored = self._explore(ns, prompt, params, c, audit=False)
        self._count(ns, "misses")
        elapsed = time.perf_counter() - started
        if explored is None:
            deciding = estimates[found[0].id].threshold if found else learned.start
            return Lookup(False, None, best_seen, None, None, deciding, embed_s, elapsed)
        est = estimates[explored.id]
        return Lookup(
            False,
            None,
            best_seen,
            None,
            None,
            est.threshold,
            embed_s,
            elapsed,
            candidate_id=f"{explored.id:016x}",
            estimated_error=est.error,
            audit=est.serve,
        )

    def _explore(
        self, ns: str, prompt: str, params: Mapping[str, Any], c: _Candidate, *, audit: bool
    ) -> _Candidate | None:
        """Remember an exploration of ``c`` for the prompt's store; None if the
        namespace's probes are full."""
        probe = Probe(
            c.id,
            c.similarity,
            audit,
            int(time.time() * 1000) + PROBE_TTL_MS,
            params_digest(dict(params)),
        )
        if not self.probes.put(ns, entry_id(prompt), probe):
            return None
        self._count(ns, "explored")
        if audit:
            self._count(ns, "audited")
        return c

    def store(self, scope: Scope, prompt: str, params: Mapping[str, Any], response: str) -> Stored:
        """Cache ``response`` for ``prompt``; refused unless deterministic (see
        :meth:`store_many`)."""
        try:
            check_deterministic(params)
        except NonDeterministicParams:
            self._count(scope.namespace, "refused")
            raise
        self._check_text("response", response)
        vectors, embed_s = self.embed([prompt])
        [e], [agreed] = self._store(scope, [(prompt, response)], params, vectors)
        return Stored(e, embed_s, agreed)

    def store_vector(
        self, scope: Scope, prompt: str, params: Mapping[str, Any], response: str, vector: Vectors
    ) -> str:
        """:meth:`store` with the prompt already embedded; returns the entry id."""
        return self._store(scope, [(prompt, response)], params, vector[None, :])[0][0]

    def store_many(
        self,
        scope: Scope,
        items: list[tuple[str, str]],
        params: Mapping[str, Any],
        vectors: Vectors | None = None,
    ) -> list[str]:
        """Store ``(prompt, response)`` pairs in one pipeline; returns their entry ids.

        The prompts are embedded in one batch unless ``vectors`` are given (one row
        each). Refused as a whole unless the params are deterministic. In order: the
        entries with their TTL, their ids in the expiry-scored set, an ``add`` per
        entry on the namespace's stream (with the vector, so other processes need not
        read the entry), the namespace in its tenant's registry, the counters; every
        key's TTL set or extended; with a learned decision, the probes of explorations
        of these prompts taken. Then the bounds (:class:`Limits`): past the
        namespace's entries, its oldest are evicted now; past the tenant's
        namespaces, the least recently stored into is purged in the background. Last,
        each probe taken labels its candidate (:meth:`_label`).
        """
        return self._store(scope, items, params, vectors)[0]

    def _store(
        self,
        scope: Scope,
        items: list[tuple[str, str]],
        params: Mapping[str, Any],
        vectors: Vectors | None,
    ) -> tuple[list[str], list[bool | None]]:
        """:meth:`store_many`, and per item whether it agreed with an explored
        candidate (None: it answered no exploration)."""
        ns = scope.namespace
        try:
            check_deterministic(params)
        except NonDeterministicParams:
            self._count(ns, "refused", len(items))
            raise
        for prompt, response in items:
            self._check_text("prompt", prompt)
            self._check_text("response", response)
        if vectors is None:
            vectors, _ = self.embed([p for p, _ in items])
        if len(vectors) != len(items) or vectors.shape[1] != self.embedder.dim:
            raise InvalidPrompt(
                f"{len(vectors)} vectors of width {vectors.shape[1]} for "
                f"{len(items)} prompts; the embedder gives {self.embedder.dim}"
            )
        now_ms = int(time.time() * 1000)
        ttl = self.ttl_ms
        digest = params_digest(dict(params))
        ids_key, log_key = semantic_ids_key(ns), semantic_log_key(ns)
        registry = semantic_registry_key(scope.tenant)
        minid = trim_minid(now_ms)
        pipe = self.redis.pipeline(transaction=False)
        out = [f"{entry_id(prompt):016x}" for prompt, _ in items]
        for (prompt, response), member, vector in zip(items, out, vectors, strict=True):
            entry = Entry(prompt, response, now_ms, digest, np.asarray(vector, dtype=np.float32))
            pipe.set(semantic_entry_key(ns, int(member, 16)), encode(entry), px=ttl)
        # The ids before the stream events: an index build between the two still
        # finds the entry (pipeline.semantic.pool).
        pipe.zadd(ids_key, dict.fromkeys(out, now_ms + ttl))
        pipe.zremrangebyscore(ids_key, "-inf", now_ms)
        size_at = len(pipe)
        pipe.zcard(ids_key)
        for member, vector in zip(out, vectors, strict=True):
            pipe.xadd(
                log_key,
                {"op": "add", "id": member, "v": np.asarray(vector, dtype="<f4").tobytes()},
                minid=minid,
                approximate=True,
            )
        pipe.pexpire(ids_key, ttl)
        pipe.pexpire(log_key, ttl)
        pipe.zadd(registry, {ns: now_ms})
        pipe.zremrangebyscore(registry, "-inf", now_ms - ttl)
        spaces_at = len(pipe)
        pipe.zcard(registry)
        pipe.pexpire(registry, ttl)
        probes_at = len(pipe)
        if self.decision is not None:
            self.probes.take_into(pipe, ns, [int(m, 16) for m in out])
        self._count(ns, "stored", len(items))
        self._flush_into(pipe, ns)
        replies = pipe.execute()
        self._enforce_limits(scope, int(replies[size_at]), int(replies[spaces_at]))
        agreed: list[bool | None] = [None] * len(items)
        if self.decision is not None:
            taken = self.probes.taken(replies[probes_at], now_ms)
            agreed = self._label(ns, items, out, taken, digest)
        return out, agreed

    def _label(
        self,
        ns: str,
        items: list[tuple[str, str]],
        ids: list[str],
        probes: list[Probe | None],
        digest: str,
    ) -> list[bool | None]:
        """Compare each stored response with its probe's candidate's, and append the
        outcome to those of the candidate's template (entries that differ only in
        numbers and names share them): three round trips, only when a store answers an
        exploration. A candidate gone meanwhile has nothing to learn."""
        wanted = [
            (i, p)
            for i, p in enumerate(probes)
            if p is not None and p.params == digest and f"{p.candidate:016x}" != ids[i]
        ]
        agreed: list[bool | None] = [None] * len(items)
        if not wanted:
            return agreed
        raws = cast(
            list[bytes | None],
            self.redis.mget([semantic_entry_key(ns, p.candidate) for _, p in wanted]),
        )
        found: list[tuple[int, Probe, Entry]] = []
        for (i, p), raw in zip(wanted, raws, strict=True):
            try:
                cached = decode(raw) if raw else None
            except CorruptSemanticEntry:
                cached = None
            if cached is not None:
                found.append((i, p, cached))
        if not found:
            return agreed
        # Each label goes to the candidate's own outcomes and to its template pair's.
        own = sorted({p.candidate for _, p, _ in found})
        pairs = sorted({pair_id(cached.prompt, items[i][0]) for i, _, cached in found})
        outcomes, paired, room = self._past(ns, own, pairs)
        for i, p, cached in found:
            agreed[i] = right = same_response(items[i][1], cached.response)
            outcomes[p.candidate] = decision.append(outcomes[p.candidate], p.similarity, right)
            k = pair_id(cached.prompt, items[i][0])
            paired[k] = decision.append(paired[k], p.similarity, right)
            self._count(ns, "right" if right else "wrong")
            if p.audit:
                self._count(ns, "audit_right" if right else "audit_wrong")
        self._write_outcomes(ns, outcomes, paired, room)
        return agreed

    def _past(
        self, ns: str, own: list[int], pairs: list[int]
    ) -> tuple[dict[int, decision.Outcomes], dict[int, decision.Outcomes], bool]:
        """The outcomes of entries ``own`` and of template ``pairs``, and whether the
        namespace's pairs have room for new ones (:data:`MAX_PAIRS`): one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.mget([semantic_outcomes_key(ns, e) for e in own])
        pipe.hmget(pairs_key(ns), [f"{k:016x}" for k in pairs])
        pipe.hlen(pairs_key(ns))
        mine, theirs, held = pipe.execute()
        return (
            {e: decision.decode(raw) for e, raw in zip(own, mine, strict=True)},
            {k: decision.decode(raw) for k, raw in zip(pairs, theirs, strict=True)},
            int(held) < MAX_PAIRS,
        )

    def _write_outcomes(
        self,
        ns: str,
        own: dict[int, decision.Outcomes],
        pairs: dict[int, decision.Outcomes],
        room: bool,
    ) -> None:
        """Write outcomes with their TTLs in one transaction (a pair already held is
        updated; a new one only while there is ``room``), with the counters."""
        pipe = self.redis.pipeline(transaction=True)
        for e, out in own.items():
            pipe.set(semantic_outcomes_key(ns, e), decision.encode(out), px=self.ttl_ms)
        fields = {
            f"{k:016x}": decision.encode(out) for k, out in pairs.items() if room or len(out) > 1
        }
        if fields:
            pipe.hset(pairs_key(ns), mapping=cast(Any, fields))
            pipe.pexpire(pairs_key(ns), self.ttl_ms)
        self._flush_into(pipe, ns)
        pipe.execute()

    def get_or_generate(
        self, scope: Scope, prompt: str, params: Mapping[str, Any], generate: Callable[[str], str]
    ) -> tuple[str, Lookup]:
        """The cached response, or ``generate(prompt)`` stored and returned.

        The prompt is embedded once for both steps. Non-deterministic parameters are
        refused before anything is generated: call the model directly for those.
        """
        try:
            check_deterministic(params)
        except NonDeterministicParams:
            self._count(scope.namespace, "refused")
            raise
        vectors, embed_s = self.embed([prompt])
        found = self.lookup_vector(scope, prompt, params, vectors[0], embed_s=embed_s)
        if found.hit and found.response is not None:
            return found.response, found
        response = generate(prompt)
        self._check_text("response", response)
        self.store_vector(scope, prompt, params, response, vectors[0])
        return response, found

    def flag(self, scope: Scope, entry: str) -> bool:
        """A caller says a hit was wrong: remove the entry (and its outcomes)
        everywhere, and count it. Returns whether the entry was there.
        """
        ns = scope.namespace
        e = _entry_id(entry)
        entry = f"{e:016x}"  # the stored form, whatever case the caller sent
        now_ms = int(time.time() * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(semantic_entry_key(ns, e))
        pipe.delete(semantic_outcomes_key(ns, e))
        pipe.zrem(semantic_ids_key(ns), entry)
        pipe.xadd(
            semantic_log_key(ns),
            {"op": "remove", "id": entry},
            minid=trim_minid(now_ms),
            approximate=True,
        )
        pipe.pexpire(semantic_log_key(ns), self.ttl_ms)
        self._count(ns, "flagged")
        self._flush_into(pipe, ns)
        removed = bool(pipe.execute()[0])
        idx = self.pool.peek(ns)
        if idx is not None:
            with idx.lock:
                idx.remove([e])
        return removed

    def flag_for(self, scope: Scope, entry: str, prompt: str) -> Flagged:
        """A caller says the hit of ``entry`` for ``prompt`` was wrong.

        With a learned decision, that is a wrong outcome at the prompt's similarity
        to the entry: the entry stays for prompts closer to it, and is served above a
        higher similarity from now on (:attr:`Flagged.threshold`). When ``prompt`` is
        the entry's own (similarity :data:`SAME_PROMPT` or more), the response itself
        is wrong and the entry is removed, as it is without a learned decision
        (:meth:`flag`). Counted as a flag either way.
        """
        e = _entry_id(entry)
        self._check_text("prompt", prompt)
        if self.decision is None:
            return Flagged(self.flag(scope, entry))
        ns = scope.namespace
        vectors, _ = self.embed([prompt])
        raw = cast(bytes | None, self.redis.get(semantic_entry_key(ns, e)))
        try:
            cached = decode(raw) if raw else None
        except CorruptSemanticEntry:
            cached = None
        if cached is None:
            self._count(ns, "flagged")
            return Flagged(False)
        similarity = cosine(vectors[0], cached.vector)
        if similarity >= SAME_PROMPT:
            return Flagged(self.flag(scope, entry), similarity)
        k = pair_id(cached.prompt, prompt)
        outcomes, paired, room = self._past(ns, [e], [k])
        labelled = outcomes[e] = decision.append(outcomes[e], similarity, False)
        paired[k] = decision.append(paired[k], similarity, False)
        self._count(ns, "flagged")
        self._write_outcomes(ns, outcomes, paired, room)
        return Flagged(False, similarity, self.decision.threshold(labelled))

    def purge(
        self,
        *,
        tenant: str | None = None,
        model: str | None = None,
        model_version: str | None = None,
        template_version: str | None = None,
        batch: int = 500,
    ) -> dict[str, int]:
        """:func:`~pipeline.semantic.namespaces.purge_keys`, and this process's indexes
        of those namespaces dropped."""
        removed = purge_keys(
            self.redis,
            tenant=tenant,
            model=model,
            model_version=model_version,
            template_version=template_version,
            batch=batch,
        )
        for ns in removed:
            self.pool.drop(ns)
        return removed

    def close(self) -> None:
        """Stop the background builds and write this process's pending counters."""
        self.pool.close()
        self.background.shutdown(wait=True, cancel_futures=True)
        with self._pending_lock:
            namespaces = list(self._pending)
        if namespaces:
            pipe = self.redis.pipeline(transaction=False)
            for ns in namespaces:
                self._flush_into(pipe, ns)
            pipe.execute()

    # -- helpers -----------------------------------------------------------------------

    def _check_text(self, what: str, value: object) -> None:
        if not isinstance(value, str) or not value.strip():
            raise InvalidPrompt(f"the {what} must be a non-empty string")
        if len(value) > self.max_prompt_chars:
            raise InvalidPrompt(
                f"the {what} is {len(value):,} characters, over the limit "
                f"of {self.max_prompt_chars:,}"
            )

    def _candidates(
        self,
        idx: NamespaceIndex,
        candidates: list[tuple[int, float]],
        raws: list[bytes | None],
        outcomes: list[bytes | None],
        vector: Vectors,
    ) -> list[_Candidate]:
        """The candidates present in Redis with their exact similarity, most similar
        first; those gone (expired or removed: Redis is the truth) leave the index."""
        ids: list[int] = []
        tails: list[bytes] = []
        kept: list[tuple[bytes, bytes | None]] = []
        gone: list[int] = []
        for (e, _), raw, out in zip(candidates, raws, outcomes or [None] * len(raws), strict=True):
            tail = vector_bytes(raw, idx.dim)
            if raw is None:
                gone.append(e)
            elif tail is None:
                log.warning("corrupt semantic entry %s in %s", f"{e:016x}", idx.namespace)
            else:
                ids.append(e)
                tails.append(tail)
                kept.append((raw, out))
        if gone:
            with idx.lock:
                idx.remove(gone)
        if not ids:
            return []
        stored = np.frombuffer(b"".join(tails), dtype="<f4").reshape(len(ids), idx.dim)
        stored = stored.astype(np.float64)
        query = np.asarray(vector, dtype=np.float64)
        norms = np.linalg.norm(stored, axis=1) * float(np.linalg.norm(query))
        sims = np.divide(stored @ query, norms, out=np.zeros(len(ids)), where=norms > 0)
        return [
            _Candidate(float(sims[i]), ids[i], kept[i][0], decision.decode(kept[i][1]))
            for i in np.argsort(-sims, kind="stable")
        ]

    def _first_passing(
        self, candidates: list[_Candidate], prompt: str, params: Mapping[str, Any], ns: str
    ) -> tuple[_Candidate, Entry] | None:
        """The first candidate with the same parameters, numbers and names."""
        digest = params_digest(dict(params))
        for c in candidates:
            entry = self._check(c, prompt, digest, ns)
            if entry is not None:
                return c, entry
        return None

    def _check(self, c: _Candidate, prompt: str, digest: str, ns: str) -> Entry | None:
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

    def _with_outcomes(
        self,
        ns: str,
        learned: Learned,
        found: list[_Candidate],
        prompt: str,
        params: Mapping[str, Any],
    ) -> list[_Candidate]:
        """The candidates that pass the checks, with their templates' outcomes: one
        more round trip, only when one is near enough that its outcomes could change
        what is done (its estimate from the prior alone serves or may explore)."""
        digest = params_digest(dict(params))
        passing = [c for c in found if self._check(c, prompt, digest, ns) is not None]
        if not any(
            (est := learned.estimate(c.outcomes, c.similarity)).serve or est.explore >= _MIN_EXPLORE
            for c in passing
        ):
            return passing
        fields = [f"{pair_id(cast(Entry, c.entry).prompt, prompt):016x}" for c in passing]
        raws = cast(list[bytes | None], self.redis.hmget(pairs_key(ns), fields))
        for c, raw in zip(passing, raws, strict=True):
            c.pair = decision.decode(raw)
        return passing

    def _fetch(
        self, ns: str, ids: list[int], position: str | None, outcomes: bool = False
    ) -> tuple[list[bytes | None], list[bytes | None], list[Any]]:
        """One round trip: the entries (and, if ``outcomes``, their outcomes), the
        stream since ``position`` (unless None), this process's pending counters."""
        pipe = self.redis.pipeline(transaction=False)
        keys = [semantic_entry_key(ns, e) for e in ids]
        if outcomes:
            keys += [semantic_outcomes_key(ns, e) for e in ids]
        if ids:
            pipe.mget(keys)
        if position is not None:
            pipe.xread({semantic_log_key(ns): position}, count=STREAM_BATCH)
        self._flush_into(pipe, ns)
        replies = pipe.execute()
        values: list[bytes | None] = list(replies[0]) if ids else []
        events: list[Any] = []
        if position is not None:
            reply = replies[1 if ids else 0]
            events = reply[0][1] if reply else []
        return values[: len(ids)], values[len(ids) :], events

    def _apply(self, idx: NamespaceIndex, events: list[Any]) -> int:
        """Apply events read by a lookup (the index's lock held); past a full batch,
        the rest of the stream too."""
        added = idx.apply(events)
        if len(events) >= STREAM_BATCH:
            added += self.pool.catch_up(idx)
        return added

    def _enforce_limits(self, scope: Scope, entries: int, namespaces: int) -> None:
        ns = scope.namespace
        cap = self.limits.entries_for(scope.model)
        if entries > cap:
            evicted = evict_oldest(self.redis, ns, entries - cap, self.ttl_ms)
            self._count(ns, "evicted", evicted)
        if namespaces > self.limits.max_namespaces:
            with self._pending_lock:
                if scope.tenant in self._evicting:
                    return
                self._evicting.add(scope.tenant)
            try:
                self.background.submit(self._evict_namespaces, scope.tenant)
            except RuntimeError:  # closed meanwhile: the next store over the limit evicts
                with self._pending_lock:
                    self._evicting.discard(scope.tenant)

    def _evict_namespaces(self, tenant: str) -> None:
        try:
            for ns in evict_namespaces(self.redis, tenant, self.limits.max_namespaces):
                self.pool.drop(ns)
                log.info(
                    "semantic namespace %s evicted: tenant %s is at its limit of %d",
                    ns,
                    tenant,
                    self.limits.max_namespaces,
                )
        except Exception:  # a background thread has no caller to raise to
            log.exception(
                "semantic namespaces of %s: eviction failed; the next store retries", tenant
            )
        finally:
            with self._pending_lock:
                self._evicting.discard(tenant)

    def _count(self, ns: str, field: str, n: int = 1) -> None:
        with self._pending_lock:
            self._pending.setdefault(ns, Counter())[field] += n

    def _flush_into(self, pipe: Any, ns: str) -> None:
        """Add this process's pending counters of ``ns`` to ``pipe`` (with the key's TTL)."""
        with self._pending_lock:
            pending = self._pending.pop(ns, None)
        if not pending:
            return
        key = semantic_stats_key(ns)
        for field, n in pending.items():
            pipe.hincrby(key, field, n)
        pipe.pexpire(key, self.ttl_ms)
