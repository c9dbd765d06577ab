"""One FAISS index per namespace per process, built from Redis and kept in step by a stream.

Redis holds the truth: the entries (``sem:e:...``), their ids scored by expiry
(``sem:ids:...``) and a stream of changes (``sem:log:...``: ``add`` with the vector,
``remove``, ``purge``). A process builds a namespace's index the first time it is
asked for one:

1. note the stream's last id (later changes will be replayed, harmlessly: adds of a
   live id and removals of an absent one are no-ops);
2. read the live ids (``ZRANGE ... BYSCORE now +inf``) and their entries (``MGET`` in
   chunks), and add their vectors;
3. from then on, apply the stream from the noted id.

The index only proposes candidates: a removed or expired entry that the index still
holds is caught when the cache reads the entry from Redis before serving it. HNSW
cannot delete, so a removal hides the id; once hidden ids are a quarter of the index,
the next :meth:`SemanticIndexes.get` rebuilds it. The stream keeps
:data:`STREAM_RETENTION_MS` of history; an index not synced for half that is rebuilt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np
import redis

from pipeline.core.keys import semantic_entry_key, semantic_ids_key, semantic_log_key
from pipeline.core.types import text
from pipeline.semantic.embed import Vectors
from pipeline.semantic.entry import CorruptSemanticEntry, decode

STREAM_RETENTION_MS = 600_000
HNSW_M = 32
EF_CONSTRUCTION = 80
EF_SEARCH = 64
BUILD_CHUNK = 1000
REBUILD_HIDDEN_SHARE = 0.25


@dataclass
class NamespaceIndex:
    """The FAISS index of one namespace and the stream position it reflects."""

    namespace: str
    dim: int
    index: Any = None
    live: set[int] = field(default_factory=set)
    stream_id: str = "0-0"
    synced_at: float = 0.0
    hidden: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        hnsw = faiss.IndexHNSWFlat(self.dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = EF_CONSTRUCTION
        hnsw.hnsw.efSearch = EF_SEARCH
        self.index = faiss.IndexIDMap2(hnsw)
        self.live = set()
        self.hidden = 0

    def __len__(self) -> int:
        return len(self.live)

    def add(self, ids: Iterable[int], vectors: Vectors) -> None:
        """Add vectors under their ids; ids already live are skipped."""
        ids = list(ids)
        keep = [i for i, e in enumerate(ids) if e not in self.live]
        if not keep:
            return
        fresh = np.asarray([ids[i] for i in keep], dtype=np.int64)
        self.index.add_with_ids(np.ascontiguousarray(vectors[keep], dtype=np.float32), fresh)
        self.live.update(int(i) for i in fresh)

    def remove(self, entry: int) -> None:
        if entry in self.live:
            self.live.discard(entry)
            self.hidden += 1

    def search(self, vectors: Vectors, k: int) -> list[list[tuple[int, float]]]:
        """Per query row, up to ``k`` live ``(id, approximate similarity)``, best first."""
        if not self.live:
            return [[] for _ in range(len(vectors))]
        # Over-fetch a little for hidden (removed) ids, never by their number: a search
        # for thousands of neighbours would cost more than the rebuild that clears them.
        wanted = min(k + min(self.hidden, 3 * k), len(self.live) + self.hidden)
        # One OpenMP thread (a per-thread setting): a single query gains nothing from
        # more, and on a busy machine the team's spin-waiting made a 0.2 ms search take
        # 5-10 ms (measured; bench/semantic.py).
        faiss.omp_set_num_threads(1)
        scores, ids = self.index.search(np.ascontiguousarray(vectors, dtype=np.float32),
                                        max(1, wanted))
        out: list[list[tuple[int, float]]] = []
        for row_ids, row_scores in zip(ids, scores, strict=True):
            seen: list[tuple[int, float]] = []
            for e, s in zip(row_ids.tolist(), row_scores.tolist(), strict=True):
                if e >= 0 and e in self.live and all(e != x for x, _ in seen):
                    seen.append((e, s))
                    if len(seen) == k:
                        break
            out.append(seen)
        return out

    def needs_rebuild(self, now: float) -> bool:
        total = len(self.live) + self.hidden
        stale = now - self.synced_at > STREAM_RETENTION_MS / 2000
        return stale or (total > 0 and self.hidden > REBUILD_HIDDEN_SHARE * total)


def apply_events(idx: NamespaceIndex, events: list[tuple[Any, dict[Any, Any]]]) -> int:
    """Apply stream entries to ``idx``; returns how many adds there were."""
    adds = 0
    for event_id, fields in events:
        op = text(fields.get(b"op"))
        if op == "add":
            vector = np.frombuffer(fields[b"v"], dtype="<f4").astype(np.float32)
            if vector.shape[0] == idx.dim:
                idx.add([int(text(fields[b"id"]), 16)], vector[None, :])
                adds += 1
        elif op == "remove":
            idx.remove(int(text(fields[b"id"]), 16))
        elif op == "purge":
            idx.reset()
        idx.stream_id = text(event_id)
    return adds


class SemanticIndexes:
    """This process's indexes, one per namespace, built on first use."""

    def __init__(self, client: redis.Redis, dim: int) -> None:
        self.redis = client
        self.dim = dim
        self._indexes: dict[str, NamespaceIndex] = {}
        self._lock = threading.Lock()
        self.builds = 0

    def get(self, namespace: str) -> NamespaceIndex:
        """The namespace's index, built (or rebuilt when stale) from Redis."""
        with self._lock:
            idx = self._indexes.get(namespace)
            if idx is None:
                idx = self._indexes[namespace] = NamespaceIndex(namespace, self.dim)
        if idx.synced_at == 0.0 or idx.needs_rebuild(time.monotonic()):
            with idx.lock:
                if idx.synced_at == 0.0 or idx.needs_rebuild(time.monotonic()):
                    self.build(idx)
        return idx

    def drop(self, namespace: str) -> None:
        with self._lock:
            self._indexes.pop(namespace, None)

    def namespaces(self) -> list[str]:
        with self._lock:
            return sorted(self._indexes)

    def build(self, idx: NamespaceIndex) -> None:
        """Rebuild ``idx`` from Redis (module docstring, steps 1-3). Call with its lock."""
        ns = idx.namespace
        last: Any = self.redis.xrevrange(semantic_log_key(ns), count=1)
        stream_id = text(last[0][0]) if last else "0-0"
        now_ms = int(time.time() * 1000)
        members: Any = self.redis.zrangebyscore(semantic_ids_key(ns), now_ms, "+inf")
        ids = [int(text(m), 16) for m in members]
        idx.reset()
        for start in range(0, len(ids), BUILD_CHUNK):
            chunk = ids[start:start + BUILD_CHUNK]
            raws: Any = self.redis.mget([semantic_entry_key(ns, e) for e in chunk])
            found: list[int] = []
            vectors: list[Vectors] = []
            for e, raw in zip(chunk, raws, strict=True):
                if raw is None:
                    continue
                try:
                    vector = decode(raw).vector
                except CorruptSemanticEntry:
                    continue
                if vector.shape[0] == idx.dim:
                    found.append(e)
                    vectors.append(vector)
            if found:
                idx.add(found, np.stack(vectors))
        idx.stream_id = stream_id
        idx.synced_at = time.monotonic()
        self.builds += 1
        self.catch_up(idx)

    def catch_up(self, idx: NamespaceIndex) -> int:
        """Apply the stream since the index's position; returns the adds applied."""
        adds = 0
        while True:
            reply: Any = self.redis.xread({semantic_log_key(idx.namespace): idx.stream_id},
                                     count=10_000)
            events = reply[0][1] if reply else []
            adds += apply_events(idx, events)
            idx.synced_at = time.monotonic()
            if len(events) < 10_000:
                return adds
