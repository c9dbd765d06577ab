"""Least privilege between the parts, on the stack ``scripts/stack up`` runs: the Redis ACL
users, the Postgres roles, Kafka's SCRAM listener, Connect's secrets, and Redis over TLS.

The logins come from ``.stack/env`` (tests/conftest.py keeps the least-privilege ones
under ``FRESHLINE_STACK_*`` and runs everything else as the operator). A stack started
before it had these logins has none of them: locally the tests that need one are skipped
until ``scripts/stack down && scripts/stack up``; under CI that is a failure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.api.fastpath import async_client
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cdc.connect import ConnectClient, connector_config, drop_slot, names
from freshline.pipeline.core.keys import ACTIVE_SCHEMA_KEY, INVALIDATION_CHANNEL, feature_key
from freshline.pipeline.core.maintenance import DerivedPath
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import (
    REGISTRY,
    as_user,
    assert_kafka_refuses,
    free_port,
    fresh_version,
    installed,
    kafka_login,
    need,
    redis_server,
    role_engine,
    running,
    self_signed_certificate,
    wait_until,
)


@pytest.fixture
def api_user(settings: Settings) -> Settings:
    return as_user(
        settings, need("FRESHLINE_STACK_REDIS_API_USER"), need("FRESHLINE_STACK_REDIS_API_PASSWORD")
    )


@pytest.fixture
def writer_user(settings: Settings) -> Settings:
    return as_user(
        settings,
        need("FRESHLINE_STACK_REDIS_WRITER_USER"),
        need("FRESHLINE_STACK_REDIS_WRITER_PASSWORD"),
    )


@pytest.fixture(scope="module")
def tenant(tenant_factory_module: Callable[..., SeedSummary]) -> str:
    return tenant_factory_module(users=10, transactions=200).tenants[0]


# ------------------------------------------------------------------------ Redis ACL


def test_the_default_user_is_off(settings: Settings) -> None:
    need("FRESHLINE_STACK_REDIS_ADMIN_USER")
    address = urlsplit(settings.redis_url)
    anonymous = redis.Redis(
        host=address.hostname or "127.0.0.1",
        port=address.port or 6379,
        ssl=address.scheme == "rediss",
        ssl_ca_certs=settings.redis_tls_ca or None,  # None: redis-py's default
    )
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.get("feat:1:txn_90d:{t:1}")
    anonymous.close()


@pytest.mark.parametrize(
    "command",
    [
        ("CONFIG", "GET", "maxmemory"),
        ("KEYS", "*"),
        ("MONITOR",),
        ("SET", "elsewhere:x", "1"),  # a write outside its key patterns
        ("PUBLISH", INVALIDATION_CHANNEL, "forged"),  # forging invalidations
        ("SUBSCRIBE", "elsewhere"),  # a channel it has no business in
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_the_api_user_gets_noperm(api_user: Settings, command: tuple[str, ...]) -> None:
    client = redis_client(api_user)
    try:
        assert client.acl_whoami() == api_user.redis_username
        with pytest.raises(redis.exceptions.NoPermissionError):
            if command[0] == "SUBSCRIBE":
                pubsub = client.pubsub()
                pubsub.subscribe(command[1])
                pubsub.get_message(timeout=1)
            else:
                client.execute_command(*command)
    finally:
        client.close()


# Commands that would do harm if the ACL let them through are asked of the ACL itself
# (ACL DRYRUN, as the admin): the same check, and the shared Redis survives a bug.
@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("SHUTDOWN",),
        ("CLIENT", "KILL", "TYPE", "pubsub"),
        ("CONFIG", "SET", "maxmemory", "1"),
        ("DEL", "freshline:models"),
        ("SET", ACTIVE_SCHEMA_KEY, "7"),  # the deploy pointer: read-only to it
        ("DEL", "elsewhere:x"),
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_the_api_user_may_not_run_destructive_commands(
    settings: Settings, api_user: Settings, command: tuple[str, ...]
) -> None:
    admin = redis_client(settings)
    try:
        verdict = admin.execute_command("ACL", "DRYRUN", api_user.redis_username, *command)
        allowed = admin.execute_command(
            "ACL", "DRYRUN", api_user.redis_username, "GET", "feat:1:txn_90d:{t:1}"
        )
    finally:
        admin.close()
    assert allowed == b"OK"
    assert verdict != b"OK" and b"no permissions" in verdict, verdict


def test_the_api_user_serves_and_fills_features(
    api_user: Settings, engine: Engine, tenant: str
) -> None:
    """The whole read path as the API's logins: the key lookup (and its last-used write)
    as ``freshline_api``, the read-through's lease and fill scripts as the Redis API
    user, the invalidation and deploy subscriptions."""
    api_engine = role_engine(api_user, "FRESHLINE_STACK_POSTGRES_API_URL")
    version = fresh_version()
    local = api_user.model_copy(update={"schema_version": version, "local_cache_size": 10})
    app = create_app(
        local, engine=api_engine, registry=REGISTRY
    )  # Redis: built from the API user's settings
    key = create_api_key(engine, tenant)
    try:
        with running(app, key) as api:
            first = api.get("/v1/features/txn_90d/1")
            again = api.get("/v1/features/txn_90d/1")
    finally:
        api_engine.dispose()
    assert first.status_code == 200, first.text
    assert again.status_code == 200
    want = compute(engine, REGISTRY["txn_90d"], [(tenant, "1")]).values[(tenant, "1")]
    assert first.json()["values"] == want
    admin = redis_client(
        api_user.model_copy(
            update={
                "redis_username": os.environ["FRESHLINE_REDIS_USERNAME"],
                "redis_password": SecretStr(os.environ["FRESHLINE_REDIS_PASSWORD"]),
            }
        )
    )
    stored = admin.exists(feature_key(version, EntityRef("txn_90d", tenant, "1")))
    admin.close()
    assert stored == 1  # the fill went through, as the API user


def test_the_writer_user_writes_features_but_not_deploys(
    settings: Settings, writer_user: Settings, engine: Engine, tenant: str
) -> None:
    client = redis_client(writer_user)
    try:
        assert client.acl_whoami() == writer_user.redis_username
        store = EntryStore(client, fresh_version(), registry=REGISTRY)
        batch = compute(engine, REGISTRY["device_risk"], [(tenant, "1")])
        assert store.write(batch).written == 1
        client.publish(INVALIDATION_CHANNEL, b"{}")  # consumers publish invalidations
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.keys("*")
    finally:
        client.close()
    admin = redis_client(settings)
    try:
        for command in (
            ("SET", ACTIVE_SCHEMA_KEY, "7"),
            ("FLUSHALL",),
            ("CONFIG", "SET", "maxmemory", "0"),
        ):
            verdict = admin.execute_command("ACL", "DRYRUN", writer_user.redis_username, *command)
            assert b"no permissions" in verdict, (command, verdict)
    finally:
        admin.close()


# ------------------------------------------------------------------------ Postgres roles


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO freshline.tenants (id, name) VALUES ('intruder', 'x')",
        "UPDATE transactions SET amount = 0",
        "DELETE FROM users",
        "TRUNCATE geoip",
        "UPDATE freshline.api_keys SET revoked_at = NULL",
        "INSERT INTO freshline.api_keys (key_hash, tenant_id, id) VALUES ('h', 'x', 'i')",
        "CREATE TABLE intruder (x int)",
    ],
)
@pytest.mark.parametrize(
    "role", ["FRESHLINE_STACK_POSTGRES_API_URL", "FRESHLINE_STACK_POSTGRES_CONSUMER_URL"]
)
def test_the_service_roles_cannot_write_source_tables(
    settings: Settings, role: str, statement: str
) -> None:
    eng = role_engine(settings, role)
    try:
        with eng.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM transactions")).scalar_one() >= 0
            with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
                conn.execute(sa.text(statement))
    finally:
        eng.dispose()


def test_only_the_consumer_role_may_fold_a_derived_path_and_neither_writes_it(
    settings: Settings,
) -> None:
    """The consumers fold txn_90d's logged days through the derived path's SECURITY
    DEFINER function; its partials and log stay read-only to both service roles."""
    path = REGISTRY["txn_90d"].maintenance
    assert isinstance(path, DerivedPath)
    fold = sa.text(f"SELECT freshline.{path.prefix}_fold(10, false, false)")
    consumer = role_engine(settings, "FRESHLINE_STACK_POSTGRES_CONSUMER_URL")
    api = role_engine(settings, "FRESHLINE_STACK_POSTGRES_API_URL")
    try:
        with consumer.begin() as conn:
            assert conn.execute(fold).scalar_one() is not None
        for eng in (consumer, api):
            for table in (path.days, path.log):
                with (
                    eng.connect() as conn,
                    pytest.raises(sa.exc.ProgrammingError, match="permission denied"),
                ):
                    conn.execute(sa.text(f"DELETE FROM {table}"))
        with (
            api.connect() as conn,
            pytest.raises(sa.exc.ProgrammingError, match="permission denied"),
        ):
            conn.execute(fold)
    finally:
        consumer.dispose()
        api.dispose()


def test_the_api_role_may_mark_a_key_used(settings: Settings, engine: Engine, tenant: str) -> None:
    create_api_key(engine, tenant)
    eng = role_engine(settings, "FRESHLINE_STACK_POSTGRES_API_URL")
    try:
        with eng.begin() as conn:
            updated = conn.execute(
                sa.text("UPDATE freshline.api_keys SET last_used_at = now() WHERE tenant_id = :t"),
                {"t": tenant},
            )
        assert updated.rowcount >= 1
    finally:
        eng.dispose()


def test_only_the_api_role_reads_api_keys(settings: Settings, engine: Engine, tenant: str) -> None:
    """Key hashes are for the API, which checks keys; the consumers' login (and
    ``freshline warm``'s) reads the tenants and never the keys."""
    create_api_key(engine, tenant)
    consumer = role_engine(settings, "FRESHLINE_STACK_POSTGRES_CONSUMER_URL")
    api = role_engine(settings, "FRESHLINE_STACK_POSTGRES_API_URL")
    try:
        with consumer.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM freshline.tenants")).scalar_one()
            for column in ("key_hash", "tenant_id", "id"):
                with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
                    conn.execute(sa.text(f"SELECT {column} FROM freshline.api_keys"))
                conn.rollback()
        with api.connect() as conn:
            assert conn.execute(sa.text("SELECT count(key_hash) FROM freshline.api_keys")).scalar()
    finally:
        consumer.dispose()
        api.dispose()


# ------------------------------------------------------------------------ Kafka SCRAM
# What each login may do is in tests/test_stack_security.py.


def test_a_wrong_scram_password_is_refused(settings: Settings) -> None:
    login = kafka_login(settings, "consumer")
    assert_kafka_refuses(
        login.model_copy(update={"kafka_sasl_password": SecretStr("not-the-password")})
    )


# ------------------------------------------------------------------------ Connect secrets


def test_connect_never_shows_the_database_password(settings: Settings, engine: Engine) -> None:
    secrets = need("FRESHLINE_CONNECT_SECRETS_FILE")
    tag = uuid.uuid4().hex[:8]
    local = settings.model_copy(
        update={"topic_prefix": f"sec{tag}.", "connect_secrets_file": secrets}
    )
    owned = names(local)
    client = ConnectClient(local.connect_url)
    config = connector_config(local, owned, snapshot_mode="no_data")
    reference = f"${{file:{secrets}:database.password}}"
    assert config["database.password"] == reference
    client.put_config(owned.connector, config)
    try:
        # RUNNING means the worker resolved the reference and logged in to Postgres.
        assert wait_until(lambda: _task_state(client, owned.connector) == "RUNNING", timeout=90), (
            client.status(owned.connector)
        )
        status, shown = client.request("GET", f"/connectors/{owned.connector}/config")
        assert status == 200
        status, tasks = client.request("GET", f"/connectors/{owned.connector}/tasks")
        assert status == 200
        for seen in (shown, *(task["config"] for task in tasks)):
            assert seen["database.password"] == reference
            assert [v for k, v in seen.items() if "password" in k] == [reference]
    finally:
        client.delete(owned.connector)
        drop_slot(engine, owned.slot)


def _task_state(client: ConnectClient, name: str) -> str | None:
    status = client.status(name) or {}
    tasks = status.get("tasks") or []
    return str(tasks[0].get("state")) if tasks else None


# ------------------------------------------------------------------------ Redis over TLS


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A private redis-server that speaks only TLS and requires a client certificate;
    the CA and certificates are made with openssl into ``tmp_path``."""
    openssl = installed("openssl", "openssl")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=tmp_path, check=True, capture_output=True)

    self_signed_certificate(tmp_path / "ca.crt", tmp_path / "ca.key", "/CN=test CA")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            *ext,
            "-out",
            f"{name}.crt",
        )
    port = free_port()
    proc = subprocess.Popen(
        redis_server(
            0,
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(tmp_path / "server.crt"),
            "--tls-key-file",
            str(tmp_path / "server.key"),
            "--tls-ca-cert-file",
            str(tmp_path / "ca.crt"),
            "--tls-auth-clients",
            "yes",
            "--user",
            "tester",
            "on",
            ">s3cret",
            "~*",
            "&*",
            "+@all",
            "--user",
            "default",
            "off",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not _listening(port):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("the TLS redis-server did not start")
        time.sleep(0.02)  # polling interval while the server starts
    yield port, tmp_path
    proc.terminate()
    proc.wait(5)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def tls_settings(port: int, certs: Path, **extra: Any) -> Settings:
    return Settings(
        **{
            "redis_url": f"rediss://127.0.0.1:{port}/0",
            "redis_username": "tester",
            "redis_password": "s3cret",
            "redis_tls_ca": str(certs / "ca.crt"),
            "redis_tls_cert": str(certs / "client.crt"),
            "redis_tls_key": str(certs / "client.key"),
            **extra,
        }
    )


def test_redis_over_tls_with_a_client_certificate(tls_redis: tuple[int, Path]) -> None:
    port, certs = tls_redis
    settings = tls_settings(port, certs)
    client = redis_client(settings)
    client.set("feat:1:txn_90d:{t:1}", b"x")
    assert client.get("feat:1:txn_90d:{t:1}") == b"x"

    async def api_reads() -> bytes | str | None:
        fast = async_client(settings)  # the API's asyncio client: the same TLS options
        try:
            return await fast.get("feat:1:txn_90d:{t:1}")
        finally:
            await fast.aclose()

    import anyio

    assert anyio.run(api_reads) == b"x"
    client.close()


@pytest.mark.parametrize("missing", ["certificate", "ca", "tls"])
def test_redis_tls_needs_each_option(tls_redis: tuple[int, Path], missing: str) -> None:
    """Each TLS option is really used: without it the same server refuses the client."""
    port, certs = tls_redis
    update: dict[str, Any] = {
        "certificate": {"redis_tls_cert": "", "redis_tls_key": ""},
        "ca": {"redis_tls_ca": ""},
        "tls": {"redis_url": f"redis://127.0.0.1:{port}/0"},
    }[missing]
    client = redis_client(
        tls_settings(port, certs, **update), socket_connect_timeout=2, socket_timeout=2
    )
    with pytest.raises(redis.exceptions.ConnectionError):
        client.ping()
    client.close()
