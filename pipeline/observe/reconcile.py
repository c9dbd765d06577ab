"""Reconciliation: the incremental path against the full one, on sampled entities.

For each sampled entity and each feature set with an incremental query, both paths
are computed on one REPEATABLE READ snapshot, so they see the same rows and any
difference is drift of the path's own state, not a race. A drifted entity's state is
rebuilt by its path (:meth:`IncrementalPath.rebuild`, under the lock a build takes)
and checked again. Served entries are not rewritten here: the next change of the entity, or the
entry's TTL, replaces them; ``freshline audit`` reports them meanwhile.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.features import IMPLICIT_TENANT, Entity, Registry
from freshline.pipeline.core.types import FeatureValues


@dataclass(frozen=True, slots=True)
class Drift:
    """One entity whose incremental values differ: field -> (incremental, full)."""

    feature_set: str
    tenant: str
    entity: str
    fields: dict[str, tuple[object, object]]


@dataclass(slots=True)
class ReconcileReport:
    checked: int = 0
    drifted: list[Drift] = field(default_factory=list)
    repaired: int = 0
    still_drifted: list[Drift] = field(default_factory=list)


def sample(
    engine: Engine, entity: Entity, n: int, *, tenant: str | None = None
) -> list[tuple[str, str]]:
    """``n`` random rows of ``entity``'s table (of ``tenant``, or of every tenant), as
    (tenant, entity id)."""
    if entity.table is None:
        raise ConfigError(f"entity {entity.name!r} declares no table to sample from")
    key = entity.table_key or entity.key
    if entity.tenant is None:
        if tenant not in (None, IMPLICIT_TENANT):
            return []
        query = f"SELECT {key} FROM {entity.table} ORDER BY random() LIMIT :n"
    else:
        query = (
            f"SELECT {entity.tenant}, {key} FROM {entity.table} "
            f"WHERE CAST(:t AS text) IS NULL OR {entity.tenant} = :t ORDER BY random() LIMIT :n"
        )
    with engine.connect() as conn:
        rows = conn.execute(sa.text(query), {"t": tenant, "n": n}).all()
    if entity.tenant is None:
        return [(IMPLICIT_TENANT, str(k)) for (k,) in rows]
    return [(t, str(k)) for t, k in rows]


def _diff(
    inc: FeatureValues | None, full: FeatureValues | None
) -> dict[str, tuple[object, object]]:
    inc, full = inc or {}, full or {}
    return {
        name: (inc.get(name), full.get(name))
        for name in dict.fromkeys([*full, *inc])
        if inc.get(name) != full.get(name)
    }


def compare(
    engine: Engine,
    refs: Sequence[tuple[str, str]],
    *,
    as_of: dt.datetime | None = None,
    registry: Registry,
    entity: Entity | None = None,
) -> list[Drift]:
    """Every (feature set, entity) of ``refs`` whose two paths disagree; with ``entity``,
    of the feature sets over that entity only (``refs`` are its ids)."""
    drifts: list[Drift] = []
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        for fs in registry:
            if fs.incremental is None or (entity is not None and fs.entity != entity):
                continue
            full = compute(conn, fs, refs, as_of=as_of, path="full").values
            inc = compute(conn, fs, refs, as_of=as_of, path="incremental").values
            for key in dict.fromkeys([*full, *inc]):
                differing = _diff(inc.get(key), full.get(key))
                if differing:
                    drifts.append(Drift(fs.name, key[0], key[1], differing))
        conn.rollback()
    return drifts


def reconcile(
    engine: Engine,
    refs: Sequence[tuple[str, str]],
    *,
    repair: bool = True,
    as_of: dt.datetime | None = None,
    registry: Registry,
    entity: Entity | None = None,
) -> ReconcileReport:
    """Compare ``refs`` on both paths; with ``repair``, rebuild drifted entities and
    recheck."""
    report = ReconcileReport(checked=len(dict.fromkeys(refs)))
    report.drifted = compare(engine, refs, as_of=as_of, registry=registry, entity=entity)
    if not report.drifted or not repair:
        report.still_drifted = list(report.drifted)
        return report
    with engine.begin() as conn:
        for path in registry.maintenances():
            keys = sorted(
                {
                    (d.tenant, d.entity)
                    for d in report.drifted
                    if registry[d.feature_set].maintenance is path
                }
            )
            if keys:
                path.rebuild(conn, keys)
    again = {(d.tenant, d.entity) for d in report.drifted}
    report.still_drifted = compare(
        engine, sorted(again), as_of=as_of, registry=registry, entity=entity
    )
    left = {(d.tenant, d.entity) for d in report.still_drifted}
    report.repaired = len(again - left)
    return report
