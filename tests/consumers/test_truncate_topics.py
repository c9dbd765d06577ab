"""A TRUNCATE is honoured only from the CDC topic of the table it names.

A truncate voids a feature set for every tenant, so it is taken only from Debezium's
topic of that table (``freshline.<schema>.<table>``), never from a domain-event topic,
another three-part topic, or another table's CDC topic.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from freshline.consumers.dlq import ERROR_KIND
from freshline.consumers.events import EventRejected, decode
from freshline.consumers.kafka import Consumer, Producer
from freshline.consumers.worker import Worker
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.topics import DLQ
from freshline.pipeline.core.types import EntityRef
from tests.consumers.conftest import PARTITIONS, Env, own_topic, read_topic
from tests.helpers import REGISTRY, kafka_headers

FIXTURES = Path(__file__).parent / "fixtures"


def truncate_of(table: str) -> dict[str, Any]:
    """Debezium's truncate envelope (captured, see fixtures/README.md), naming ``table``."""
    value: dict[str, Any] = json.loads((FIXTURES / "user_devices_truncate_t.json").read_text())[
        "value"
    ]
    value["payload"]["source"]["table"] = table
    return value


def test_a_truncate_from_its_own_cdc_topic_is_honoured() -> None:
    event = decode("freshline.public.user_devices", None, orjson.dumps(truncate_of("user_devices")))
    assert event is not None and event.op == "t" and event.table == "user_devices"


@pytest.mark.parametrize(
    "topic",
    [
        "orders.v1.created",  # a domain-event topic the active repository does not declare
        "routed.public.user_devices",  # not Debezium's prefix
        "freshline.public.transactions",  # another table's CDC topic
    ],
)
def test_a_truncate_from_any_other_topic_is_rejected(topic: str) -> None:
    with pytest.raises(EventRejected) as rejected:
        decode(topic, None, orjson.dumps(truncate_of("user_devices")))
    assert rejected.value.kind == "truncate_outside_cdc"


@pytest.mark.parametrize("topic", ["user.updated", "device.updated", "transaction.updated"])
def test_a_domain_event_topic_never_yields_a_truncate(topic: str) -> None:
    body = {**truncate_of("user_devices")["payload"], "tenant": "acme", "user_id": 1}
    body |= {"device_id": "d1", "transaction_id": 1}
    event = decode(topic, None, orjson.dumps(body))
    assert event is not None and event.op in ("c", "u")


@pytest.fixture
def domain_style_topic(env: Env, admin: AdminClient) -> Iterator[str]:
    with own_topic(env, admin, "orders.v1.created") as name:
        yield name


def test_a_forged_truncate_on_a_domain_event_topic_voids_nothing(
    env: Env,
    domain_style_topic: str,
    engine: Engine,
    redis_client: redis.Redis,
    producer: Producer,
    consumer_factory: Callable[..., Consumer],
) -> None:
    store = EntryStore(redis_client, env.settings.schema_version, registry=REGISTRY)
    refs = [(env.tenant, "1"), (env.tenant, "2")]
    store.write(compute(engine, REGISTRY["device_risk"], refs))
    producer.produce(domain_style_topic, orjson.dumps(truncate_of("user_devices")), b"x")
    producer.flush()
    totals = Worker(env.settings, topics=[domain_style_topic]).run(max_messages=1, timeout=60)
    assert (totals.consumed, totals.applied, totals.dead_lettered) == (1, 0, 1)
    [dead] = read_topic(consumer_factory(), env.topic(DLQ), 1, PARTITIONS)
    assert kafka_headers(dead)[ERROR_KIND] == b"truncate_outside_cdc"
    entries = store.read([EntityRef("device_risk", t, e) for t, e in refs])
    assert None not in entries  # every tenant's entries still served
