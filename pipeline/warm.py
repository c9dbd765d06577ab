"""Warming a schema version before the flip: which entities, at what rate, how.

Which entities: the hottest by recent reads (:class:`HotReads`, a sampled counter
that :class:`pipeline.client.FeatureClient` and :class:`pipeline.readthrough.ReadThrough`
feed) or every active user (:func:`active_users`). How: batches through the
set-based feature queries and the conditional store writes, under a rate limit
(:class:`Throttle`) so the database stays healthy.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from pipeline.deploy import locked
from pipeline.errors import DeployError
from pipeline.features import REGISTRY, Registry
from pipeline.keys import hot_key
from pipeline.lock import Lock
from pipeline.recompute import compute
from pipeline.store import FeatureStore
from pipeline.types import EntityRef

HOT_SAMPLE: Final = 16
HOT_TTL_S: Final = 24 * 3600


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


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
        scored = [(score, tenant, _text(entity))
                  for tenant, rows in zip(tenant_list, pipe.execute(), strict=True)
                  for entity, score in rows]
        scored.sort(key=lambda row: (-row[0], row[1], row[2]))
        return [(tenant, entity) for _, tenant, entity in scored[:n]]


def tenant_ids(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT id FROM tenants ORDER BY id")).scalars())


_ACTIVE_USERS = sa.text("""
SELECT u.tenant_id, u.id FROM users u
WHERE (u.tenant_id, u.id) > (:after_tenant, :after_id)
  AND u.tenant_id = ANY(CAST(:tenants AS text[]))
  AND EXISTS (SELECT 1 FROM transactions x
              WHERE x.tenant_id = u.tenant_id AND x.user_id = u.id
                AND x.created_at > now() - make_interval(days => :days))
ORDER BY u.tenant_id, u.id LIMIT :limit
""")


def active_users(engine: Engine, tenants: Sequence[str], *, days: int = 90,
                 batch_size: int = 500) -> Iterator[list[tuple[str, str]]]:
    """Every user with a transaction in the last ``days``, in keyset-paged batches."""
    after: tuple[str, int] = ("", -1)
    while True:
        with engine.connect() as conn:
            rows = conn.execute(_ACTIVE_USERS, {
                "after_tenant": after[0], "after_id": after[1], "tenants": list(tenants),
                "days": days, "limit": batch_size}).all()
        if not rows:
            return
        yield [(t, str(u)) for t, u in rows]
        after = (rows[-1][0], int(rows[-1][1]))


@dataclass(slots=True)
class WarmResult:
    entities: int = 0
    written: int = 0
    batches: int = 0


class Throttle:
    """Keeps a loop under ``rate`` items per second by sleeping between batches."""

    def __init__(self, rate: float | None, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.started = clock()
        self.done = 0

    def add(self, items: int) -> None:
        self.done += items
        if self.rate:
            ahead = self.done / self.rate - (self.clock() - self.started)
            if ahead > 0:
                self.sleep(ahead)


def warm(client: redis.Redis, engine: Engine, version: int, feature_set: str,
         batches: Iterable[Sequence[tuple[str, str]]], lock: Lock, *,
         registry: Registry = REGISTRY, rate: float | None = None,
         progress: Callable[[int], None] | None = None) -> WarmResult:
    """Compute ``feature_set`` for each batch of (tenant, entity) and write it to ``version``.

    One set-based query per batch, then conditional writes (an entry a consumer wrote
    from a newer snapshot is kept). ``rate`` caps entities per second.
    """
    locked(lock, version, "warm")
    if not lock.compatible(version, registry, feature_set):
        raise DeployError(f"this code's {feature_set!r} differs from schema version "
                          f"{version}'s lock entry; warm it with the code of that version")
    store = FeatureStore(client, version, registry=registry)
    throttle = Throttle(rate)
    result = WarmResult()
    for refs in batches:
        written = store.write(compute(engine, registry[feature_set], refs))
        result.entities += len(refs)
        result.written += written.written
        result.batches += 1
        if progress is not None:
            progress(result.entities)
        throttle.add(len(refs))
    return result


def count_active_users(engine: Engine, tenants: Sequence[str], *, days: int = 90) -> int:
    """How many users :func:`active_users` yields, for a progress bar's total."""
    query = _ACTIVE_USERS.text.split("ORDER BY")[0].replace(
        "SELECT u.tenant_id, u.id", "SELECT count(*)")
    with engine.connect() as conn:
        return int(conn.execute(sa.text(query), {
            "after_tenant": "", "after_id": -1, "tenants": list(tenants), "days": days,
        }).scalar_one())
