"""Stores and flags: what the caller tells the cache.

A store writes, in one transaction (so a crash never leaves a key without its TTL):
the entries with their TTL, their ids in the expiry-scored set, an ``add`` per entry
on the namespace's stream (with the vector), the counters; every key's TTL set or
extended in the same ``MULTI``. The tenant's registry of namespaces is in it too,
except on Redis Cluster, where it lives in another slot and has a transaction of its
own. Then the bounds (:class:`~freshline.pipeline.semantic.namespaces.Limits`), then the labels
of explorations the stored prompts answer.

With a tenant budget (:class:`freshline.pipeline.core.budget.TenantBudget`, in keys and bytes:
an entry is its key, its value, its vector on the stream, its id, its outcomes at
their most and Redis's overhead), the entries are counted against their tenant
before that transaction, and the budget pops the tenant's oldest entries, in any of
its namespaces, until it holds; after the transaction those are evicted as a
namespace's oldest are (out of the id set, unlinked, a ``remove`` on the stream),
each only while its value is the size it was counted at: a prompt stored again with
another response (after a flag, say) has a member of its own, and its old one going
takes nothing with it. Only a tenant's own stores add to its budget, so another
tenant's entries are never touched. A store that could never fit (one entry, or the
batch, over the whole budget) is refused before anything is counted
(:class:`~freshline.pipeline.semantic.scope.EntryOverBudget`). Entries evicted by the other
bounds, or flagged away, stay counted until their expiry or their turn to be popped,
as if present: the count errs towards less room, never more.

A flag writes its counter only into a namespace that exists, and its ``remove`` on
the stream only when it removed something: a flag for a namespace never stored into
stores nothing, and one for an id not there adds only to the namespace's counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from freshline.pipeline.core.budget import entry_cost
from freshline.pipeline.core.cluster import is_cluster
from freshline.pipeline.core.keys import (
    semantic_budget_keys,
    semantic_entry_key,
    semantic_ids_key,
    semantic_log_key,
    semantic_outcomes_key,
    semantic_registry_key,
)
from freshline.pipeline.semantic import decision
from freshline.pipeline.semantic.embed import Vectors
from freshline.pipeline.semantic.entry import (
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
from freshline.pipeline.semantic.lookups import Lookups
from freshline.pipeline.semantic.namespaces import (
    evict_entries,
    evict_namespaces,
    evict_oldest,
    trim_minid,
)
from freshline.pipeline.semantic.scope import (
    EntryOverBudget,
    Flagged,
    Lookup,
    NonDeterministicParams,
    Scope,
    Stored,
    check_deterministic,
    parse_entry_id,
)

log = logging.getLogger(__name__)

ID_BYTES = 24
"""An entry's member in its namespace's id set: 16 hex digits and a score."""
OUTCOMES_BYTES = 1 + 2 * decision.MAX_OUTCOMES + 150
"""An entry's outcomes (``sem:o``) at their most, and what Redis spends on a string
key with a TTL (about 150 bytes, :data:`freshline.pipeline.core.budget.ENTRY_OVERHEAD_BYTES`):
counted with every entry, labelled or not, so that the count never falls short."""

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

    # long: checks, one MULTI whose order matters (entries, ids, stream, TTLs), then limits
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
        out = [f"{entry_id(prompt):016x}" for prompt, _ in items]
        blobs = {
            semantic_entry_key(ns, int(member, 16)): encode(
                Entry(prompt, response, now_ms, digest, np.asarray(vector, dtype=np.float32))
            )
            for (prompt, response), member, vector in zip(items, out, vectors, strict=True)
        }
        popped = self._admit(scope.tenant, blobs)
        gone = set(popped)
        # One MULTI: every key written here gets its TTL in the same transaction.
        pipe = self.redis.pipeline(transaction=True)
        for key, blob in blobs.items():
            if (key, self._cost(key, len(blob))) not in gone:  # else popped at once
                pipe.set(key, blob, px=ttl)
        # The ids before the stream events: an index build between the two still
        # finds the entry (freshline.pipeline.semantic.pool).
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
        self._evict_popped([(k, c) for k, c in popped if k not in blobs])
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
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(semantic_entry_key(ns, e))
        pipe.delete(semantic_outcomes_key(ns, e))
        pipe.zrem(semantic_ids_key(ns), entry)
        self._count(ns, "flagged")
        counted = len(pipe)
        pending = self._flush_into(pipe, ns)
        replies = pipe.execute()
        self._settle(ns, pending, replies[counted] if pending else None)
        removed = bool(replies[0])
        if removed or replies[2]:
            # Only a removal is news to the other workers: a flag of an id that is
            # not there (a caller's guess) adds nothing to the stream. NOMKSTREAM: a
            # namespace whose stream has gone has no index to tell.
            log_key = semantic_log_key(ns)
            pipe = self.redis.pipeline(transaction=True)  # the stream's TTL with its write
            pipe.xadd(
                log_key,
                {"op": "remove", "id": entry},
                minid=trim_minid(now_ms),
                approximate=True,
                nomkstream=True,
            )
            pipe.pexpire(log_key, self.ttl_ms)
            pipe.execute()
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

    def _admit(self, tenant: str, blobs: dict[str, bytes]) -> list[tuple[str, int]]:
        """Count the entries ``blobs`` against ``tenant``'s budget, if there is one;
        returns the keys it popped, the tenant's oldest (module docstring), with the
        bytes each was counted for. Refused, before anything is counted, when they
        could never fit."""
        if self.budget is None:
            return []
        entries = [(key, self._value_bytes(key, len(blob))) for key, blob in blobs.items()]
        cost = sum(self._cost(key, len(blob)) for key, blob in blobs.items())
        if cost > self.budget.max_bytes or len(entries) > self.budget.max_keys:
            raise EntryOverBudget(cost, len(entries), self.budget.max_bytes, self.budget.max_keys)
        return self.budget.admit_costs(semantic_budget_keys(tenant), entries, self.ttl_ms)

    def _value_bytes(self, key: str, blob: int) -> int:
        """What an entry of ``blob`` bytes at ``key`` is counted for besides its key
        and its budget member: also its vector on the stream, its member in the id
        set and its outcomes' key at their most."""
        return blob + 4 * self.embedder.dim + ID_BYTES + len(key) + OUTCOMES_BYTES

    def _cost(self, key: str, blob: int) -> int:
        """The bytes the budget counts an entry at ``key`` of ``blob`` bytes for."""
        return entry_cost(key, self._value_bytes(key, blob))

    def _evict_popped(self, popped: list[tuple[str, int]]) -> None:
        """Evict the tenant's entries its budget popped (never another tenant's: only
        its own stores add to its budget), each only if it is still the version that
        was counted: one stored again since with another size (after a flag, say) is
        newer than the member popped, and one gone already needs nothing."""
        if not popped:
            return
        counted: dict[str, set[int]] = {}
        for key, cost in popped:
            counted.setdefault(key, set()).add(cost)
        pipe = self.redis.pipeline(transaction=False)
        for key in counted:
            pipe.strlen(key)  # one key per command: on a cluster, each to its own slot
        sizes = pipe.execute()
        current = [
            key
            for (key, costs), size in zip(counted.items(), sizes, strict=True)
            if size and self._cost(key, int(size)) in costs
        ]
        for ns, n in evict_entries(self.redis, current, self.ttl_ms).items():
            if n:
                self._count(ns, "evicted", n)

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
