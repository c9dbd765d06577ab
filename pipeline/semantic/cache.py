"""The semantic response cache: a prompt close enough to a cached one gets its response.

Scope
-----
Every entry lives in a namespace ``{<tenant>:<model>:<model_version>:<template_version>}``
(:func:`pipeline.core.keys.semantic_namespace`), and every namespace has an index of
its own (:mod:`pipeline.semantic.index`). A lookup searches only its own namespace:
another tenant's, model's, model version's or template version's entries are never
even candidates.

What may be cached
------------------
Only deterministic generations: ``params["temperature"] == 0``, or
``params["deterministic"] is True`` (a seeded, pinned backend that says so). Anything
else is refused with :class:`NonDeterministicParams`, on lookup as on store: a
sampled response served again is not what the caller asked for.

A lookup, in order
------------------
1. Refuse non-deterministic parameters; embed the prompt (once, in the caller's batch).
2. Search the namespace's index for the :data:`CANDIDATES` nearest ids.
3. One round trip: ``MGET`` their entries, ``XREAD`` the namespace's stream since the
   index's position, and this process's pending counters. Changes read are applied;
   when they added entries, steps 2-3 run once more so a new entry can win.
4. Check each candidate present in Redis *exactly*: cosine similarity of the stored
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from pipeline.core.errors import FreshlineError
from pipeline.core.keys import (
    parse_semantic_namespace,
    semantic_entry_key,
    semantic_ids_key,
    semantic_log_key,
    semantic_namespace,
    semantic_pattern,
    semantic_stats_key,
)
from pipeline.core.types import text
from pipeline.semantic.embed import Embedder, Vectors
from pipeline.semantic.entry import (
    CorruptSemanticEntry,
    Entry,
    cosine,
    decode,
    encode,
    entry_id,
    literals_match,
    params_digest,
)
from pipeline.semantic.index import STREAM_RETENTION_MS, NamespaceIndex, SemanticIndexes

log = logging.getLogger(__name__)

CANDIDATES = 8
DEFAULT_THRESHOLD = 0.93
STAT_FIELDS = ("hits", "misses", "stored", "flagged", "refused")


class NonDeterministicParams(FreshlineError):
    """A generation that may differ for the same prompt: never stored nor served."""


class InvalidPrompt(FreshlineError, ValueError):
    """A prompt or response the cache cannot take (empty, not text, too long)."""


@dataclass(frozen=True, slots=True)
class Scope:
    """Who asks and for what: the parts of a namespace."""

    tenant: str
    model: str
    model_version: str
    template_version: str

    @property
    def namespace(self) -> str:
        return semantic_namespace(self.tenant, self.model, self.model_version,
                                  self.template_version)


@dataclass(frozen=True, slots=True)
class Lookup:
    """A lookup's answer. ``response`` is None on a miss.

    ``similarity`` is the served entry's exact cosine similarity (on a miss, the best
    candidate's, or None without one); ``lookup_s`` excludes ``embed_s``.
    """

    hit: bool
    response: str | None
    similarity: float | None
    age_ms: int | None
    entry_id: str | None
    threshold: float
    embed_s: float
    lookup_s: float


@dataclass(frozen=True, slots=True)
class Stored:
    entry_id: str
    embed_s: float


def check_deterministic(params: Mapping[str, Any]) -> None:
    """Raise :class:`NonDeterministicParams` unless the generation is deterministic."""
    if not isinstance(params, Mapping):
        raise NonDeterministicParams("params must be an object such as {\"temperature\": 0}")
    declared = params.get("deterministic")
    if declared is not None and not isinstance(declared, bool):
        raise NonDeterministicParams("params.deterministic must be true or false")
    if declared is True:
        return
    temperature = params.get("temperature")
    if temperature is None:
        raise NonDeterministicParams(
            "params.temperature is required: only temperature 0 (or params.deterministic "
            "= true) responses are cached")
    if (isinstance(temperature, bool) or not isinstance(temperature, int | float)
            or not math.isfinite(temperature) or temperature < 0):
        raise NonDeterministicParams(f"params.temperature {temperature!r} is not a number >= 0")
    if temperature != 0:
        raise NonDeterministicParams(
            f"temperature {temperature:g} is not deterministic: only temperature 0 (or "
            "params.deterministic = true) responses are cached; call the model directly")


class SemanticCache:
    """Tenant-scoped, version-scoped semantic cache of deterministic LLM responses.

    ``thresholds`` maps a model to its similarity threshold (default ``threshold``);
    ``ttl_s`` bounds every key's life. Thread-safe; share one per process, since it
    holds this process's indexes.
    """

    def __init__(self, client: redis.Redis, embedder: Embedder, *,
                 threshold: float = DEFAULT_THRESHOLD,
                 thresholds: Mapping[str, float] | None = None, ttl_s: int = 86_400,
                 max_prompt_chars: int = 32_000, guard_literals: bool = True) -> None:
        self.redis = client
        self.embedder = embedder
        self.threshold = threshold
        self.thresholds = dict(thresholds or {})
        self.ttl_ms = ttl_s * 1000
        self.max_prompt_chars = max_prompt_chars
        self.guard_literals = guard_literals
        self.indexes = SemanticIndexes(client, embedder.dim)
        self._pending: dict[str, Counter[str]] = {}
        self._pending_lock = threading.Lock()

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

    def lookup_vector(self, scope: Scope, prompt: str, params: Mapping[str, Any],
                      vector: Vectors, *, embed_s: float = 0.0) -> Lookup:
        """:meth:`lookup` with the prompt already embedded (batches, benchmarks)."""
        check_deterministic(params)
        started = time.perf_counter()
        ns = scope.namespace
        threshold = self.threshold_for(scope.model)
        digest = params_digest(dict(params))
        idx = self.indexes.get(ns)
        query = vector[None, :]
        with idx.lock:
            candidates = idx.search(query, CANDIDATES)[0]
        raws, events = self._fetch(idx, [e for e, _ in candidates])
        with idx.lock:
            added = self._apply(idx, events)
            if added:
                candidates = idx.search(query, CANDIDATES)[0]
        if added:
            raws, _ = self._fetch(idx, [e for e, _ in candidates], read_stream=False)
        best: tuple[float, int, Entry] | None = None
        best_seen: float | None = None
        for (e, _), raw in zip(candidates, raws, strict=True):
            if raw is None:
                with idx.lock:
                    idx.remove(e)  # expired or removed: Redis is the truth
                continue
            try:
                entry = decode(raw)
            except CorruptSemanticEntry:
                log.warning("corrupt semantic entry %s in %s", f"{e:016x}", ns)
                continue
            similarity = cosine(vector, entry.vector)
            best_seen = similarity if best_seen is None else max(best_seen, similarity)
            if (similarity >= threshold and entry.params == digest
                    and (not self.guard_literals or literals_match(prompt, entry.prompt))
                    and (best is None or similarity > best[0])):
                best = (similarity, e, entry)
        elapsed = time.perf_counter() - started
        if best is None:
            self._count(ns, "misses")
            return Lookup(False, None, best_seen, None, None, threshold, embed_s, elapsed)
        similarity, e, entry = best
        self._count(ns, "hits")
        age = max(0, int(time.time() * 1000) - entry.created_at_ms)
        return Lookup(True, entry.response, similarity, age, f"{e:016x}", threshold,
                      embed_s, elapsed)

    def store(self, scope: Scope, prompt: str, params: Mapping[str, Any],
              response: str) -> Stored:
        """Cache ``response`` for ``prompt``; refused unless deterministic.

        One pipeline: the entry with its TTL, its id in the expiry-scored set, an
        ``add`` on the namespace's stream (with the vector, so other processes need
        not read the entry), the counters; every key's TTL set or extended.
        """
        try:
            check_deterministic(params)
        except NonDeterministicParams:
            self._count(scope.namespace, "refused")
            raise
        self._check_text("response", response)
        vectors, embed_s = self.embed([prompt])
        [e] = self.store_many(scope, [(prompt, response)], params, vectors)
        return Stored(e, embed_s)

    def store_vector(self, scope: Scope, prompt: str, params: Mapping[str, Any],
                     response: str, vector: Vectors) -> str:
        """:meth:`store` with the prompt already embedded; returns the entry id."""
        return self.store_many(scope, [(prompt, response)], params, vector[None, :])[0]

    def store_many(self, scope: Scope, items: list[tuple[str, str]],
                   params: Mapping[str, Any], vectors: Vectors | None = None) -> list[str]:
        """Store ``(prompt, response)`` pairs in one pipeline; returns their entry ids.

        The prompts are embedded in one batch unless ``vectors`` are given (one row
        each). Refused as a whole unless the params are deterministic.
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
            raise InvalidPrompt(f"{len(vectors)} vectors of width {vectors.shape[1]} for "
                                f"{len(items)} prompts; the embedder gives {self.embedder.dim}")
        now_ms = int(time.time() * 1000)
        ttl = self.ttl_ms
        digest = params_digest(dict(params))
        ids_key, log_key = semantic_ids_key(ns), semantic_log_key(ns)
        minid = str(now_ms - STREAM_RETENTION_MS)
        pipe = self.redis.pipeline(transaction=False)
        out: list[str] = []
        members: dict[str, int] = {}
        for (prompt, response), vector in zip(items, vectors, strict=True):
            e = entry_id(prompt)
            vec = np.asarray(vector, dtype=np.float32)
            entry = Entry(prompt, response, now_ms, digest, vec)
            pipe.set(semantic_entry_key(ns, e), encode(entry), px=ttl)
            members[f"{e:016x}"] = now_ms + ttl
            pipe.xadd(log_key, {"op": "add", "id": f"{e:016x}", "v": vec.astype("<f4").tobytes()},
                      minid=minid, approximate=True)
            out.append(f"{e:016x}")
        pipe.zadd(ids_key, members)
        pipe.zremrangebyscore(ids_key, "-inf", now_ms)
        pipe.pexpire(ids_key, ttl)
        pipe.pexpire(log_key, ttl)
        self._count(ns, "stored", len(items))
        self._flush_into(pipe, ns)
        pipe.execute()
        return out

    def get_or_generate(self, scope: Scope, prompt: str, params: Mapping[str, Any],
                        generate: Callable[[str], str]) -> tuple[str, Lookup]:
        """The cached response, or ``generate(prompt)`` stored and returned.

        The prompt is embedded once for both steps. Non-deterministic parameters are
        refused before anything is generated: call the model directly for those.
        """
        found = self.lookup(scope, prompt, params)
        if found.hit and found.response is not None:
            return found.response, found
        response = generate(prompt)
        self._check_text("response", response)
        vector = self.embedder.embed([prompt])[0]
        self.store_vector(scope, prompt, params, response, vector)
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
        pipe.xadd(semantic_log_key(ns), {"op": "remove", "id": entry},
                  minid=str(now_ms - STREAM_RETENTION_MS), approximate=True)
        pipe.pexpire(semantic_log_key(ns), self.ttl_ms)
        self._count(ns, "flagged")
        self._flush_into(pipe, ns)
        removed = bool(pipe.execute()[0])
        idx = self.indexes.get(ns)
        with idx.lock:
            idx.remove(e)
        return removed

    def purge(self, *, tenant: str | None = None, model: str | None = None,
              model_version: str | None = None, template_version: str | None = None,
              batch: int = 500) -> dict[str, int]:
        """:func:`purge_keys`, and this process's indexes of those namespaces dropped."""
        removed = purge_keys(self.redis, tenant=tenant, model=model,
                             model_version=model_version, template_version=template_version,
                             batch=batch)
        for ns in removed:
            self.indexes.drop(ns)
        return removed

    def close(self) -> None:
        """Write this process's pending counters."""
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
            raise InvalidPrompt(f"the {what} is {len(value):,} characters, over the limit "
                                f"of {self.max_prompt_chars:,}")

    def _fetch(self, idx: NamespaceIndex, ids: list[int], *,
               read_stream: bool = True) -> tuple[list[bytes | None], list[Any]]:
        ns = idx.namespace
        pipe = self.redis.pipeline(transaction=False)
        if ids:
            pipe.mget([semantic_entry_key(ns, e) for e in ids])
        if read_stream:
            pipe.xread({semantic_log_key(ns): idx.stream_id}, count=10_000)
        self._flush_into(pipe, ns)
        replies = pipe.execute()
        raws: list[bytes | None] = list(replies[0]) if ids else []
        events: list[Any] = []
        if read_stream:
            reply = replies[1 if ids else 0]
            events = reply[0][1] if reply else []
        return raws, events

    def _apply(self, idx: NamespaceIndex, events: list[Any]) -> int:
        from pipeline.semantic.index import apply_events

        added = apply_events(idx, events)
        idx.synced_at = time.monotonic()
        if len(events) >= 10_000:
            added += self.indexes.catch_up(idx)
        return added

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


def purge_keys(client: redis.Redis, *, tenant: str | None = None, model: str | None = None,
               model_version: str | None = None, template_version: str | None = None,
               batch: int = 500) -> dict[str, int]:
    """Remove every key of the matching namespaces (SCAN + UNLINK in batches).

    A tenant, a model version or a template version must be given (a model alone
    narrows). Each namespace's stream then carries a ``purge``, so every process
    empties its index. Returns the keys removed per namespace. Safe to interrupt and
    run again.
    """
    if not (tenant or model_version or template_version):
        raise InvalidPrompt("purge needs a tenant, a model version or a template version")
    pattern = semantic_pattern(tenant, model, model_version, template_version)
    removed: Counter[str] = Counter()
    keys: list[bytes] = []
    for key in client.scan_iter(match=pattern, count=batch):
        removed[_namespace_of(text(key))] += 1
        keys.append(key)
        if len(keys) >= batch:
            client.unlink(*keys)
            keys.clear()
    if keys:
        client.unlink(*keys)
    now_ms = int(time.time() * 1000)
    pipe = client.pipeline(transaction=False)
    for ns in removed:
        pipe.xadd(semantic_log_key(ns), {"op": "purge"},
                  minid=str(now_ms - STREAM_RETENTION_MS), approximate=True)
        pipe.pexpire(semantic_log_key(ns), STREAM_RETENTION_MS)
    pipe.execute()
    return dict(removed)


def _namespace_of(key: str) -> str:
    start = key.index("{")
    return key[start:key.index("}", start) + 1]


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    tenant: str
    model: str
    model_version: str
    template_version: str
    entries: int
    counts: dict[str, int]

    @property
    def hit_rate(self) -> float | None:
        total = self.counts.get("hits", 0) + self.counts.get("misses", 0)
        return self.counts.get("hits", 0) / total if total else None


def stats(client: redis.Redis, tenant: str | None = None,
          model: str | None = None) -> list[NamespaceStats]:
    """Live entries and counters per namespace (SCAN of the id sets, never KEYS)."""
    now_ms = int(time.time() * 1000)
    out: list[NamespaceStats] = []
    namespaces: set[str] = set()
    for kind in ("ids", "stats"):
        for key in client.scan_iter(match=semantic_pattern(tenant, model, kind=kind),
                                    count=500):
            namespaces.add(_namespace_of(text(key)))
    for ns in sorted(namespaces):
        entries = int(client.zcount(semantic_ids_key(ns), now_ms, "+inf"))
        raw = client.hgetall(semantic_stats_key(ns))
        counts = {f: int(raw.get(f.encode(), 0)) for f in STAT_FIELDS}
        out.append(NamespaceStats(*parse_semantic_namespace(ns), entries=entries,
                                  counts=counts))
    return out
