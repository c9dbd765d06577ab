"""Routing: which (feature set, tenant, entity) entries a change affects.

A change reaches a feature set through the set's :class:`~freshline.pipeline.core.features.Source`
for the changed table: directly, through columns that hold an entity's key (the old
and the new value both, so a row that moves between entities affects both), or through
a reverse-lookup query that returns the affected entities' key columns, tenant first
(in the fraud example, a changed device affects every user of it). Identical lookups
within one batch run once. In a single-tenant repository every entity is of
:data:`~freshline.pipeline.core.features.IMPLICIT_TENANT`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from freshline.pipeline.core.errors import FreshlineError, InvalidId
from freshline.pipeline.core.features import IMPLICIT_TENANT, Entity, Registry, Source
from freshline.pipeline.core.keys import validate_id
from freshline.pipeline.core.types import ChangeEvent

Targets = dict[str, set[tuple[str, str]]]
"""Feature set name -> the (tenant, entity) pairs to recompute or invalidate."""


class Unroutable(FreshlineError):
    """A change that cannot be mapped to entities (a TRUNCATE, say)."""


def _entity_ids(row: Mapping[str, Any] | None, columns: Iterable[str], entity: Entity) -> list[str]:
    if not row:
        return []
    found = []
    for column in columns:
        value = row.get(column)
        if value is not None:
            found.append(entity.validate(value))
    return found


def _params(row: Mapping[str, Any] | None, names: Iterable[str]) -> tuple[Any, ...] | None:
    if not row or any(row.get(n) is None for n in names):
        return None
    return tuple(row[n] for n in names)


class Router:
    """Maps change events to the feature entries they affect."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._statements: dict[str, tuple[sa.TextClause, tuple[str, ...]]] = {}

    def is_known(self, table: str) -> bool:
        return bool(self.registry.affected_by(table))

    def route(self, conn: Connection, events: Iterable[ChangeEvent]) -> Targets:
        """Every entry the ``events`` affect, coalesced; reverse lookups run once each."""
        targets: Targets = defaultdict(set)
        lookups: dict[tuple[str, str, tuple[Any, ...]], None] = {}
        for event in events:
            if event.op == "t":
                raise Unroutable(f"TRUNCATE of {event.table} cannot be routed to entities")
            for fs, source in self.registry.affected_by(event.table):
                if source.entity_columns:
                    tenant = event.tenant if fs.entity.tenant else IMPLICIT_TENANT
                    if tenant is None:
                        raise InvalidId(
                            "tenant", None, f"a {event.table} change needs {source.tenant}"
                        )
                    for row in (event.row, event.before):
                        for key in _entity_ids(row, source.entity_columns, fs.entity):
                            targets[fs.name].add((tenant, key))
                if source.reverse:
                    _, names = self._compile(source)
                    for row in (event.row, event.before):
                        params = _params(row, names)
                        if params is not None:
                            lookups[(fs.name, source.reverse, params)] = None
        for fs_name, sql, params in lookups:
            statement, names = self._statements[sql]
            entity = self.registry[fs_name].entity
            for found in conn.execute(statement, dict(zip(names, params, strict=True))):
                if entity.tenant:
                    targets[fs_name].add(
                        (validate_id("tenant", found[0]), entity.validate(found[1]))
                    )
                else:
                    targets[fs_name].add((IMPLICIT_TENANT, entity.validate(found[0])))
        return dict(targets)

    def _compile(self, source: Source) -> tuple[sa.TextClause, tuple[str, ...]]:
        assert source.reverse is not None
        if source.reverse not in self._statements:
            statement = sa.text(source.reverse)
            names = tuple(statement._bindparams)
            self._statements[source.reverse] = (statement, names)
        return self._statements[source.reverse]
