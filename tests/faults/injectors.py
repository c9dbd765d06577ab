"""Faults that are neither a signal nor a service restart, caused for real on the private stack.

* **A commit held after its WAL is flushed** (:class:`HeldCommit`): with
  ``synchronous_standby_names`` naming a standby that never connects, a transaction
  with ``synchronous_commit = on`` writes and flushes its commit record (which logical
  decoding ships to Debezium) and then waits for the standby, still invisible to every
  new snapshot. Cancelling the waiting backend ends the wait: the commit completes
  locally and becomes visible, and no further event says so. Everything else runs with
  ``synchronous_commit = local`` meanwhile, so only the held transaction waits.
* **A topic that refuses writes** (:func:`set_topic_config`): a ``max.message.bytes``
  below the records' size makes the broker refuse every produce to it
  (``MSG_SIZE_TOO_LARGE``) while it stays readable; deleting the override heals it.

:func:`heal_postgres` and :func:`heal_topic` undo either, whatever state a case left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import sqlalchemy as sa
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
)
from sqlalchemy.engine import Connection, Engine

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
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(POLL_S)  # polling interval, not synchronisation


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
    """Back to the configuration file's settings (a waiting commit is released); whether
    anything had to be undone."""
    if (
        _setting(engine, "synchronous_standby_names") == ""
        and _setting(engine, "synchronous_commit") == "on"
    ):
        return False
    _admin_sql(
        engine,
        "ALTER SYSTEM RESET synchronous_standby_names",
        "ALTER SYSTEM RESET synchronous_commit",
        "SELECT pg_reload_conf()",
    )
    return True


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
