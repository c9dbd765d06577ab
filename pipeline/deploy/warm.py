"""Warming a schema version before the flip: which entities, at what rate, how.

Which entities: the hottest by recent reads (:class:`~freshline.pipeline.cache.hot.HotReads`,
a sampled counter that the client and the read-through feed) or every active entity
(:func:`active_entities`, by the entity's ``active`` condition). How: batches through
the set-based feature queries and the conditional store writes, under a rate limit
(:class:`Throttle`) so the database stays healthy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.cache.recompute import Batch, compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.errors import DeployError
from freshline.pipeline.core.features import IMPLICIT_TENANT, Entity, Registry
from freshline.pipeline.core.lock import Lock
from freshline.pipeline.deploy.pointer import locked


def tenant_ids(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT id FROM freshline.tenants ORDER BY id")).scalars())


def _active(entity: Entity, tenants: Sequence[str], *, count: bool = False) -> sa.TextClause:
    if entity.table is None:
        raise DeployError(
            f"entity {entity.name!r} declares no table to list its entities from; "
            "warm with --top N instead"
        )
    key = entity.table_key or entity.key
    cols = [f"e.{entity.tenant}", f"e.{key}"] if entity.tenant else [f"e.{key}"]
    after = (
        f"(:after_tenant, CAST(:after_id AS {entity.type}))"
        if entity.tenant
        else f"CAST(:after_id AS {entity.type})"
    )
    where = [f"(CAST(:after_id AS text) IS NULL OR ({', '.join(cols)}) > {after})"]
    if entity.tenant:
        where.append(f"e.{entity.tenant} = ANY(CAST(:tenants AS text[]))")
    if entity.active:
        where.append(f"({entity.active})")
    select = "count(*)" if count else ", ".join(cols)
    order = "" if count else f" ORDER BY {', '.join(cols)} LIMIT :limit"
    return sa.text(f"SELECT {select} FROM {entity.table} e WHERE {' AND '.join(where)}{order}")


def active_entities(
    engine: Engine, entity: Entity, tenants: Sequence[str], *, batch_size: int = 500
) -> Iterator[list[tuple[str, str]]]:
    """Every entity its ``active`` condition selects (every row of its table when it
    declares none), of ``tenants``, in keyset-paged batches."""
    query = _active(entity, tenants)
    after: tuple[str, object] = ("", None)
    while True:
        with engine.connect() as conn:
            rows = conn.execute(
                query,
                {
                    "after_tenant": after[0],
                    "after_id": after[1],
                    "tenants": list(tenants),
                    "limit": batch_size,
                },
            ).all()
        if not rows:
            return
        if entity.tenant:
            yield [(t, str(k)) for t, k in rows]
            after = (rows[-1][0], rows[-1][1])
        else:
            yield [(IMPLICIT_TENANT, str(k)) for (k,) in rows]
            after = ("", rows[-1][0])


def count_active(engine: Engine, entity: Entity, tenants: Sequence[str]) -> int:
    """How many entities :func:`active_entities` yields, for a progress bar's total."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                _active(entity, tenants, count=True),
                {"after_tenant": "", "after_id": None, "tenants": list(tenants)},
            ).scalar_one()
        )


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
    registry: Registry,
    rate: float | None = None,
    progress: Callable[[int], None] | None = None,
    guard: Callable[[], None] | None = None,
    on_computed: Callable[[Sequence[Batch]], None] | None = None,
) -> WarmResult:
    """Compute ``feature_set`` for each batch of (tenant, entity) and write it to ``version``.

    One set-based query per batch, then conditional writes (an entry a consumer wrote
    from a newer snapshot is kept). ``rate`` caps entities per second. ``guard`` runs
    before each batch and raises to stop: the command passes
    :func:`freshline.pipeline.deploy.pointer.writing`, so a warm stops once its deploy is
    cancelled and writes nothing the consumers do not keep fresh. ``on_computed`` gets
    each computation before its entries are written (history keeps their snapshot).
    """
    locked(lock, version, "warm")
    if not lock.compatible(version, registry, feature_set):
        raise DeployError(
            f"this code's {feature_set!r} differs from schema version "
            f"{version}'s lock entry; warm it with the code of that version"
        )
    store = EntryStore(client, version, registry=registry)
    throttle = Throttle(rate)
    result = WarmResult()
    for refs in batches:
        if guard is not None:
            guard()
        batch = compute(engine, registry[feature_set], refs)
        if on_computed is not None:
            on_computed([batch])
        written = store.write(batch)
        result.entities += len(refs)
        result.written += written.written
        result.batches += 1
        if progress is not None:
            progress(result.entities)
        throttle.add(len(refs))
    return result
