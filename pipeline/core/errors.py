"""The exception hierarchy: one root, a few subclasses that carry data."""

from __future__ import annotations


class FreshlineError(Exception):
    """Root of every error freshline raises on purpose."""


class ConfigError(FreshlineError):
    """A setting is missing or invalid."""


class DefinitionFailed(ConfigError):
    """A feature set's statement (its query or horizon) does not run on this database:
    the definition at ``origin`` is wrong (``freshline plan`` runs the same statement)."""

    def __init__(self, feature_set: str, origin: str, detail: str) -> None:
        self.feature_set = feature_set
        self.origin = origin
        self.detail = detail
        super().__init__(
            f"feature set {feature_set!r} ({origin or 'no origin'}): its statement fails: "
            f"{detail}; fix the definition (freshline plan checks it against the database)"
        )


STACK_HINT = "start the local stack with: scripts/stack up"


class ServiceUnavailable(FreshlineError):
    """A service (Postgres, Redis, Kafka, Kafka Connect, an HTTP endpoint) did not answer.

    ``hint`` is the remedy the message ends with: by default, start the local stack;
    a caller that knows better (the API is a process of its own) names its own.
    """

    def __init__(self, service: str, url: str, detail: str = "", hint: str = STACK_HINT) -> None:
        self.service = service
        self.url = url
        self.detail = detail
        self.hint = hint
        super().__init__(f"{service} is not reachable at {url} ({detail or 'no answer'}); {hint}")


class PermissionDenied(FreshlineError):
    """Postgres refused a statement to the role freshline logged in as.

    Commands that write (seed, tenants, API keys, the demo's changes, schema changes) log in
    as the owner, FRESHLINE_POSTGRES_ADMIN_URL; without it they fall back to
    FRESHLINE_POSTGRES_URL, which is usually a read-only service role.
    """

    def __init__(self, role: str, setting: str, detail: str) -> None:
        self.role = role
        self.setting = setting
        self.detail = detail
        if setting == "FRESHLINE_POSTGRES_URL":
            remedy = (
                "set FRESHLINE_POSTGRES_ADMIN_URL to the owner's login (scripts/stack "
                "writes it to .stack/env: set -a; . .stack/env; set +a) and run it again"
            )
        else:
            remedy = (
                f"{setting} must name the role that owns freshline's tables "
                "(the one freshline db upgrade ran as)"
            )
        super().__init__(f"Postgres {detail} for role {role!r} ({setting}); {remedy}")


class InvalidId(FreshlineError, ValueError):
    """A tenant, entity, model or arm id that must never reach a key."""

    def __init__(self, kind: str, value: object, reason: str) -> None:
        self.kind = kind
        self.value = value
        self.reason = reason
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid {kind} id {shown}: {reason}")


class UnknownFeatureSet(FreshlineError, KeyError):
    """A feature set name that is not in the registry."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        super().__init__(f"unknown feature set {name!r}; known: {', '.join(sorted(known))}")

    def __str__(self) -> str:
        return str(self.args[0])


class SchemaVersionMismatch(FreshlineError):
    """An entry or write names a schema version other than the one expected."""

    def __init__(self, expected: int, found: int) -> None:
        self.expected = expected
        self.found = found
        super().__init__(f"schema version mismatch: expected {expected}, found {found}")


class CorruptEntry(FreshlineError):
    """Bytes in a feature key that do not decode as an entry."""


class LockMismatch(FreshlineError):
    """A feature definition changed without a SCHEMA_VERSION bump."""


class DeployError(FreshlineError):
    """A warm, flip or purge that would be unsafe."""


class SchemaVersionUnknown(FreshlineError):
    """A reader cannot serve the active schema version: it cannot decode or compute it,
    and its own version is no longer written (:mod:`freshline.pipeline.cache.versions`)."""

    def __init__(self, version: int, own: int) -> None:
        self.version = version
        self.own = own
        super().__init__(
            f"schema version {version} is active, which this reader does not compute "
            f"(it computes {own}, no longer written); retry on a reader that knows it"
        )


class ModelError(FreshlineError):
    """An unknown model, or one that must not be cached."""


class AccessRefused(FreshlineError):
    """A service refused a login something it must do, by an ACL or a grant: waiting
    cannot help, so the process stops and the message names the ACL or the setting."""
