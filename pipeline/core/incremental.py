"""The extension point for a repository's own incremental maintenance.

A feature set's defining ``query`` reads the source rows; for an entity with a long
history that costs the history. A repository may also give a feature set an
``incremental`` query over partial aggregates it maintains itself, and the
:class:`IncrementalPath` that maintains them: its tables and triggers are the
repository's (its own migrations), and freshline calls the path's hooks at the right
moments:

- :meth:`~IncrementalPath.statement`, for every recompute on the incremental path (the
  whole statement over the batch in ``:tenants``/``:ids`` at ``:as_of``; it must give
  exactly the defining query's values, which ``freshline reconcile`` and the property
  tests hold it to);
- :meth:`~IncrementalPath.fold`, from each consumer's upkeep thread, every
  ``FRESHLINE_BUCKET_FOLD_INTERVAL_MS``, to apply pending changes to the aggregates;
- :meth:`~IncrementalPath.rebuild`, after a bulk load or when ``reconcile`` finds drift;
- ``freshline buckets status | build | fold`` for the operator.

A declared aggregation gets one derived from its declaration
(:class:`freshline.pipeline.core.maintenance.DerivedPath`: per-day partials, a log of changed days
written by triggers, a fold), as the fraud example's ``txn_90d`` does; a repository may
write its own for what a declaration cannot say.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.engine import Connection, Engine


class Queries(Protocol):
    """What a path reads of a feature set (a :class:`~freshline.pipeline.core.features.FeatureSet`;
    named structurally so that this module stays below ``features``)."""

    @property
    def name(self) -> str: ...
    @property
    def query(self) -> str: ...
    @property
    def incremental(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class BuildState:
    """How far the build of the aggregates for existing rows has come."""

    complete: bool
    cursor: tuple[str, Any] | None
    """The last (tenant, key) built, while the build is incomplete."""
    remaining: int | None = None
    """Keys still to build (only when asked to count)."""


class IncrementalPath(abc.ABC):
    """A repository's incremental maintenance of partial aggregates (see the module)."""

    name: str = "incremental"

    @abc.abstractmethod
    def statement(self, fs: Queries) -> str:
        """The SQL of ``fs`` on this path: keys in ``:tenants``/``:ids``, ``:as_of``;
        the rows as the defining query returns them."""

    @abc.abstractmethod
    def rebuild(self, conn: Connection, keys: Sequence[tuple[str, Any]]) -> None:
        """Rebuild the aggregates of ``keys`` (tenant, key) from the source rows, in
        ``conn``'s transaction."""

    @abc.abstractmethod
    def fold(self, db: Engine | Connection, *, max_keys: int, wait: bool) -> int | None:
        """Apply pending changes of up to ``max_keys`` keys; how many keys were folded,
        or ``None`` if ``wait`` is false and another fold holds the lock."""

    @abc.abstractmethod
    def pending(self, db: Engine | Connection) -> tuple[int, int]:
        """(pending changes, keys they belong to)."""

    def fold_settled(self, db: Engine | Connection, *, max_keys: int, wait: bool) -> int | None:
        """:meth:`fold`, leaving what a path may fold later at no cost to reads (the
        consumers call this every ``FRESHLINE_BUCKET_FOLD_INTERVAL_MS`` and :meth:`fold`
        every ``FRESHLINE_BUCKET_FOLD_ALL_INTERVAL_MS``). By default, all of it."""
        return self.fold(db, max_keys=max_keys, wait=wait)

    def fold_all(
        self,
        engine: Engine,
        *,
        max_keys: int = 1000,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Fold until nothing is pending, ``max_keys`` keys per transaction; the keys
        folded. ``progress(keys)`` is called after each transaction."""
        done = 0
        while n := self.fold(engine, max_keys=max_keys, wait=True):
            done += n
            if progress is not None:
                progress(n)
        return done

    def summary(self, db: Engine | Connection) -> str:
        """One line on the aggregates' size, for ``freshline buckets status``."""
        return ""

    def state(self, db: Engine | Connection, *, count: bool = False) -> BuildState:
        """The build state of the aggregates for existing rows (complete by default)."""
        return BuildState(True, None, 0 if count else None)

    def build(
        self, engine: Engine, *, batch: int = 500, progress: Callable[[int], None] | None = None
    ) -> int:
        """Build the aggregates of every key not yet covered; the keys built."""
        return 0

    def restart(self, engine: Engine) -> None:
        """Mark every key unbuilt, so that :meth:`build` starts over (nothing to mark
        by default)."""
        return None
