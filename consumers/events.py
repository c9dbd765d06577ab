"""Decoding Kafka records into :class:`freshline.pipeline.core.types.ChangeEvent`.

Two input forms become one event:

* Debezium Postgres connector envelopes (JSON converter, with or without the
  ``{"schema": ..., "payload": ...}`` wrapper) on topics ``<prefix>.<schema>.<table>``;
* domain events on the topics the active repository declares
  (:class:`freshline.pipeline.core.events.Event`; the fraud example's are ``transaction.created``,
  ``transaction.updated``, ``device.updated`` and ``user.updated``), whose contracts
  are the JSON Schemas ``freshline events schemas`` writes.

A TRUNCATE (op ``t``) voids a feature set for every tenant, so it is honoured only on
Debezium's topic of the table it names (``freshline.<schema>.<table>``): never on a
domain-event topic (an :class:`~freshline.pipeline.core.events.Event` is an insert or an update),
on another three-part topic taken for a CDC one, or on another table's CDC topic.

:func:`decode` returns ``None`` for a tombstone (nothing to do) and raises
:class:`EventRejected` for anything it cannot turn into an event, never another
exception, so the run loop can dead-letter the record and move on.

Every tenant and entity id in a returned event's ``row`` and ``before`` has passed
:func:`freshline.pipeline.core.keys.validate_id`, so routing can build keys from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import orjson

from freshline.pipeline.core.errors import FreshlineError, InvalidId
from freshline.pipeline.core.events import Event, EventFieldError
from freshline.pipeline.core.features import Entity, Registry
from freshline.pipeline.core.keys import validate_id
from freshline.pipeline.core.repository import Repository, active
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import CDC_PREFIX, CDC_TOPIC_PATTERN
from freshline.pipeline.core.types import ChangeEvent, Op

RejectKind = Literal[
    "oversized",
    "malformed_json",
    "missing_field",
    "invalid_field",
    "invalid_id",
    "unknown_table",
    "unknown_event_type",
    "impossible_txid",
    "truncate_outside_cdc",
]

DEFAULT_MAX_BYTES = Settings.model_fields["max_message_bytes"].default


# Keyed by the repository's events tuple's id, and holding that tuple too, as _tables.
_events: dict[int, tuple[object, dict[str, Event]]] = {}


def domain_events(repo: Repository | None = None) -> dict[str, Event]:
    """The domain events ``repo`` (the active repository) declares, by topic."""
    events = (repo or active()).events
    cached = _events.get(id(events))
    if cached is not None and cached[0] is events:
        return cached[1]
    found = {e.topic: e for e in events}
    _events[id(events)] = (events, found)
    return found


@dataclass(frozen=True, slots=True)
class TableIds:
    """What of one source table's rows may reach a key: its tenant column, and the
    columns holding entity keys, each with the entity whose type checks it."""

    tenant: str | None
    keys: tuple[tuple[str, Entity], ...]


# Keyed by the registry's set mapping's id, and holding that mapping too: an id alone
# could be reused by a later registry once the first is gone.
_tables: dict[int, tuple[object, dict[str, TableIds]]] = {}


def table_ids(registry: Registry) -> dict[str, TableIds]:
    """The source tables of ``registry`` and their id columns."""
    cached = _tables.get(id(registry._sets))
    if cached is not None and cached[0] is registry._sets:
        return cached[1]
    found: dict[str, TableIds] = {}
    for table in sorted({s.table for fs in registry for s in fs.sources}):
        pairs = registry.affected_by(table)
        tenants = {s.tenant for _, s in pairs if s.tenant}
        keys = {c: fs.entity for fs, s in pairs for c in s.entity_columns}
        found[table] = TableIds(
            tenants.pop() if len(tenants) == 1 else None, tuple(sorted(keys.items()))
        )
    _tables[id(registry._sets)] = (registry._sets, found)
    return found


_OPS: frozenset[str] = frozenset(get_args(Op))


class EventRejected(FreshlineError):
    """A record that cannot become a change event; it belongs in the dead-letter topic.

    ``kind`` is short and machine-readable (one of :data:`RejectKind`); ``reason`` says
    what was wrong in words.
    """

    def __init__(self, reason: str, *, kind: RejectKind) -> None:
        self.reason = reason
        self.kind: RejectKind = kind
        super().__init__(f"{kind}: {reason}")


def decode(
    topic: str,
    key: bytes | None,
    value: bytes | None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    repository: Repository | None = None,
) -> ChangeEvent | None:
    """Turn one Kafka record into a :class:`ChangeEvent`.

    Returns ``None`` for a tombstone (a null value, as Debezium sends after a delete).
    Raises :class:`EventRejected` for an oversized record, bad JSON, a missing or
    invalid field, an id that must not reach a key, an unknown table or an unknown
    topic. ``key`` is not needed: correctness never depends on how producers key.
    ``repository``: whose tables and events (the active repository where not given).
    """
    if value is None:
        return None
    if len(value) > max_bytes:
        raise EventRejected(
            f"{len(value)} bytes, over the {max_bytes}-byte limit", kind="oversized"
        )
    event = domain_events(repository).get(topic)
    if event is not None:
        return _domain_event(event, _load_object(value))
    match = CDC_TOPIC_PATTERN.fullmatch(topic)
    if match is None:
        raise EventRejected(f"no decoder for topic {topic!r}", kind="unknown_event_type")
    registry = (repository or active()).registry
    change = _debezium_event(match["table"], _load_object(value), registry)
    if (
        change is not None
        and change.op == "t"
        and (match["prefix"] != CDC_PREFIX or match["table"] != change.table)
    ):
        raise EventRejected(
            f"a truncate of {change.table!r} is taken only from its CDC topic "
            f"{CDC_PREFIX}.<schema>.{change.table}, not from {topic!r}",
            kind="truncate_outside_cdc",
        )
    return change


def _load_object(value: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise EventRejected(f"not valid JSON: {exc}", kind="malformed_json") from exc
    if not isinstance(obj, dict):
        raise EventRejected(
            f"expected a JSON object, got {type(obj).__name__}", kind="missing_field"
        )
    return obj


def _domain_event(event: Event, obj: dict[str, Any]) -> ChangeEvent:
    try:
        return event.change(obj)
    except EventFieldError as exc:
        raise EventRejected(str(exc), kind=exc.kind) from exc


def _debezium_event(
    topic_table: str, obj: dict[str, Any], registry: Registry
) -> ChangeEvent | None:
    payload: Any = obj
    if "op" not in obj and "payload" in obj:
        payload = obj["payload"]  # the JSON converter's schema wrapper
        if payload is None:
            return None  # a wrapped tombstone: nothing changed
        if not isinstance(payload, dict):
            raise EventRejected("'payload' is not a JSON object", kind="missing_field")
    op = payload.get("op")
    if op is None:
        raise EventRejected("envelope has no 'op'", kind="missing_field")
    if not isinstance(op, str) or op not in _OPS:
        raise EventRejected(f"unknown op {op!r}", kind="invalid_field")
    source = payload.get("source")
    if source is None:
        source = {}
    elif not isinstance(source, dict):
        raise EventRejected("'source' is not a JSON object", kind="invalid_field")
    # source.table is the truth when present: a topic-routing SMT may rename topics.
    table = source.get("table") or topic_table
    ids = table_ids(registry).get(table) if isinstance(table, str) else None
    if ids is None:
        raise EventRejected(
            f"table {table!r} is not a freshline source table", kind="unknown_table"
        )
    watermark = _non_negative_int(source, "lsn", "source.lsn") or 0
    committed_at_ms = _non_negative_int(source, "ts_ms", "source.ts_ms")
    txid = _non_negative_int(source, "txId", "source.txId")
    if op == "t":
        return ChangeEvent(
            table=table,
            op="t",
            tenant=None,
            row={},
            before=None,
            watermark=watermark,
            committed_at_ms=committed_at_ms,
            txid=txid,
        )
    before = _row(payload, "before", table, ids)
    after = _row(payload, "after", table, ids)
    if op == "d":
        if before is None:
            raise EventRejected("delete envelope has no 'before'", kind="missing_field")
        row: Mapping[str, Any] = before
    else:
        if after is None:
            raise EventRejected(f"op {op!r} envelope has no 'after'", kind="missing_field")
        row = {**before, **after} if before else after
    return ChangeEvent(
        table=table,
        op=cast(Op, op),
        tenant=_tenant(table, row, ids),
        row=row,
        before=before,
        watermark=watermark,
        committed_at_ms=committed_at_ms,
        txid=txid,
    )


def _row(payload: dict[str, Any], name: str, table: str, ids: TableIds) -> dict[str, Any] | None:
    row = payload.get(name)
    if row is None:
        return None
    if not isinstance(row, dict):
        raise EventRejected(f"'{name}' is not a JSON object", kind="invalid_field")
    column = ids.tenant
    try:
        if column is not None and row.get(column) is not None:
            validate_id(f"{table}.{column}", row[column])
        for column, entity in ids.keys:
            if row.get(column) is not None:
                entity.validate(row[column])
    except InvalidId as exc:
        raise EventRejected(f"{name}.{column}: {exc.reason}", kind="invalid_id") from exc
    return row


def _tenant(table: str, row: Mapping[str, Any], ids: TableIds) -> str | None:
    column = ids.tenant
    if column is None:
        return None
    tenant = row.get(column)
    if tenant is None:
        raise EventRejected(f"{table} row has no {column!r}", kind="missing_field")
    if not isinstance(tenant, str):
        raise EventRejected(f"{table}.{column} must be a string", kind="invalid_id")
    return tenant  # already validated with the row's id columns


def _non_negative_int(obj: dict[str, Any], name: str, label: str) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EventRejected(f"{label} must be a non-negative integer", kind="invalid_field")
    return value
