"""The learned decision in the cache: serve, audit, explore or miss, and the labels.

Serving (:meth:`Learning.decide`, step 5 of a lookup in :mod:`freshline.pipeline.semantic.lookups`)
takes the candidate with the lowest estimated error within the bound; with none, the
nearest that passes the checks may be explored. The outcomes come back through the
caller's store (:meth:`Learning.label`) or a flag, and go to the entry's own and to
its template pair's (:mod:`freshline.pipeline.semantic.feedback`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, cast

from freshline.pipeline.core.keys import (
    semantic_entry_key,
    semantic_outcomes_key,
)
from freshline.pipeline.semantic import decision
from freshline.pipeline.semantic.decision import Learned
from freshline.pipeline.semantic.entry import (
    CorruptSemanticEntry,
    Entry,
    decode,
    entry_id,
    params_digest,
    template_id,
)
from freshline.pipeline.semantic.feedback import (
    MAX_PAIRS,
    PROBE_TTL_MS,
    Probe,
    decode_pairs,
    encode_pairs,
    pairs_key,
    same_response,
)
from freshline.pipeline.semantic.scope import Lookup
from freshline.pipeline.semantic.state import CacheState, Candidate

log = logging.getLogger(__name__)

MIN_EXPLORE = 0.001  # below this chance, a candidate is not even checked for exploring


class Learning(CacheState):
    """The learned decision's part of the cache (module docstring)."""

    def decide(
        self,
        ns: str,
        learned: Learned,
        found: list[Candidate],
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
            explored: Candidate | None = c
        else:
            worth = [c for c in found if estimates[c.id].explore >= MIN_EXPLORE]
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
        self, ns: str, prompt: str, params: Mapping[str, Any], c: Candidate, *, audit: bool
    ) -> Candidate | None:
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

    def _with_outcomes(
        self,
        ns: str,
        learned: Learned,
        found: list[Candidate],
        prompt: str,
        params: Mapping[str, Any],
        pairs: bytes | None,
    ) -> list[Candidate]:
        """The candidates near enough to be served or explored (on their own outcomes)
        that pass the checks, with their template pairs' outcomes from ``pairs`` (the
        prompt template's field, read in the lookup's round trip)."""
        digest = params_digest(dict(params))
        worth = [
            c
            for c in found
            if c.known
            and learned.worth(c.outcomes, c.similarity, MIN_EXPLORE)
            and self.check(c, prompt, digest, ns) is not None
        ]
        if worth and pairs:
            learned_pairs = decode_pairs(pairs)
            for c in worth:
                c.pair = learned_pairs.get(template_id(cast(Entry, c.entry).prompt), decision.EMPTY)
        return worth

    def label(
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
        keys = [(template_id(cached.prompt), template_id(items[i][0])) for i, _, cached in found]
        outcomes, paired, room = self._past(ns, own, keys)
        for (i, p, cached), pair in zip(found, keys, strict=True):
            agreed[i] = right = same_response(items[i][1], cached.response)
            outcomes[p.candidate] = decision.append(outcomes[p.candidate], p.similarity, right)
            held = paired[pair[1]]
            held[pair[0]] = decision.append(held.pop(pair[0], decision.EMPTY), p.similarity, right)
            self._count(ns, "right" if right else "wrong")
            if p.audit:
                self._count(ns, "audit_right" if right else "audit_wrong")
        self._write_outcomes(ns, outcomes, paired, room)
        return agreed

    def _past(
        self, ns: str, own: list[int], pairs: list[tuple[int, int]]
    ) -> tuple[dict[int, decision.Outcomes], dict[int, dict[int, decision.Outcomes]], bool]:
        """The outcomes of entries ``own``; the pairs held for the prompt templates of
        ``pairs`` (``(entry template, prompt template)``), by prompt template; whether
        the namespace has room for another prompt template (:data:`MAX_PAIRS`). One
        round trip."""
        queries = sorted({q for _, q in pairs})
        pipe = self.redis.pipeline(transaction=False)
        pipe.mget([semantic_outcomes_key(ns, e) for e in own])
        pipe.hmget(pairs_key(ns), [f"{q:016x}" for q in queries])
        pipe.hlen(pairs_key(ns))
        mine, theirs, held = pipe.execute()
        return (
            {e: decision.decode(raw) for e, raw in zip(own, mine, strict=True)},
            {q: decode_pairs(raw) for q, raw in zip(queries, theirs, strict=True)},
            int(held) < MAX_PAIRS,
        )

    def _write_outcomes(
        self,
        ns: str,
        own: dict[int, decision.Outcomes],
        pairs: dict[int, dict[int, decision.Outcomes]],
        room: bool,
    ) -> None:
        """Write outcomes with their TTLs in one transaction (a prompt template already
        held is updated; a new one only while there is ``room``), with the counters."""
        pipe = self.redis.pipeline(transaction=True)
        for e, out in own.items():
            pipe.set(semantic_outcomes_key(ns, e), decision.encode(out), px=self.ttl_ms)
        fields = {
            f"{q:016x}": encode_pairs(held)
            for q, held in pairs.items()
            if room or sum(len(o) for o in held.values()) > 1
        }
        if fields:
            pipe.hset(pairs_key(ns), mapping=cast(Any, fields))
            pipe.pexpire(pairs_key(ns), self.ttl_ms)
        counted = len(pipe)
        pending = self._flush_into(pipe, ns)
        replies = pipe.execute()
        self._settle(ns, pending, replies[counted] if pending else None)
