"""A consumer that cannot do its job says so: it stops with one line naming the ACL or
setting, never a traceback or a quiet retry; and a stop asked for while it is paused
is a clean stop.

Run with the least-privilege logins ``.stack/env`` gives the consumers (Kafka's
consumer login, Redis's writer, Postgres's consumer role) unless a test says why not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from pydantic import SecretStr

from freshline.consumers.access import group_refused
from freshline.consumers.kafka import Producer
from freshline.consumers.worker import Worker
from freshline.pipeline.core.errors import AccessRefused
from freshline.pipeline.core.settings import Settings
from tests.consumers.conftest import Env, emit_per_user, wait_for
from tests.consumers.test_worker_faults import Running
from tests.helpers import FRESHLINE, free_port, kafka_login, need, role_url

pytestmark = pytest.mark.kafka


def as_consumer(settings: Settings, group: str | None = None) -> Settings:
    """``settings`` with the consumers' own logins, in a group of ``group`` (default:
    one the stack's ACLs allow, ``freshline-<random>``)."""
    return kafka_login(settings, "consumer").model_copy(
        update={
            "consumer_group": group or f"freshline-test-{uuid.uuid4().hex[:8]}",
            "postgres_url": role_url(settings, "FRESHLINE_STACK_POSTGRES_CONSUMER_URL"),
            "redis_username": need("FRESHLINE_STACK_REDIS_WRITER_USER"),
            "redis_password": SecretStr(need("FRESHLINE_STACK_REDIS_WRITER_PASSWORD")),
            "bucket_fold_interval_ms": 0,
        }
    )


def environment(settings: Settings) -> dict[str, str]:
    """The environment of a ``freshline consume`` run with ``settings``' logins."""
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_REDIS_USERNAME": settings.redis_username,
        "FRESHLINE_REDIS_PASSWORD": settings.redis_password.get_secret_value(),
        "FRESHLINE_KAFKA_SASL_USERNAME": settings.kafka_sasl_username,
        "FRESHLINE_KAFKA_SASL_PASSWORD": settings.kafka_sasl_password.get_secret_value(),
        "FRESHLINE_TOPIC_PREFIX": settings.topic_prefix,
        "FRESHLINE_CONSUMER_GROUP": settings.consumer_group,
        "FRESHLINE_SCHEMA_VERSION": str(settings.schema_version),
        "FRESHLINE_BUCKET_FOLD_INTERVAL_MS": "0",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def consume(settings: Settings, *args: str, timeout: float = 90) -> tuple[int, list[str]]:
    """Run ``freshline consume`` with ``settings``' logins until it exits; its status and
    its stderr's lines. A run still going at ``timeout`` is stopped and fails the test."""
    proc = subprocess.Popen(
        [FRESHLINE, "consume", "--metrics-port", "0", *args],
        env=environment(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"freshline consume still ran after {timeout}s: {err[-2000:]}")
    return proc.returncode, err.strip().splitlines()


def the_error(status: int, lines: list[str]) -> str:
    """The one error line a refused consumer ends with: status 1, no traceback."""
    assert status == 1, lines
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [lines[-1]], "\n".join(lines)
    return lines[-1]


def test_a_group_the_acls_refuse_stops_the_consumer_with_one_line(env: Env) -> None:
    settings = as_consumer(env.settings, group=f"other-{uuid.uuid4().hex[:8]}")
    line = the_error(*consume(settings))
    assert "GROUP_AUTHORIZATION_FAILED" in line, line
    assert settings.consumer_group in line and "FRESHLINE_CONSUMER_GROUP" in line, line


def test_a_group_refused_while_running_stops_the_consumer_with_the_same_line(
    env: Env, admin: AdminClient, topic_factory: Callable[..., str]
) -> None:
    """The ACL changes under a running consumer: a DENY on its group, added (and
    removed after) by the operator. No topic prefix: the consumer login's own layout."""
    settings = as_consumer(env.settings).model_copy(update={"topic_prefix": ""})
    group, user = settings.consumer_group, f"User:{settings.kafka_sasl_username}"
    running = Running(Worker(settings, topics=[topic_factory("deny")]), timeout=120)
    running.wait(lambda: bool(running.worker.consumer.assignment()), "the assignment")
    rule = (ResourceType.GROUP, group, ResourcePatternType.LITERAL, user, "*")
    deny = AclBinding(*rule, AclOperation.READ, AclPermissionType.DENY)
    for future in admin.create_acls([deny]).values():
        future.result()
    try:
        wait_for(lambda: not running.thread.is_alive(), "the consumer to stop", 90)
    finally:
        undo = AclBindingFilter(*rule, AclOperation.ANY, AclPermissionType.ANY)
        for future in admin.delete_acls([undo]).values():
            future.result()
    assert isinstance(running.error, AccessRefused), repr(running.error)
    assert str(running.error) == str(group_refused(settings, group))


def test_invalidations_the_acls_refuse_stop_the_consumer_with_one_line(env: Env) -> None:
    """The test's topics have a prefix of their own; the stack's ACLs let the consumer
    login write the invalidations and dead letters of no prefix only."""
    settings = as_consumer(env.settings)
    line = the_error(*consume(settings))
    assert "TOPIC_AUTHORIZATION_FAILED" in line, line
    assert f"{settings.topic_prefix}freshline." in line, line
    assert "FRESHLINE_TOPIC_PREFIX" in line, line


def test_a_redis_user_that_may_not_publish_stops_the_consumer(env: Env, producer: Producer) -> None:
    """Run as the README ran it: the API's Redis user, which may write entries but not
    publish. Kafka as the operator: the test's own topic prefix is not the consumer
    login's (the test above)."""
    settings = as_consumer(env.settings).model_copy(
        update={
            "kafka_sasl_username": env.settings.kafka_sasl_username,
            "kafka_sasl_password": env.settings.kafka_sasl_password,
            "redis_username": need("FRESHLINE_STACK_REDIS_API_USER"),
            "redis_password": SecretStr(need("FRESHLINE_STACK_REDIS_API_PASSWORD")),
        }
    )
    emit_per_user(producer, env, "transaction.created", [1])
    running = Running(Worker(settings), timeout=120)
    wait_for(lambda: not running.thread.is_alive(), "the consumer to stop", 90)
    assert isinstance(running.error, AccessRefused), repr(running.error)
    message = str(running.error)
    assert "PUBLISH" in message and "freshline:invalidations" in message, message
    assert settings.redis_username in message and "FRESHLINE_REDIS_USERNAME" in message
    assert "\n" not in message
    totals = running.worker.totals
    assert totals.consumed == 0  # the batch stays uncommitted: read again once fixed


def test_sigterm_to_a_paused_consumer_is_a_clean_stop(
    env: Env, producer: Producer, tmp_path: Path
) -> None:
    """Paused by a Postgres that does not answer (a port nothing listens on). Kafka as
    the operator: the test's own topic prefix is not the consumer login's."""
    settings = as_consumer(env.settings).model_copy(
        update={
            "kafka_sasl_username": env.settings.kafka_sasl_username,
            "kafka_sasl_password": env.settings.kafka_sasl_password,
            "postgres_url": f"postgresql+psycopg://nobody:x@127.0.0.1:{free_port()}/none",
        }
    )
    emit_per_user(producer, env, "transaction.created", [1])
    log = tmp_path / "consume.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [FRESHLINE, "consume", "--metrics-port", "0"],
            env=environment(settings),
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        paused: Callable[[], bool] = lambda: "retrying the batch" in log.read_text()  # noqa: E731
        wait_for(lambda: paused() or proc.poll() is not None, "the consumer to pause", 90)
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    output = log.read_text()
    assert status == 0 and "Traceback" not in output, output
    assert "stopped with a batch held uncommitted" in output, output
