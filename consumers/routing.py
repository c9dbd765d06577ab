"""Routing: which (feature set, tenant, entity) entries a change affects.

A change reaches a feature set through the set's :class:`~pipeline.core.features.Source`
for the changed table: directly, through columns that hold a user id (the old and
the new value both, so a row that moves between users affects both), or through a
reverse-lookup query (a changed device affects every user of it; a changed geoip
range every user with a transaction from an IP in it). Identical lookups within one
batch run once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from pipeline.core.errors import FreshlineError, InvalidId
from pipeline.core.features import REGISTRY, Registry, Source
from pipeline.core.keys import validate_id
from pipeline.core.types import ChangeEvent

Targets = dict[str, set[tuple[str, str]]]
"""Feature set name -> the (tenant, entity) pairs to recompute or invalidate."""


class Unroutable(FreshlineError):
    """A change that cannot be mapped to entities (a TRUNCATE, say)."""


def _user_ids(row: Mapping[str, Any] | None, columns: Iterable[str]) -> list[str]:
    if not row:
        return []
    found = []
    for column in columns:
        value = row.get(column)
        if value is not None:
            found.append(validate_id("entity", value))
    return found


def _params(row: Mapping[str, Any] | None, names: Iterable[str]) -> tuple[Any, ...] | None:
    if not row or any(row.get(n) is None for n in names):
        return None
    return tuple(row[n] for n in names)


class Router:
    """Maps change events to the feature entries they affect."""

    def __init__(self, registry: Registry = REGISTRY) -> None:
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
                if source.user_columns:
                    if event.tenant is None:
                        raise InvalidId("tenant", None, f"a {event.table} change needs tenant_id")
                    for row in (event.row, event.before):
                        for user in _user_ids(row, source.user_columns):
                            targets[fs.name].add((event.tenant, user))
                if source.reverse:
                    _, names = self._compile(source)
                    for row in (event.row, event.before):
                        params = _params(row, names)
                        if params is not None:
                            lookups[(fs.name, source.reverse, params)] = None
        for fs_name, sql, params in lookups:
            statement, names = self._statements[sql]
            for tenant, user in conn.execute(statement, dict(zip(names, params, strict=True))):
                targets[fs_name].add((tenant, str(user)))
        return dict(targets)

    def _compile(self, source: Source) -> tuple[sa.TextClause, tuple[str, ...]]:
        assert source.reverse is not None
        if source.reverse not in self._statements:
            statement = sa.text(source.reverse)
            names = tuple(statement._bindparams)
            self._statements[source.reverse] = (statement, names)
        return self._statements[source.reverse]
