"""This process's indexes: one per namespace, built from Redis off the request path,
within a budget of vectors.

Redis holds the truth (the entries, their ids scored by expiry, a stream of changes);
a build notes the stream's last id, reads the live ids (and trains the inverted lists
on a sample above ``flat_max``), reads the entries in chunks, applies the stream from
the noted id, and swaps the index in. Builds run at start-up (:meth:`IndexPool.warm`),
inline for a small namespace's first lookup, and otherwise one at a time in the
background; past ``max_vectors`` the least recently used index of the tenant holding
the most is dropped.

The build's order, when builds run, and the budget's fairness: docs/reading.md, "How a
worker's semantic indexes are built".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import faiss
import numpy as np
import redis

from freshline.pipeline.core.keys import semantic_entry_key, semantic_ids_key, semantic_log_key
from freshline.pipeline.core.types import text
from freshline.pipeline.semantic.embed import Vectors
from freshline.pipeline.semantic.entry import vector_bytes
from freshline.pipeline.semantic.index import (
    FLAT_MAX,
    TRAIN_PER_LIST,
    NamespaceIndex,
    lists_for,
    stream_position,
)

log = logging.getLogger(__name__)

BUILD_CHUNK = 1000
STREAM_BATCH = 10_000
INLINE_MAX = 1000
MIN_CHARGE = 1000
MAX_VECTORS = 2_000_000


class IndexPool:
    """This process's :class:`NamespaceIndex` per namespace (docs/reading.md).

    ``background`` runs the builds (one worker thread); ``flat_max`` and
    ``inline_max`` are the sizes above which an index is IVF, and built off the
    request path; ``max_vectors`` is the budget.
    """

    def __init__(
        self,
        client: redis.Redis,
        dim: int,
        background: Executor,
        *,
        max_vectors: int = MAX_VECTORS,
        flat_max: int = FLAT_MAX,
        inline_max: int = INLINE_MAX,
    ) -> None:
        self.redis = client
        self.dim = dim
        self.background = background
        self.max_vectors = max_vectors
        self.flat_max = flat_max
        self.inline_max = inline_max
        self.builds = 0
        self.dropped = 0
        self._indexes: dict[str, NamespaceIndex] = {}
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._inline = threading.Lock()
        self._closed = False
        self._rng = np.random.default_rng()

    # -- what the cache calls ------------------------------------------------------------

    def get(self, namespace: str) -> NamespaceIndex:
        """The namespace's index, ready or not (it never waits for a large build)."""
        now = time.monotonic()
        idx, pending = self._entry(namespace, now)
        if idx.ready:
            reason = None if pending else idx.wants_rebuild(now)
            if reason == "stale" and self._stream_intact(idx):
                idx.synced_at = now  # idle, but every event since is still in the stream
            elif reason:
                self.schedule(namespace)
            return idx
        if pending:
            return idx
        if int(self.redis.zcard(semantic_ids_key(namespace))) <= self.inline_max:
            with self._inline:
                if not idx.ready:
                    fresh = self.build(namespace)
                    if fresh is not None:
                        self._publish(idx, fresh)
        else:
            self.schedule(namespace)
        return idx

    def peek(self, namespace: str) -> NamespaceIndex | None:
        """The namespace's index if this process holds one; builds nothing."""
        with self._lock:
            return self._indexes.get(namespace)

    def schedule(self, namespace: str) -> bool:
        """Queue a background (re)build of ``namespace``; False if one is queued already."""
        with self._lock:
            if self._closed or namespace in self._pending:
                return False
            self._pending.add(namespace)
        try:
            self.background.submit(self._build_in_background, namespace)
        except RuntimeError:  # the executor shut down since the check: closing
            with self._lock:
                self._pending.discard(namespace)
            return False
        return True

    def warm(self, namespaces: Sequence[tuple[str, int]]) -> int:
        """Queue builds for ``(namespace, entries)``, in order, while the budget holds
        them; returns how many were queued."""
        used = 0
        queued = 0
        for namespace, entries in namespaces:
            charge = max(entries, MIN_CHARGE)
            if used and used + charge > self.max_vectors:
                break
            used += charge
            self._entry(namespace, time.monotonic())
            queued += self.schedule(namespace)
        return queued

    def drop(self, namespace: str) -> None:
        with self._lock:
            self._indexes.pop(namespace, None)

    def namespaces(self) -> list[str]:
        with self._lock:
            return sorted(self._indexes)

    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._pending)

    def close(self) -> None:
        """Stop building: a build under way stops at its next chunk."""
        with self._lock:
            self._closed = True

    # -- building ------------------------------------------------------------------------

    def build(self, namespace: str) -> NamespaceIndex | None:
        """A new index of ``namespace`` from Redis, caught up with its stream (module
        docstring, steps 1-4 but the swap); None if the pool closed meanwhile."""
        last: Any = self.redis.xrevrange(semantic_log_key(namespace), count=1)
        position = text(last[0][0]) if last else "0-0"
        now_ms = int(time.time() * 1000)
        members: Any = self.redis.zrangebyscore(semantic_ids_key(namespace), now_ms, "+inf")
        ids = np.fromiter((int(text(m), 16) for m in members), dtype=np.int64, count=len(members))
        fresh = NamespaceIndex(namespace, self.dim, flat_max=self.flat_max)
        if len(ids) > self.flat_max:
            wanted = min(len(ids), TRAIN_PER_LIST * lists_for(len(ids)))
            sample = self._rng.choice(ids, wanted, replace=False)
            _, vectors = self.load(namespace, sample)
            fresh.train(vectors, len(ids))
        for start in range(0, len(ids), BUILD_CHUNK):
            if self._closed:
                return None
            found, vectors = self.load(namespace, ids[start : start + BUILD_CHUNK])
            if found:
                fresh.add(found, vectors)
        fresh.stream_id = position
        self.catch_up(fresh)
        return fresh

    def load(self, namespace: str, ids: Sequence[int] | np.ndarray) -> tuple[list[int], Vectors]:
        """The vectors of those ``ids`` still in Redis (MGET in chunks), with their ids."""
        found: list[int] = []
        tails: list[bytes] = []
        for start in range(0, len(ids), BUILD_CHUNK):
            chunk = [int(e) for e in ids[start : start + BUILD_CHUNK]]
            raws: Any = self.redis.mget([semantic_entry_key(namespace, e) for e in chunk])
            for e, raw in zip(chunk, raws, strict=True):
                tail = vector_bytes(raw, self.dim)
                if tail is not None:
                    found.append(e)
                    tails.append(tail)
        vectors = np.frombuffer(b"".join(tails), dtype="<f4").astype(np.float32)
        return found, vectors.reshape(len(found), self.dim)

    def catch_up(self, idx: NamespaceIndex) -> int:
        """Apply the stream since the index's position; returns the adds applied."""
        adds = 0
        while True:
            reply: Any = self.redis.xread(
                {semantic_log_key(idx.namespace): idx.stream_id}, count=STREAM_BATCH
            )
            events = reply[0][1] if reply else []
            adds += idx.apply(events)
            if len(events) < STREAM_BATCH:
                return adds

    # -- helpers -------------------------------------------------------------------------

    def _entry(self, namespace: str, now: float) -> tuple[NamespaceIndex, bool]:
        with self._lock:
            idx = self._indexes.get(namespace)
            if idx is None:
                idx = self._indexes[namespace] = NamespaceIndex(
                    namespace, self.dim, flat_max=self.flat_max
                )
            idx.used_at = now
            return idx, namespace in self._pending

    def _stream_intact(self, idx: NamespaceIndex) -> bool:
        """Whether the stream still holds every event after the index's position (its
        oldest event is at or before it, or it has none left at all)."""
        first: Any = self.redis.xrange(semantic_log_key(idx.namespace), count=1)
        if not first:
            return True
        return stream_position(text(first[0][0])) <= stream_position(idx.stream_id)

    def _build_in_background(self, namespace: str) -> None:
        faiss.omp_set_num_threads(1)  # this thread's setting: leave a core to lookups
        started = time.perf_counter()
        try:
            fresh = self.build(namespace)
            if fresh is not None:
                idx, _ = self._entry(namespace, time.monotonic())
                self._publish(idx, fresh)
                log.info(
                    "semantic index %s: %d vectors (%s) built in %.1f s",
                    namespace,
                    len(fresh),
                    fresh.kind,
                    time.perf_counter() - started,
                )
        except Exception:  # a background thread has no caller to raise to
            log.exception("semantic index %s: build failed; the next lookup retries", namespace)
        finally:
            with self._lock:
                self._pending.discard(namespace)

    def _publish(self, idx: NamespaceIndex, fresh: NamespaceIndex) -> None:
        with idx.lock:
            self.catch_up(fresh)
            idx.take(fresh)
        self.builds += 1
        self._enforce_budget(keep=idx.namespace)

    def _enforce_budget(self, keep: str) -> None:
        """Drop indexes until the budget holds: each time the least recently used index
        of the tenant that holds the most, never ``keep`` (docs/reading.md, the budget)."""
        with self._lock:
            charges = {ns: max(len(i), MIN_CHARGE) for ns, i in self._indexes.items()}
            total = sum(charges.values())
            held: dict[str, int] = {}
            for ns, charge in charges.items():
                held[tenant_of(ns)] = held.get(tenant_of(ns), 0) + charge
            order = sorted(
                (n for n in charges if n != keep), key=lambda n: self._indexes[n].used_at
            )
            while total > self.max_vectors and order:
                heaviest = max({tenant_of(n) for n in order}, key=held.__getitem__)
                victim = next(n for n in order if tenant_of(n) == heaviest)
                order.remove(victim)
                del self._indexes[victim]
                total -= charges[victim]
                held[heaviest] -= charges[victim]
                self.dropped += 1


def tenant_of(namespace: str) -> str:
    """The tenant of a namespace tag ``{<tenant>:...}`` (tenants hold no ``:``)."""
    return namespace[1:].split(":", 1)[0]
