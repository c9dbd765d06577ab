""":class:`DerivedPath`: the incremental path of one declaration of windowed
aggregations, as :mod:`freshline.pipeline.core.incremental`'s hooks (recompute, fold,
rebuild) and as what ``plan`` and ``apply`` install, check and secure. The SQL is
written by :mod:`.ddl`, :mod:`.triggers`, :mod:`.fold` and :mod:`.query`; why its
values are exact is in docs/incremental.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.core.incremental import IncrementalPath, Queries
from freshline.pipeline.core.maintenance import catalog, ddl, partials, triggers
from freshline.pipeline.core.maintenance.query import incremental_query
from freshline.pipeline.core.maintenance.security import lacking
from freshline.pipeline.core.maintenance.shape import Shape


class DerivedPath(Shape, IncrementalPath):
    """The incremental path of one declaration: per-day partials in freshline's schema,
    a log of the days writes have changed, kept by statement-level triggers on the
    source table, a fold, and an incremental query that reads at most one partial per
    whole day of the window plus the source rows of the days the window's edges cut
    through and of the days logged since the last fold.

    Installing it changes the user's table (triggers), so ``freshline apply`` does it
    only with ``--alter-tables``, and fills the partials from the existing rows in the
    same transaction, under ``LOCK TABLE ... IN SHARE MODE``. Every generated function
    runs as the owner, and no other login may write the path's tables or run its
    functions (:meth:`grants`)."""

    name = "derived"

    # -- the SQL ----------------------------------------------------------------------

    def query(self) -> str:
        """The incremental query: the keys ``k``, ``t.as_of``, like the defining one."""
        return incremental_query(self)

    def ddl(self, conn: Connection) -> list[str]:
        """The statements that install this path: its tables, trigger functions and the
        triggers on the source table (the last change the user's table), then the
        build of the partials from the rows there are."""
        source = catalog.source(conn, self)
        return ddl.statements(
            self, source, catalog.partitions(conn, source.table), catalog.roles(conn)
        )

    def grants(self, conn: Connection) -> list[str]:
        """The privileges on the path's objects, set whole (:func:`.ddl.grants`)."""
        return ddl.grants(self, catalog.roles(conn))

    def describe(self, conn: Connection) -> str:
        """What installing it does, in one line (for ``plan``)."""
        table = catalog.qualified(conn, self.decl.table)
        return ddl.describe(self, table, catalog.lookup_tables(conn, self))

    def search_path(self, conn: Connection) -> str:
        """The ``search_path`` the path's functions that run the declaration's SQL (all
        but the insert trigger's) run with: ``plan`` checks that SQL under it, so what
        plan accepts, the triggers run."""
        table = catalog.qualified(conn, self.decl.table)
        return catalog.search_path(table, catalog.lookup_tables(conn, self))

    def partitions(self, conn: Connection) -> list[str]:
        """Every partition of the source table, at every level, qualified; none when it is
        not partitioned."""
        return catalog.partitions(conn, catalog.qualified(conn, self.decl.table))

    def partition_triggers(self, partitions: Sequence[str]) -> list[str]:
        """The statement triggers of ``partitions`` (:func:`.triggers.partition_triggers`)."""
        return triggers.partition_triggers(self, partitions)

    # -- the extension point's hooks --------------------------------------------------------

    def statement(self, fs: Queries) -> str:
        return self.entity.keys_cte() + str(fs.incremental)

    def rebuild(self, conn: Connection, keys: Sequence[tuple[str, Any]]) -> None:
        table = catalog.qualified(conn, self.decl.table)
        if self.entity.tenant:
            keys_from = (
                "SELECT * FROM unnest(CAST(:tenants AS text[]), "
                f"CAST(:ids AS {self.entity.type}[]))"
            )
        else:
            keys_from = f"SELECT * FROM unnest(CAST(:ids AS {self.entity.type}[]))"
        params = {
            "tenants": [t for t, _ in keys],
            "ids": [self.entity.param(str(k)) for _, k in keys],
        }
        for statement in partials.locks(self, table, catalog.lookup_tables(conn, self)):
            conn.execute(sa.text(statement))
        for statement in partials.rebuild(self, table, keys_from):
            conn.execute(sa.text(statement), params)

    def fold(self, db: Engine | Connection, *, max_keys: int, wait: bool) -> int | None:
        """Recompute up to ``max_keys`` logged (key, day)s (the generated function does,
        as the partials' owner: a consumer needs only EXECUTE on it). With an Engine,
        one statement in autocommit, so the lock is let go as the statement ends."""
        return self._fold(db, max_keys=max_keys, wait=wait, settled=False)

    def fold_settled(self, db: Engine | Connection, *, max_keys: int, wait: bool) -> int | None:
        """:meth:`fold` of the days before the current UTC day only. A read takes the
        day of its ``as_of`` from the source rows whatever the partials hold, so a
        partial of the current day is read only once the day is over: folding it
        while writes keep logging it recomputes it again and again for nothing."""
        return self._fold(db, max_keys=max_keys, wait=wait, settled=True)

    def _fold(
        self, db: Engine | Connection, *, max_keys: int, wait: bool, settled: bool
    ) -> int | None:
        fold = sa.text(f"SELECT {self.function}_fold(:n, :wait, :settled)")
        params = {"n": max_keys, "wait": wait, "settled": settled}
        if isinstance(db, Connection):
            n = db.execute(fold, params).scalar_one()
        else:
            with db.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                n = conn.execute(fold, params).scalar_one()
        return None if n is None else int(n)

    def pending(self, db: Engine | Connection) -> tuple[int, int]:
        """(logged (key, day)s, keys they belong to): a scan of the log."""
        entities = ", ".join(self.entity.columns)
        row = _one_row(db, f"SELECT count(*), count(DISTINCT ({entities})) FROM {self.log}")
        return int(row[0]), int(row[1])

    def summary(self, db: Engine | Connection) -> str:
        sizes = " + ".join(f"pg_total_relation_size('{t}')" for t in self.tables)
        row = _one_row(db, f"SELECT (SELECT count(*) FROM {self.days}), pg_size_pretty({sizes})")
        return f"{row[0]:,} day rows, {row[1]}"

    # -- installing, checking, securing ---------------------------------------------------

    def install(self, conn: Connection) -> None:
        """Run :meth:`ddl` in ``conn``'s transaction."""
        for statement in self.ddl(conn):
            conn.execute(sa.text(statement))

    def installed(self, conn: Connection) -> bool:
        """Whether this path's table and triggers are in the database."""
        return bool(
            conn.execute(
                sa.text(
                    "SELECT to_regclass(:days) IS NOT NULL AND to_regclass(:log) IS NOT NULL "
                    "AND EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = :trigger)"
                ),
                {"days": self.days, "log": self.log, "trigger": f"{self.trigger}_t"},
            ).scalar()
        )

    def unsecured(self, conn: Connection) -> list[str]:
        """What an installed path lacks of what :meth:`ddl` makes now, as to who may do
        what (an earlier freshline's, say): each function SECURITY DEFINER with its fixed
        ``search_path`` (the insert trigger's with none), each trigger function checking
        the trigger it runs as, none executable by PUBLIC, no privilege of PUBLIC on a
        table, the grants of :meth:`grants`. Empty when nothing; :meth:`secure` makes it
        so."""
        table = catalog.qualified(conn, self.decl.table)
        return lacking(conn, self, table, catalog.lookup_tables(conn, self))

    def secure(self, conn: Connection) -> None:
        """Replace the installed path's functions with those :meth:`ddl` makes now and
        set :meth:`grants`, in ``conn``'s transaction. Its tables, partials, log and
        triggers stay as they are: a replaced function keeps its oid, so the triggers
        call the new one, and its log rows mean what they meant."""
        source = catalog.source(conn, self)
        for statement in [*ddl.functions(self, source), *self.grants(conn)]:
            conn.execute(sa.text(statement))

    def untriggered_partitions(self, conn: Connection) -> list[str]:
        """The partitions without the path's triggers (made after ``apply``): writes
        addressed to them are not logged until ``apply --alter-tables`` attaches them."""
        found = self.partitions(conn)
        if not found:
            return []
        triggered = set(
            conn.execute(
                sa.text(
                    "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_trigger t "
                    "JOIN pg_class c ON c.oid = t.tgrelid "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE t.tgname = :name"
                ),
                {"name": f"{self.trigger}_p"},
            ).scalars()
        )
        return [p for p in found if p not in triggered]

    def table_fixes(self, conn: Connection) -> list[str]:
        """What an installed path needs on the user's tables to see every write: its
        triggers on partitions made after it was installed, and ALWAYS on triggers an
        earlier freshline left firing in origin sessions only. ``apply --alter-tables``
        installs it again (:meth:`install`: the triggers, then its partials rebuilt from
        the rows, which a write to an untriggered partition may have missed)."""
        out = []
        parts = self.untriggered_partitions(conn)
        if parts:
            out.append(f"partitions without its triggers: {', '.join(parts)}")
        origin = conn.execute(
            sa.text("SELECT count(*) FROM pg_trigger WHERE tgname LIKE :name AND tgenabled = 'O'"),
            {"name": f"{self.trigger}\\_%"},
        ).scalar()
        if origin:
            out.append(f"{origin} trigger(s) not fired in replica-role sessions (not ALWAYS)")
        return out


def _one_row(db: Engine | Connection, sql: str) -> tuple[Any, ...]:
    """The one row of ``sql``, in ``db``'s transaction or a connection of its own."""
    if isinstance(db, Connection):
        return tuple(db.execute(sa.text(sql)).one())
    with db.connect() as conn:
        return tuple(conn.execute(sa.text(sql)).one())
