"""The Debezium side of CDC: the connector's configuration, Connect's REST API, the slot.

``freshline cdc register`` builds the configuration with :func:`connector_config` and
PUTs it (create or update, idempotent); ``freshline cdc status`` reads the connector's
state from Connect and the replication slot's from ``pg_replication_slots``.

Every name derives from ``FRESHLINE_TOPIC_PREFIX`` (:func:`names`), so a test run or a
second environment gets its own connector, slot and topics
(``<prefix>freshline.public.<table>``) on a shared Connect cluster and Postgres. The
publication is shared: migration 0002 creates it, one per database.
"""

from __future__ import annotations

import contextlib
import re
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.http import fetch
from freshline.pipeline.core.settings import Settings, redact
from freshline.pipeline.core.topics import CDC_PREFIX, qualified

CONNECTOR_CLASS = "io.debezium.connector.postgresql.PostgresConnector"
CONNECTOR_NAME = "freshline-postgres"
PUBLICATION = "freshline"
SCHEMA = "public"
HEARTBEAT_MS = 10_000
HEARTBEAT_PREFIX = "freshline-heartbeat"


def latency_settings(settings: Settings) -> dict[str, str]:
    """The connector's settings for a short commit-to-Kafka path (``docs/cdc.md``):
    ``FRESHLINE_CDC_POLL_INTERVAL_MS`` and ``FRESHLINE_CDC_LINGER_MS``."""
    return {
        "poll.interval.ms": str(settings.cdc_poll_interval_ms),
        "producer.override.linger.ms": str(settings.cdc_linger_ms),
    }


LATENCY_SETTINGS = latency_settings(Settings.model_construct())
""":func:`latency_settings` at the settings' defaults."""
WAL_WARN_BYTES = 1 << 30
HTTP_TIMEOUT_S = 10.0

SnapshotMode = Literal["no_data", "initial", "when_needed", "always"]
"""Debezium ``snapshot.mode`` values that make sense here (``no_data`` is the default)."""


class ConnectError(FreshlineError):
    """Kafka Connect answered, but refused or failed the request."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(f"Kafka Connect: {method} {path} -> {status}: {message}")


class SlotBusy(FreshlineError):
    """The replication slot is still held by a walsender after the deadline."""


def captured_tables(registry: Registry) -> list[str]:
    """The tables some feature set reads: exactly what the connector captures."""
    return sorted({src.table for fs in registry for src in fs.sources})


@dataclass(frozen=True, slots=True)
class Names:
    """Everything one connector owns, derived from the topic prefix."""

    connector: str
    slot: str
    topic_prefix: str
    publication: str = PUBLICATION

    def topic(self, table: str) -> str:
        return f"{self.topic_prefix}.{SCHEMA}.{table}"

    @property
    def heartbeat_topic(self) -> str:
        """Where Debezium publishes the heartbeats (its default ``topic.heartbeat.prefix``)."""
        return f"__debezium-heartbeat.{self.topic_prefix}"


def slot_name(prefix: str) -> str:
    """A replication slot name for a topic prefix: ``[a-z0-9_]``, at most 63 bytes."""
    base = re.sub(r"[^a-z0-9_]", "_", prefix.lower()).strip("_")
    return f"{base}_{CDC_PREFIX}"[-63:].lstrip("_") if base else CDC_PREFIX


def names(settings: Settings, connector: str | None = None) -> Names:
    """The connector, slot and Debezium ``topic.prefix`` for ``settings``' topic prefix."""
    return Names(
        connector=connector or settings.topic_prefix + CONNECTOR_NAME,
        slot=slot_name(settings.topic_prefix),
        topic_prefix=qualified(settings, CDC_PREFIX),
    )


def connector_config(
    settings: Settings,
    owned: Names,
    *,
    snapshot_mode: SnapshotMode = "no_data",
    database_host: str | None = None,
    tables: list[str] | None = None,
) -> dict[str, str]:
    """The Debezium Postgres connector configuration; see ``docs/cdc.md`` for each choice.

    The database comes from ``FRESHLINE_POSTGRES_ADMIN_URL`` (else ``_URL``).
    ``database_host`` overrides its host where Connect sees Postgres under another name
    (``postgres`` in compose). With ``connect_secrets_file`` the login is the file's
    ``database.user`` and ``database.password``, ``${file:...}`` references that the
    worker resolves (so Connect's REST API never returns the password, and Debezium logs
    in as a replication role of its own); without it, the URL's user and password.
    """
    url = make_url(settings.migration_url)
    if not url.database:
        raise FreshlineError("FRESHLINE_POSTGRES_URL names no database")
    if tables is None:
        from freshline.pipeline.core.repository import active

        tables = captured_tables(active().registry)
    include = ",".join(f"{SCHEMA}.{t}" for t in tables)
    return {
        "connector.class": CONNECTOR_CLASS,
        "tasks.max": "1",
        "database.hostname": database_host or url.host or "127.0.0.1",
        "database.port": str(url.port or 5432),
        "database.user": (
            f"${{file:{settings.connect_secrets_file}:database.user}}"
            if settings.connect_secrets_file
            else url.username or ""
        ),
        "database.password": (
            f"${{file:{settings.connect_secrets_file}:database.password}}"
            if settings.connect_secrets_file
            else url.password or ""
        ),
        "database.dbname": url.database,
        "topic.prefix": owned.topic_prefix,
        "plugin.name": "pgoutput",
        "slot.name": owned.slot,
        "publication.name": owned.publication,
        # The migration owns the publication; a missing one is an error, not a surprise.
        "publication.autocreate.mode": "disabled",
        "table.include.list": include,
        "snapshot.mode": snapshot_mode,
        "key.converter": "org.apache.kafka.connect.json.JsonConverter",
        "key.converter.schemas.enable": "false",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter.schemas.enable": "false",
        "decimal.handling.mode": "string",
        "time.precision.mode": "adaptive_time_microseconds",
        "tombstones.on.delete": "true",
        # Truncates are emitted: the consumers void the feature sets the table feeds,
        # and history ends every open version of the table.
        "skipped.operations": "none",
        # Heartbeats commit the slot's position while captured tables are quiet; the
        # action writes a logical message into *this* database's WAL, so the slot
        # advances even when only other databases on the server are busy.
        "heartbeat.interval.ms": str(HEARTBEAT_MS),
        "heartbeat.action.query": (
            f"SELECT pg_logical_emit_message(false, '{HEARTBEAT_PREFIX}', now()::text)"
        ),
        "message.prefix.exclude.list": HEARTBEAT_PREFIX,
        "slot.drop.on.stop": "false",
        **latency_settings(settings),
    }


# -- Kafka Connect's REST API ------------------------------------------------------


class ConnectClient:
    """A thin client for the few Kafka Connect REST calls freshline makes."""

    def __init__(self, url: str, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise FreshlineError(f"FRESHLINE_CONNECT_URL must be http(s): {redact(url)}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        """One call: ``(status, decoded JSON or None)``.

        A 404 is returned, not raised; another error status raises :class:`ConnectError`
        with Connect's message; no answer raises :class:`ServiceUnavailable`.
        """
        response = fetch(
            self.url + path,
            method=method,
            body=None if body is None else orjson.dumps(body),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
            timeout=self.timeout_s,
            service="Kafka Connect",
        )
        if response.status == 404:
            return 404, None
        if not response.ok:
            try:
                found = response.json()
                detail = found.get("message", "") if isinstance(found, dict) else ""
            except orjson.JSONDecodeError:
                detail = response.body[:200].decode(errors="replace")
            raise ConnectError(method, path, response.status, str(detail) or "no message")
        return response.status, response.json()

    def ping(self) -> None:
        """Raise :class:`ServiceUnavailable` unless the worker answers."""
        self.request("GET", "/")

    def put_config(self, name: str, config: dict[str, str]) -> bool:
        """Create or update connector ``name``; True when it was created."""
        status, _ = self.request("PUT", f"/connectors/{_q(name)}/config", config)
        return status == 201

    def status(self, name: str) -> dict[str, Any] | None:
        _, body = self.request("GET", f"/connectors/{_q(name)}/status")
        return body if isinstance(body, dict) else None

    def restart(self, name: str) -> None:
        self.request("POST", f"/connectors/{_q(name)}/restart?includeTasks=true")

    def delete(self, name: str, *, offsets: bool = True) -> bool:
        """Stop the connector, reset its stored offsets, delete it; False if it was absent.

        Resetting offsets means a connector registered again under the same name
        starts afresh (per its snapshot mode) instead of resuming at a stale position.
        """
        if self.status(name) is None:
            return False
        if offsets:
            self.request("PUT", f"/connectors/{_q(name)}/stop")
            _wait(lambda: _state(self.status(name)) == "STOPPED", 30.0)
            with contextlib.suppress(ConnectError):  # best effort: the delete is what matters
                self.request("DELETE", f"/connectors/{_q(name)}/offsets")
        self.request("DELETE", f"/connectors/{_q(name)}")
        return True


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _state(status: dict[str, Any] | None) -> str | None:
    return None if status is None else str(status.get("connector", {}).get("state"))


def _wait(condition: Any, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


# -- state -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskState:
    id: int
    state: str
    worker: str
    trace: str | None = None

    @property
    def error(self) -> str | None:
        """The trace's first line: the exception and its message."""
        return self.trace.strip().splitlines()[0] if self.trace else None


@dataclass(frozen=True, slots=True)
class SlotState:
    name: str
    active: bool
    restart_lsn: str | None
    confirmed_flush_lsn: str | None
    retained_bytes: int
    """WAL the server keeps for this slot: current LSN minus ``restart_lsn``."""


@dataclass(slots=True)
class CdcStatus:
    names: Names
    connector: TaskState | None
    tasks: list[TaskState] = field(default_factory=list)
    slot: SlotState | None = None
    publication_tables: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        states = [t.state for t in [*([self.connector] if self.connector else []), *self.tasks]]
        return "FAILED" in states

    @property
    def running(self) -> bool:
        return is_running(self.connector, self.tasks)


def is_running(connector: TaskState | None, tasks: list[TaskState]) -> bool:
    """The connector and its tasks, at least one, are all RUNNING."""
    return (
        connector is not None
        and connector.state == "RUNNING"
        and bool(tasks)
        and all(t.state == "RUNNING" for t in tasks)
    )


def connector_running(client: ConnectClient, name: str) -> bool:
    """Whether connector ``name`` :func:`is_running` now (False when it is not registered)."""
    return is_running(*connector_state(client, name))


def streaming(client: ConnectClient, engine: Engine, owned: Names) -> bool:
    """Whether ``owned``'s connector runs and its slot exists: commits from now on are
    captured."""
    return connector_running(client, owned.connector) and slot_state(engine, owned.slot) is not None


def connector_state(client: ConnectClient, name: str) -> tuple[TaskState | None, list[TaskState]]:
    body = client.status(name)
    if body is None:
        return None, []
    conn = body.get("connector", {})
    connector = TaskState(
        -1, str(conn.get("state")), str(conn.get("worker_id", "")), conn.get("trace")
    )
    tasks = [
        TaskState(
            int(t.get("id", 0)), str(t.get("state")), str(t.get("worker_id", "")), t.get("trace")
        )
        for t in body.get("tasks", [])
    ]
    return connector, sorted(tasks, key=lambda t: t.id)


_SLOT_SQL = sa.text(
    "SELECT slot_name, active, restart_lsn::text, confirmed_flush_lsn::text, "
    "coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::bigint "
    "FROM pg_replication_slots WHERE slot_name = :slot"
)


def slot_state(engine: Engine, slot: str) -> SlotState | None:
    with engine.connect() as conn:
        row = conn.execute(_SLOT_SQL, {"slot": slot}).one_or_none()
    if row is None:
        return None
    return SlotState(row[0], bool(row[1]), row[2], row[3], int(row[4]))


def publication_tables(engine: Engine, publication: str = PUBLICATION) -> list[str] | None:
    """The tables in ``publication`` (None if there is no such publication)."""
    with engine.connect() as conn:
        exists = conn.execute(
            sa.text("SELECT 1 FROM pg_publication WHERE pubname = :p"), {"p": publication}
        ).one_or_none()
        if exists is None:
            return None
        rows = (
            conn.execute(
                sa.text(
                    "SELECT tablename FROM pg_publication_tables "
                    "WHERE pubname = :p AND schemaname = :s "
                    "ORDER BY tablename"
                ),
                {"p": publication, "s": SCHEMA},
            )
            .scalars()
            .all()
        )
    return list(rows)


def check_publication(engine: Engine, tables: list[str], publication: str = PUBLICATION) -> None:
    """Raise unless ``publication`` exists and covers ``tables`` (migration 0002 made it)."""
    found = publication_tables(engine, publication)
    if found is None:
        raise FreshlineError(
            f"publication {publication!r} does not exist in "
            f"{engine.url.database}; run: freshline apply"
        )
    missing = sorted(set(tables) - set(found))
    if missing:
        raise FreshlineError(
            f"publication {publication!r} lacks {', '.join(missing)}; run: freshline apply"
        )


def status(settings: Settings, engine: Engine, connector: str | None = None) -> CdcStatus:
    owned = names(settings, connector)
    conn, tasks = connector_state(ConnectClient(settings.connect_url), owned.connector)
    return CdcStatus(
        owned,
        conn,
        tasks,
        slot_state(engine, owned.slot),
        publication_tables(engine, owned.publication) or [],
    )


def drop_slot(engine: Engine, slot: str, deadline_s: float = 30.0) -> bool:
    """Drop ``slot`` once no walsender holds it; False if there was none.

    After a connector is deleted its task lets go of the slot asynchronously, so an
    active slot is waited for, up to ``deadline_s``.
    """
    end = time.monotonic() + deadline_s
    while True:
        state = slot_state(engine, slot)
        if state is None:
            return False
        if not state.active:
            try:
                with engine.begin() as conn:
                    conn.execute(sa.text("SELECT pg_drop_replication_slot(:s)"), {"s": slot})
                return True
            except sa.exc.DBAPIError:
                pass  # taken again, or dropped meanwhile: look again
        if time.monotonic() > end:
            raise SlotBusy(f"replication slot {slot!r} is still active after {deadline_s:.0f}s")
        time.sleep(0.2)


def format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
