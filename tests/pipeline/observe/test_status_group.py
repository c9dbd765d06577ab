"""The status page's consumer lag is the lag of the group actually consuming, named; and
topics that do not exist are a problem on it, not a quiet lag of 0.

The API is logged in to Kafka as ``.stack/env`` gives it (the consumers' login); the
test's own topics are made by the operator.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.kafka import Consumer, Producer, admin_client
from freshline.consumers.topics import ensure, managed_topics
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import qualified
from tests.consumers.conftest import wait_for
from tests.helpers import api_for, kafka_login

pytestmark = pytest.mark.kafka


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=1, transactions=1).tenants[0]


@pytest.fixture
def prefixed(settings: Settings) -> Iterator[Settings]:
    """``settings`` on topics of a prefix of their own, made and deleted here."""
    tag = uuid.uuid4().hex[:8]
    local = settings.model_copy(update={"topic_prefix": f"test{tag}."})
    admin: AdminClient = admin_client(settings)
    topics = managed_topics(local)
    ensure(admin, 2, topics=topics)
    yield local
    for future in admin.delete_topics(topics, operation_timeout=10).values():
        future.result()


def test_the_lag_shown_is_the_consuming_groups_and_named(
    prefixed: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    topic = qualified(prefixed, "transaction.created")
    with Producer(prefixed) as producer:
        for i in range(3):
            producer.produce(topic, b"{}", str(i).encode(), partition=0)
    tag = uuid.uuid4().hex[:8]
    reader = kafka_login(prefixed, "consumer").model_copy(
        update={"consumer_group": f"freshline-reader-{tag}"}
    )
    # The API's own setting names another group, which has read nothing.
    api_settings = reader.model_copy(update={"consumer_group": f"freshline-serve-{tag}"})
    with Consumer(reader) as consumer:
        consumer.subscribe([topic])
        wait_for(lambda: consumer.poll(0.2) is not None or bool(consumer.assignment()), "join")
        consumer.commit_offsets([TopicPartition(topic, 0, 3), TopicPartition(topic, 1, 0)])
        with api_for(api_settings, engine, redis_client, tenant) as api:
            status = api.ops("/status.json").json()
            assert status["consumer_group"] == {"name": reader.consumer_group, "consuming": True}
            [txn] = [fs for fs in status["feature_sets"] if fs["name"] == "txn_90d"]
            assert txn["current"]["consumer_lag"] == 0, status


def test_topics_that_do_not_exist_are_a_problem(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    absent = kafka_login(settings, "consumer").model_copy(
        update={"topic_prefix": f"absent{uuid.uuid4().hex[:8]}."}
    )
    with api_for(absent, engine, redis_client, tenant) as api:
        status = api.ops("/status.json").json()
    assert status["broker_reachable"], status
    problems = [p for p in status["problems"] if "none of its topics exists" in p]
    assert any(p.startswith("txn_90d: ") and absent.topic_prefix in p for p in problems), status
