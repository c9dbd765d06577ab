"""The stack's own logins (issue 30, items 2 and 10): the Postgres owner is no superuser
and has a password made per instance, Debezium logs in as a replication role of its own,
Kafka Connect's REST API listens on loopback and asks for a login, and Kafka refuses a
client without a login and allows each login only its own topics.

The logins come from ``.stack/env``, as in tests/test_security.py: a stack started before
it had them is skipped locally (restart it with ``scripts/stack down && scripts/stack
up``) and fails under CI.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from freshline.pipeline.cdc.connect import ConnectClient, connector_config, drop_slot, names
from freshline.pipeline.core.http import fetch
from freshline.pipeline.core.settings import Settings
from tests.helpers import kafka_login, need, wait_until
from tests.kafka_acls import (
    FORBIDDEN_WRITES,
    acl_topics,
    anonymous,
    assert_each_writer_writes_its_topics,
    assert_group_refused,
    assert_refused_everything,
    assert_write_refused,
)


def _properties(path: str) -> dict[str, str]:
    lines = Path(path).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def _login(settings: Settings, user: str, password: str) -> Engine:
    url = make_url(settings.postgres_url).set(username=user, password=password)
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


# ------------------------------------------------------------------------ Postgres


def test_the_owner_is_no_superuser_and_may_not_make_roles(engine: Engine) -> None:
    need("FRESHLINE_STACK_POSTGRES_SUPERUSER_URL")
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication "
                "FROM pg_roles WHERE rolname = current_user"
            )
        ).one()
        assert tuple(row) == (False, False, True, True)
        with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
            conn.execute(sa.text("CREATE ROLE freshline_test_never LOGIN"))
        conn.rollback()
        with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
            conn.execute(sa.text("SELECT pg_read_file('postgresql.conf')"))


def test_the_owners_password_is_made_per_instance(settings: Settings) -> None:
    need("FRESHLINE_STACK_POSTGRES_SUPERUSER_URL")
    owner = make_url(settings.postgres_url)
    assert owner.password not in (None, "", "freshline")
    fixed = _login(settings, owner.username or "", "freshline")
    try:
        with pytest.raises(sa.exc.OperationalError, match="password authentication failed"):
            fixed.connect().close()
    finally:
        fixed.dispose()


def test_debezium_logs_in_as_its_own_replication_role(settings: Settings, engine: Engine) -> None:
    need("FRESHLINE_STACK_POSTGRES_SUPERUSER_URL")
    secrets = need("FRESHLINE_CONNECT_SECRETS_FILE")
    login = _properties(secrets)
    cdc = login["database.user"]
    owner = make_url(settings.postgres_url).username
    assert cdc != owner
    local = settings.model_copy(
        update={"topic_prefix": f"stk{uuid.uuid4().hex[:8]}.", "connect_secrets_file": secrets}
    )
    owned = names(local)
    client = ConnectClient(local.connect_url)
    config = connector_config(local, owned, snapshot_mode="no_data")
    assert config["database.user"] == f"${{file:{secrets}:database.user}}"
    client.put_config(owned.connector, config)
    try:
        # The slot's walsender is Debezium's session: whose login it is shows who it is.
        query = sa.text(
            "SELECT a.usename FROM pg_replication_slots s "
            "JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = :slot"
        )

        seen: list[str] = []

        def walsender() -> bool:
            with engine.connect() as conn:
                found = conn.execute(query, {"slot": owned.slot}).scalar()
            seen.extend([found] if found else [])
            return bool(seen)

        assert wait_until(walsender, timeout=90), client.status(owned.connector)
        assert seen == [cdc]
    finally:
        client.delete(owned.connector)
        drop_slot(engine, owned.slot)
    with engine.connect() as conn:
        rights = conn.execute(
            sa.text(
                "SELECT rolsuper, rolreplication, rolcreaterole, rolcreatedb "
                "FROM pg_roles WHERE rolname = :r"
            ),
            {"r": cdc},
        ).one()
    assert tuple(rights) == (False, True, False, False)
    debezium = _login(settings, cdc, login["database.password"])
    try:
        with debezium.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM transactions")).scalar() is not None
            for statement in (
                "SELECT count(*) FROM freshline.api_keys",
                "DELETE FROM transactions WHERE false",
            ):
                with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
                    conn.execute(sa.text(statement))
                conn.rollback()
    finally:
        debezium.dispose()


# ------------------------------------------------------------------------ Connect REST


def _without_login(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def test_connect_rest_asks_for_its_login(settings: Settings) -> None:
    need("FRESHLINE_STACK_CONNECT_REST_USER")
    url = settings.connect_url
    bare = _without_login(url)
    assert fetch(f"{bare}/connectors", service="Kafka Connect").status == 401
    wrong = bare.replace("://", "://freshline:not-the-password@", 1)
    assert fetch(f"{wrong}/connectors", service="Kafka Connect").status == 401
    assert fetch(f"{url}/connectors", service="Kafka Connect").status == 200
    ConnectClient(url).ping()  # freshline's client sends the URL's login


def _listening(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on ``port`` (/proc/net/tcp*)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_connect_rest_listens_on_loopback_only(settings: Settings) -> None:
    port = urlsplit(settings.connect_url).port or 8083
    addresses = _listening(port)
    assert addresses, f"nothing listens on port {port}"
    # 127.0.0.1, ::1 and ::ffff:127.0.0.1 (Java's sockets) as /proc shows them: 32-bit
    # words, each little-endian.
    loopback = {
        "0100007F",
        "00000000000000000000000001000000",
        "0000000000000000FFFF00000100007F",
    }
    assert set(addresses) <= loopback, addresses


# ------------------------------------------------------------------------ Kafka ACLs
# The checks are shared with the cluster topology's brokers (tests/kafka_acls.py).


@pytest.fixture
def kafka_topics(settings: Settings) -> Iterator[dict[str, str]]:
    with acl_topics(settings) as topics:
        yield topics


def test_kafka_refuses_a_client_without_a_login(
    settings: Settings, kafka_topics: dict[str, str]
) -> None:
    """Nothing answers a client without a login: it can produce neither a domain event
    nor a CDC record, and cannot read the invalidations (not even their offsets)."""
    assert_refused_everything(settings, anonymous(settings), kafka_topics)


@pytest.mark.parametrize(("login", "kind"), FORBIDDEN_WRITES)
def test_a_login_may_not_write_another_logins_topics(
    settings: Settings, kafka_topics: dict[str, str], login: str, kind: str
) -> None:
    """The domain-event producer cannot forge a CDC record or an invalidation; Debezium's
    login writes no domain event; the consumers write neither."""
    assert_write_refused(kafka_login(settings, login), kafka_topics[kind])


def test_each_writer_writes_its_topics_and_the_consumer_reads_them(
    settings: Settings, kafka_topics: dict[str, str]
) -> None:
    assert_each_writer_writes_its_topics(lambda login: kafka_login(settings, login), kafka_topics)


def test_the_consumer_login_may_not_join_other_groups(
    settings: Settings, kafka_topics: dict[str, str]
) -> None:
    group = f"other-{uuid.uuid4().hex[:8]}"
    assert_group_refused(kafka_login(settings, "consumer"), group, kafka_topics["domain"])
