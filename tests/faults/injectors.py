"""Faults that are neither a signal nor a service restart, caused for real on the private stack.

* **A commit held after its WAL is flushed** (:class:`HeldCommit`): with
  ``synchronous_standby_names`` naming a standby that never connects, a transaction
  with ``synchronous_commit = on`` writes and flushes its commit record (which logical
  decoding ships to Debezium) and then waits for the standby, still invisible to every
  new snapshot. Cancelling the waiting backend ends the wait: the commit completes
  locally and becomes visible, and no further event says so. Everything else runs with
  ``synchronous_commit = local`` meanwhile, so only the held transaction waits.
* **Commits visible, never durable** (:func:`asynchronous_commits`,
  :func:`freeze_wal_writer`): with ``synchronous_commit = off`` a commit is visible
  before the WAL writer flushes it; with the WAL writer SIGSTOPped nothing flushes it
  (no synchronous commit runs: :func:`revoke_temporary` takes from the consumers the
  one write they make to force a flush), so a crash (the WAL writer SIGKILLed: the
  postmaster's crash path) loses every such commit.
* **A wall-clock step in a consumer** (:func:`step_clock`): the offset a member started
  with ``Fleet.spawn(clock=...)`` adds to its wall clock (``tests/faults/clock``).
* **A malformed deploy pointer** (:func:`set_key`): any Redis key set to a value, and
  put back as it was.
* **A topic that refuses writes** (:func:`set_topic_config`): a ``max.message.bytes``
  below the records' size makes the broker refuse every produce to it
  (``MSG_SIZE_TOO_LARGE``) while it stays readable; deleting the override heals it.

:func:`heal_postgres` and :func:`heal_topic` undo these, whatever state a case left;
:func:`reset_deploy` undoes a deploy a scenario made (the pointer, its markers and
the entries of every version it left unwritten).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import sqlalchemy as sa
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
)
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.cache.versions import DEFAULT_POINTER, Pointer, state
from freshline.pipeline.core.errors import DeployError
from freshline.pipeline.core.keys import LEASE_PREFIX, feature_pattern, source_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import text
from freshline.pipeline.dev import processes

ABSENT_STANDBY = "freshline_faults_absent_standby"
"""A standby name nothing connects as: synchronous commits wait for it for ever."""
POLL_S = 0.02


def _admin_sql(engine: Engine, *statements: str) -> None:
    """Run ``statements`` outside a transaction (ALTER SYSTEM refuses to run in one)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for statement in statements:
            conn.execute(sa.text(statement))


def _setting(engine: Engine, name: str) -> str:
    with engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT current_setting(:n)"), {"n": name}).scalar())


def _wait(condition: Callable[[], bool], what: str, deadline_s: float) -> None:
    processes.wait_for(condition, what, deadline_s, interval=POLL_S)


def hold_synchronous_commits(engine: Engine, deadline_s: float = 30.0) -> None:
    """Name a standby that never connects; every session but one that asks for
    ``synchronous_commit = on`` commits locally, as before.

    In two reloads: ``synchronous_commit = local`` first, so that no session still
    running with ``on`` meets the absent standby.
    """
    _admin_sql(engine, "ALTER SYSTEM SET synchronous_commit = 'local'", "SELECT pg_reload_conf()")
    _wait(
        lambda: _setting(engine, "synchronous_commit") == "local",
        "a new session to see synchronous_commit = local",
        deadline_s,
    )
    _admin_sql(
        engine,
        f"ALTER SYSTEM SET synchronous_standby_names = '{ABSENT_STANDBY}'",
        "SELECT pg_reload_conf()",
    )
    _wait(
        lambda: _setting(engine, "synchronous_standby_names") == ABSENT_STANDBY,
        "a new session to see the absent standby",
        deadline_s,
    )


def heal_postgres(engine: Engine) -> bool:
    """Back to the configuration file's settings (a waiting commit is released) and
    ``TEMPORARY`` granted to ``PUBLIC`` again; whether anything had to be undone."""
    regranted = grant_temporary(engine)
    if (
        _setting(engine, "synchronous_standby_names") == ""
        and _setting(engine, "synchronous_commit") == "on"
    ):
        return regranted
    _admin_sql(
        engine,
        "ALTER SYSTEM RESET synchronous_standby_names",
        "ALTER SYSTEM RESET synchronous_commit",
        "SELECT pg_reload_conf()",
    )
    return True


# -- commits visible before they are durable ----------------------------------------------


def asynchronous_commits(engine: Engine, deadline_s: float = 30.0) -> None:
    """``ALTER SYSTEM SET synchronous_commit = off`` and reload: every session's commit
    is acknowledged, and visible, before its WAL is flushed. (:func:`heal_postgres`
    resets it.)"""
    _admin_sql(engine, "ALTER SYSTEM SET synchronous_commit = 'off'", "SELECT pg_reload_conf()")
    _wait(
        lambda: _setting(engine, "synchronous_commit") == "off",
        "a new session to see synchronous_commit = off",
        deadline_s,
    )


def _database_acl(engine: Engine, statement: str) -> None:
    with engine.connect() as conn:
        name = str(conn.execute(sa.text("SELECT current_database()")).scalar_one())
        quoted = conn.dialect.identifier_preparer.quote(name)
    _admin_sql(engine, statement.format(database=quoted))


def public_temporary(engine: Engine) -> bool:
    """Whether ``PUBLIC`` holds ``TEMPORARY`` on the database (Postgres's default)."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT EXISTS (SELECT 1 FROM pg_database d, "
                    "aclexplode(coalesce(d.datacl, acldefault('d', d.datdba))) a "
                    "WHERE d.datname = current_database() AND a.grantee = 0 "
                    "AND a.privilege_type = 'TEMPORARY')"
                )
            ).scalar()
        )


def revoke_temporary(engine: Engine) -> None:
    """Take ``TEMPORARY`` from ``PUBLIC``: a consumer can no longer force a WAL flush
    (its one write, a temporary table), so it waits for the WAL writer's."""
    _database_acl(engine, "REVOKE TEMPORARY ON DATABASE {database} FROM PUBLIC")


def grant_temporary(engine: Engine) -> bool:
    """Give ``PUBLIC`` its ``TEMPORARY`` back; whether it had been taken."""
    if public_temporary(engine):
        return False
    _database_acl(engine, "GRANT TEMPORARY ON DATABASE {database} TO PUBLIC")
    return True


def wal_writer_pid(engine: Engine) -> int:
    """The pid of the WAL writer (superuser: other roles see no pids of server processes)."""
    with engine.connect() as conn:
        pid = conn.execute(
            sa.text("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
        ).scalar()
    if pid is None:
        raise RuntimeError("no WAL writer in pg_stat_activity")
    return int(pid)


def freeze_wal_writer(engine: Engine) -> int:
    """SIGSTOP the WAL writer: asynchronous commits stay in shared memory, visible and
    not flushed, until a synchronous commit flushes them; its pid."""
    pid = wal_writer_pid(engine)
    os.kill(pid, signal.SIGSTOP)
    return pid


def crash_wal_writer(pid: int) -> None:
    """SIGKILL the (frozen) WAL writer: the postmaster takes its crash path at once (every
    server process quits, shared memory and the unflushed WAL in it are dropped) and
    recovers from the WAL on disk, as after ``pg_ctl stop -m immediate``."""
    os.kill(pid, signal.SIGKILL)


def wal_positions(engine: Engine) -> tuple[int, int]:
    """The WAL insert and flush positions, in bytes."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn, "
                "pg_current_wal_flush_lsn() - '0/0'::pg_lsn"
            )
        ).one()
    return int(row[0]), int(row[1])


# -- a consumer's wall clock ----------------------------------------------------------------


def step_clock(path: Path, offset_s: float, deadline_s: float = 30.0) -> None:
    """Set the wall-clock offset of the member(s) reading ``path`` to ``offset_s`` (from
    the real clock, not from the last step) and wait until they have taken it."""
    wanted = str(round(offset_s * 1e9))
    path.write_text(wanted)
    seen = path.with_name(path.name + ".seen")

    def taken() -> bool:
        try:
            return seen.read_text().strip() == wanted
        except OSError:
            return False

    _wait(taken, f"the stepped clock to take offset {offset_s:+.0f}s", deadline_s)


# -- Redis keys ------------------------------------------------------------------------------


def set_key(client: redis.Redis, key: str, value: bytes | str | None) -> None:
    """Set ``key`` to ``value``, or (None) delete it."""
    if value is None:
        client.delete(key)
    else:
        client.set(key, value)


def reset_deploy(
    client: redis.Redis, settings: Settings, *, pointer: Pointer = DEFAULT_POINTER
) -> dict[int, int] | None:
    """Undo a deploy a case made, so the next case starts on the settings' version as
    on a stack nobody deployed on: None if the pointer was untouched, else the keys
    removed, by version. Only while nothing writes (no consumer, no deploy command).

    Clearing the pointer makes the settings' version active again and stops writing
    every other; clearing a retired marker forgets that a version's entries may be
    stale (``purge --force`` leaves one because a consumer's batch in flight can land
    after its scan). The deploy commands would refuse such a version until purged, so
    every version the deploy named loses its entries first, but the settings' version
    if it was still written when the case ended (active, next or previous, unmarked).
    Then the pointer and the markers go, and listening readers (the read API), which
    would otherwise keep the version they hold, are told.
    """
    keys = [pointer.active_key, pointer.next_key, pointer.previous_key]
    markers = [text(k) for k in client.scan_iter(match=f"{pointer.retired_prefix}:*")]
    named = {text(v) for v in client.mget(keys)} | {m.rpartition(":")[2] for m in markers}
    if not named - {""}:
        return None
    written: set[int | None] = set()  # a malformed pointer: the consumers held their writes
    with contextlib.suppress(DeployError):
        seen = state(client, settings, pointer=pointer)
        written = {seen.active, seen.next, seen.previous}
    own = settings.schema_version
    stale = {int(v) for v in named if v.isdigit()} | {own}
    if own in written and pointer.retired_key(own) not in markers:
        stale.discard(own)
    removed: dict[int, int] = {}
    for version in sorted(stale):
        found = [
            key
            for pattern in (feature_pattern(version), f"{LEASE_PREFIX}:{version}:*")
            for key in client.scan_iter(match=pattern, count=1000)
        ]
        for at in range(0, len(found), 1000):
            client.unlink(*found[at : at + 1000])
        client.delete(source_key(version))
        removed[version] = len(found)
    client.delete(*keys, *markers)
    client.publish(pointer.channel, "")
    return removed


@dataclass
class HeldCommit:
    """One transaction whose commit waits for the absent standby, in a thread of its own.

    ``begin`` runs ``statement`` and COMMITs it with ``synchronous_commit = on``; the
    commit record is flushed at once, and the COMMIT then waits (``wait_event`` SyncRep)
    until :meth:`cancel` cancels the wait.
    """

    engine: Engine
    statement: str
    params: dict[str, object]
    pid: int = 0
    txid: int = 0
    error: BaseException | None = None
    _conn: Connection | None = None
    _thread: threading.Thread | None = None
    _done: threading.Event = field(default_factory=threading.Event)

    def begin(self) -> None:
        conn = self._conn = self.engine.connect()
        conn.begin()
        conn.execute(sa.text("SET LOCAL synchronous_commit = on"))
        conn.execute(sa.text(self.statement), self.params)
        self.pid = int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        self.txid = int(
            conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
        )
        self._thread = threading.Thread(
            target=self._commit, args=(conn,), name="held-commit", daemon=True
        )
        self._thread.start()

    def _commit(self, conn: Connection) -> None:
        try:
            conn.commit()
        except BaseException as exc:  # reported through .error, read by the scenario
            self.error = exc
        finally:
            self._done.set()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def waiting(self) -> bool:
        """Its COMMIT is waiting for the standby (its WAL flushed, not yet visible)."""
        with self.engine.connect() as conn:
            return (
                conn.execute(
                    sa.text("SELECT wait_event = 'SyncRep' FROM pg_stat_activity WHERE pid = :p"),
                    {"p": self.pid},
                ).scalar()
                is True
            )

    def settled(self) -> bool:
        """Finished, or its COMMIT waiting for the standby."""
        return self.finished or self.waiting()

    def cancel(self, deadline_s: float = 30.0) -> None:
        """Cancel the wait: the commit completes locally and becomes visible."""
        with self.engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_cancel_backend(:p)"), {"p": self.pid})
        self.close(deadline_s)

    def close(self, deadline_s: float = 30.0) -> None:
        if self._thread is not None and not self._done.wait(deadline_s):
            raise TimeoutError(f"the held commit (pid {self.pid}) did not end")
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def matches(self, txid: int | None) -> bool:
        """Whether a change event's transaction id is this one's (Debezium reports the
        32-bit xid, without its epoch)."""
        return txid is not None and txid in (self.txid, self.txid & 0xFFFFFFFF)


# -- Kafka topic configuration -------------------------------------------------------------


def set_topic_config(admin: AdminClient, topic: str, name: str, value: str | None) -> None:
    """Set a topic's ``name`` to ``value``, or (None) delete the override: the broker's
    default again."""
    entry = (
        ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
        if value is not None
        else ConfigEntry(name, "", incremental_operation=AlterConfigOpType.DELETE)
    )
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    for future in admin.incremental_alter_configs([resource]).values():
        future.result()


def topic_override(admin: AdminClient, topic: str, name: str) -> str | None:
    """The topic's own value of ``name``, or None where it takes the broker's default."""
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    configs = admin.describe_configs([resource])[resource].result()
    entry = configs.get(name)
    if entry is None:
        return None
    source = int(getattr(entry.source, "value", entry.source))
    return str(entry.value) if source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value else None


def heal_topic(admin: AdminClient, topic: str, name: str) -> bool:
    """Delete ``name``'s override on ``topic``; whether there was one."""
    if topic_override(admin, topic, name) is None:
        return False
    set_topic_config(admin, topic, name, None)
    return True
