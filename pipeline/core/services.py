"""Reaching the services: the one place Redis clients are built from settings, and
the one place that turns a connection failure into one line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import psycopg
import redis
import redis.asyncio
import sqlalchemy as sa
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from sqlalchemy.engine import make_url

from freshline.pipeline.core.errors import PermissionDenied, ServiceUnavailable
from freshline.pipeline.core.settings import Settings, load_settings, redact


def redis_options(settings: Settings) -> dict[str, Any]:
    """The credentials and TLS options ``settings`` add to its Redis URL.

    A username or password in ``FRESHLINE_REDIS_USERNAME``/``_PASSWORD`` wins over one
    in the URL. The TLS options apply to ``rediss://`` URLs only; redis-py then verifies
    the server's certificate (against ``redis_tls_ca`` when set).
    """
    options: dict[str, Any] = {}
    if settings.redis_username:
        options["username"] = settings.redis_username
    if settings.redis_password.get_secret_value():
        options["password"] = settings.redis_password.get_secret_value()
    if settings.redis_url.startswith("rediss://"):
        if settings.redis_tls_ca:
            options["ssl_ca_certs"] = settings.redis_tls_ca
        if settings.redis_tls_cert:
            options["ssl_certfile"] = settings.redis_tls_cert
            options["ssl_keyfile"] = settings.redis_tls_key or None
    return options


def redis_client(settings: Settings, url: str | None = None, **kwargs: Any) -> redis.Redis:
    """A Redis client for ``url`` (default: ``settings.redis_url``) with the settings'
    credentials and TLS options; ``kwargs`` are redis-py's (timeouts and the like).

    With ``settings.redis_cluster`` it is redis-py's ``RedisCluster``, typed as
    ``redis.Redis``: it answers the same commands; where a cluster needs another
    path the code asks :func:`freshline.pipeline.core.cluster.is_cluster`. The URL names one
    node; the client learns the others from it and follows slot moves and failovers.
    """
    url, options = _url_and_options(settings, url, kwargs)
    if settings.redis_cluster:
        cluster = RedisCluster.from_url(url, **options)
        return cast(redis.Redis, cluster)
    return redis.Redis.from_url(url, **options)


def async_redis_client(settings: Settings, **kwargs: Any) -> redis.asyncio.Redis:
    """:func:`redis_client` for asyncio: the same server, login, database and TLS
    options; redis-py's asyncio ``RedisCluster`` (typed as ``redis.asyncio.Redis``) with
    ``settings.redis_cluster``. It belongs to the event loop that first uses it."""
    url, options = _url_and_options(settings, None, kwargs)
    if settings.redis_cluster:
        cluster = AsyncRedisCluster.from_url(url, **options)
        return cast(redis.asyncio.Redis, cluster)
    return redis.asyncio.Redis.from_url(url, **options)


def _url_and_options(
    settings: Settings, url: str | None, kwargs: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    options = {**redis_options(settings), **kwargs}
    url = url or settings.redis_url
    if "username" in options or "password" in options:
        url = _without_login(url)  # redis-py would let the URL's login win
    if settings.redis_cluster:
        options.pop("db", None)
    return url, options


def consumer_redis_client(settings: Settings) -> redis.Redis:
    """The consumers' client: every command fails within the settings' timeouts, and
    redis-py never sends a command or pipeline again by itself.

    A pipeline of conditional writes that redis-py sent again after a lost reply (its
    cluster client retries ten times by default; its standalone defaults changed
    between releases) would land late, computed from an older snapshot than writes
    made meanwhile. The consumer retries the batch instead, recomputed from a new one
    (:mod:`freshline.consumers.failures` counts a cluster's own failover errors as transient).
    """
    return redis_client(
        settings,
        socket_timeout=settings.consumer_redis_timeout_s,
        socket_connect_timeout=settings.consumer_redis_connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def _without_login(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{scheme}{sep}{netloc.rpartition('@')[2]}{slash}{path}"


def kafka_security_config(settings: Settings) -> dict[str, Any]:
    """librdkafka's security options from ``settings``: protocol, SASL login, CA file.

    Empty for the default PLAINTEXT, so a plain broker sees the same clients as before.
    """
    config: dict[str, Any] = {}
    if settings.kafka_security_protocol != "plaintext":
        config["security.protocol"] = settings.kafka_security_protocol
    if settings.kafka_sasl_mechanism:
        config.update(
            {
                "sasl.mechanism": settings.kafka_sasl_mechanism,
                "sasl.username": settings.kafka_sasl_username,
                "sasl.password": settings.kafka_sasl_password.get_secret_value(),
            }
        )
    if settings.kafka_ssl_ca:
        config["ssl.ca.location"] = settings.kafka_ssl_ca
    return config


@contextmanager
def translate_errors() -> Iterator[None]:
    """Re-raise client connection errors as :class:`ServiceUnavailable`, and a refusal
    by Postgres's privileges as :class:`PermissionDenied` (role, setting, remedy)."""
    try:
        yield
    except psycopg.errors.InsufficientPrivilege as exc:
        raise permission_denied(exc) from exc
    except sa.exc.ProgrammingError as exc:
        if isinstance(exc.orig, psycopg.errors.InsufficientPrivilege):
            raise permission_denied(exc.orig) from exc
        raise
    except redis.exceptions.ConnectionError as exc:
        raise ServiceUnavailable("Redis", redact(load_settings().redis_url), str(exc)) from exc
    except sa.exc.OperationalError as exc:
        detail = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise ServiceUnavailable("Postgres", redact(load_settings().postgres_url), detail) from exc


def permission_denied(exc: psycopg.Error, settings: Settings | None = None) -> PermissionDenied:
    """The one line for a refused statement: commands that write log in with
    ``settings.migration_url``, so its role and setting are the ones to name."""
    settings = settings or load_settings()
    setting = (
        "FRESHLINE_POSTGRES_ADMIN_URL" if settings.postgres_admin_url else "FRESHLINE_POSTGRES_URL"
    )
    role = make_url(settings.migration_url).username or "(default)"
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "permission denied"
    return PermissionDenied(role, setting, detail)
