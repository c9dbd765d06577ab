"""A lookup, in order
------------------
1. Refuse non-deterministic parameters; embed the prompt (once, in the caller's batch).
2. Take this process's index of the namespace (:mod:`freshline.pipeline.semantic.pool`). If it
   is not ready (a large namespace still building), answer a miss, ``warming``.
3. Search it for the :data:`CANDIDATES` nearest ids.
4. One round trip: ``MGET`` their entries (and, with a learned decision, their own
   outcomes and ``HGET`` the prompt template's pairs), ``XREAD`` the namespace's
   stream since the index's position, and this process's pending counters. Changes
   read are applied; when they added entries, steps 3-4 run once more so a new entry
   can win.
5. Check each candidate present in Redis *exactly*: the same generation parameters,
   the same numbers and names in both prompts
   (:func:`freshline.pipeline.semantic.entry.literals_match`), and its cosine similarity with
   the query (float64) good enough to serve: with a
   :class:`~freshline.pipeline.semantic.decision.Learned` decision, the estimated error at that
   similarity (from the outcomes of its template pair and its own, read in step 4's
   round trip; the embedding model's prior until there are some) at most
   ``max_error`` (:mod:`freshline.pipeline.semantic.learning`); without one, at or above the
   model's fixed threshold. With a learned decision, the candidate with the lowest
   estimated error is served, unless it is audited.
6. With no candidate served, the nearest that passes the checks may be explored: a
   miss that names it (``Lookup.candidate_id``), remembered so that the caller's
   store of the model's response labels it (:mod:`freshline.pipeline.semantic.feedback`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from freshline.pipeline.core.keys import (
    semantic_entry_key,
    semantic_log_key,
    semantic_outcomes_key,
)
from freshline.pipeline.semantic import decision
from freshline.pipeline.semantic.embed import Vectors
from freshline.pipeline.semantic.entry import (
    template_id,
    vector_bytes,
)
from freshline.pipeline.semantic.feedback import pairs_key
from freshline.pipeline.semantic.index import NamespaceIndex
from freshline.pipeline.semantic.learning import MIN_EXPLORE, Learning
from freshline.pipeline.semantic.pool import STREAM_BATCH
from freshline.pipeline.semantic.scope import (
    Lookup,
    NonDeterministicParams,
    Scope,
    check_deterministic,
)
from freshline.pipeline.semantic.state import Candidate

log = logging.getLogger(__name__)

CANDIDATES = 8
MARGIN = 0.1
"""With a learned decision, a candidate's own outcomes are read only when the index
puts it at most this far below the similarity at which the prior starts exploring
(0.45 for the local model); the others are neither served nor explored."""


class Lookups(Learning):
    """The lookup path of the cache (module docstring)."""

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
        learned = prompt if self.decision is not None else None
        raws, outcomes, pairs, events = self._fetch(ns, candidates, position, learned)
        if events:
            with idx.lock:
                added = self._apply(idx, events)
                if added:
                    candidates = idx.search(query, CANDIDATES)[0]
            if added:
                raws, outcomes, pairs, _ = self._fetch(ns, candidates, None, learned)
        found = self._candidates(idx, candidates, raws, outcomes, vector)
        best_seen = found[0].similarity if found else None
        if self.decision is not None:
            found = self._with_outcomes(ns, self.decision, found, prompt, params, pairs)
            return self.decide(
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

    def _candidates(
        self,
        idx: NamespaceIndex,
        candidates: list[tuple[int, float]],
        raws: list[bytes | None],
        outcomes: dict[int, bytes | None],
        vector: Vectors,
    ) -> list[Candidate]:
        """The candidates present in Redis with their exact similarity, most similar
        first; those gone (expired or removed: Redis is the truth) leave the index."""
        ids: list[int] = []
        tails: list[bytes] = []
        kept: list[bytes] = []
        gone: list[int] = []
        for (e, _), raw in zip(candidates, raws, strict=True):
            tail = vector_bytes(raw, idx.dim)
            if raw is None:
                gone.append(e)
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
            return []
        stored = np.frombuffer(b"".join(tails), dtype="<f4").reshape(len(ids), idx.dim)
        stored = stored.astype(np.float64)
        query = np.asarray(vector, dtype=np.float64)
        norms = np.linalg.norm(stored, axis=1) * float(np.linalg.norm(query))
        sims = np.divide(stored @ query, norms, out=np.zeros(len(ids)), where=norms > 0)
        return [
            Candidate(
                float(sims[i]),
                ids[i],
                kept[i],
                decision.decode(outcomes.get(ids[i])),
                known=ids[i] in outcomes,
            )
            for i in np.argsort(-sims, kind="stable")
        ]

    def _fetch(
        self,
        ns: str,
        candidates: list[tuple[int, float]],
        position: str | None,
        learned: str | None = None,
    ) -> tuple[list[bytes | None], dict[int, bytes | None], bytes | None, list[Any]]:
        """One round trip: the entries (and, for a ``learned`` decision's prompt, the
        outcomes of those near enough, :data:`MARGIN`, and its template's pairs), the
        stream since ``position`` (unless None), this process's pending counters."""
        # A transaction: the counters flushed here get their TTL in the same MULTI.
        pipe = self.redis.pipeline(transaction=True)
        ids = [e for e, _ in candidates]
        keys = [semantic_entry_key(ns, e) for e in ids]
        near: list[int] = []
        if learned is not None and self.decision is not None:
            floor = self.decision.floor(MIN_EXPLORE) - MARGIN
            near = [e for e, s in candidates if s >= floor]
            keys += [semantic_outcomes_key(ns, e) for e in near]
            pipe.hget(pairs_key(ns), f"{template_id(learned):016x}")
        if ids:
            pipe.mget(keys)
        if position is not None:
            pipe.xread({semantic_log_key(ns): position}, count=STREAM_BATCH)
        counted = len(pipe)
        pending = self._flush_into(pipe, ns)
        replies = pipe.execute()
        self._settle(ns, pending, replies[counted] if pending else None)
        pairs = replies.pop(0) if learned is not None else None
        values: list[bytes | None] = list(replies[0]) if ids else []
        events: list[Any] = []
        if position is not None:
            reply = replies[1 if ids else 0]
            events = reply[0][1] if reply else []
        return values[: len(ids)], dict(zip(near, values[len(ids) :], strict=True)), pairs, events

    def _apply(self, idx: NamespaceIndex, events: list[Any]) -> int:
        """Apply events read by a lookup (the index's lock held); past a full batch,
        the rest of the stream too."""
        added = idx.apply(events)
        if len(events) >= STREAM_BATCH:
            added += self.pool.catch_up(idx)
        return added
