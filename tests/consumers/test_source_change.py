"""A running consumer whose Postgres becomes another cluster holds its batch and says so.

Two real clusters: the stack's, then the private one of ``test_durability`` (another
system identifier), swapped under the running worker's processor, as when the name in
``FRESHLINE_POSTGRES_URL`` comes to point elsewhere. Nothing is written or committed,
one error line names the fix, ``freshline_consumer_paused{cause="source"}`` is 1; a
restart of the consumer (here: forgetting the identity) lets the batch through.
"""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY as METRICS
from sqlalchemy.engine import Engine

from freshline.consumers.kafka import Producer
from freshline.consumers.worker import Worker
from tests.consumers.conftest import Env, emit
from tests.consumers.test_config_errors import offsets, paused_lines, sample
from tests.consumers.test_durability import Cluster, lagging
from tests.consumers.test_worker_faults import Running

pytestmark = pytest.mark.kafka
__all__ = ["lagging"]  # the private cluster's fixture, used here


def test_a_consumer_whose_postgres_changes_history_holds_its_batch(
    env: Env,
    engine: Engine,
    lagging: Cluster,
    producer: Producer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="freshline.consumer")
    topic = env.topic("transaction.updated")

    def send(user: int) -> None:
        body = {"tenant": env.tenant, "user_id": user, "transaction_id": user}
        emit(producer, env, "transaction.updated", body, b"k")
        producer.flush()

    worker = Worker(env.settings, topics=[topic])
    running = Running(worker, timeout=180)
    try:
        send(1)
        running.wait(lambda: worker.totals.consumed == 1, "batch 1")
        first = worker.processor.source
        assert first is not None
        retried = sample("freshline_config_retries_total", "source")
        worker.processor.engine = lagging.engine  # another cluster under the same name
        send(2)
        running.wait(
            lambda: sample("freshline_config_retries_total", "source") >= retried + 2,
            "the worker to hold the batch read from another cluster",
        )
        assert worker.totals.consumed == 1  # the second batch is in hand, uncommitted
        assert sum(offsets(env, topic, 4)[0]) == 1
        assert METRICS.get_sample_value("freshline_consumer_paused", {"cause": "source"}) == 1
        said = paused_lines(caplog)
        assert len(said) == 1, said
        assert "timeline" in said[0] and "Purge" in said[0]
        # The operator purged and restarts the consumer: it starts without the identity.
        # Swapped just after a retry has failed, while the worker waits out its backoff,
        # so no attempt in flight on the other cluster records that cluster's identity.
        failed = sample("freshline_config_retries_total", "source")
        running.wait(
            lambda: sample("freshline_config_retries_total", "source") > failed,
            "the next retry to fail",
        )
        worker.processor.engine = engine
        worker.processor.source = None
        running.wait(lambda: worker.totals.consumed == 2, "the held batch applied")
    finally:
        running.stop()
    assert worker.totals.applied == 2
    assert sample("freshline_consumer_paused", "source") == 0
