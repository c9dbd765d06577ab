"""Stores and flags: what the caller tells the cache.

A store writes, in one transaction (so a crash never leaves a key without its TTL):
the entries with their TTL, their ids in the expiry-scored set, an ``add`` per entry
on the namespace's stream (with the vector), the counters; every key's TTL set or
extended in the same ``MULTI``. The tenant's registry of namespaces is in it too,
except on Redis Cluster, where it lives in another slot and has a transaction of its
own. Then the bounds (:class:`~pipeline.semantic.namespaces.Limits`), then the labels
of explorations the stored prompts answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from pipeline.core.cluster import is_cluster
from pipeline.core.keys import (
    semantic_entry_key,
    semantic_ids_key,
    semantic_log_key,
    semantic_outcomes_key,
    semantic_registry_key,
)
from pipeline.semantic import decision
from pipeline.semantic.embed import Vectors
from pipeline.semantic.entry import (
    CorruptSemanticEntry,
    Entry,
    InvalidPrompt,
    cosine,
    decode,
    encode,
    entry_id,
    params_digest,
    template_id,
)
from pipeline.semantic.lookups import Lookups
from pipeline.semantic.namespaces import (
    evict_namespaces,
    evict_oldest,
    trim_minid,
)
from pipeline.semantic.scope import (
    Flagged,
    Lookup,
    NonDeterministicParams,
    Scope,
    Stored,
    check_deterministic,
    parse_entry_id,
)

log = logging.getLogger(__name__)

SAME_PROMPT = 0.999
"""A flag at or above this similarity is about the entry's own prompt: the response
itself is wrong, and the entry is removed."""


class Stores(Lookups):
    """The store and flag paths of the cache (module docstring)."""

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
        # One MULTI: every key written here gets its TTL in the same transaction.
        pipe = self.redis.pipeline(transaction=True)
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
        # The registry is in the tenant's slot: on a cluster, a transaction of its own.
        apart = is_cluster(self.redis)
        reg = self.redis.pipeline(transaction=True) if apart else pipe
        reg.zadd(registry, {ns: now_ms})
        reg.zremrangebyscore(registry, "-inf", now_ms - ttl)
        spaces_at = len(reg)
        reg.zcard(registry)
        reg.pexpire(registry, ttl)
        probes_at = len(pipe)
        if self.decision is not None:
            self.probes.take_into(pipe, ns, [int(m, 16) for m in out])
        self._count(ns, "stored", len(items))
        self._flush_into(pipe, ns)
        replies = pipe.execute()
        spaces = reg.execute() if apart else replies
        self._enforce_limits(scope, int(replies[size_at]), int(spaces[spaces_at]))
        agreed: list[bool | None] = [None] * len(items)
        if self.decision is not None:
            taken = self.probes.taken(replies[probes_at], now_ms)
            agreed = self.label(ns, items, out, taken, digest)
        return out, agreed

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
        e = parse_entry_id(entry)
        entry = f"{e:016x}"  # the stored form, whatever case the caller sent
        now_ms = int(time.time() * 1000)
        pipe = self.redis.pipeline(transaction=True)  # the stream's TTL with its write
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
        e = parse_entry_id(entry)
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
        pair = (template_id(cached.prompt), template_id(prompt))
        outcomes, paired, room = self._past(ns, [e], [pair])
        labelled = outcomes[e] = decision.append(outcomes[e], similarity, False)
        held = paired[pair[1]]
        held[pair[0]] = decision.append(held.pop(pair[0], decision.EMPTY), similarity, False)
        self._count(ns, "flagged")
        self._write_outcomes(ns, outcomes, paired, room)
        return Flagged(False, similarity, self.decision.threshold(labelled))

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
