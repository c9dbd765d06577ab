"""A running consumer registers itself for the deploy commands
(:mod:`freshline.pipeline.cache.roster`).

Real broker, Postgres and Redis; the consumer logs in as the consumers do (the writers'
Redis login, the consumer's Kafka login) on a pointer of its own.
"""

from __future__ import annotations

import threading
import uuid
from types import SimpleNamespace
from typing import cast

import pytest
import redis

from freshline.consumers.kafka import admin_client
from freshline.consumers.topics import allow_consumer
from freshline.consumers.worker import Worker
from freshline.pipeline.api.app import deploy_report
from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.roster import CONSUMER, Proc, Registration, roster
from freshline.pipeline.cache.versions import Pointer, WriteVersions
from freshline.pipeline.core.lock import Lock, LockedSet
from freshline.pipeline.core.services import consumer_redis_client
from freshline.pipeline.core.settings import Settings
from tests.consumers.conftest import Env
from tests.helpers import REGISTRY, as_user, kafka_login, need, wait_until
from tests.pipeline.deploy.test_readers import registrations_allowed

pytestmark = pytest.mark.kafka


def test_a_consumer_is_registered_with_its_group_and_versions_while_it_runs(
    env: Env, redis_client: redis.Redis
) -> None:
    group = f"freshline-roster-{uuid.uuid4().hex[:8]}"
    settings = as_user(
        kafka_login(env.settings, "consumer"),
        need("FRESHLINE_STACK_REDIS_WRITER_USER"),
        need("FRESHLINE_STACK_REDIS_WRITER_PASSWORD"),
    ).model_copy(update={"consumer_group": group})
    version = settings.schema_version
    lock = Lock({version: {fs.name: LockedSet.of(fs) for fs in REGISTRY}})
    pointer = Pointer.scoped(uuid.uuid4().hex)
    writes_with = consumer_redis_client(settings)
    registrations_allowed(writes_with, pointer, "consume")
    # What apply grants the consumers' login for the test's topic prefix.
    admin = admin_client(env.settings)
    allow_consumer(admin, need("FRESHLINE_STACK_KAFKA_CONSUMER_USER"), settings)
    worker = Worker(
        settings,
        versions=WriteVersions(
            writes_with, settings, pointer=pointer, lock=lock, registry=REGISTRY
        ),
    )
    thread = threading.Thread(target=worker.run, kwargs={"timeout": 120})
    thread.start()
    try:
        assert wait_until(lambda: len(roster(redis_client, pointer=pointer)) == 1, timeout=30)
        [proc] = roster(redis_client, pointer=pointer)
        assert (proc.kind, proc.role, proc.group) == ("consume", CONSUMER, group)
        assert (proc.knows, proc.computes) == ((version,), (version,))
        assert redis_client.pttl(pointer.proc_key(CONSUMER, proc.id)) > 0
    finally:
        worker.stop()
        thread.join(60)
        writes_with.close()
    assert roster(redis_client, pointer=pointer) == []  # it left on the way out


def test_a_paused_consumer_is_a_status_page_problem(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """What holds a consumer's batch reaches the status page through its registration:
    every paused consumer is a problem there, named with the cause and remedy."""
    settings = as_user(
        settings,
        need("FRESHLINE_STACK_REDIS_WRITER_USER"),
        need("FRESHLINE_STACK_REDIS_WRITER_PASSWORD"),
    )
    version = settings.schema_version
    lock = Lock({version: {fs.name: LockedSet.of(fs) for fs in REGISTRY}})
    pointer = Pointer.scoped(uuid.uuid4().hex)
    writes_with = consumer_redis_client(settings)
    registrations_allowed(writes_with, pointer, "consume")
    held: list[str | None] = [None]
    proc = Proc.of("consume", lock, REGISTRY, group="freshline-paused", pointer=pointer)
    registration = Registration(writes_with, proc, pointer=pointer, paused=lambda: held[0])
    reader = cast(ReadThrough, SimpleNamespace(versions=None))  # no version problems
    try:
        registration.renew()
        assert deploy_report(redis_client, pointer, reader)["problems"] == []
        held[0] = "definition: feature set 'geo' (features.py:177): its statement fails: x"
        registration.renew()
        [line] = deploy_report(redis_client, pointer, reader)["problems"]
        assert "freshline-paused is paused" in line and "features.py:177" in line
        held[0] = None
        registration.renew()
        assert deploy_report(redis_client, pointer, reader)["problems"] == []
    finally:
        registration.close()
        writes_with.close()
