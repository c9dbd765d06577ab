"""The consumer itself on the cluster topology: a real ``Worker`` reads domain events
from the three brokers (topics replicated 3 times), recomputes on the Postgres primary
and writes to the Redis Cluster, with the consumers' own logins (``freshline_consumer``,
the Redis writer, ``freshline-consumer`` on the brokers), fed by the domain-event
producer's login; the auditor then finds every entry present and equal to Postgres
(``-m cluster``; see conftest)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import orjson
import pytest
import redis
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient
from pydantic import SecretStr

from freshline.consumers.kafka import Producer
from freshline.consumers.topics import allow_writer, ensure, managed_topics
from freshline.consumers.worker import Worker
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import DLQ, INVALIDATIONS, qualified
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.observe.audit import Auditor
from tests.cluster.conftest import add_tenant, kafka_config, kafka_login, revoke_writer
from tests.helpers import REGISTRY, wait_until

pytestmark = pytest.mark.cluster
USERS = 40


def test_a_worker_on_the_cluster_writes_entries_the_auditor_finds_consistent(
    engines: tuple[sa.Engine, sa.Engine],
    cluster_redis: redis.Redis,
    cluster_settings: Settings,
    cluster_env: dict[str, str],
) -> None:
    primary, _ = engines
    tag = uuid.uuid4().hex[:8]
    tenant = f"wk-{tag}"
    settings = cluster_settings.model_copy(
        update={
            "topic_prefix": f"cl{tag}.",
            "consumer_group": f"freshline-cl-{tag}",  # the consumers' login's groups
            "schema_version": 960_000 + uuid.uuid4().int % 30_000,
            "batch_max_wait_ms": 20,
            "auto_offset_reset": "earliest",
        }
    )
    admin = AdminClient(kafka_config(settings))
    topics = managed_topics(settings)
    report = ensure(admin, 3, topics=topics)
    assert sorted(report.created) == sorted(topics)
    with primary.begin() as conn:
        add_tenant(conn, tenant, USERS)
        ids = conn.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
                "SELECT :t, g % :n + 1, g % 90 + 1, 'm' || g % 7, '11.0.0.1' "
                "FROM generate_series(1, :k) g RETURNING id, user_id"
            ),
            {"t": tenant, "n": USERS, "k": USERS * 3},
        ).all()

    # The stack grants the consumers' login the unprefixed dead-letter and invalidation
    # topics; with a topic prefix, the operator allows its own (as for Debezium's).
    consumer_writes = [qualified(settings, DLQ), qualified(settings, INVALIDATIONS)]
    as_consumer = kafka_login(settings, cluster_env, "consumer")
    allow_writer(admin, as_consumer.kafka_sasl_username, consumer_writes)
    as_consumer = as_consumer.model_copy(
        update={
            "postgres_url": cluster_env["FRESHLINE_STACK_POSTGRES_CONSUMER_URL"],
            "redis_username": cluster_env["FRESHLINE_STACK_REDIS_WRITER_USER"],
            "redis_password": SecretStr(cluster_env["FRESHLINE_STACK_REDIS_WRITER_PASSWORD"]),
        }
    )
    worker = Worker(as_consumer, topics=[qualified(settings, "transaction.created")])
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        with Producer(kafka_login(settings, cluster_env, "producer")) as producer:
            for txn, user in ids:
                producer.produce(
                    qualified(settings, "transaction.created"),
                    orjson.dumps(
                        {
                            "tenant": tenant,
                            "user_id": user,
                            "transaction_id": txn,
                            "occurred_at": "2026-12-03T10:00:00Z",
                        }
                    ),
                    f"{tenant}:{user}".encode(),
                )
        refs = [
            EntityRef(name, tenant, str(u))
            for name in ("txn_90d", "geo")
            for u in range(1, USERS + 1)
        ]
        store = EntryStore(cluster_redis, settings.schema_version, registry=REGISTRY)
        assert wait_until(lambda: None not in store.read(refs), 90)
    finally:
        worker.stop()
        thread.join(60)
        assert not thread.is_alive()
        for future in admin.delete_topics(topics, operation_timeout=10).values():
            future.result()
        revoke_writer(admin, as_consumer.kafka_sasl_username, consumer_writes)
    assert worker.totals.applied == len(ids) and worker.totals.dead_lettered == 0
    client: Any = cluster_redis
    masters = {client.get_node_from_key(store.key(r)).name for r in refs}
    assert len(masters) == 3  # the entities' slots are spread over every master
    audit = Auditor(cluster_redis, primary, settings.schema_version, rate=None, registry=REGISTRY)
    result = audit.audit_refs(refs)
    assert result.checked == len(refs) and result.consistent, result
