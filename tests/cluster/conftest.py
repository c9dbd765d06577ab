"""The cluster topology's tests: ``-m cluster``, against ``scripts/stack up --topology
cluster`` (Redis Cluster 3+3, three Kafka brokers, a Postgres replica).

Skipped when that topology is not up, unless ``FRESHLINE_CLUSTER_REQUIRED=1`` (set by
scripts/test, which starts it): then a missing topology fails the run. The settings
come from ``.stack/cluster/env``, never from the single topology's. As on the single
topology (tests/helpers.py), the tests act as the operator: the Postgres owner, the
Redis admin and the Kafka admin; the least-privilege logins stay in ``cluster_env``
(:func:`kafka_login`) for the clients that are services and for the tests of those
logins (test_cluster_security.py).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from confluent_kafka.admin import (
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from pydantic import SecretStr

from freshline.pipeline.core.services import kafka_security_config, redis_client
from freshline.pipeline.core.settings import Settings
from tests.helpers import migrate

ROOT = Path(__file__).resolve().parents[2]
STACK = Path(os.environ.get("FRESHLINE_STACK_DIR", ROOT / ".stack"))
ENV_FILE = STACK / "cluster" / "env"
PORTS = (7001, 7002, 7003, 7004, 7005, 7006, 19092, 19093, 19094, 15432, 15433)


def _open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _cluster_env() -> dict[str, str] | None:
    if not ENV_FILE.exists() or not all(_open(p) for p in PORTS):
        return None
    env: dict[str, str] = {}
    for line in ENV_FILE.read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            env[key] = shlex.split(value)[0] if value else ""
    return env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cluster_env() is not None or os.environ.get("FRESHLINE_CLUSTER_REQUIRED") == "1":
        return
    skip = pytest.mark.skip(reason="cluster topology not up (scripts/stack up --topology cluster)")
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster_env() -> dict[str, str]:
    env = _cluster_env()
    if env is None:
        pytest.fail("FRESHLINE_CLUSTER_REQUIRED=1 but the cluster topology is not up")
    return env


@pytest.fixture(scope="session")
def cluster_settings(cluster_env: dict[str, str]) -> Settings:
    # The replica's URL is left out: the tests that read through it build their own
    # ReadThrough on it (test_pg_replica.py), the rest read the primary.
    fields = {
        k.removeprefix("FRESHLINE_").lower(): v
        for k, v in cluster_env.items()
        if k.startswith("FRESHLINE_")
        and not k.startswith("FRESHLINE_STACK_")
        and k != "FRESHLINE_POSTGRES_REPLICA_URL"
    }
    # The operator's logins (see the module's docstring).
    if "FRESHLINE_POSTGRES_ADMIN_URL" in cluster_env:
        fields["postgres_url"] = cluster_env["FRESHLINE_POSTGRES_ADMIN_URL"]
    if "FRESHLINE_STACK_REDIS_ADMIN_USER" in cluster_env:
        fields["redis_username"] = cluster_env["FRESHLINE_STACK_REDIS_ADMIN_USER"]
        fields["redis_password"] = cluster_env["FRESHLINE_STACK_REDIS_ADMIN_PASSWORD"]
    if "FRESHLINE_STACK_KAFKA_ADMIN_USER" in cluster_env:
        fields["kafka_sasl_username"] = cluster_env["FRESHLINE_STACK_KAFKA_ADMIN_USER"]
        fields["kafka_sasl_password"] = cluster_env["FRESHLINE_STACK_KAFKA_ADMIN_PASSWORD"]
    # Credentials the single topology's .stack/env may set must not reach this one.
    for name in (
        "redis_username",
        "redis_password",
        "redis_tls_ca",
        "kafka_sasl_mechanism",
        "kafka_sasl_username",
        "kafka_sasl_password",
        "kafka_ssl_ca",
        "postgres_admin_url",
    ):
        if name in Settings.model_fields:
            fields.setdefault(name, "")
    if "kafka_security_protocol" in Settings.model_fields:
        fields.setdefault("kafka_security_protocol", "plaintext")
    return Settings(**fields)  # type: ignore[arg-type]


@pytest.fixture
def cluster_redis(cluster_settings: Settings) -> Iterator[redis.Redis]:
    client = redis_client(cluster_settings)
    yield client
    nodes = list(client.nodes_manager.nodes_cache.values())  # type: ignore[attr-defined]
    client.close()
    # redis-py's close leaves each node's pool open (its COMMAND GETKEYS socket
    # included): close them, or they are reported unclosed at garbage collection.
    for node in nodes:
        if node.redis_connection is not None:
            node.redis_connection.connection_pool.disconnect()


def kafka_login(settings: Settings, cluster_env: dict[str, str], login: str) -> Settings:
    """``settings`` logged in to the brokers as one of the cluster's logins: ``consumer``
    (the env file's default), ``producer`` (domain events), ``connect`` or ``admin``."""
    if login == "consumer":
        user, password = "FRESHLINE_KAFKA_SASL_USERNAME", "FRESHLINE_KAFKA_SASL_PASSWORD"
    else:
        user, password = (
            f"FRESHLINE_STACK_KAFKA_{login.upper()}_{k}" for k in ("USER", "PASSWORD")
        )
    return settings.model_copy(
        update={
            "kafka_sasl_username": cluster_env[user],
            "kafka_sasl_password": SecretStr(cluster_env[password]),
        }
    )


def revoke_writer(admin: AdminClient, user: str, topics: list[str]) -> None:
    """Remove every ACL of the SASL login ``user`` on ``topics`` (literal names), as
    :func:`freshline.consumers.topics.allow_writer` added them."""
    filters = [
        AclBindingFilter(
            ResourceType.TOPIC,
            name,
            ResourcePatternType.LITERAL,
            f"User:{user}",
            "*",
            AclOperation.ANY,
            AclPermissionType.ANY,
        )
        for name in topics
    ]
    for future in admin.delete_acls(filters).values():
        future.result()


def kafka_config(settings: Settings, **config: Any) -> dict[str, Any]:
    """librdkafka's configuration for a plain client of the cluster's brokers: the
    bootstrap servers and the SCRAM login in ``settings``, then ``config``."""
    return {
        "bootstrap.servers": settings.kafka_bootstrap,
        **kafka_security_config(settings),
        **config,
    }


@pytest.fixture(scope="session")
def engines(
    cluster_env: dict[str, str], cluster_settings: Settings
) -> Iterator[tuple[sa.Engine, sa.Engine]]:
    """The cluster topology's Postgres primary (as the owner) and replica (as the
    superuser, who may pause its replay), migrated to the head (the fraud example's
    tables the feature queries read, and txn_90d's derived path)."""
    migrate(cluster_settings.postgres_url)
    primary = sa.create_engine(cluster_settings.postgres_url)
    replica_port = sa.engine.make_url(cluster_env["FRESHLINE_POSTGRES_REPLICA_URL"]).port
    superuser = cluster_env.get("FRESHLINE_STACK_POSTGRES_SUPERUSER_URL")
    replica = sa.create_engine(
        sa.engine.make_url(superuser).set(port=replica_port)
        if superuser
        else cluster_env["FRESHLINE_POSTGRES_REPLICA_URL"]
    )
    yield primary, replica
    primary.dispose()
    replica.dispose()


def stack(*args: str) -> None:
    """``scripts/stack ARGS --topology cluster``; fails the test with its output."""
    done = subprocess.run(
        [str(ROOT / "scripts" / "stack"), *args, "--topology", "cluster"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def add_tenant(conn: sa.Connection, tenant: str, users: int) -> None:
    """A tenant of its own, with users 1 to ``users``."""
    conn.execute(sa.text("INSERT INTO freshline.tenants (id, name) VALUES (:t, :t)"), {"t": tenant})
    conn.execute(
        sa.text("INSERT INTO users (tenant_id, id) SELECT :t, g FROM generate_series(1, :n) g"),
        {"t": tenant, "n": users},
    )
