"""Typed models of the domain events, as the JSON Schemas beside this file define them.

One schema file per topic (``<topic>.schema.json``, JSON Schema draft 2020-12); a test
checks that each file's ``required`` names are exactly the model's required fields.
Parsing is hand-written rather than generic: the consumer decodes thousands of events
a second, and each failure names the field and says whether it was missing, an id that
cannot reach a key, or a badly typed value.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from schemas.ids import id_problem

SCHEMA_DIR = Path(__file__).resolve().parent
MAX_BIGINT = 2**63 - 1

FieldProblem = Literal["missing_field", "invalid_id", "invalid_field"]


class EventFieldError(ValueError):
    """A domain event whose fields break its contract."""

    def __init__(self, kind: FieldProblem, field: str, reason: str) -> None:
        self.kind = kind
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


def schema_path(topic: str) -> Path:
    """The JSON Schema file of one domain-event topic."""
    return SCHEMA_DIR / f"{topic}.schema.json"


def _required(obj: dict[str, Any], name: str) -> Any:
    value = obj.get(name)
    if value is None:
        raise EventFieldError("missing_field", name, "required")
    return value


def _text_id(obj: dict[str, Any], name: str) -> str:
    value = _required(obj, name)
    if not isinstance(value, str):
        raise EventFieldError("invalid_id", name, "must be a string")
    problem = id_problem(value)
    if problem is not None:
        raise EventFieldError("invalid_id", name, problem)
    return value


def _numeric_id(obj: dict[str, Any], name: str) -> int:
    """A bigint id: an integer, or a string of digits (JSON producers in some languages
    cannot send 64-bit integers exactly)."""
    value = _required(obj, name)
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise EventFieldError("invalid_id", name, "must be an integer or a string of digits")
    if not 0 <= number <= MAX_BIGINT:
        raise EventFieldError("invalid_id", name, "out of range for a bigint id")
    return number


def _occurred_at(obj: dict[str, Any]) -> datetime | None:
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
    return moment


def _version(obj: dict[str, Any]) -> int | None:
    value = obj.get("version")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventFieldError("invalid_field", "version", "must be an integer")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class DomainEvent:
    """Fields every domain event has."""

    table: ClassVar[str]

    tenant: str
    occurred_at: datetime | None = None
    version: int | None = None

    @classmethod
    def parse(cls, obj: dict[str, Any]) -> Self:
        """Build the event from decoded JSON; raise :class:`EventFieldError` if invalid."""
        raise NotImplementedError

    def row(self) -> dict[str, Any]:
        """The event as the changed row's columns, named as in the source table."""
        raise NotImplementedError

    @property
    def occurred_at_ms(self) -> int | None:
        if self.occurred_at is None:
            return None
        return int(self.occurred_at.timestamp() * 1000)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransactionEvent(DomainEvent):
    """``transaction.created`` / ``transaction.updated``: one transaction row changed."""

    table: ClassVar[str] = "transactions"

    user_id: int
    transaction_id: int

    @classmethod
    def parse(cls, obj: dict[str, Any]) -> Self:
        return cls(
            tenant=_text_id(obj, "tenant"),
            user_id=_numeric_id(obj, "user_id"),
            transaction_id=_numeric_id(obj, "transaction_id"),
            occurred_at=_occurred_at(obj),
            version=_version(obj),
        )

    def row(self) -> dict[str, Any]:
        return {"tenant_id": self.tenant, "user_id": self.user_id, "id": self.transaction_id}


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceEvent(DomainEvent):
    """``device.updated``: one device row changed."""

    table: ClassVar[str] = "devices"

    device_id: str

    @classmethod
    def parse(cls, obj: dict[str, Any]) -> Self:
        return cls(
            tenant=_text_id(obj, "tenant"),
            device_id=_text_id(obj, "device_id"),
            occurred_at=_occurred_at(obj),
            version=_version(obj),
        )

    def row(self) -> dict[str, Any]:
        return {"tenant_id": self.tenant, "id": self.device_id}


@dataclass(frozen=True, slots=True, kw_only=True)
class UserEvent(DomainEvent):
    """``user.updated``: one user row changed."""

    table: ClassVar[str] = "users"

    user_id: int

    @classmethod
    def parse(cls, obj: dict[str, Any]) -> Self:
        return cls(
            tenant=_text_id(obj, "tenant"),
            user_id=_numeric_id(obj, "user_id"),
            occurred_at=_occurred_at(obj),
            version=_version(obj),
        )

    def row(self) -> dict[str, Any]:
        return {"tenant_id": self.tenant, "id": self.user_id}
