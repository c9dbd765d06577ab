"""Hot-read sampling: which entities readers ask for most, so a deploy warms them first.

Reads are sampled (one in ``sample``, each independently: the gaps between sampled
reads are drawn from the geometric distribution, one random number per sampled read
rather than per read) into memory and flushed to Redis in one pipelined round trip, by a
background thread every ``flush_s`` (the API and the following client), so sampling
adds no round trip to a read; without ``flush_s`` each :meth:`HotReads.record` flushes
at once. Each flush trims every sorted set it touched to its ``max_entities``
highest scores, so ids that readers make up cannot grow a set without bound.

Each sorted set is counted, trimmed and given its TTL by one script call: a flush cut
short (the process killed, the connection dropped mid-pipeline) never leaves a set
that a count created without its TTL.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import redis

from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.keys import hot_key
from freshline.pipeline.core.types import EntityRef, text

HOT_SAMPLE: Final = 16
HOT_TTL_S: Final = 24 * 3600
HOT_MAX_ENTITIES: Final = 10_000

# KEYS[1] one sorted set; ARGV[1] TTL in seconds, ARGV[2] how many entities it keeps,
# then (score, entity) pairs to add. Atomic, so the set never exists without its TTL.
_COUNT_LUA: Final = """
for i = 3, #ARGV, 2 do redis.call('ZINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[2]) - 1)
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

log = logging.getLogger(__name__)

_Set = tuple[int, str, str]  # (schema version, feature set, tenant): one sorted set


class HotReads:
    """Sampled read counts per entity: one read in ``sample`` is counted.

    Counts go to ``hot:<version>:<feature_set>:<tenant>`` (a sorted set whose TTL is
    renewed on each flush), weighted by ``sample`` so the scores estimate reads; each
    set keeps its ``max_entities`` highest scores. With ``flush_s`` the counts gather
    in memory and a daemon thread flushes them; :meth:`close` stops it after a last
    flush.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        sample: int = HOT_SAMPLE,
        ttl_s: int = HOT_TTL_S,
        max_entities: int = HOT_MAX_ENTITIES,
        flush_s: float | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if sample < 1:
            raise ValueError(f"sample must be at least 1, got {sample}")
        if max_entities < 1:
            raise ValueError(f"max_entities must be at least 1, got {max_entities}")
        if flush_s is not None and flush_s <= 0:
            raise ValueError(f"flush_s must be positive, got {flush_s}")
        self.redis = client
        self.sample = sample
        self.ttl_s = ttl_s
        self.max_entities = max_entities
        self.flush_s = flush_s
        self.rng = rng
        self._log_skip = math.log1p(-1 / sample) if sample > 1 else 0.0
        self._skip = self._gap()  # reads to pass over before the next sampled one
        self._pending: defaultdict[_Set, Counter[str]] = defaultdict(Counter)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self, version: int, refs: Sequence[EntityRef]) -> None:
        """Count a sample of ``refs``; no Redis call when flushing in the background.

        Only the sampled positions of ``refs`` are read (it may build them lazily).
        """
        n = len(refs)
        sample = self.sample
        with self._lock:
            at = self._skip
            if at >= n:
                self._skip = at - n
                return
            while at < n:
                ref = refs[at]
                self._pending[(version, ref.feature_set, ref.tenant)][ref.entity] += sample
                at += 1 + self._gap()
            self._skip = at - n
        if self.flush_s is None:
            self.flush()
        elif self._thread is None:
            self._start()

    def _gap(self) -> int:
        """Reads to pass over before the next sampled one: geometric with p = 1/sample."""
        if self.sample == 1:
            return 0
        return int(math.log(1.0 - self.rng()) / self._log_skip)

    def flush(self) -> None:
        """Write the counts gathered so far, in one pipelined round trip."""
        with self._lock:
            pending, self._pending = self._pending, defaultdict(Counter)
        if not pending:
            return
        pipe = self.redis.pipeline(transaction=False)
        for (version, feature_set, tenant), counts in pending.items():
            try:
                key = hot_key(version, feature_set, tenant)
            except InvalidId:  # a read that was refused: nothing to count
                continue
            pairs = [arg for entity, score in counts.items() for arg in (score, entity)]
            # EVAL, not EVALSHA: no NOSCRIPT to handle after a restart, for a few hundred
            # bytes a second; execute_command, as a cluster pipeline refuses eval().
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "EVAL", _COUNT_LUA, 1, key, self.ttl_s, self.max_entities, *pairs
            )
        pipe.execute()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._run, name="freshline-hot-reads", daemon=True
            )
        self._thread.start()

    def _run(self) -> None:
        interval = self.flush_s or 1.0
        while not self._stop.wait(interval):
            self._flush_logged()

    def _flush_logged(self) -> None:
        try:
            self.flush()
        except (redis.RedisError, OSError) as exc:
            # A sample, not a record: losing one interval's counts only blurs the ranking.
            log.warning("hot-read counts not flushed (%s); dropped", exc)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the flushing thread, then flush what is left."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._flush_logged()

    def top(
        self, version: int, feature_set: str, tenants: Iterable[str], n: int
    ) -> list[tuple[str, str]]:
        """The ``n`` most-read (tenant, entity) pairs of ``feature_set`` across ``tenants``."""
        tenant_list = list(tenants)
        pipe = self.redis.pipeline(transaction=False)
        for tenant in tenant_list:
            pipe.zrevrange(hot_key(version, feature_set, tenant), 0, n - 1, withscores=True)
        scored = [
            (score, tenant, text(entity))
            for tenant, rows in zip(tenant_list, pipe.execute(), strict=True)
            for entity, score in rows
        ]
        scored.sort(key=lambda row: (-row[0], row[1], row[2]))
        return [(tenant, entity) for _, tenant, entity in scored[:n]]
