"""Reaching the services: one place that turns a connection failure into one line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
import sqlalchemy as sa

from pipeline.core.errors import ServiceUnavailable
from pipeline.core.settings import load_settings, redact


@contextmanager
def translate_errors() -> Iterator[None]:
    """Re-raise client connection errors as :class:`ServiceUnavailable`."""
    try:
        yield
    except redis.exceptions.ConnectionError as exc:
        raise ServiceUnavailable("Redis", redact(load_settings().redis_url), str(exc)) from exc
    except sa.exc.OperationalError as exc:
        detail = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise ServiceUnavailable("Postgres", redact(load_settings().postgres_url), detail) from exc
