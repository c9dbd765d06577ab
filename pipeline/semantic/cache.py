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
5. Check each candidate present in Redis *exactly*: cosine similarity of the stored
   vector and the query's (float64) at or above the model's threshold, the same
   generation parameters, and the same numbers in both prompts
   (:func:`pipeline.semantic.entry.literals_match`). The best that passes is served.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from pipeline.core.errors import FreshlineError
from pipeline.core.keys import (
    semantic_entry_key,
    semantic_ids_key,
    semantic_log_key,
    semantic_namespace,
    semantic_registry_key,
    semantic_stats_key,
)
from pipeline.semantic.embed import Embedder, Vectors
from pipeline.semantic.entry import (
    CorruptSemanticEntry,
    Entry,
    InvalidPrompt,
    decode,
    encode,
    entry_id,
    literals_match,
    params_digest,
    vector_bytes,
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

__all__ = [
    "CANDIDATES",
    "DEFAULT_THRESHOLD",
    "InvalidPrompt",
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


@dataclass(frozen=True, slots=True)
class Stored:
    entry_id: str
    embed_s: float


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

    ``thresholds`` maps a model to its similarity threshold (default ``threshold``);
    ``ttl_s`` bounds every key's life; ``limits`` bounds entries per namespace and
    namespaces per tenant; ``max_index_vectors`` bounds the vectors this process's
    indexes hold. Thread-safe; share one per process, since it holds this process's
    indexes and their background builder. :meth:`close` stops it.
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
    ) -> None:
        self.redis = client
        self.embedder = embedder
        self.threshold = threshold
        self.thresholds = dict(thresholds or {})
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
        raws, events = self._fetch(ns, [e for e, _ in candidates], position)
        if events:
            with idx.lock:
                added = self._apply(idx, events)
                if added:
                    candidates = idx.search(query, CANDIDATES)[0]
            if added:
                raws, _ = self._fetch(ns, [e for e, _ in candidates], None)
        found = self._best(idx, candidates, raws, vector, prompt, params, threshold)
        elapsed = time.perf_counter() - started
        best_seen, best = found
        if best is None:
            self._count(ns, "misses")
            return Lookup(False, None, best_seen, None, None, threshold, embed_s, elapsed)
        similarity, e, entry = best
        self._count(ns, "hits")
        age = max(0, int(time.time() * 1000) - entry.created_at_ms)
        return Lookup(
            True, entry.response, similarity, age, f"{e:016x}", threshold, embed_s, elapsed
        )

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
        [e] = self.store_many(scope, [(prompt, response)], params, vectors)
        return Stored(e, embed_s)

    def store_vector(
        self, scope: Scope, prompt: str, params: Mapping[str, Any], response: str, vector: Vectors
    ) -> str:
        """:meth:`store` with the prompt already embedded; returns the entry id."""
        return self.store_many(scope, [(prompt, response)], params, vector[None, :])[0]

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
        key's TTL set or extended. Then the bounds (:class:`Limits`): past the
        namespace's entries, its oldest are evicted now; past the tenant's
        namespaces, the least recently stored into is purged in the background.
        """
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
        self._count(ns, "stored", len(items))
        self._flush_into(pipe, ns)
        replies = pipe.execute()
        self._enforce_limits(scope, int(replies[size_at]), int(replies[spaces_at]))
        return out

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
        """A caller says a hit was wrong: remove the entry everywhere, and count it.

        Returns whether the entry was there.
        """
        ns = scope.namespace
        try:
            e = int(entry, 16)
        except (TypeError, ValueError) as exc:
            raise InvalidPrompt(f"entry id {entry!r} is not 16 hex digits") from exc
        if not isinstance(entry, str) or len(entry) != 16 or e < 0:
            raise InvalidPrompt(f"entry id {entry!r} is not 16 hex digits")
        entry = f"{e:016x}"  # the stored form, whatever case the caller sent
        now_ms = int(time.time() * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(semantic_entry_key(ns, e))
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

    def _best(
        self,
        idx: NamespaceIndex,
        candidates: list[tuple[int, float]],
        raws: list[bytes | None],
        vector: Vectors,
        prompt: str,
        params: Mapping[str, Any],
        threshold: float,
    ) -> tuple[float | None, tuple[float, int, Entry] | None]:
        """The best candidate's similarity, and the best that passes every check."""
        ids: list[int] = []
        tails: list[bytes] = []
        kept: list[bytes] = []
        gone: list[int] = []
        for (e, _), raw in zip(candidates, raws, strict=True):
            tail = vector_bytes(raw, idx.dim)
            if raw is None:
                gone.append(e)  # expired or removed: Redis is the truth
            elif tail is None:
                log.warning("corrupt semantic entry %s in %s", f"{e:016x}", idx.namespace)
            else:
                ids.append(e)
                tails.append(tail)
                kept.append(raw)
        if gone:
            with idx.lock:
                idx.remove(gone)
        if not ids:
            return None, None
        stored = np.frombuffer(b"".join(tails), dtype="<f4").reshape(len(ids), idx.dim)
        stored = stored.astype(np.float64)
        query = np.asarray(vector, dtype=np.float64)
        norms = np.linalg.norm(stored, axis=1) * float(np.linalg.norm(query))
        sims = np.divide(stored @ query, norms, out=np.zeros(len(ids)), where=norms > 0)
        digest = params_digest(dict(params))
        for i in np.argsort(-sims, kind="stable"):
            similarity = float(sims[i])
            if similarity < threshold:
                break
            try:
                entry = decode(kept[i])
            except CorruptSemanticEntry:
                log.warning("corrupt semantic entry %s in %s", f"{ids[i]:016x}", idx.namespace)
                continue
            if entry.params == digest and (
                not self.guard_literals or literals_match(prompt, entry.prompt)
            ):
                return float(sims.max()), (similarity, ids[i], entry)
        return float(sims.max()), None

    def _fetch(
        self, ns: str, ids: list[int], position: str | None
    ) -> tuple[list[bytes | None], list[Any]]:
        """One round trip: the entries, the stream since ``position`` (unless None),
        this process's pending counters."""
        pipe = self.redis.pipeline(transaction=False)
        if ids:
            pipe.mget([semantic_entry_key(ns, e) for e in ids])
        if position is not None:
            pipe.xread({semantic_log_key(ns): position}, count=STREAM_BATCH)
        self._flush_into(pipe, ns)
        replies = pipe.execute()
        raws: list[bytes | None] = list(replies[0]) if ids else []
        events: list[Any] = []
        if position is not None:
            reply = replies[1 if ids else 0]
            events = reply[0][1] if reply else []
        return raws, events

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
