"""What a failure to apply a batch is about, which decides what the worker does with it.

Failures are classified by cause, never by where they surfaced:

- **transient** (:data:`TRANSIENT`): a service is away or behind: Postgres or Redis
  down, Redis full under ``noeviction``, a change not yet visible, a snapshot's WAL
  not yet flushed, Redis replicas that have not acknowledged the batch (``WAIT``). The worker holds
  the batch and retries it with backoff.
- **configuration** (:data:`CONFIGURATION`): the deployment is wrong, not the event:
  the deploy pointer, the lock, the eviction policy or another setting, a permission
  (Postgres's grants, Redis's ACL), a schema the migrations have not made, a Postgres
  whose history changed under the consumer (a promoted standby: see
  :class:`~freshline.consumers.processor.SourceChanged`). Every
  event would fail alike, so none is dead-lettered: the worker holds the batch, says
  once what to fix, and retries with the same backoff until it is fixed.
- **data** (:data:`DATA_ERRORS`): one event's own data cannot be applied (an id no
  key may hold, a value Postgres refuses). The worker finds the culprits by applying
  the batch's events one by one and dead-letters them with the reason.

- **refused** (:data:`FATAL`): an ACL refuses the consumer's login its group, a topic
  or the invalidation channel. The consumer stops with one line naming the ACL or
  the setting (:mod:`freshline.consumers.access`), its batch uncommitted.

Anything else is a bug: it ends the loop with the batch uncommitted.
"""

from __future__ import annotations

from typing import Literal

import psycopg
import redis
import sqlalchemy as sa

from freshline.consumers.kafka import NotAuthorized
from freshline.consumers.processor import PublishRefused, ReplicasBehind, SourceChanged
from freshline.pipeline.cache.recompute import NotYetDurable, NotYetVisible
from freshline.pipeline.core.errors import (
    AccessRefused,
    ConfigError,
    DefinitionFailed,
    DeployError,
    FreshlineError,
    LockMismatch,
    PermissionDenied,
)

TRANSIENT: tuple[type[BaseException], ...] = (
    NotYetVisible,
    NotYetDurable,
    ReplicasBehind,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.OutOfMemoryError,  # a full Redis under noeviction: wait for room
    # A cluster failing over or resharding: the consumer's client does not retry them
    # itself (freshline.pipeline.core.services.consumer_redis_client), the batch is retried.
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.RedisClusterUnreachableError,
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
)
CONFIGURATION: tuple[type[BaseException], ...] = (
    SourceChanged,
    DeployError,
    LockMismatch,
    ConfigError,
    PermissionDenied,
    sa.exc.ProgrammingError,  # the consumer's own SQL: a missing grant, table or function
    redis.exceptions.NoPermissionError,
    redis.exceptions.AuthenticationError,
)
"""Failures of the deployment, not of an event: held and retried, never dead-lettered.
Caught before :data:`TRANSIENT` (Redis's ``AuthenticationError`` is a connection error)
and before :data:`DATA_ERRORS` (most are :class:`FreshlineError`)."""
FATAL: tuple[type[BaseException], ...] = (AccessRefused, PublishRefused, NotAuthorized)
"""Refusals by an ACL (:mod:`freshline.consumers.access`): waiting cannot help, so the consumer
stops with one line naming the ACL or the setting; its batch stays uncommitted."""
RETRIED: tuple[type[BaseException], ...] = CONFIGURATION + TRANSIENT
"""Every failure that holds the batch rather than dead-letter an event."""
DATA_ERRORS: tuple[type[BaseException], ...] = (FreshlineError, ValueError, sa.exc.DataError)
"""Failures of one event's data: dead-lettered, never retried."""

Cause = Literal["deploy", "lock", "definition", "settings", "permission", "schema", "source"]


def service(exc: BaseException) -> str:
    """The label of a transient failure: ``visibility``, ``redis`` or ``postgres``."""
    if isinstance(exc, NotYetVisible):
        return "visibility"
    if isinstance(
        exc, ReplicasBehind | redis.exceptions.RedisError | redis.exceptions.RedisClusterException
    ):
        return "redis"
    return "postgres"


def cause(exc: BaseException) -> Cause:
    """The label of a configuration failure (an instance of :data:`CONFIGURATION`)."""
    if isinstance(exc, SourceChanged):
        return "source"
    if isinstance(exc, DeployError):
        return "deploy"
    if isinstance(exc, LockMismatch):
        return "lock"
    if isinstance(exc, DefinitionFailed):
        return "definition"
    if isinstance(exc, ConfigError):
        return "settings"
    if isinstance(exc, sa.exc.ProgrammingError) and not isinstance(
        exc.orig, psycopg.errors.InsufficientPrivilege
    ):
        return "schema"
    return "permission"


def remedy(exc: BaseException, *, role: str | None = None) -> str:
    """One line naming what is wrong and how to fix it; ``role`` is the Postgres login."""
    if isinstance(exc, sa.exc.ProgrammingError):
        detail = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        if cause(exc) == "permission":
            return (
                f"Postgres refused the consumer's query ({detail}); grant the role "
                f"{role or '(default)'} (FRESHLINE_POSTGRES_URL) what the repository's "
                "feature queries read"
            )
        return (
            f"Postgres refused the consumer's query ({detail}); run `freshline db upgrade` "
            "if the database is behind this code"
        )
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return (
            f"Redis refused the consumer's login ({exc}); check FRESHLINE_REDIS_USERNAME "
            "and FRESHLINE_REDIS_PASSWORD"
        )
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return (
            f"Redis refused a command to the consumer's user ({exc}); allow it in that "
            "user's ACL (FRESHLINE_REDIS_USERNAME)"
        )
    return str(exc) or repr(exc)
