"""The derived paths in the database: installing those missing, securing those an
earlier freshline made, pausing their logging for a bulk load, and finding those no
declaration keeps (``freshline buckets prune``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from freshline.pipeline.core.incremental import IncrementalPath
from freshline.pipeline.core.maintenance import catalog
from freshline.pipeline.core.maintenance.path import DerivedPath
from freshline.pipeline.core.maintenance.sql import SCHEMA


def install_missing(conn: Connection, paths: Iterable[IncrementalPath]) -> list[DerivedPath]:
    """Install the derived paths among ``paths`` that are not installed yet, in ``conn``'s
    transaction (what ``freshline apply --alter-tables`` does); those it installed."""
    done = []
    for path in paths:
        if isinstance(path, DerivedPath) and not path.installed(conn):
            path.install(conn)
            done.append(path)
    return done


_ENABLE = {"A": "ENABLE ALWAYS", "O": "ENABLE", "R": "ENABLE REPLICA"}
"""How ``ALTER TABLE`` sets a trigger back to each ``pg_trigger.tgenabled`` (``D``:
disabled, left so)."""


@contextmanager
def paused_inserts(
    conn: Connection, paths: Iterable[IncrementalPath], table: str
) -> Iterator[list[DerivedPath]]:
    """The installed derived paths among ``paths`` over ``table``, their insert triggers
    off inside the block (in ``conn``'s transaction) and at its end as they were: ALWAYS,
    as :meth:`DerivedPath.install` makes them, not the origin-only a plain ``ENABLE
    TRIGGER`` would leave."""
    found = [
        path
        for path in paths
        if isinstance(path, DerivedPath) and path.decl.table == table and path.installed(conn)
    ]
    if not found:
        yield []
        return
    qualified = catalog.qualified(conn, table)
    names = [f"{path.trigger}_i" for path in found]
    states: dict[str, str] = dict(
        conn.execute(
            sa.text(
                "SELECT tgname, tgenabled FROM pg_trigger "
                "WHERE tgrelid = CAST(:table AS regclass) AND tgname = ANY(:names)"
            ),
            {"table": qualified, "names": names},
        ).all()
    )
    for name in names:
        conn.execute(sa.text(f"ALTER TABLE {qualified} DISABLE TRIGGER {name}"))
    yield found
    for name in names:
        enable = _ENABLE.get(states.get(name, "A"))
        if enable is not None:
            conn.execute(sa.text(f"ALTER TABLE {qualified} {enable} TRIGGER {name}"))


def secure_installed(conn: Connection, paths: Iterable[IncrementalPath]) -> list[DerivedPath]:
    """Fix in place the installed derived paths among ``paths`` that
    :meth:`DerivedPath.unsecured` finds lacking (an earlier freshline's), in ``conn``'s
    transaction, as ``freshline apply`` does; those it fixed."""
    done = []
    for path in paths:
        if isinstance(path, DerivedPath) and path.installed(conn) and path.unsecured(conn):
            path.secure(conn)
            done.append(path)
    return done


@dataclass(frozen=True)
class Installed:
    """A derived path found in the database by its objects' names: its tables, the
    triggers on the user's tables and its functions."""

    prefix: str
    tables: tuple[str, ...]
    triggers: tuple[tuple[str, str], ...]
    """(trigger, the table it is on)."""
    functions: tuple[str, ...]
    logged: int
    """Rows in its log: what its triggers have appended and no fold took."""

    def drop(self, conn: Connection) -> None:
        """Drop its triggers, functions and tables, in ``conn``'s transaction."""
        for trigger, table in self.triggers:
            conn.execute(sa.text(f'DROP TRIGGER IF EXISTS "{trigger}" ON {table}'))
        for function in self.functions:
            conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {function}"))
        for table in self.tables:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS {SCHEMA}."{table}"'))


def superseded(conn: Connection, keep: Iterable[DerivedPath]) -> list[Installed]:
    """The derived paths installed in the database that are none of ``keep``: those of
    an earlier declaration (a schema version no longer deployed) or of an earlier
    freshline's layout. Their triggers go on logging every write for no reader."""
    kept = {path.prefix for path in keep}
    prefixes = conn.execute(
        sa.text(
            "SELECT left(c.relname, length(c.relname) - 5) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :schema AND c.relkind = 'r' AND c.relname LIKE 'agg%' "
            "AND right(c.relname, 5) = '_days' ORDER BY 1"
        ),
        {"schema": SCHEMA},
    ).scalars()
    found = []
    for prefix in prefixes:
        if prefix in kept:
            continue
        params = {"schema": SCHEMA, "p": f"{prefix}_", "t": f"freshline_{prefix}_"}
        tables = conn.execute(
            sa.text(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = :schema AND c.relkind = 'r' "
                "AND left(c.relname, length(:p)) = :p ORDER BY 1"
            ),
            params,
        ).scalars()
        triggers = conn.execute(
            sa.text(
                "SELECT t.tgname, t.tgrelid::regclass::text FROM pg_trigger t "
                "WHERE NOT t.tgisinternal AND left(t.tgname, length(:t)) = :t ORDER BY 1"
            ),
            params,
        ).all()
        functions = conn.execute(
            sa.text(
                "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n "
                "ON n.oid = p.pronamespace WHERE n.nspname = :schema "
                "AND left(p.proname, length(:p)) = :p ORDER BY 1"
            ),
            params,
        ).scalars()
        table_names = tuple(str(t) for t in tables)
        log = f"{prefix}_log"
        logged = (
            conn.execute(sa.text(f'SELECT count(*) FROM {SCHEMA}."{log}"')).scalar_one()
            if log in table_names
            else 0
        )
        found.append(
            Installed(
                prefix,
                table_names,
                tuple((str(a), str(b)) for a, b in triggers),
                tuple(str(f) for f in functions),
                int(logged),
            )
        )
    return found
