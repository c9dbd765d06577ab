"""Redis replication under the consumer: WAIT before the offsets, floors after a failover.

A primary and a replica of the test's own (private redis-server processes, no
persistence). The replica is frozen (SIGSTOP: a replica that stops acknowledging, for
real), or promoted while the primary still takes writes (a split, as when Sentinel
promotes a replica cut off from a live primary) before the primary is killed. The one
thing done by hand is the consumer's Redis name moving to the promoted replica (what
Sentinel, a proxy or a DNS name does): its client's pool is pointed at the new port.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from pydantic import SecretStr
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.events import decode
from freshline.consumers.kafka import Producer
from freshline.consumers.processor import Processor, ReplicasBehind
from freshline.consumers.worker import Worker
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.keys import floor_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import ChangeEvent, EntityRef
from tests.consumers.conftest import Env, emit, wait_for
from tests.consumers.test_worker_faults import Running, committed
from tests.helpers import REGISTRY, free_port, redis_server

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass
class Server:
    port: int
    proc: subprocess.Popen[bytes]
    workdir: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(10)


def start_server(*args: str) -> Server:
    port = free_port()
    argv = redis_server(port)
    # Its own directory: a replica writes the primary's snapshot to disk when it syncs.
    workdir = tempfile.mkdtemp(prefix="freshline-redis-")
    proc = subprocess.Popen(
        [*argv, "--dir", workdir, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = Server(port, proc, workdir)
    probe = server.client()

    def answers() -> bool:
        try:
            return bool(probe.ping())
        except redis.exceptions.ConnectionError:
            return False

    wait_for(answers, f"redis-server on port {port}")
    probe.close()
    return server


def move(client: redis.Redis, port: int) -> None:
    """Point ``client`` at ``port`` from its next command on (its name moved)."""
    client.connection_pool.connection_kwargs["port"] = port
    client.connection_pool.disconnect()
    client.connection_pool.reset()


@contextmanager
def failing_over(pair: tuple[Server, Server], client: redis.Redis) -> Iterator[None]:
    """Promote the pair's replica once it has every write so far; what runs inside reaches
    only the old primary (no WAIT: the split the consumer must survive). Then the old
    primary dies and ``client``'s name moves to the promoted replica."""
    primary, replica = pair
    assert client.wait(1, 5000) == 1
    replica.client().replicaof("NO", "ONE")
    yield
    primary.kill()
    move(client, replica.port)


def replicas_online(primary: redis.Redis) -> int:
    info = primary.info("replication")
    return sum(1 for k, v in info.items() if k.startswith("slave") and v.get("state") == "online")


@pytest.fixture
def pair() -> Iterator[tuple[Server, Server]]:
    """A primary and one replica of it, in sync."""
    primary = start_server()
    replica = start_server("--replicaof", "127.0.0.1", str(primary.port))
    client = primary.client()
    try:
        wait_for(lambda: replicas_online(client) == 1, "the replica to come online")
        yield primary, replica
    finally:
        client.close()
        for server in (replica, primary):
            if server.proc.poll() is None:
                server.kill()
            shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=10, transactions=200).tenants[0]


def touch(tenant: str, user: int) -> ChangeEvent:
    return ChangeEvent("transactions", "u", tenant, {"tenant_id": tenant, "user_id": user})


def test_a_batch_is_not_acknowledged_until_a_replica_has_it(
    engine: Engine, pair: tuple[Server, Server], tenant: str, version: int
) -> None:
    primary, replica = pair
    client = primary.client()
    # WAIT returns as soon as the replica has the writes: a long timeout costs a healthy
    # pair nothing, and a loaded machine may take more than 100 ms to replicate.
    processor = Processor(
        engine,
        client,
        versions=lambda: [version],
        wait_replicas=1,
        wait_timeout_ms=5000,
        registry=REGISTRY,
    )
    impatient = Processor(
        engine,
        client,
        versions=lambda: [version],
        wait_replicas=1,
        wait_timeout_ms=100,
        registry=REGISTRY,
    )
    key = EntryStore(client, version, registry=REGISTRY).key(EntityRef("txn_90d", tenant, "1"))
    assert processor.apply([touch(tenant, 1)]).writes.written == 2
    assert replica.client().exists(key)  # acknowledged, so already on the replica
    replica.freeze()
    try:
        with pytest.raises(ReplicasBehind) as behind:
            impatient.apply([touch(tenant, 2)])
        assert (behind.value.acknowledged, behind.value.wanted) == (0, 1)
    finally:
        replica.thaw()
    assert processor.apply([touch(tenant, 2)]).writes.written == 2
    assert replica.client().exists(
        EntryStore(client, version, registry=REGISTRY).key(EntityRef("txn_90d", tenant, "2"))
    )


@pytest.mark.kafka
def test_the_offsets_wait_for_the_replica(
    env: Env, pair: tuple[Server, Server], producer: Producer
) -> None:
    primary, replica = pair
    settings = env.settings.model_copy(
        update={
            "redis_url": primary.url,
            "redis_username": "",
            "redis_password": SecretStr(""),
            "redis_wait_replicas": 1,
            "redis_wait_timeout_ms": 100,
        }
    )
    topic = env.topic("transaction.updated")
    replica.freeze()
    worker = Worker(settings, topics=[topic])
    running = Running(worker, timeout=120)
    try:
        emit(
            producer,
            env,
            "transaction.updated",
            {"tenant": env.tenant, "user_id": 3, "transaction_id": 1},
            b"k",
        )
        producer.flush()
        running.wait(
            lambda: worker.totals.retries >= 2,
            "the worker to retry the batch no replica acknowledged",
        )
        assert worker.totals.consumed == 0  # the batch is in hand, uncommitted
        assert all(o < 0 for o in committed(settings.consumer_group, settings, topic))
        replica.thaw()
        running.wait(
            lambda: worker.totals.consumed == 1,
            "the batch to be acknowledged once the replica is back",
        )
        wait_for(
            lambda: (
                sum(max(o, 0) for o in committed(settings.consumer_group, settings, topic)) == 1
            ),
            "the offset to be committed",
        )
    finally:
        replica.thaw()
        running.stop()
    assert worker.totals.applied == 1


def test_a_wait_the_consumer_cannot_do_is_refused_at_start(settings: Settings) -> None:
    with pytest.raises(ConfigError, match="Cluster"):
        Worker(settings.model_copy(update={"redis_wait_replicas": 1, "redis_cluster": True}))
    with pytest.raises(ConfigError, match="below"):
        Worker(
            settings.model_copy(update={"redis_wait_replicas": 1, "redis_wait_timeout_ms": 5000})
        )


def truncate_event() -> ChangeEvent:
    captured = json.loads((FIXTURES / "user_devices_truncate_t.json").read_text())
    event = decode("freshline.public.user_devices", None, json.dumps(captured["value"]).encode())
    assert event is not None and event.op == "t"
    return event


def test_a_failover_that_loses_a_truncate_floor_raises_every_floor(
    engine: Engine, pair: tuple[Server, Server], tenant: str, version: int
) -> None:
    client = pair[0].client()
    processor = Processor(engine, client, versions=lambda: [version], registry=REGISTRY)
    users = ["1", "2", "3"]
    processor.apply(
        [
            ChangeEvent("user_devices", "u", tenant, {"tenant_id": tenant, "user_id": int(u)})
            for u in users
        ]
    )
    risk = [EntityRef("device_risk", tenant, u) for u in users]
    store = EntryStore(client, version, registry=REGISTRY)
    assert None not in store.read(risk)
    with failing_over(pair, client):  # the truncate's floor is lost with the old primary
        processor.apply([truncate_event()])
        assert store.read(risk) == [None] * len(users)
    # The lost floor revived every voided entry; readers serve none of them until a
    # consumer has raised the floors (freshline.pipeline.cache.server).
    assert client.get(floor_key(version, "device_risk")) is None
    assert all(client.exists(store.key(r)) for r in risk)
    assert store.read(risk) == [None] * len(users)
    # A consumer started after the failover: it knows the old server only from the
    # identity the consumers recorded, which the promoted replica holds.
    failovers: list[object] = []
    restarted = Processor(
        engine,
        client,
        versions=lambda: [version],
        on_failover=lambda before, now: failovers.append((before, now)),
        registry=REGISTRY,
    )
    assert restarted.watch()
    assert store.read(risk) == [None] * len(users)
    assert len(failovers) == 1
    assert not restarted.watch()  # once per change
    assert not processor.watch()  # and the running one finds it recorded


def test_a_batch_after_a_failover_raises_the_floors_in_its_announce(
    engine: Engine, pair: tuple[Server, Server], tenant: str, version: int
) -> None:
    client = pair[0].client()
    processor = Processor(engine, client, versions=lambda: [version], registry=REGISTRY)
    processor.apply([touch(tenant, 4)])
    store = EntryStore(client, version, registry=REGISTRY)
    with failing_over(pair, client):
        processor.apply([touch(tenant, 5)])  # lost with the old primary
    assert client.exists(store.key(EntityRef("txn_90d", tenant, "4")))
    processor.apply([touch(tenant, 6)])
    # Every entry written before the change is void, the batch's own included; later
    # batches write again.
    assert store.read([EntityRef("txn_90d", tenant, u) for u in ("4", "6")]) == [None, None]
    processor.apply([touch(tenant, 6)])
    wait_for(  # readers ask the now recorded server again (freshline.pipeline.cache.server)
        lambda: store.read([EntityRef("txn_90d", tenant, "6")])[0] is not None,
        "readers to serve the server the consumer recorded",
    )
