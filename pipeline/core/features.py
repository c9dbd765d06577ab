"""Feature definitions: entities, the tables that change them, and feature sets.

These are the classes a feature repository declares with (``freshline``, the top-level
package, exports them; :mod:`freshline.pipeline.core.repository` loads a repository):

* an :class:`Entity` names its key column and the key's type (``bigint``, ``text`` or
  ``uuid``, each validated before an id reaches a key), and optionally a tenant column
  (without one the repository is single-tenant: one implicit tenant) and the table whose
  rows are the entities;
* a :class:`Table` says how a changed row reaches entities: through a column holding the
  entity's key (the old and the new value both), or through a reverse-lookup query;
* a :class:`FeatureSet` is one set-based SQL query that computes its fields for a whole
  batch of keys in one round trip, with a TTL, the tables it reads, and optionally a
  horizon and an incremental path.

A feature query reads the batch from the relation ``keys`` (also named ``k``), whose
columns are the entity's tenant column (if it has one) and key column, and the moment it
computes for from ``t(as_of)`` (``:as_of``, or the transaction's ``now()``). It returns
one row per key, in no particular order: the tenant column (if any), the key, then the
fields in declared order.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import InitVar, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import orjson
import sqlalchemy as sa

from freshline.pipeline.core.errors import ConfigError, InvalidId, UnknownFeatureSet

if TYPE_CHECKING:
    from freshline.pipeline.core.incremental import IncrementalPath

FieldType = Literal["int", "float", "bool", "str", "timestamp"]
FIELD_TYPES: tuple[FieldType, ...] = ("int", "float", "bool", "str", "timestamp")
KeyType = Literal["bigint", "text", "uuid"]
KEY_TYPES: tuple[KeyType, ...] = ("bigint", "text", "uuid")
WriteMode = Literal["recompute", "invalidate"]
Path = Literal["full", "incremental"]
"""How a recompute evaluates a feature set: its defining ``query`` over the source rows
(``full``), or its ``incremental`` query over partial aggregates, which gives the same
values (an extension a repository registers: :mod:`freshline.pipeline.core.incremental`)."""

IMPLICIT_TENANT = "default"
"""The one tenant of a single-tenant repository (an entity without a tenant column)."""

AS_OF = "coalesce(CAST(:as_of AS timestamptz), now())"
"""The moment a feature query computes for: ``:as_of``, or the transaction's ``now()``."""

_IDENT = re.compile(r"[a-z_][a-z0-9_]*")
# What reads the clock (a query calling one computes for the moment it runs, not for
# t(as_of), so it cannot be evaluated at a past moment), and the moment parameter itself.
_CLOCK = re.compile(
    r"\b(?:(as_of|current_date|current_time|current_timestamp|localtime|localtimestamp)\b"
    r"|(now|clock_timestamp|statement_timestamp|transaction_timestamp|timeofday)\s*\()",
    re.IGNORECASE,
)
_NOT_CODE = re.compile(r"--[^\n]*|/\*.*?\*/|'(?:[^']|'')*'", re.DOTALL)
"""Comments and string literals: what a query says there is not code."""


def clock_calls(sql: str, *, as_of: bool = False) -> list[str]:
    """What in ``sql`` reads the clock (``now()``, ``current_date``, ...), and with
    ``as_of`` the moment parameter too, in order, each once, in lower case; comments and
    string literals are not looked at."""
    found = ((m[1] or f"{m[2]}()").lower() for m in _CLOCK.finditer(_NOT_CODE.sub(" ", sql)))
    return list(dict.fromkeys(name for name in found if as_of or name != "as_of"))


def reads_clock(query: str) -> str | None:
    """The first clock function ``query`` calls directly (``now()``, ``current_date``,
    ...), if any: such a query computes for the moment it runs rather than ``t(as_of)``."""
    found = clock_calls(query)
    return found[0] if found else None


_DURATION = re.compile(r"(\d+)(s|m|h|d)")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(value: int | str, what: str) -> int:
    """A duration as whole seconds: an int, or text such as ``"90s"``, ``"1h"``, ``"30d"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected seconds or a duration such as '1h', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{what}: must be positive, got {value}")
        return value
    match = _DURATION.fullmatch(str(value).strip())
    if match is None:
        raise ConfigError(f"{what}: expected a duration such as '90s', '1h', '30d', got {value!r}")
    return int(match[1]) * _SECONDS[match[2]]


def duration(value_s: int) -> str:
    """Seconds as the shortest duration text :func:`seconds` reads back (``"30d"``)."""
    for unit, size in sorted(_SECONDS.items(), key=lambda item: -item[1]):
        if value_s % size == 0:
            return f"{value_s // size}{unit}"
    return f"{value_s}s"  # pragma: no cover - every whole number of seconds divides by 1


def identifier(value: object, what: str) -> str:
    """A lower-case SQL identifier, the only kind definitions may name (never quoted)."""
    if not isinstance(value, str) or not _IDENT.fullmatch(value) or len(value) > 63:
        raise ConfigError(f"{what}: {value!r} is not a lower-case identifier ([a-z_][a-z0-9_]*)")
    return value


BIGINT_MAX = (1 << 63) - 1
BIGINT_RULE = "a bigint key is a non-negative integer without leading zeros"
UUID_RULE = "a uuid key is 8-4-4-4-12 hex digits and dashes, 36 characters"


def _bigint_id(value: object) -> str:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        isinstance(text, str)
        and text.isascii()
        and text.isdigit()
        and (text == "0" or text[0] != "0")
        and len(text) <= 19
        and int(text) <= BIGINT_MAX
    ):
        return text
    raise InvalidId("entity", value, BIGINT_RULE)


def _uuid_id(value: object) -> str:
    if isinstance(value, uuid.UUID):  # as Postgres's rows give it
        return str(value)
    if isinstance(value, str) and len(value) == 36:
        text = value.lower()  # many systems write upper case; Postgres answers lower
        try:
            parsed = uuid.UUID(text)
        except ValueError:
            pass
        else:
            if str(parsed) == text:
                return text
    raise InvalidId("entity", value, UUID_RULE)


def _text_id(value: object) -> str:
    from freshline.pipeline.core.keys import validate_id

    return validate_id("entity", value)


_ID_CHECKS = {"bigint": _bigint_id, "text": _text_id, "uuid": _uuid_id}


def validate_key(kind: KeyType, value: object) -> str:
    """``value`` as the canonical text of a key of type ``kind``, or :class:`InvalidId`.

    The one rule for entity ids wherever they come in (the read API, the Python client,
    change and domain events; training spines, when they come), so each takes and
    refuses the same ids, with the same message: ``bigint``, a non-negative integer (or
    its digits, no leading zeros); ``uuid``, 8-4-4-4-12 hex digits in either case,
    normalised to lower case (as Postgres writes it); ``text``, the id rule of
    :mod:`freshline.schemas.ids`.
    """
    return _ID_CHECKS[kind](value)


_CORE = os.path.dirname(__file__) + os.sep


def _caller() -> str:
    """``file:line`` of the code that declared a definition (outside the definition
    modules of this package, and the ``__init__`` dataclasses generate)."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_CORE) or frame.f_code.co_filename == "<string>"
    ):
        frame = frame.f_back  # type: ignore[assignment]
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""


@dataclass(frozen=True, slots=True)
class Entity:
    """What features are about: a member, a user, a device.

    ``key``: the key column (in ``keys`` and in the query's result); ``type``: the key's
    Postgres type, ``bigint``, ``text`` or ``uuid``. ``tenant``: the column holding the
    tenant (text), or None for a single-tenant repository. ``table``/``table_key``: the
    table whose rows are the entities and its key column (default ``key``); the read API
    stores a read-through only for ids with a row there, so a caller cannot fill Redis
    with entries of ids that do not exist. Without it, every computed entry is stored.
    ``active``: a SQL condition on a row ``e`` of that table that makes the entity worth
    warming before a deploy flips (``freshline deploy warm --all``); default every row.
    """

    name: str
    key: str = "id"
    type: KeyType = "bigint"
    tenant: str | None = None
    table: str | None = None
    table_key: str | None = None
    active: str | None = None

    def __post_init__(self) -> None:
        from freshline.pipeline.core.keys import validate_name

        try:
            validate_name("entity", self.name)
        except InvalidId as exc:
            raise ConfigError(f"entity {self.name!r}: {exc.reason}") from None
        identifier(self.key, f"entity {self.name!r} key")
        if self.type not in KEY_TYPES:
            raise ConfigError(
                f"entity {self.name!r}: key type {self.type!r} is not one of "
                f"{', '.join(KEY_TYPES)} (the types whose ids freshline can validate)"
            )
        if self.tenant is not None:
            identifier(self.tenant, f"entity {self.name!r} tenant column")
        if self.table is not None:
            identifier(self.table, f"entity {self.name!r} table")
        if self.table_key is not None:
            identifier(self.table_key, f"entity {self.name!r} table_key")
        if self.active is not None and self.table is None:
            raise ConfigError(f"entity {self.name!r}: 'active' needs the entity's table")

    @property
    def columns(self) -> tuple[str, ...]:
        """The key columns of ``keys`` and of a feature query's result, in order."""
        return (self.tenant, self.key) if self.tenant else (self.key,)

    def validate(self, value: object) -> str:
        """``value`` as the canonical text of a key of this entity, or :class:`InvalidId`."""
        return validate_key(self.type, value)

    def param(self, text: str) -> int | str:
        """A validated id as the query parameter of its type."""
        return int(text) if self.type == "bigint" else text

    def keys_cte(self) -> str:
        """``keys`` (and ``k``) over ``:tenants``/``:ids``, and ``t(as_of)``."""
        if self.tenant:
            unnest = f"unnest(CAST(:tenants AS text[]), CAST(:ids AS {self.type}[]))"
        else:
            unnest = f"unnest(CAST(:ids AS {self.type}[]))"
        return (
            f"\nWITH keys({', '.join(self.columns)}) AS (\n    SELECT * FROM {unnest}\n"
            f"), k AS (SELECT * FROM keys), t(as_of) AS (\n    SELECT {AS_OF}\n)\n"
        )


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    type: FieldType

    def __post_init__(self) -> None:
        identifier(self.name, "field name")
        if self.type not in FIELD_TYPES:
            raise ConfigError(
                f"field {self.name!r}: type {self.type!r} is not one of {', '.join(FIELD_TYPES)}"
            )


@dataclass(frozen=True, slots=True)
class Table:
    """A source table and how a changed row of it reaches entities.

    ``entities``: per entity, the column of this table that holds its key; both the old
    and the new value are routed, so a row that moves between entities affects both.
    ``reverse``: per entity, a query taking the changed row's columns as ``:name``
    parameters and returning the affected entities' key columns (tenant first). ``tenant``:
    the column holding the tenant; by default the entities' tenant column when the
    table routes through a column of its own, else none.
    """

    name: str
    entities: Mapping[Entity, str] = field(default_factory=dict)
    reverse: Mapping[Entity, str] = field(default_factory=dict)
    tenant: str | None = None

    def __post_init__(self) -> None:
        identifier(self.name, "table name")
        for entity, column in self.entities.items():
            identifier(column, f"table {self.name!r} column for entity {entity.name!r}")
        if self.tenant is None:
            tenants = {e.tenant for e in self.entities if e.tenant}
            if len(tenants) == 1:
                object.__setattr__(self, "tenant", tenants.pop())
        else:
            identifier(self.tenant, f"table {self.name!r} tenant column")

    def __hash__(self) -> int:
        return hash(self.name)

    def source_for(self, entity: Entity) -> Source | None:
        """How this table reaches ``entity``, or None if it does not."""
        column = next((c for e, c in self.entities.items() if e.name == entity.name), None)
        reverse = next((q for e, q in self.reverse.items() if e.name == entity.name), None)
        if column is None and reverse is None:
            return None
        return Source(self.name, (column,) if column else (), reverse, self.tenant)


@dataclass(frozen=True, slots=True)
class Source:
    """How changes to one source table reach one feature set's entities.

    ``entity_columns``: row columns holding an affected entity's key directly (both the
    old and the new value are looked at, so a row that moves entities affects both).
    ``reverse``: a query taking the changed row's columns as parameters and returning
    the entity's key columns (tenant first) for every affected entity. ``tenant``: the
    row's tenant column, if it has one.
    """

    table: str
    entity_columns: tuple[str, ...] = ()
    reverse: str | None = None
    tenant: str | None = "tenant_id"


@dataclass(frozen=True)
class FeatureSet:
    """A feature set: ``FeatureSet(name, entity=..., ttl="1h", sources=[...], fields=[...],
    query=...)``. ``sources`` are :class:`Table` declarations (or :class:`Source`s);
    ``ttl`` is seconds or a duration (``"1h"``)."""

    name: str
    entity: Entity = field(default_factory=lambda: Entity("user"))
    fields: tuple[Field, ...] = ()
    ttl_s: int = 0
    query: str = ""
    sources: tuple[Any, ...] = ()
    mode: WriteMode = "recompute"
    description: str = ""
    incremental: str | None = field(default=None, repr=False, compare=False)
    """The same features from partial aggregates: the query the ``maintenance`` path
    evaluates. Not part of the fingerprint."""
    maintenance: IncrementalPath | None = field(default=None, repr=False, compare=False)
    """The repository's :class:`~freshline.pipeline.core.incremental.IncrementalPath` that keeps
    those aggregates (a declared aggregation's is
    :class:`~freshline.pipeline.core.maintenance.DerivedPath`);
    required with ``incremental``."""
    path: Path = field(default="full", compare=False)
    """Which evaluation recomputes use by default. Not part of the fingerprint."""
    horizon: str | None = field(default=None, repr=False, compare=False)
    """For features that change with time alone (a window over the last days), a SQL
    expression for one key (``f.<tenant>``, ``f.<key>``; the moment computed for is
    :data:`AS_OF`) giving the first moment after it at which they may change with no
    source row changing: a row leaving or entering the window. ``NULL``: never. An
    entry expires then, if before its TTL, so a window that moves past a row leaves
    the entry absent rather than stale (:mod:`freshline.pipeline.cache.store`). Early is safe
    (a miss), late is not, so a horizon may be conservative. Not part of the
    fingerprint: it decides when an entry expires, never its value, and an entry
    written without one is still a valid entry of the same schema version."""
    max_staleness_ms: int | None = field(default=None, compare=False)
    """The default freshness bound of a read that gives none: an entry computed longer
    ago than this is recomputed (or waited for) rather than served, as with a read's
    ``max_staleness_ms`` (which, given, wins). ``None``: entries are served until their
    TTL or an invalidation. Not part of the fingerprint: it decides what a read
    accepts, never a value."""
    log_sample: float = field(default=0.0, compare=False)
    """The share of reads of this feature set the served log keeps (0 to 1), chosen by
    a hash of the request id, a request logged whole (:mod:`freshline.pipeline.observe.served`).
    Not part of the fingerprint: it decides what is logged, never a value."""
    ttl: InitVar[int | str | None] = None
    declared: object | None = field(default=None, repr=False, compare=False)
    """The declaration that generated ``query`` and ``horizon``, if one did (a
    :class:`freshline.pipeline.core.aggregations.Declaration`); ``plan`` shows it."""
    origin: str = field(default="", repr=False, compare=False)
    """Where it was declared (``file:line``), for error messages; set by the loader."""
    statement: sa.TextClause = field(init=False, repr=False, compare=False)
    _fingerprint: str = field(init=False, repr=False, compare=False)

    def __post_init__(self, ttl: int | str | None) -> None:
        from freshline.pipeline.core.keys import validate_name

        try:
            validate_name("feature set", self.name)
        except InvalidId as exc:
            raise ConfigError(f"feature set {self.name!r}: {exc.reason}") from None
        if not self.origin:
            object.__setattr__(self, "origin", _caller())
        if ttl is not None:
            object.__setattr__(self, "ttl_s", seconds(ttl, f"feature set {self.name!r} ttl"))
        object.__setattr__(self, "fields", tuple(self.fields))
        if self.max_staleness_ms is not None and (
            type(self.max_staleness_ms) is not int or self.max_staleness_ms < 0
        ):
            raise ConfigError(
                f"feature set {self.name!r}: max_staleness_ms must be an integer of 0 or "
                f"more (milliseconds), got {self.max_staleness_ms!r}"
            )
        if not (isinstance(self.log_sample, int | float) and 0.0 <= self.log_sample <= 1.0):
            raise ConfigError(
                f"feature set {self.name!r}: log_sample must be a share from 0 to 1, "
                f"got {self.log_sample!r}"
            )
        sources: list[Source] = []
        for declared in self.sources:
            if isinstance(declared, Table):
                source = declared.source_for(self.entity)
                if source is None:
                    raise ConfigError(
                        f"feature set {self.name!r}: table {declared.name!r} routes no change "
                        f"to entity {self.entity.name!r} (give it a column or a reverse query)"
                    )
                sources.append(source)
            else:
                sources.append(declared)
        object.__setattr__(self, "sources", tuple(sources))
        if self.mode not in ("recompute", "invalidate"):
            raise ConfigError(
                f"feature set {self.name!r}: mode {self.mode!r} is not recompute or invalidate"
            )
        if (self.incremental is None) != (self.maintenance is None):
            raise ConfigError(
                f"feature set {self.name!r}: an incremental query and its maintenance "
                "(an IncrementalPath) go together"
            )
        object.__setattr__(self, "statement", sa.text(self.entity.keys_cte() + self.query))
        object.__setattr__(self, "_fingerprint", self._digest())

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def fingerprint(self) -> str:
        """A digest of everything that shapes an entry: fields, types, query, TTL, mode.

        The repository's lock file records it per schema version; a change
        without a SCHEMA_VERSION bump is refused (``freshline check``).

        The ``incremental`` query and the ``path`` choice are left out on purpose. The
        defining ``query`` is the specification; the incremental query is a way of
        evaluating it that must give the same value for every field (the property
        tests and ``freshline reconcile`` hold it to that). Choosing a path is then
        like choosing an index: it changes the cost of an entry, never its value, so
        it needs no new key namespace, and a deployment can flip it per environment
        without a SCHEMA_VERSION bump. A change to the *values* still goes through
        ``query`` and is refused without a bump.
        """
        return self._fingerprint

    def _digest(self) -> str:
        body = orjson.dumps(
            {
                "name": self.name,
                "entity": self.entity.name,
                "fields": [[f.name, f.type] for f in self.fields],
                "ttl_s": self.ttl_s,
                "mode": self.mode,
                "query": " ".join(self.query.split()),
            }
        )
        return hashlib.sha256(body).hexdigest()[:16]

    def sources_for(self, table: str) -> list[Source]:
        return [s for s in self.sources if s.table == table]

    def sql(self, path: Path | None = None) -> str:
        """The statement's text on ``path`` (default: this set's own): keys in
        ``:tenants``/``:ids``, ``:as_of``."""
        path = path or self.path
        if path == "full":
            return self.statement.text
        self.on_path(path)  # raises without an incremental path
        assert self.maintenance is not None
        return self.maintenance.statement(self)

    def on_path(self, path: Path) -> FeatureSet:
        """This feature set recomputed by ``path`` by default."""
        if path == "incremental" and self.incremental is None:
            raise ConfigError(
                f"feature set {self.name!r} has no incremental path; "
                "it can only be recomputed in full"
            )
        return self if path == self.path else replace(self, path=path)


class Registry:
    """The feature sets by name."""

    def __init__(self, feature_sets: Iterable[FeatureSet]) -> None:
        self._sets = {fs.name: fs for fs in feature_sets}

    def __getitem__(self, name: str) -> FeatureSet:
        try:
            return self._sets[name]
        except KeyError:
            raise UnknownFeatureSet(name, list(self._sets)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._sets

    def __iter__(self) -> Iterator[FeatureSet]:
        return iter(self._sets.values())

    def names(self) -> list[str]:
        return list(self._sets)

    def affected_by(self, table: str) -> list[tuple[FeatureSet, Source]]:
        return [(fs, src) for fs in self._sets.values() for src in fs.sources_for(table)]

    def maintenances(self) -> list[IncrementalPath]:
        """The incremental paths of these feature sets, each once."""
        found: dict[int, IncrementalPath] = {}
        for fs in self._sets.values():
            if fs.maintenance is not None:
                found.setdefault(id(fs.maintenance), fs.maintenance)
        return list(found.values())

    def fingerprints(self) -> Mapping[str, str]:
        return {name: fs.fingerprint() for name, fs in self._sets.items()}

    def with_paths(self, paths: Mapping[str, Path]) -> Registry:
        """The same feature sets, with the recompute path of those named in ``paths``
        overridden (``FRESHLINE_RECOMPUTE_PATHS``); an unknown name is an error."""
        for name in paths:
            self[name]  # raises UnknownFeatureSet
        return Registry(fs.on_path(paths[fs.name]) if fs.name in paths else fs for fs in self)
