"""Domain events: a topic a repository declares, whose records name a changed row.

An :class:`Event` says which table's rows its records name and which columns they give:
the routing columns of the table (its tenant column as ``tenant``, each entity column,
each reverse-lookup parameter), renamed or extended by ``fields``. The consumers decode
a record with :meth:`Event.change`. :func:`record_model` is the same contract as a
pydantic model, and :func:`event_schema` its JSON Schema (draft 2020-12), which
``freshline events schemas`` writes for producers; a test checks that the parser takes
exactly the records the model takes.

The parser stays hand-written: each failure names the field and says whether it was
missing, an id that cannot reach a key, or a badly typed value (the dead-letter topic's
reasons), and the model, with the :class:`~freshline.pipeline.core.types.ChangeEvent` still to
build after it, decoded no faster (``python -m bench.contracts``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    create_model,
)
from pydantic.json_schema import GenerateJsonSchema, SkipJsonSchema

from freshline.pipeline.core.errors import ConfigError, InvalidId
from freshline.pipeline.core.features import (
    KEY_TYPES,
    KeyType,
    Table,
    _caller,
    identifier,
    validate_key,
)
from freshline.pipeline.core.types import ChangeEvent
from freshline.schemas.ids import ID_PATTERN, MAX_ID_LENGTH

EventOp = Literal["c", "u"]
FieldProblem = Literal["missing_field", "invalid_id", "invalid_field"]

TENANT_FIELD = "tenant"
"""The wire name of the tenant column in every domain event."""
MAX_BIGINT = (1 << 63) - 1
_PARAMETER = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")
_TOPIC = re.compile(r"[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)*")


class EventFieldError(ValueError):
    """A domain event whose fields break its contract."""

    def __init__(self, kind: FieldProblem, field: str, reason: str) -> None:
        self.kind = kind
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True, slots=True)
class EventField:
    """A field of a domain event: the row column it gives, that column's key type
    (default: its entity's), and what it is, for the schema's description."""

    column: str
    type: KeyType | None = None
    description: str = ""


@dataclass(frozen=True, slots=True)
class Column:
    """One resolved field: wire name, row column, type, description."""

    name: str
    column: str
    type: KeyType
    description: str


def _bigint(name: str, value: object) -> int:
    # A string of digits too: JSON producers in some languages cannot send 64-bit
    # integers exactly. The rule and its message are every entity id's (validate_key).
    try:
        return int(validate_key("bigint", value))
    except InvalidId as exc:
        raise EventFieldError("invalid_id", name, exc.reason) from None


def _string_parser(kind: KeyType) -> Callable[[str, object], str]:
    def parse(name: str, value: object) -> str:
        if kind == "text" and not isinstance(value, str):  # JSON: a number is no text key
            raise EventFieldError("invalid_id", name, "must be a string")
        try:
            return validate_key(kind, value)
        except InvalidId as exc:
            raise EventFieldError("invalid_id", name, exc.reason) from None

    return parse


_PARSERS: dict[KeyType, Callable[[str, object], int | str]] = {
    "bigint": _bigint,
    "text": _string_parser("text"),
    "uuid": _string_parser("uuid"),
}


def _occurred_at_ms(obj: Mapping[str, Any]) -> int | None:
    value = obj.get("occurred_at")
    if value is None:
        return None
    if not isinstance(value, str):
        raise EventFieldError("invalid_field", "occurred_at", "must be an RFC 3339 string")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError as exc:
        raise EventFieldError("invalid_field", "occurred_at", "not an RFC 3339 date-time") from exc
    if moment.tzinfo is None:
        raise EventFieldError("invalid_field", "occurred_at", "needs a UTC offset (e.g. 'Z')")
    return int(moment.timestamp() * 1000)


def _version(obj: Mapping[str, Any]) -> int | None:
    value = obj.get("version")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventFieldError("invalid_field", "version", "must be an integer")
    return value


@dataclass(frozen=True)
class Event:
    """A domain-event topic: ``Event(topic, table=..., op="u", description=...,
    fields={...})``.

    A record on ``topic`` says one row of ``table`` was inserted (``op="c"``) or changed
    (``"u"``), naming it by the table's routing columns: its tenant column (as
    ``tenant``), each entity column (typed by its entity) and each parameter of its
    reverse queries. ``fields`` maps a wire name to an :class:`EventField`: naming a
    routing column renames it on the wire; naming another column adds it (a reverse
    parameter or an added column needs its ``type``). Every field is required; an
    ``occurred_at`` (RFC 3339) and a ``version`` (integer) are optional.
    """

    topic: str
    table: Table
    op: EventOp = "u"
    description: str = ""
    fields: Mapping[str, EventField] = field(default_factory=dict)
    origin: str = field(default="", compare=False)
    """Where it was declared (``file:line``), for error messages."""
    columns: tuple[Column, ...] = field(init=False, compare=False)
    _parse: tuple[tuple[str, str, Callable[[str, object], int | str]], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.topic, str) or not _TOPIC.fullmatch(self.topic):
            raise ConfigError(f"event {self.topic!r}: not a topic name (dotted lower-case words)")
        if not isinstance(self.table, Table):
            raise ConfigError(f"event {self.topic!r}: table must be a Table declaration")
        if self.op not in ("c", "u"):
            raise ConfigError(f"event {self.topic!r}: op {self.op!r} is not 'c' or 'u'")
        if not self.origin:
            object.__setattr__(self, "origin", _caller())
        object.__setattr__(self, "fields", dict(self.fields))
        object.__setattr__(self, "columns", self._resolve())
        # Looked up once here: change() runs for every record of the topic.
        parse = tuple((c.name, c.column, _PARSERS[c.type]) for c in self.columns)
        object.__setattr__(self, "_parse", parse)

    def _resolve(self) -> tuple[Column, ...]:
        table = self.table.name
        found: dict[str, Column] = {}  # by row column
        if self.table.tenant:
            found[self.table.tenant] = Column(
                TENANT_FIELD, self.table.tenant, "text", "The tenant id"
            )
        for entity, column in self.table.entities.items():
            found.setdefault(
                column, Column(column, column, entity.type, f"The {entity.name}'s key")
            )
        parameters = [p for q in self.table.reverse.values() for p in _PARAMETER.findall(q)]
        for name, declared in self.fields.items():
            identifier(name, f"event {self.topic!r} field")
            if not isinstance(declared, EventField):
                raise ConfigError(f"event {self.topic!r} field {name!r}: must be an EventField")
            identifier(declared.column, f"event {self.topic!r} field {name!r} column")
            known = found.get(declared.column)
            kind = declared.type or (known.type if known else None)
            if kind is None or kind not in KEY_TYPES:
                raise ConfigError(
                    f"event {self.topic!r} field {name!r}: give its type "
                    f"({', '.join(KEY_TYPES)}); column {table}.{declared.column} has no entity"
                )
            what = declared.description or (known.description if known else "")
            found[declared.column] = Column(name, declared.column, kind, what)
        missing = [p for p in dict.fromkeys(parameters) if p not in found]
        if missing:
            raise ConfigError(
                f"event {self.topic!r}: table {table!r}'s reverse queries take "
                f"{', '.join(':' + p for p in missing)}; declare each in fields with its type"
            )
        names = [c.name for c in found.values()]
        clash = {n for n in names if names.count(n) > 1} | ({"occurred_at", "version"} & {*names})
        if clash:
            raise ConfigError(f"event {self.topic!r}: field names {sorted(clash)} clash")
        return tuple(found.values())

    @property
    def required(self) -> tuple[str, ...]:
        """The wire names every record must give."""
        return tuple(c.name for c in self.columns)

    def change(self, obj: Mapping[str, Any]) -> ChangeEvent:
        """The change a decoded record describes; :class:`EventFieldError` if invalid."""
        row: dict[str, Any] = {}
        for name, column, parse in self._parse:
            value = obj.get(name)
            if value is None:
                raise EventFieldError("missing_field", name, "required")
            row[column] = parse(name, value)
        return self.change_of(row, _occurred_at_ms(obj), _version(obj))

    def change_of(
        self, row: dict[str, Any], committed_at_ms: int | None, version: int | None
    ) -> ChangeEvent:
        """The change of a checked record: ``row`` its columns' parsed values (a
        ``version`` is added to it as ``_version``)."""
        if version is not None:
            row["_version"] = version
        tenant = self.table.tenant
        return ChangeEvent(
            table=self.table.name,
            op=self.op,
            tenant=row[tenant] if tenant else None,
            row=row,
            watermark=0,
            committed_at_ms=committed_at_ms,
        )


_TEXT_RULE = "letters, digits, '_', '.' and '-', starting alphanumeric, at most 64 characters"
_UUID_PATTERN = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"


def _bigint_text(text: str) -> str:
    if int(text) > MAX_BIGINT:
        raise ValueError("out of range for a bigint id")
    return text


_FIELD_TYPES: dict[KeyType, tuple[Any, str]] = {
    "bigint": (
        Annotated[int, Strict(), Field(ge=0, le=MAX_BIGINT)]
        | Annotated[
            str,
            Strict(),
            StringConstraints(pattern="^(0|[1-9][0-9]{0,18})$"),
            AfterValidator(_bigint_text),
        ],
        "a non-negative integer, or a string of its digits without leading zeros",
    ),
    "uuid": (
        Annotated[str, Strict(), StringConstraints(pattern=_UUID_PATTERN)],
        "a UUID, either case (read as lower case)",
    ),
    "text": (
        Annotated[
            str,
            Strict(),
            StringConstraints(
                pattern=f"^{ID_PATTERN.pattern}$", min_length=1, max_length=MAX_ID_LENGTH
            ),
        ],
        _TEXT_RULE,
    ),
}


_When: TypeAlias = Annotated[AwareDatetime, Strict()] | SkipJsonSchema[None]
_Version: TypeAlias = Annotated[int, Strict()] | SkipJsonSchema[None]


def _optional(schema: dict[str, Any]) -> None:
    schema.pop("default", None)  # absent, not null, when not given


class _NoTitles(GenerateJsonSchema):
    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def record_model(event: Event) -> type[BaseModel]:
    """The pydantic model of ``event``'s records: every field typed and described as
    :meth:`Event.change` takes it (its JSON Schema is :func:`event_schema`)."""
    fields: dict[str, Any] = {}
    for column in event.columns:
        kind, rule = _FIELD_TYPES[column.type]
        where = f"{event.table.name}.{column.column}"
        fields[column.name] = (kind, Field(description=f"{column.description} ({where}): {rule}."))
    fields["occurred_at"] = (
        _When,
        Field(
            default=None,
            description="When the change was committed at the source (RFC 3339, with a "
            "UTC offset). Used to measure freshness lag.",
            json_schema_extra=_optional,
        ),
    )
    fields["version"] = (
        _Version,
        Field(
            default=None,
            description="The row's version at the source, if the producer keeps one. "
            "Informational: correctness never depends on it.",
            json_schema_extra=_optional,
        ),
    )
    verb = "inserted" if event.op == "c" else "changed"
    description = event.description or f"A {event.table.name} row was {verb}."
    model: type[BaseModel] = create_model(
        "Record",
        __config__=ConfigDict(
            extra="allow", title=event.topic, json_schema_extra={"description": description}
        ),
        **fields,
    )
    return model


def event_schema(event: Event) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``event``'s records, generated from
    :func:`record_model`: what :meth:`Event.change` accepts."""
    schema = record_model(event).model_json_schema(schema_generator=_NoTitles)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:freshline:event:{event.topic}",
        **schema,
    }


def schema_file(event: Event) -> tuple[str, str]:
    """``(file name, text)`` of ``event``'s schema file: ``<topic>.schema.json``."""
    return f"{event.topic}.schema.json", json.dumps(event_schema(event), indent=2) + "\n"
