"""One namespace's FAISS index: exact while small, inverted lists once large.

The index only proposes candidates; the cache reads each from Redis and checks it
exactly before serving it, so an index that lags (a removal not applied yet, an entry
not added yet) costs a miss at worst, never a wrong answer.

Two kinds, chosen by size when the index is built:

* ``flat``: up to :data:`FLAT_MAX` vectors, an exact inner-product search
  (``IndexFlatIP``). It reads every vector on every search: at 10,000 (15 MB) that
  was slower under load than an IVF search of 100,000 (measured, bench/semantic.py),
  hence a small bound.
* ``ivf``: above it, an inverted-file index with 8-bit scalar-quantized vectors
  (``IndexIVFScalarQuantizer``, a quarter of float32's memory): about ``2 sqrt(n)``
  lists (:func:`lists_for`), trained on :data:`TRAIN_PER_LIST` sampled vectors per
  list, searched in :data:`NPROBE` lists. On the benchmark's vectors
  (``bench/semantic.py``) that finds the exact nearest entry of every query at cosine
  0.93 or more (recall 1.0 at 100,000 and 1,000,000 entries) in well under a
  millisecond on one thread, and builds 1,000,000 vectors in about a minute on one
  core, where HNSW took half an hour. Removals are real (a hashtable maps ids to list
  positions).

An index outgrows its kind: a flat index above :data:`FLAT_MAX`, or an IVF index
holding :data:`GROWTH` times what its lists were trained for, asks for a rebuild
(:meth:`NamespaceIndex.wants_rebuild`), which :mod:`freshline.pipeline.semantic.pool` runs in
the background while this one keeps serving.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import faiss
import numpy as np

from freshline.pipeline.core.types import text
from freshline.pipeline.semantic.embed import Vectors

STREAM_RETENTION_MS = 600_000
"""How long a namespace's change stream keeps an event (trimmed by MINID on writes)."""
FLAT_MAX = 2_000
NPROBE = 32
TRAIN_PER_LIST = 40
MIN_LISTS, MAX_LISTS = 64, 4096
GROWTH = 4
TRAIN_ITERATIONS = 10

Kind = Literal["flat", "ivf"]


def lists_for(n: int) -> int:
    """Inverted lists for ``n`` vectors: the power of two nearest ``2 sqrt(n)``, bounded.

    A search scores every list's centroid, then the vectors of :data:`NPROBE` lists:
    more lists make the second part cheaper and training dearer (it grows with the
    square of the lists). ``2 sqrt(n)``: 512 lists at 100,000, 2,048 at 1,000,000.
    """
    nearest = 2 ** round(math.log2(2 * math.sqrt(max(n, 1))))
    return int(min(MAX_LISTS, max(MIN_LISTS, nearest)))


def stream_position(event_id: str) -> tuple[int, int]:
    """A stream id (``<ms>-<seq>``) as a pair that orders like the stream."""
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class NamespaceIndex:
    """The index of one namespace, the ids it holds and the stream position it reflects.

    Not thread-safe by itself: callers hold :attr:`lock` around every method that
    reads or changes the index. ``ready`` is false until a first build has filled it
    from Redis; a lookup on an index that is not ready answers a miss.
    """

    namespace: str
    dim: int
    flat_max: int = FLAT_MAX
    index: Any = None
    kind: Kind = "flat"
    trained_for: int = 0
    live: set[int] = field(default_factory=set)
    stream_id: str = "0-0"
    synced_at: float = 0.0
    ready: bool = False
    used_at: float = 0.0
    quantizer: Any = None  # an IVF index's coarse quantizer, which it does not own
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.index is None:
            self.reset()

    def __len__(self) -> int:
        return len(self.live)

    def reset(self) -> None:
        """Empty, exact."""
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        self.kind = "flat"
        self.trained_for = 0
        self.quantizer = None
        self.live = set()

    def train(self, sample: Vectors, expected: int) -> None:
        """Become an empty IVF index with lists trained on ``sample`` for about
        ``expected`` vectors. Too small a sample (fewer rows than lists) keeps it flat."""
        lists = lists_for(expected)
        if len(sample) < lists:
            self.reset()
            return
        quantizer = faiss.IndexFlatIP(self.dim)
        # Vectors are quantized as they are, not as residuals from their list's
        # centroid: as accurate here (the exact check re-ranks) and half the build.
        ivf = faiss.IndexIVFScalarQuantizer(
            quantizer,
            self.dim,
            lists,
            faiss.ScalarQuantizer.QT_8bit,
            faiss.METRIC_INNER_PRODUCT,
            False,
        )
        ivf.cp.niter = TRAIN_ITERATIONS
        ivf.cp.min_points_per_centroid = 1  # the sample is sized on purpose; no warning
        ivf.train(np.ascontiguousarray(sample, dtype=np.float32))
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]  # not in the stubs
        ivf.nprobe = min(NPROBE, lists)
        self.index, self.quantizer = ivf, quantizer
        self.kind = "ivf"
        self.trained_for = expected
        self.live = set()

    def add(self, ids: Iterable[int], vectors: Vectors) -> None:
        """Add vectors under their ids; ids already held are skipped."""
        ids = list(ids)
        keep = [i for i, e in enumerate(ids) if e not in self.live]
        if not keep:
            return
        fresh = np.asarray([ids[i] for i in keep], dtype=np.int64)
        rows = vectors if len(keep) == len(ids) else vectors[keep]
        self.index.add_with_ids(np.ascontiguousarray(rows, dtype=np.float32), fresh)
        self.live.update(int(i) for i in fresh)

    def remove(self, ids: Iterable[int]) -> None:
        gone = [e for e in ids if e in self.live]
        if gone:
            self.index.remove_ids(np.asarray(gone, dtype=np.int64))
            self.live.difference_update(gone)

    def search(self, vectors: Vectors, k: int) -> list[list[tuple[int, float]]]:
        """Per query row, up to ``k`` ``(id, approximate similarity)``, best first."""
        if not self.live:
            return [[] for _ in range(len(vectors))]
        # One OpenMP thread (a per-thread setting): a single query gains nothing from
        # more, and on a busy machine the team's spin-waiting made a 0.2 ms search take
        # 5-10 ms (measured; bench/semantic.py).
        faiss.omp_set_num_threads(1)
        scores, ids = self.index.search(
            np.ascontiguousarray(vectors, dtype=np.float32), min(k, len(self.live))
        )
        return [
            [(e, s) for e, s in zip(row_ids.tolist(), row_scores.tolist(), strict=True) if e >= 0]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]

    def take(self, other: NamespaceIndex) -> None:
        """Serve ``other``'s index from now on (a rebuild's swap)."""
        self.index, self.kind, self.trained_for = other.index, other.kind, other.trained_for
        self.quantizer = other.quantizer
        self.live, self.stream_id, self.synced_at = other.live, other.stream_id, other.synced_at
        self.ready = True

    def wants_rebuild(self, now: float) -> str | None:
        """Why this index should be rebuilt from Redis, or None.

        ``stale``: not synced for half the stream's retention, so events it never read
        may be trimmed (entries added meanwhile would be missed); the pool rebuilds it
        only if they were. ``grown``: past its
        kind's size (``flat_max``, or :data:`GROWTH` times the trained size).
        """
        if not self.ready:
            return None
        if now - self.synced_at > STREAM_RETENTION_MS / 2000:
            return "stale"
        if self.kind == "flat" and len(self.live) > self.flat_max:
            return "grown"
        if self.kind == "ivf" and len(self.live) > GROWTH * self.trained_for:
            return "grown"
        return None

    def apply(self, events: list[tuple[Any, dict[Any, Any]]]) -> int:
        """Apply stream events after this index's position; returns the adds applied.

        Events at or before the position are skipped: two lookups may read the same
        events, and a rebuild's swap may land between a lookup's read and its apply.
        """
        adds = 0
        position = stream_position(self.stream_id)
        removals: list[int] = []
        for event_id, fields in events:
            eid = text(event_id)
            if stream_position(eid) <= position:
                continue
            op = text(fields.get(b"op"))
            if op == "add":
                vector = np.frombuffer(fields[b"v"], dtype="<f4")
                if vector.shape[0] == self.dim:
                    e = int(text(fields[b"id"]), 16)
                    if removals:  # keep the stream's order: a remove, then a re-add
                        self.remove(removals)
                        removals = []
                    self.add([e], vector[None, :].astype(np.float32))
                    adds += 1
            elif op == "remove":
                removals.append(int(text(fields[b"id"]), 16))
            elif op == "purge":
                removals = []
                self.reset()
            self.stream_id = eid
        if removals:
            self.remove(removals)
        self.synced_at = time.monotonic()
        return adds
