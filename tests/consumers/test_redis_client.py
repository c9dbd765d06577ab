"""The consumer's Redis client: every command fails within its timeouts, and redis-py
never sends a failed write again by itself (the batch's own retry recomputes)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.connection import AbstractConnection
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.failures import TRANSIENT
from freshline.consumers.worker import Worker
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY, free_port, fresh_version, redis_login_args, redis_server

DEADLINE_S = 60.0
"""The test's own bound on a write to a stalled server: far above any timeout here."""


def test_the_consumers_client_has_timeouts_and_no_retry(settings: Settings) -> None:
    local = settings.model_copy(
        update={"consumer_redis_timeout_s": 3.5, "consumer_redis_connect_timeout_s": 1.5}
    )
    worker = Worker(local, topics=["unused"])
    try:
        options = worker.redis.connection_pool.connection_kwargs
        assert (options.get("socket_timeout"), options.get("socket_connect_timeout")) == (3.5, 1.5)
        connection = worker.redis.connection_pool.make_connection()
        assert isinstance(connection, AbstractConnection)
        assert connection.retry.get_retries() == 0
    finally:
        worker.close()


def test_a_write_to_a_stalled_redis_fails_instead_of_hanging(
    settings: Settings,
    engine: Engine,
    tenant_factory: Callable[..., SeedSummary],
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
) -> None:
    """A Redis that stops answering (SIGSTOP: the socket stays open, nothing replies)
    fails the consumer's conditional write with a timeout, which the worker retries as
    a transient failure; once the server runs again the next write goes through."""
    url, _, _ = private_redis
    tenant = tenant_factory(users=3, transactions=30).tenants[0]
    local = settings.model_copy(
        update={
            "redis_url": url,
            "consumer_redis_timeout_s": 0.5,
            "consumer_redis_connect_timeout_s": 0.5,
        }
    )
    batch = compute(engine, REGISTRY["txn_90d"], [(tenant, "1"), (tenant, "2")])
    worker = Worker(local, topics=["unused"])
    store = EntryStore(worker.redis, fresh_version(), registry=REGISTRY)
    outcome: list[BaseException | object] = []

    def write() -> None:
        try:
            outcome.append(store.write(batch))
        except BaseException as exc:  # reported to the test
            outcome.append(exc)

    try:
        assert store.write(batch).written == 2
        pid = int(worker.redis.info("server")["process_id"])
        os.kill(pid, signal.SIGSTOP)
        try:
            writer = threading.Thread(target=write, daemon=True)
            writer.start()
            writer.join(DEADLINE_S)
            assert not writer.is_alive(), "the write to a stalled Redis hung"
        finally:
            os.kill(pid, signal.SIGCONT)
        [failed] = outcome
        assert isinstance(failed, redis.exceptions.TimeoutError), failed
        assert store.write(batch).written == 0  # answered again; nothing newer to write
    finally:
        worker.close()


@pytest.fixture
def one_node_cluster(tmp_path: Path) -> Iterator[redis.Redis]:
    """A redis-server of this test's own in cluster mode, serving every slot; yields a
    plain client on it, for the test to change the cluster with."""
    port = free_port()
    user, password = (
        os.environ.get("FRESHLINE_REDIS_USERNAME") or None,
        os.environ.get("FRESHLINE_REDIS_PASSWORD") or None,
    )
    # The cluster bus port is given: by default it is the port + 10000, past 65535 for
    # half of the ports free_port can pick.
    bus = ["--cluster-enabled", "yes", "--cluster-port", str(free_port())]
    proc = subprocess.Popen(
        redis_server(port, "--dir", str(tmp_path), *bus, *redis_login_args()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    admin = redis.Redis(port=port, username=user, password=password, socket_timeout=5)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                admin.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail("the private redis-server did not start")
                time.sleep(0.02)  # polling interval while the server starts
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        while admin.cluster("info")["cluster_state"] != "ok":
            if time.monotonic() > deadline:
                pytest.fail("the one-node cluster did not come up")
            time.sleep(0.02)  # polling interval while the cluster forms
        yield admin
    finally:
        admin.close()
        proc.terminate()
        proc.wait(5)


def test_the_consumers_cluster_client_sends_a_write_once_and_a_cluster_down_is_transient(
    settings: Settings, one_node_cluster: redis.Redis
) -> None:
    """redis-py's cluster client retries a failed pipeline ten times by default. The
    consumer's sends it once: a cluster that stops serving a slot fails the write at
    once, as a transient failure the worker retries the batch for."""
    admin = one_node_cluster
    port = admin.connection_pool.connection_kwargs["port"]
    local = settings.model_copy(
        update={
            "redis_url": f"redis://127.0.0.1:{port}/0",
            "redis_cluster": True,
            "consumer_redis_timeout_s": 3.5,
            "consumer_redis_connect_timeout_s": 1.5,
        }
    )
    worker = Worker(local, topics=["unused"])
    try:
        client = worker.redis
        node = client.get_default_node()  # type: ignore[attr-defined]
        options = node.redis_connection.connection_pool.connection_kwargs
        assert (options.get("socket_timeout"), options.get("socket_connect_timeout")) == (3.5, 1.5)
        client.set("probe", "1")
        admin.execute_command("CLUSTER", "DELSLOTSRANGE", 0, 16383)
        admin.config_resetstat()
        pipe = client.pipeline(transaction=False)
        pipe.set("probe", "2")
        with pytest.raises(TRANSIENT):
            pipe.execute()
        stats = admin.info("commandstats").get("cmdstat_set", {})
        assert stats.get("calls", 0) + stats.get("rejected_calls", 0) == 1, stats
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + DEADLINE_S
        while admin.cluster("info")["cluster_state"] != "ok":
            assert time.monotonic() < deadline, "the cluster did not serve its slots again"
            time.sleep(0.02)  # polling interval while the cluster recovers
        pipe = client.pipeline(transaction=False)
        pipe.set("probe", "3")
        assert pipe.execute() == [True]
    finally:
        worker.close()
