"""Hot-read sampling: which entities readers ask for most, so a deploy warms them first."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import redis

from pipeline.core.keys import hot_key
from pipeline.core.types import EntityRef, text

HOT_SAMPLE: Final = 16
HOT_TTL_S: Final = 24 * 3600


class HotReads:
    """Sampled read counts per entity: one read in ``sample`` does a ZINCRBY.

    Counts go to ``hot:<version>:<feature_set>:<tenant>`` (a sorted set whose TTL is
    renewed on each sample), weighted by ``sample`` so the scores estimate reads.
    """

    def __init__(self, client: redis.Redis, *, sample: int = HOT_SAMPLE,
                 ttl_s: int = HOT_TTL_S, rng: Callable[[], float] = random.random) -> None:
        if sample < 1:
            raise ValueError(f"sample must be at least 1, got {sample}")
        self.redis = client
        self.sample = sample
        self.ttl_s = ttl_s
        self.rng = rng

    def record(self, version: int, refs: Sequence[EntityRef]) -> None:
        picked = [r for r in refs if self.sample == 1 or self.rng() * self.sample < 1]
        if not picked:
            return
        pipe = self.redis.pipeline(transaction=False)
        keys: set[str] = set()
        for ref in picked:
            key = hot_key(version, ref.feature_set, ref.tenant)
            pipe.zincrby(key, self.sample, ref.entity)
            keys.add(key)
        for key in keys:
            pipe.expire(key, self.ttl_s)
        pipe.execute()

    def top(self, version: int, feature_set: str, tenants: Iterable[str],
            n: int) -> list[tuple[str, str]]:
        """The ``n`` most-read (tenant, entity) pairs of ``feature_set`` across ``tenants``."""
        tenant_list = list(tenants)
        pipe = self.redis.pipeline(transaction=False)
        for tenant in tenant_list:
            pipe.zrevrange(hot_key(version, feature_set, tenant), 0, n - 1, withscores=True)
        scored = [(score, tenant, text(entity))
                  for tenant, rows in zip(tenant_list, pipe.execute(), strict=True)
                  for entity, score in rows]
        scored.sort(key=lambda row: (-row[0], row[1], row[2]))
        return [(tenant, entity) for _, tenant, entity in scored[:n]]
