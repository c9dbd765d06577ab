"""Readers and a Redis server that came back with less than it acknowledged.

A redis-server of the test's own keeps its data in a directory of its own; ``SAVE``
writes its snapshot there, and a restart loads it: the RDB persistence that brings a
killed server back older than its last writes, for real. The consumer's code writes
the entries and records the server (:class:`freshline.consumers.processor.Processor`); the
readers are the API (its app, over that server) and the Python client.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.processor import Processor
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.server import recorded_identity, redis_identity, server_gate
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.keys import SERVER_KEY
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import ChangeEvent, EntityRef
from tests.consumers.test_redis_failover import truncate_event
from tests.helpers import (
    REGISTRY,
    UNWINDOWED,
    api_for,
    free_port,
    fresh_version,
    redis_server,
    wait_until,
)

DEADLINE_S = 30.0


@dataclass
class Persisting:
    """A redis-server on ``port`` whose snapshot (``SAVE``) lives in ``workdir``."""

    port: int = field(default_factory=free_port)
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="freshline-rdb-"))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it; it loads the snapshot in ``workdir``, if there is one."""
        self.proc = subprocess.Popen(
            [*redis_server(self.port), "--dir", self.workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        probe = redis.Redis(port=self.port, socket_connect_timeout=0.2)

        def loaded() -> bool:
            try:
                return int(probe.info("persistence")["loading"]) == 0
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                return False

        assert wait_until(loaded, DEADLINE_S), f"redis-server on port {self.port}"
        probe.close()

    def kill(self) -> None:
        """SIGKILL: nothing written since the last ``SAVE`` survives."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def persisting() -> Iterator[Persisting]:
    server = Persisting()
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.kill()
    shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=10, transactions=200).tenants[0]


def changed(table: str, tenant: str, user: int) -> ChangeEvent:
    return ChangeEvent(table, "u", tenant, {"tenant_id": tenant, "user_id": user})


def truth(engine: Engine, feature_set: str, tenant: str, entity: str) -> dict[str, Any]:
    return compute(engine, REGISTRY[feature_set], [(tenant, entity)]).values[(tenant, entity)]


@pytest.mark.parametrize("tiers", [False, True], ids=["redis", "in-process-tiers"])
def test_readers_serve_nothing_a_restarted_redis_resurrected(
    engine: Engine, settings: Settings, persisting: Persisting, tenant: str, tiers: bool
) -> None:
    version = fresh_version()
    client = redis.Redis(port=persisting.port, socket_timeout=5)
    processor = Processor(engine, client, versions=lambda: [version], registry=REGISTRY)
    processor.apply([changed("transactions", tenant, 1), changed("user_devices", tenant, 1)])
    assert client.get(SERVER_KEY) is not None  # the consumer recorded the server
    tier = LocalTier(client, max_entries=100, registry=UNWINDOWED).start() if tiers else None
    assert tier is None or tier.wait_live(DEADLINE_S)
    reader = FeatureClient(client, version, registry=UNWINDOWED, local=tier)
    before = reader.get("txn_90d", tenant, "1")
    assert before is not None and reader.get("device_risk", tenant, "1") is not None
    client.save()  # the snapshot the restart will load

    with engine.begin() as conn:  # a newer value, then a voided one
        conn.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
                "VALUES (:t, 1, 9999.00, 'm-later', '1.2.3.4')"
            ),
            {"t": tenant},
        )
    processor.apply([changed("transactions", tenant, 1)])
    processor.apply([truncate_event()])
    fresh = truth(engine, "txn_90d", tenant, "1")
    assert fresh != before.values
    assert reader.get("txn_90d", tenant, "1").values == fresh  # type: ignore[union-attr]
    assert reader.get("device_risk", tenant, "1") is None

    api_settings = settings.model_copy(
        update={
            "redis_url": persisting.url,
            "redis_username": "",
            "redis_password": SecretStr(""),
            "schema_version": version,
            "local_cache_size": 100 if tiers else 0,
        }
    )
    with api_for(
        api_settings, engine, redis.Redis(port=persisting.port), tenant, registry=UNWINDOWED
    ) as api:

        def batch(mode: str) -> dict[str, Any]:
            response = api.post(
                "/v1/features/batch",
                params={"mode": mode},
                json={"feature_sets": ["txn_90d", "device_risk"], "entities": ["1"]},
            )
            assert response.status_code == 200, response.text
            return {item["feature_set"]: item["values"] for item in response.json()["items"]}

        assert batch("cache-only") == {"txn_90d": fresh, "device_risk": None}

        persisting.kill()
        persisting.start()  # back from the snapshot: the older value, no truncate floor
        admin = redis.Redis(port=persisting.port)
        assert EntryStore(admin, version, registry=REGISTRY).read(
            [EntityRef("txn_90d", tenant, "1"), EntityRef("device_risk", tenant, "1")]
        ) == [None, None]  # a fresh client's first read: the gate is asked once
        assert recorded_identity(admin.get(SERVER_KEY)) != redis_identity(
            admin.info("server", "replication")
        )

        # Every reader reconnects to the restarted server and serves none of it.
        assert reader.get("txn_90d", tenant, "1") is None
        assert reader.get("device_risk", tenant, "1") is None
        assert batch("cache-only") == {"txn_90d": None, "device_risk": None}
        through = api.get("/v1/features/txn_90d/1", params={"mode": "read-through"}).json()
        assert through["values"] == fresh and through["source"] != "hit"

        # A consumer raises the floors and records the server: every older entry reads
        # as absent, and what it writes next is served.
        assert processor.watch()
        assert reader.get("txn_90d", tenant, "1") is None
        processor.apply([changed("transactions", tenant, 1)])
        assert wait_until(
            lambda: getattr(reader.get("txn_90d", tenant, "1"), "values", None) == fresh,
            DEADLINE_S,
        )
        assert wait_until(lambda: batch("cache-only")["txn_90d"] == fresh, DEADLINE_S)
        assert batch("cache-only")["device_risk"] is None
    if tier is not None:
        tier.close()
    admin.close()
    client.close()


def test_a_server_is_vouched_for_by_its_own_identity_or_by_none(
    engine: Engine, persisting: Persisting, tenant: str, caplog: pytest.LogCaptureFixture
) -> None:
    version = fresh_version()
    ref = EntityRef("txn_90d", tenant, "2")
    admin = redis.Redis(port=persisting.port)
    EntryStore(admin, version, registry=REGISTRY).write(
        compute(engine, REGISTRY["txn_90d"], [(tenant, "2")])
    )
    client = redis.Redis(port=persisting.port)
    store = EntryStore(client, version, registry=REGISTRY)
    assert store.read([ref])[0] is not None  # nothing recorded: nothing to compare
    assert server_gate(client).vouched

    admin.set(SERVER_KEY, "another-run-id:another-replid")
    assert store.read([ref])[0] is not None  # asked when a connection is made only
    client.connection_pool.disconnect()  # as a restart does
    assert store.read([ref]) == [None]
    assert store.read_rows([("txn_90d", tenant, "2")]) == [None]
    assert not server_gate(client).vouched
    assert "is not the one the consumers last wrote to" in caplog.text

    identity = redis_identity(admin.info("server", "replication"))
    admin.set(SERVER_KEY, ":".join(identity))  # what a consumer records
    assert wait_until(lambda: store.read([ref])[0] is not None, DEADLINE_S)

    # A login that may not ask for the identity cannot tell: it serves, and says so.
    admin.acl_setuser(
        "blind",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        categories=["+@all"],
        commands=["-info"],
    )
    admin.set(SERVER_KEY, "another-run-id:another-replid")
    blind = redis.Redis(port=persisting.port, username="blind", password="pw")
    with caplog.at_level(logging.WARNING):
        assert EntryStore(blind, version, registry=REGISTRY).read([ref])[0] is not None
    assert "may not read the server's identity" in caplog.text
    for c in (admin, client, blind):
        c.close()
