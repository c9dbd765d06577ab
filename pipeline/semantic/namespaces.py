"""Namespaces in Redis: their bounds, their eviction, purge and stats.

A namespace is ``{<tenant>:<model>:<model_version>:<template_version>}``; its keys are
the entries ``sem:e:<ns>:<id>``, the ids scored by expiry ``sem:ids:<ns>``, the change
stream ``sem:log:<ns>``, the counters ``sem:stats:<ns>``, each entry's labelled
outcomes ``sem:o:<ns>:<id>`` and the explorations awaiting their store ``sem:x:<ns>``
(:mod:`freshline.pipeline.semantic.feedback`). Each tenant's namespaces are listed in
``sem:ns:<tenant>``, scored by their last store.

Bounds (:class:`Limits`), all enforced when a response is stored:

* **Entries per namespace** (``max_entries``, or the model's own): past it, the
  namespace's oldest stored entries are evicted (``ZPOPMIN`` on the expiry-scored
  ids: storing a prompt again makes it young), their keys (and outcomes) unlinked and
  a ``remove``
  written to the stream for every worker.
* **Namespaces per tenant** (``max_namespaces``): storing into one more purges the
  namespace the tenant stored into least recently, typically an old model or
  template version. A namespace whose last store is older than the TTL has expired
  and no longer counts.
* **Bytes and entries per tenant** (``FRESHLINE_SEMANTIC_TENANT_MAX_BYTES`` and
  ``_MAX_KEYS``, with a :class:`freshline.pipeline.core.budget.TenantBudget` in
  ``sem:_own:{<tenant>}`` and ``sem:_bytes:{<tenant>}``): past it, the tenant's oldest
  entries in any of its namespaces are evicted (:func:`evict_entries`,
  :mod:`freshline.pipeline.semantic.stores`).
* **Time**: every key has a TTL (``FRESHLINE_SEMANTIC_TTL_S``), extended by stores.

Only a store makes a namespace: lookups and flags write their counters, their
``remove`` and their explorations only where it exists.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import redis

from freshline.pipeline.core.keys import (
    parse_semantic_namespace,
    semantic_budget_keys,
    semantic_entry_key,
    semantic_ids_key,
    semantic_log_key,
    semantic_outcomes_key,
    semantic_pattern,
    semantic_probes_key,
    semantic_registry_key,
    semantic_stats_key,
)
from freshline.pipeline.core.types import text
from freshline.pipeline.semantic.entry import InvalidPrompt
from freshline.pipeline.semantic.index import STREAM_RETENTION_MS

STAT_FIELDS = (
    "hits",
    "misses",
    "stored",
    "flagged",
    "refused",
    "evicted",
    "explored",
    "audited",
    "right",
    "wrong",
    "audit_right",
    "audit_wrong",
    "scored",
    "risk_ppm",
)
"""The counters of ``sem:stats``. ``explored``: misses that named a candidate to label
(``audited`` of them would have been hits); ``right`` and ``wrong``: the labels their
stores gave (``audit_right``, ``audit_wrong``: those of audits); ``scored``: hits
served with an estimated error (by the learned decision), ``risk_ppm``: those
estimates summed, in millionths."""


@dataclass(frozen=True, slots=True)
class Limits:
    """How much the cache keeps per namespace and per tenant (module docstring)."""

    max_entries: int = 200_000
    max_entries_per_model: Mapping[str, int] = field(default_factory=dict)
    max_namespaces: int = 16

    def entries_for(self, model: str) -> int:
        return self.max_entries_per_model.get(model, self.max_entries)


def trim_minid(now_ms: int) -> str:
    """The MINID that trims a change stream to :data:`STREAM_RETENTION_MS`."""
    return str(now_ms - STREAM_RETENTION_MS)


def evict_oldest(client: redis.Redis, namespace: str, count: int, ttl_ms: int) -> int:
    """Evict the ``count`` oldest stored entries of ``namespace``; returns how many."""
    # Out of the id set first: a build never reads them again.
    popped: Any = client.zpopmin(semantic_ids_key(namespace), count)
    _unlink_entries(client, namespace, [int(text(m), 16) for m, _ in popped], ttl_ms)
    return len(popped)


def evict_entries(client: redis.Redis, keys: Iterable[str], ttl_ms: int) -> Counter[str]:
    """Evict the entries whose keys are ``keys`` (those its tenant's budget popped),
    as :func:`evict_oldest` does: out of their id sets first, then their keys and
    outcomes unlinked and a ``remove`` on each stream. Returns how many of them were
    still in their id sets, per namespace."""
    by_namespace: dict[str, list[int]] = {}
    for key in keys:
        by_namespace.setdefault(namespace_of(key), []).append(int(key.rpartition(":")[2], 16))
    evicted: Counter[str] = Counter()
    for ns, ids in by_namespace.items():
        evicted[ns] = int(client.zrem(semantic_ids_key(ns), *[f"{e:016x}" for e in ids]))
        _unlink_entries(client, ns, ids, ttl_ms)
    return evicted


def _unlink_entries(client: redis.Redis, namespace: str, ids: list[int], ttl_ms: int) -> None:
    if not ids:
        return
    log_key = semantic_log_key(namespace)
    minid = trim_minid(int(time.time() * 1000))
    pipe = client.pipeline(transaction=True)  # the stream's TTL with its write
    pipe.unlink(*[semantic_entry_key(namespace, e) for e in ids])
    pipe.unlink(*[semantic_outcomes_key(namespace, e) for e in ids])
    for e in ids:
        # NOMKSTREAM: a namespace whose stream has gone has no index to tell.
        pipe.xadd(
            log_key,
            {"op": "remove", "id": f"{e:016x}"},
            minid=minid,
            approximate=True,
            nomkstream=True,
        )
    pipe.pexpire(log_key, ttl_ms)
    pipe.execute()


def evict_namespaces(client: redis.Redis, tenant: str, keep: int) -> list[str]:
    """Purge the tenant's namespaces stored into least recently, until ``keep`` are left.

    The registry entry goes last, so an interrupted eviction is finished by the next.
    Returns the namespaces purged.
    """
    registry = semantic_registry_key(tenant)
    members: Any = client.zrange(registry, 0, -1)
    victims = [text(m) for m in members[: max(0, len(members) - keep)]]
    for ns in victims:
        purge_namespace(client, ns)
        client.zrem(registry, ns)
    return victims


def purge_namespace(client: redis.Redis, namespace: str, batch: int = 500) -> int:
    """Remove one namespace's keys, walking its id set in batches (no keyspace SCAN),
    then tell every worker through a ``purge`` on its stream. Returns the keys removed."""
    ids_key = semantic_ids_key(namespace)
    removed = 0
    while True:
        members: Any = client.zrange(ids_key, 0, batch - 1)
        if not members:
            break
        ids = [int(text(m), 16) for m in members]
        pipe = client.pipeline(transaction=False)
        pipe.unlink(*[semantic_entry_key(namespace, e) for e in ids])
        pipe.unlink(*[semantic_outcomes_key(namespace, e) for e in ids])
        pipe.zrem(ids_key, *members)
        replies = pipe.execute()
        removed += int(replies[0]) + int(replies[1])
    removed += int(
        client.unlink(
            ids_key,
            semantic_stats_key(namespace),
            semantic_probes_key(namespace),
            semantic_outcomes_key(namespace, 0),  # the template pairs (feedback.PAIRS_ID)
        )
    )
    _announce_purges(client, [namespace])
    return removed


class Purge(TypedDict, total=False):
    """The keyword arguments of :func:`purge_keys` after the client."""

    tenant: str | None
    model: str | None
    model_version: str | None
    template_version: str | None
    batch: int


def purge_keys(
    client: redis.Redis,
    *,
    tenant: str | None = None,
    model: str | None = None,
    model_version: str | None = None,
    template_version: str | None = None,
    batch: int = 500,
) -> dict[str, int]:
    """Remove every key of the matching namespaces (SCAN + UNLINK in batches).

    A tenant, a model version or a template version must be given (a model alone
    narrows). Each namespace's stream then carries a ``purge``, so every process
    empties its index, and the namespace leaves its tenant's registry. Returns the
    keys removed per namespace. Safe to interrupt and run again.
    """
    if not (tenant or model_version or template_version):
        raise InvalidPrompt("purge needs a tenant, a model version or a template version")
    pattern = semantic_pattern(tenant, model, model_version, template_version)
    removed: Counter[str] = Counter()
    keys: list[bytes] = []
    for key in client.scan_iter(match=pattern, count=batch):
        removed[namespace_of(text(key))] += 1
        keys.append(key)
        if len(keys) >= batch:
            client.unlink(*keys)
            keys.clear()
    if keys:
        client.unlink(*keys)
    if tenant and not (model or model_version or template_version):
        # The whole tenant: its budget's count goes with its entries.
        client.unlink(*semantic_budget_keys(tenant))
    _announce_purges(client, list(removed))
    return dict(removed)


def _announce_purges(client: redis.Redis, namespaces: list[str]) -> None:
    if not namespaces:
        return
    minid = trim_minid(int(time.time() * 1000))
    for ns in namespaces:  # one transaction each: a stream and its TTL, in one slot
        pipe = client.pipeline(transaction=True)
        pipe.xadd(semantic_log_key(ns), {"op": "purge"}, minid=minid, approximate=True)
        pipe.pexpire(semantic_log_key(ns), STREAM_RETENTION_MS)
        pipe.execute()
    pipe = client.pipeline(transaction=False)
    for ns in namespaces:
        pipe.zrem(semantic_registry_key(parse_semantic_namespace(ns)[0]), ns)
    pipe.execute()


def namespace_of(key: str) -> str:
    start = key.index("{")
    return key[start : key.index("}", start) + 1]


def live_namespaces(client: redis.Redis) -> list[tuple[str, int]]:
    """Every namespace with live entries and their number, most recently stored first."""
    now_ms = int(time.time() * 1000)
    namespaces = sorted(
        {
            namespace_of(text(k))
            for k in client.scan_iter(match=semantic_pattern(kind="ids"), count=1000)
        }
    )
    if not namespaces:
        return []
    pipe = client.pipeline(transaction=False)
    for ns in namespaces:
        pipe.zcount(semantic_ids_key(ns), now_ms, "+inf")
        pipe.zscore(semantic_registry_key(parse_semantic_namespace(ns)[0]), ns)
    replies = pipe.execute()
    rows = [
        (ns, int(replies[2 * i]), float(replies[2 * i + 1] or 0)) for i, ns in enumerate(namespaces)
    ]
    rows.sort(key=lambda r: (-r[2], -r[1]))
    return [(ns, n) for ns, n, _ in rows if n > 0]


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    tenant: str
    model: str
    model_version: str
    template_version: str
    entries: int
    counts: dict[str, int]

    @property
    def lookups(self) -> int:
        return self.counts.get("hits", 0) + self.counts.get("misses", 0)

    @property
    def hit_rate(self) -> float | None:
        return self.counts.get("hits", 0) / self.lookups if self.lookups else None

    @property
    def exploration_rate(self) -> float | None:
        """Lookups answered as a miss that named a candidate to label."""
        return self.counts.get("explored", 0) / self.lookups if self.lookups else None

    @property
    def estimated_error(self) -> float | None:
        """The mean estimated error of the hits served: what the decision expected."""
        scored = self.counts.get("scored", 0)
        return self.counts.get("risk_ppm", 0) / 1e6 / scored if scored else None

    @property
    def observed_error(self) -> float | None:
        """Flags over hits: the wrong answers callers reported."""
        hits = self.counts.get("hits", 0)
        return self.counts.get("flagged", 0) / hits if hits else None

    @property
    def audited_error(self) -> float | None:
        """Wrong labels over labelled audits: the error of would-be hits, measured.
        Audits are drawn most often near the bound, so this leans high."""
        done = self.counts.get("audit_right", 0) + self.counts.get("audit_wrong", 0)
        return self.counts.get("audit_wrong", 0) / done if done else None


def stats(
    client: redis.Redis, tenant: str | None = None, model: str | None = None
) -> list[NamespaceStats]:
    """Live entries and counters per namespace (SCAN of the id sets, never KEYS)."""
    now_ms = int(time.time() * 1000)
    out: list[NamespaceStats] = []
    namespaces: set[str] = set()
    for kind in ("ids", "stats"):
        for key in client.scan_iter(match=semantic_pattern(tenant, model, kind=kind), count=500):
            namespaces.add(namespace_of(text(key)))
    for ns in sorted(namespaces):
        entries = int(client.zcount(semantic_ids_key(ns), now_ms, "+inf"))
        raw = client.hgetall(semantic_stats_key(ns))
        counts = {f: int(raw.get(f.encode(), 0)) for f in STAT_FIELDS}
        out.append(NamespaceStats(*parse_semantic_namespace(ns), entries=entries, counts=counts))
    return out
