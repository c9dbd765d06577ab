"""Warming a schema version before the flip: which entities, at what rate, how.

Which entities: the hottest by recent reads (:class:`~pipeline.cache.hot.HotReads`,
a sampled counter that the client and the read-through feed) or every active user
(:func:`active_users`). How: batches through the set-based feature queries and the
conditional store writes, under a rate limit (:class:`Throttle`) so the database
stays healthy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from pipeline.cache.recompute import compute
from pipeline.cache.store import FeatureStore
from pipeline.core.errors import DeployError
from pipeline.core.features import Registry
from pipeline.core.lock import Lock
from pipeline.core.repository import REGISTRY
from pipeline.deploy.pointer import locked


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


def active_users(
    engine: Engine, tenants: Sequence[str], *, days: int = 90, batch_size: int = 500
) -> Iterator[list[tuple[str, str]]]:
    """Every user with a transaction in the last ``days``, in keyset-paged batches."""
    after: tuple[str, int] = ("", -1)
    while True:
        with engine.connect() as conn:
            rows = conn.execute(
                _ACTIVE_USERS,
                {
                    "after_tenant": after[0],
                    "after_id": after[1],
                    "tenants": list(tenants),
                    "days": days,
                    "limit": batch_size,
                },
            ).all()
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

    def __init__(
        self,
        rate: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.started = clock()
        self.done = 0

    def add(self, items: int) -> None:
        self.done += items
        if self.rate:
            ahead = self.done / self.rate - (self.clock() - self.started)
            if ahead > 0:
                self.sleep(ahead)


def warm(
    client: redis.Redis,
    engine: Engine,
    version: int,
    feature_set: str,
    batches: Iterable[Sequence[tuple[str, str]]],
    lock: Lock,
    *,
    registry: Registry = REGISTRY,
    rate: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> WarmResult:
    """Compute ``feature_set`` for each batch of (tenant, entity) and write it to ``version``.

    One set-based query per batch, then conditional writes (an entry a consumer wrote
    from a newer snapshot is kept). ``rate`` caps entities per second.
    """
    locked(lock, version, "warm")
    if not lock.compatible(version, registry, feature_set):
        raise DeployError(
            f"this code's {feature_set!r} differs from schema version "
            f"{version}'s lock entry; warm it with the code of that version"
        )
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
        "SELECT u.tenant_id, u.id", "SELECT count(*)"
    )
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(query),
                {
                    "after_tenant": "",
                    "after_id": -1,
                    "tenants": list(tenants),
                    "days": days,
                },
            ).scalar_one()
        )
