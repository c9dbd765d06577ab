"""The semantic cache's busiest namespaces, as ``/status`` shows them.

A namespace's counters (``sem:stats``, :mod:`freshline.pipeline.semantic.namespaces`) cover its
life in Redis, as ``freshline semantic stats`` shows them. The page reads them from
the namespaces each tenant stored into within the TTL (``sem:ns:<tenant>``, newest
first, at most :data:`MAX_READ` in all; never a keyspace SCAN) and shows the
:data:`TOP` busiest.

The page names only what the operator chose: a row is a tenant and a model label
(the model if the settings name it, else ``other``: the rule of the metrics'
labels, :meth:`freshline.pipeline.api.llm.SemanticService.label`), its counters summed over
the model and template versions, which are strings only a request carried.

The ops port's process shows them too, without running the cache: this module
imports :mod:`freshline.pipeline.semantic.namespaces` (and so FAISS) only when it first reads.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import redis
from sqlalchemy.engine import Engine

from freshline.pipeline.core.keys import (
    parse_semantic_namespace,
    semantic_ids_key,
    semantic_registry_key,
    semantic_stats_key,
)
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import text
from freshline.pipeline.deploy.warm import tenant_ids

TOP = 10
"""Rows on the page: the tenant and model labels with the most lookups."""
MAX_READ = 500
"""Namespaces read at the most, the most recently stored into first."""
OTHER = "other"
"""The label value of every model the settings do not name."""


def named_models(settings: Settings) -> frozenset[str]:
    """The models a metric label or a page may name: those the settings name
    (:meth:`freshline.pipeline.api.llm.SemanticService.label`)."""
    return frozenset(
        [
            *settings.semantic_models,
            *settings.semantic_thresholds,
            *settings.semantic_max_entries_per_model,
        ]
    )


def reader(settings: Settings, client: redis.Redis, engine: Engine) -> Callable[[], dict[str, Any]]:
    """:func:`busiest` of every tenant (``freshline.tenants``), labelled by the settings."""
    named = named_models(settings)

    def read() -> dict[str, Any]:
        return busiest(
            client,
            tenant_ids(engine),
            lambda model: model if model in named else OTHER,
            ttl_s=settings.semantic_ttl_s,
        )

    return read


def busiest(
    client: redis.Redis,
    tenants: Sequence[str],
    label: Callable[[str], str],
    *,
    ttl_s: int,
    top: int = TOP,
    max_read: int = MAX_READ,
) -> dict[str, Any]:
    """``{"namespaces": read, "rows": [...]}``: per tenant and model label, the summed
    counters of its namespaces with the rates of
    :class:`~freshline.pipeline.semantic.namespaces.NamespaceStats`."""
    from freshline.pipeline.semantic.namespaces import (  # FAISS: see above
        STAT_FIELDS,
        NamespaceStats,
    )

    now_ms = int(time.time() * 1000)
    pipe = client.pipeline(transaction=False)
    for tenant in tenants:
        pipe.zrangebyscore(
            semantic_registry_key(tenant), now_ms - ttl_s * 1000, "+inf", withscores=True
        )
    stored: list[tuple[float, str]] = [
        (score, text(ns)) for reply in pipe.execute() for ns, score in reply
    ]
    namespaces = [ns for _, ns in sorted(stored, reverse=True)[:max_read]]
    pipe = client.pipeline(transaction=False)
    for ns in namespaces:
        pipe.hgetall(semantic_stats_key(ns))
        pipe.zcount(semantic_ids_key(ns), now_ms, "+inf")
    replies = pipe.execute() if namespaces else []

    counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    entries: Counter[tuple[str, str]] = Counter()
    members: Counter[tuple[str, str]] = Counter()
    for i, ns in enumerate(namespaces):
        tenant, model, _, _ = parse_semantic_namespace(ns)
        key = (tenant, label(model))
        raw = replies[2 * i]
        counts[key].update({f: int(raw.get(f.encode(), 0)) for f in STAT_FIELDS})
        entries[key] += int(replies[2 * i + 1])
        members[key] += 1
    rows = [NamespaceStats(*key, "", "", entries[key], dict(c)) for key, c in counts.items()]
    rows.sort(key=lambda r: (-r.lookups, r.tenant, r.model))
    return {
        "namespaces": len(namespaces),
        "rows": [
            {
                "tenant": r.tenant,
                "model": r.model,
                "namespaces": members[(r.tenant, r.model)],
                "entries": r.entries,
                "lookups": r.lookups,
                "hits": r.counts.get("hits", 0),
                "flagged": r.counts.get("flagged", 0),
                "hit_rate": r.hit_rate,
                "exploration_rate": r.exploration_rate,
                "estimated_error": r.estimated_error,
                "observed_error": r.observed_error,
            }
            for r in rows[:top]
        ],
    }
