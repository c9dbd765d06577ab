"""The semantic response cache: a prompt close enough to a cached one gets its response.

Scope
-----
Every entry lives in a namespace ``{<tenant>:<model>:<model_version>:<template_version>}``
(:func:`freshline.pipeline.core.keys.semantic_namespace`), and every namespace has an index of
its own (:mod:`freshline.pipeline.semantic.index`). A lookup searches only its own namespace:
another tenant's, model's, model version's or template version's entries are never
even candidates. How much a namespace and a tenant keep is bounded
(:mod:`freshline.pipeline.semantic.namespaces`).

The parts
---------
:class:`SemanticCache` is one object per process, put together from one module per
concern, each a layer on the one before:

* :mod:`freshline.pipeline.semantic.scope`: the vocabulary (scopes, answers) and which
  generations may be cached (deterministic ones only);
* :mod:`freshline.pipeline.semantic.state`: settings, collaborators, the exact checks, counters;
* :mod:`freshline.pipeline.semantic.learning`: the learned decision and its labels;
* :mod:`freshline.pipeline.semantic.lookups`: a lookup, step by step;
* :mod:`freshline.pipeline.semantic.stores`: stores and flags;
* this module: warming, purging and closing, and the names callers import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

from freshline.pipeline.core.keys import semantic_entry_key, semantic_ids_key, semantic_stats_key
from freshline.pipeline.semantic.decision import Learned
from freshline.pipeline.semantic.entry import InvalidPrompt
from freshline.pipeline.semantic.lookups import CANDIDATES
from freshline.pipeline.semantic.namespaces import Limits, Purge, live_namespaces, purge_keys
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
from freshline.pipeline.semantic.state import DEFAULT_THRESHOLD
from freshline.pipeline.semantic.stores import SAME_PROMPT, Stores

__all__ = [
    "CANDIDATES",
    "DEFAULT_THRESHOLD",
    "SAME_PROMPT",
    "EntryOverBudget",
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
    "flag_keys",
]


def flag_keys(scope: Scope, entry: str) -> list[str]:
    """The keys a flag of ``entry`` in ``scope`` could find: the namespace's ids and
    counters (whether it exists, as its counters ask) and the entry itself, one cluster
    slot. With none of them in Redis, a flag removes nothing and has no counters to add
    to, which one ``EXISTS`` tells: the API answers such a flag on its event loop,
    without the cache (:func:`freshline.pipeline.api.llm.flag`). Raises
    :class:`InvalidPrompt` for an entry id that is not 16 hex digits."""
    ns = scope.namespace
    return [
        semantic_ids_key(ns),
        semantic_stats_key(ns),
        semantic_entry_key(ns, parse_entry_id(entry)),
    ]


class SemanticCache(Stores):
    """Tenant-scoped, version-scoped semantic cache of deterministic LLM responses.

    ``decision`` serves each entry under an error bound it learns
    (:class:`~freshline.pipeline.semantic.decision.Learned`); without one, ``thresholds`` maps
    a model to its fixed similarity threshold (default ``threshold``). ``rng`` draws
    the explorations (seed it for repeatable runs). ``ttl_s`` bounds every key's
    life; ``limits`` bounds entries per namespace and namespaces per tenant;
    ``max_index_vectors`` bounds the vectors this process's indexes hold; ``budget``
    bounds each tenant's entries in keys and bytes (:mod:`freshline.pipeline.semantic.stores`).
    Thread-safe; share one per process, since it holds this process's indexes and
    their background builder. :meth:`close` stops it.
    """

    def warm(self, namespaces: Sequence[tuple[str, int]] | None = None) -> int:
        """Build, in the background, the indexes of the namespaces in Redis (or of
        ``(namespace, entries)`` given), most recently stored first, as many as the
        index budget holds; returns how many were queued. The API calls it at start-up."""
        found = live_namespaces(self.redis) if namespaces is None else namespaces
        return self.pool.warm(found)

    def purge(self, **match: Unpack[Purge]) -> dict[str, int]:
        """:func:`~freshline.pipeline.semantic.namespaces.purge_keys`, and this process's indexes
        of those namespaces dropped."""
        removed = purge_keys(self.redis, **match)
        for ns in removed:
            self.pool.drop(ns)
        return removed

    def close(self) -> None:
        """Stop the background builds and write this process's pending counters."""
        self.pool.close()
        self.background.shutdown(wait=True, cancel_futures=True)
        with self._pending_lock:
            namespaces = list(self._pending)
        for ns in namespaces:  # one transaction each: a namespace is one cluster slot
            pipe = self.redis.pipeline(transaction=True)
            self._flush_into(pipe, ns)
            pipe.execute()
