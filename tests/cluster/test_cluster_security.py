"""Least privilege on the cluster topology, as on the single one (issue 28 item 9,
issue 30 item 10): every Redis node, replicas included, has the ACL users and no
default user; the brokers take only SCRAM logins and allow each only what the single
topology's ACLs grant it; the Postgres owner is no superuser and its password is made
per instance (``-m cluster``; see conftest).

The logins come from ``.stack/cluster/env``; the tests of what a Redis login may not do
ask ``ACL DRYRUN`` (as the admin) where a command let through would harm the shared
topology.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from confluent_kafka.admin import (
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from freshline.consumers.kafka import admin_client
from freshline.pipeline.core.errors import ServiceUnavailable
from freshline.pipeline.core.keys import ACTIVE_SCHEMA_KEY, INVALIDATION_CHANNEL
from freshline.pipeline.core.maintenance import DerivedPath
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import Settings
from tests import kafka_acls
from tests.cluster.conftest import ENV_FILE, kafka_login
from tests.helpers import REGISTRY, assert_kafka_refuses, wait_until
from tests.test_derived_roles import assert_only_the_owner_may_write, freshline_logins, new_role

pytestmark = pytest.mark.cluster

REDIS_PORTS = (7001, 7002, 7003, 7004, 7005, 7006)
BROKER_PORTS = (19092, 19093, 19094)
FEATURE_KEY = "feat:1:txn_90d:{t:1}"


def node(cluster_env: dict[str, str], port: int, user: str = "ADMIN") -> redis.Redis:
    """A plain (non-cluster) client of one node, logged in as the ``user`` login of
    ``.stack/cluster/env`` (ADMIN or WRITER)."""
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        username=cluster_env[f"FRESHLINE_STACK_REDIS_{user}_USER"],
        password=cluster_env[f"FRESHLINE_STACK_REDIS_{user}_PASSWORD"],
    )


@pytest.fixture
def api_settings(cluster_settings: Settings, cluster_env: dict[str, str]) -> Settings:
    return cluster_settings.model_copy(
        update={
            "redis_username": cluster_env["FRESHLINE_REDIS_USERNAME"],
            "redis_password": SecretStr(cluster_env["FRESHLINE_REDIS_PASSWORD"]),
        }
    )


@pytest.fixture
def admins(cluster_env: dict[str, str]) -> Iterator[list[redis.Redis]]:
    clients = [node(cluster_env, port) for port in REDIS_PORTS]
    yield clients
    for client in clients:
        client.close()


# ------------------------------------------------------------------------ Redis ACL


@pytest.mark.parametrize("port", REDIS_PORTS)
def test_the_default_user_is_refused_on_every_node(port: int) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=port)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.get(FEATURE_KEY)
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.execute_command("AUTH", "default", "")
    finally:
        anonymous.close()


def rules(client: redis.Redis, user: str) -> dict[str, Any]:
    """``ACL GETUSER``'s answer in a comparable form: no password hashes, each list
    sorted (a node lists a user's commands in its own order)."""
    got: dict[str, Any] = client.acl_getuser(user) or {}
    return {
        k: sorted(map(str, v)) if isinstance(v, list) else v
        for k, v in got.items()
        if k != "passwords"
    }


def test_every_node_has_the_same_users(admins: list[redis.Redis]) -> None:
    """Replicas too: a failover promotes one, and it must refuse what its master did."""
    users = sorted(str(u) for u in admins[0].acl_users())
    assert users == sorted(
        ["default", "freshline-admin", "freshline-api", "freshline-writer", "freshline-replication"]
    )
    want = {u: rules(admins[0], u) for u in users}
    assert "off" in want["default"]["flags"]
    for client in admins[1:]:
        assert {u: rules(client, u) for u in users} == want


@pytest.mark.parametrize(
    "command",
    [
        ("CONFIG", "GET", "maxmemory"),
        ("KEYS", "*"),
        ("SET", "elsewhere:x", "1"),  # a write outside its key patterns
        ("SPUBLISH", INVALIDATION_CHANNEL, "forged"),  # forging invalidations
        ("PUBLISH", INVALIDATION_CHANNEL, "forged"),
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_the_api_user_gets_noperm(api_settings: Settings, command: tuple[str, ...]) -> None:
    client = redis_client(api_settings)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command, target_nodes="primaries")
    finally:
        client.close()


# What the single topology forbids the API's and the writers' logins, asked of every
# node's ACL: the same verdicts.
DRYRUN = [
    ("GET", FEATURE_KEY),
    ("SET", FEATURE_KEY, "1"),
    ("EVAL", "return 1", "1", FEATURE_KEY),
    ("SET", "floor:1:{t:1}", "1"),
    ("SET", ACTIVE_SCHEMA_KEY, "7"),
    ("DEL", "freshline:models"),
    ("FLUSHALL",),
    ("SHUTDOWN",),
    ("CONFIG", "SET", "maxmemory", "1"),
    ("CLUSTER", "FAILOVER"),
    ("CLUSTER", "RESET"),
    ("ACL", "SETUSER", "default", "on"),
    ("REPLICAOF", "NO", "ONE"),
    ("DEBUG", "SLEEP", "0"),
]


def verdicts(client: redis.Redis, user: str) -> list[bool]:
    return [client.execute_command("ACL", "DRYRUN", user, *command) == b"OK" for command in DRYRUN]


@pytest.mark.parametrize("user", ["freshline-api", "freshline-writer"])
def test_the_service_users_may_do_what_the_single_topology_allows_and_no_more(
    admins: list[redis.Redis], base_settings: Settings, user: str
) -> None:
    """The single topology's Redis (``.stack/env``, its admin) is the reference: the
    cluster's nodes must give each login the same verdicts, whatever they are."""
    single = redis_client(base_settings)
    try:
        try:
            want = verdicts(single, user)
        except redis.exceptions.ConnectionError:
            pytest.skip("the single topology's Redis is not up: no reference")
    finally:
        single.close()
    assert want[0] and not any(want[4:]), want  # GET served, the harmful ones refused
    for client in admins:
        assert verdicts(client, user) == want, client.connection_pool.connection_kwargs["port"]


def test_the_replication_user_may_only_replicate(admins: list[redis.Redis]) -> None:
    for command in (("GET", FEATURE_KEY), ("INFO",), ("CLUSTER", "NODES"), ("KEYS", "*")):
        verdict = admins[0].execute_command("ACL", "DRYRUN", "freshline-replication", *command)
        assert b"no permissions" in verdict, (command, verdict)
    assert admins[0].execute_command("ACL", "DRYRUN", "freshline-replication", "PING") == b"OK"


def test_the_writer_writes_features_on_a_master(cluster_env: dict[str, str]) -> None:
    writer = node(cluster_env, 7001, "WRITER")
    try:
        assert writer.acl_whoami() == cluster_env["FRESHLINE_STACK_REDIS_WRITER_USER"]
        with pytest.raises(redis.exceptions.NoPermissionError):
            writer.keys("*")
    finally:
        writer.close()


# ------------------------------------------------------------------------ Postgres


def test_the_owner_is_no_superuser_and_may_not_make_roles(cluster_settings: Settings) -> None:
    owner = sa.create_engine(cluster_settings.postgres_url, poolclass=sa.pool.NullPool)
    try:
        with owner.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT current_user, rolsuper, rolcreaterole, rolcreatedb, rolreplication "
                    "FROM pg_roles WHERE rolname = current_user"
                )
            ).one()
            assert tuple(row) == ("freshline", False, False, True, True)
            with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
                conn.execute(sa.text("CREATE ROLE freshline_test_never LOGIN"))
    finally:
        owner.dispose()


@pytest.mark.parametrize(
    "port_of", ["FRESHLINE_POSTGRES_ADMIN_URL", "FRESHLINE_POSTGRES_REPLICA_URL"]
)
def test_the_owners_password_is_made_per_instance(
    cluster_env: dict[str, str], cluster_settings: Settings, port_of: str
) -> None:
    """On the primary and on the standby; and never the single topology's."""
    owner = make_url(cluster_settings.postgres_url)
    assert owner.password not in (None, "", "freshline")
    single = os.environ.get("FRESHLINE_POSTGRES_URL", "")  # the single topology's owner
    if single:
        assert make_url(single).password != owner.password
    port = make_url(cluster_env[port_of]).port
    fixed = sa.create_engine(owner.set(password="freshline", port=port), poolclass=sa.pool.NullPool)
    try:
        with pytest.raises(sa.exc.OperationalError, match="password authentication failed"):
            fixed.connect().close()
    finally:
        fixed.dispose()


@pytest.mark.parametrize(
    "variable",
    [
        "FRESHLINE_POSTGRES_URL",
        "FRESHLINE_POSTGRES_REPLICA_URL",
        "FRESHLINE_STACK_POSTGRES_CONSUMER_URL",
    ],
)
def test_the_service_logins_are_not_the_owner(cluster_env: dict[str, str], variable: str) -> None:
    eng = sa.create_engine(cluster_env[variable], poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            user, superuser = conn.execute(
                sa.text("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")
            ).one()
    finally:
        eng.dispose()
    assert user in ("freshline_api", "freshline_consumer") and not superuser


def test_the_env_file_is_private_and_names_every_login() -> None:
    assert stat.S_IMODE(ENV_FILE.stat().st_mode) == 0o600
    text = ENV_FILE.read_text()
    for name in (
        "FRESHLINE_REDIS_USERNAME",
        "FRESHLINE_STACK_REDIS_WRITER_USER",
        "FRESHLINE_STACK_REDIS_ADMIN_USER",
        "FRESHLINE_POSTGRES_ADMIN_URL",
        "FRESHLINE_STACK_POSTGRES_CONSUMER_URL",
        "FRESHLINE_STACK_POSTGRES_SUPERUSER_URL",
        "FRESHLINE_KAFKA_SASL_USERNAME",
        "FRESHLINE_KAFKA_SASL_PASSWORD",
        "FRESHLINE_STACK_KAFKA_PRODUCER_USER",
        "FRESHLINE_STACK_KAFKA_CONNECT_USER",
        "FRESHLINE_STACK_KAFKA_ADMIN_USER",
    ):
        assert f"\n{name}=" in text, name


def test_no_login_but_the_owner_may_write_freshlines_schema_on_the_primary(
    cluster_env: dict[str, str], engines: tuple[sa.Engine, sa.Engine]
) -> None:
    """As on the single topology (tests/test_derived_roles.py), on the primary the
    fraud example's derived paths are installed in: a new role with no grant, the API's
    and the consumers' logins (no Debezium here) may write no table of freshline's
    schema, run none of its functions nor attach one to a TEMP table, but what
    freshline means them to."""
    primary, _ = engines
    theirs = freshline_logins(
        str(primary.url.database),
        cluster_env["FRESHLINE_POSTGRES_URL"],
        cluster_env["FRESHLINE_STACK_POSTGRES_CONSUMER_URL"],
    )
    paths = [p for p in REGISTRY.maintenances() if isinstance(p, DerivedPath)]
    try:
        superuser = cluster_env["FRESHLINE_STACK_POSTGRES_SUPERUSER_URL"]
        with new_role(primary, superuser_url=superuser) as nobody:
            assert_only_the_owner_may_write(primary, {"no grants": nobody, **theirs}, paths)
    finally:
        for engine in theirs.values():
            engine.dispose()


# ------------------------------------------------------------------------ Kafka SCRAM


def on_broker(settings: Settings, port: int) -> Settings:
    return settings.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{port}"})


@pytest.mark.parametrize("port", BROKER_PORTS)
def test_a_broker_refuses_a_client_without_a_login(cluster_settings: Settings, port: int) -> None:
    assert cluster_settings.kafka_security_protocol == "sasl_plaintext"
    with pytest.raises(ServiceUnavailable):
        admin_client(on_broker(kafka_acls.anonymous(cluster_settings), port))


def test_a_wrong_scram_password_is_refused(cluster_settings: Settings) -> None:
    wrong = cluster_settings.model_copy(
        update={"kafka_sasl_password": SecretStr("not-the-password")}
    )
    assert_kafka_refuses(wrong)


def test_the_scram_login_reaches_all_three_brokers(cluster_settings: Settings) -> None:
    admin = admin_client(cluster_settings)
    brokers = admin.list_topics(timeout=15).brokers
    assert sorted(b.port for b in brokers.values()) == list(BROKER_PORTS)


def describe_cluster(port: int) -> bytes:
    """The whole answer to one DescribeCluster request (v1, asking a controller, as
    Kafka's Admin with ``bootstrap.controllers`` does), sent with no login; empty when
    the server closes the connection instead. Hand-encoded: librdkafka cannot address
    a controller."""
    client = b"freshline-test"
    header = struct.pack(">hhih", 60, 1, 7, len(client)) + client + b"\x00"
    request = header + b"\x00\x02\x00"  # no authorized operations, controllers, no tags
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        while len(answer) < 4 or len(answer) - 4 < struct.unpack(">i", answer[:4])[0]:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
    return answer


@pytest.mark.parametrize("port", [19192, 19193, 19194])
def test_a_controller_answers_no_client_without_a_login(port: int) -> None:
    """A controller's listener serves the Admin API (describe and alter the brokers'
    configurations): without a login it must close the connection, never answer."""
    assert describe_cluster(port) == b""


# ------------------------------------------------------------------------ Kafka ACLs
# The brokers run the StandardAuthorizer with the single topology's ACLs (scripts/stack's
# kafka_acls, granted at `up`): the single topology's checks (tests/kafka_acls.py), on
# topics replicated over the three brokers.


@pytest.fixture
def kafka_topics(cluster_settings: Settings) -> Iterator[dict[str, str]]:
    with kafka_acls.acl_topics(cluster_settings) as topics:
        yield topics


@pytest.fixture
def stranger(cluster_settings: Settings) -> Iterator[Settings]:
    """A SCRAM login of its own that no ACL names, made by the operator (and removed
    after) once every broker takes it."""
    user, password = f"freshline-stranger-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = admin_client(cluster_settings)
    scram = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
    for future in admin.alter_user_scram_credentials(
        [UserScramCredentialUpsertion(user, scram, password.encode())]
    ).values():
        future.result()
    login = cluster_settings.model_copy(
        update={"kafka_sasl_username": user, "kafka_sasl_password": SecretStr(password)}
    )

    def every_broker_takes_it() -> bool:
        try:
            for port in BROKER_PORTS:
                admin_client(on_broker(login, port))
        except ServiceUnavailable:
            return False
        return True

    assert wait_until(every_broker_takes_it, timeout=60)
    yield login
    for future in admin.alter_user_scram_credentials(
        [UserScramCredentialDeletion(user, ScramMechanism.SCRAM_SHA_512)]
    ).values():
        future.result()


def test_the_brokers_refuse_a_login_no_acl_names(
    cluster_settings: Settings, kafka_topics: dict[str, str], stranger: Settings
) -> None:
    """A login the operator made but granted nothing (``allow.everyone.if.no.acl.found``
    stays false) can produce neither a domain event nor a CDC record, and cannot read
    the invalidations; without a login nothing answers at all (above)."""
    kafka_acls.assert_refused_everything(cluster_settings, stranger, kafka_topics)


@pytest.mark.parametrize(("login", "kind"), kafka_acls.FORBIDDEN_WRITES)
def test_a_login_may_not_write_another_logins_topics(
    cluster_settings: Settings,
    cluster_env: dict[str, str],
    kafka_topics: dict[str, str],
    login: str,
    kind: str,
) -> None:
    """As on the single topology: the producer forges no CDC record or invalidation,
    Debezium's login writes no domain event, the consumers write neither."""
    refused = kafka_login(cluster_settings, cluster_env, login)
    kafka_acls.assert_write_refused(refused, kafka_topics[kind])


def test_each_writer_writes_its_topics_and_the_consumer_reads_them(
    cluster_settings: Settings, cluster_env: dict[str, str], kafka_topics: dict[str, str]
) -> None:
    kafka_acls.assert_each_writer_writes_its_topics(
        lambda login: kafka_login(cluster_settings, cluster_env, login), kafka_topics
    )


def test_the_consumer_login_may_not_join_other_groups(
    cluster_settings: Settings, cluster_env: dict[str, str], kafka_topics: dict[str, str]
) -> None:
    consumer = kafka_login(cluster_settings, cluster_env, "consumer")
    group = f"other-{uuid.uuid4().hex[:8]}"
    kafka_acls.assert_group_refused(consumer, group, kafka_topics["domain"])
