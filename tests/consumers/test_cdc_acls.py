"""``freshline cdc remove`` takes back the ACLs ``freshline cdc register`` gave Kafka
Connect's login on the CDC topics (issue 30), on the stack's broker and its authorizer.

The connector is one of the test's own (its own topic prefix, so its own connector
name, slot and topics), removed whatever happens.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from collections.abc import Set as AbstractSet

import pytest
from confluent_kafka.admin import AclOperation, AdminClient, ResourcePatternType
from sqlalchemy.engine import Engine

from freshline.consumers.topics import revoke_writer, topic_acls
from freshline.pipeline.cdc.connect import ConnectClient, Names, captured_tables, drop_slot, names
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY, cli

pytestmark = [pytest.mark.kafka, pytest.mark.connect]


@pytest.fixture
def local(settings: Settings) -> Settings:
    if not settings.kafka_connect_user:
        pytest.skip("FRESHLINE_KAFKA_CONNECT_USER is empty: register makes no ACLs")
    return settings.model_copy(update={"topic_prefix": f"acl{uuid.uuid4().hex[:8]}."})


@pytest.fixture
def owned(local: Settings, engine: Engine, admin: AdminClient) -> Iterator[Names]:
    found = names(local)
    try:
        yield found
    finally:
        ConnectClient(local.connect_url).delete(found.connector)
        drop_slot(engine, found.slot)
        revoke_writer(admin, local.kafka_connect_user, found.topic(""))
        topics = [found.topic(t) for t in captured_tables(REGISTRY)]
        for future in admin.delete_topics(topics, operation_timeout=10).values():
            with contextlib.suppress(Exception):  # a topic never created
                future.result()


def connect_acls(
    admin: AdminClient, user: str, owned: Names, expected: AbstractSet[tuple[str, object]]
) -> set[tuple[str, object]]:
    """The (topic, operation) of each ALLOW ACL ``user`` holds on ``owned``'s topics,
    literal or prefixed, once they are ``expected`` or 30 s have passed: the controller
    has committed a change when its call returns, and the broker that answers a
    describe applies it from the metadata log soon after (a describe at once, on a busy
    machine, found none of the ACLs just created)."""
    deadline = time.monotonic() + 30
    while True:
        found = topic_acls(admin, user, owned.topic(""), ResourcePatternType.ANY)
        acls: set[tuple[str, object]] = {(b.name, b.operation) for b in found}
        if acls == expected or time.monotonic() > deadline:
            return acls
        time.sleep(0.1)


def test_cdc_remove_deletes_the_acls_register_made(
    local: Settings, admin: AdminClient, owned: Names
) -> None:
    env = {
        "FRESHLINE_POSTGRES_URL": local.postgres_url,
        "FRESHLINE_TOPIC_PREFIX": local.topic_prefix,
    }
    user = local.kafka_connect_user
    registered = cli("cdc", "register", "--wait", "0", **env)
    assert registered.returncode == 0, registered.stderr
    granted = {
        (owned.topic(t), op)
        for t in captured_tables(REGISTRY)
        for op in (AclOperation.WRITE, AclOperation.DESCRIBE)
    }
    assert connect_acls(admin, user, owned, granted) == granted

    removed = cli("cdc", "remove", **env)
    assert removed.returncode == 0, removed.stderr
    said = removed.stdout + removed.stderr
    assert f"WRITE and DESCRIBE deleted on {len(captured_tables(REGISTRY))} topics" in said, said
    assert connect_acls(admin, user, owned, set()) == set()

    again = cli("cdc", "remove", **env)
    assert again.returncode == 0, again.stderr
    assert f"acls User:{user} on {owned.topic('')}*: none" in again.stdout + again.stderr
