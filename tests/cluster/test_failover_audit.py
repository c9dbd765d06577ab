"""A Redis master killed while the read path and the consumer's write path run against
Postgres: both recover, and after quiescence ``freshline audit``'s auditor finds every
entry consistent with Postgres (``-m cluster``; see conftest)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.keys import feature_key
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.observe.audit import Auditor
from tests.cluster.conftest import add_tenant, stack
from tests.helpers import REGISTRY, wait_until

pytestmark = pytest.mark.cluster
TXN = REGISTRY["txn_90d"]
USERS = 60


class Loop:
    """``step`` in a thread until stopped, counting successes and Redis errors; it stops
    only after a step that succeeded, so the last one is whole."""

    def __init__(self, step: Callable[[int], object]) -> None:
        self.ok = self.errors = 0
        self._stop = threading.Event()
        self._step = step
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed = False
        i = 0
        while not self._stop.is_set() or failed:
            try:
                self._step(i)
                self.ok += 1
                failed = False
                i += 1
            except (redis.exceptions.RedisError, OSError):
                self.errors += 1
                failed = True
                time.sleep(0.05)  # back-off before retrying, not synchronisation

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()


def test_a_killed_master_then_quiescence_leaves_no_inconsistency(
    engines: tuple[sa.Engine, sa.Engine], cluster_redis: redis.Redis, cluster_settings: Settings
) -> None:
    primary, _ = engines
    tenant = f"fo-{uuid.uuid4().hex[:10]}"
    with primary.begin() as conn:
        add_tenant(conn, tenant, USERS)
    version = 950_000 + uuid.uuid4().int % 40_000
    refs = [EntityRef("txn_90d", tenant, str(u)) for u in range(1, USERS + 1)]
    client = redis_client(cluster_settings, socket_timeout=1, socket_connect_timeout=1)
    store = EntryStore(client, version, registry=REGISTRY)
    reader = ReadThrough(store, primary, early_refresh=False, wait_ms=200)

    def change(i: int) -> None:
        """The consumer's part: a source change, then its recompute written."""
        user = i % USERS + 1
        with primary.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO transactions (tenant_id, user_id, amount, "
                    "merchant_id) VALUES (:t, :u, :a, 'm')"
                ),
                {"t": tenant, "u": user, "a": i % 50 + 1},
            )
        store.write(compute(primary, TXN, [(tenant, str(user))]))

    writer = Loop(change)
    readers = Loop(lambda _: reader.get_many(refs))
    client_any: Any = cluster_redis
    victim = client_any.get_node_from_key(feature_key(version, refs[0]))
    name = f"redis-{victim.port - 7000}"
    try:
        assert wait_until(lambda: writer.ok >= 5 and readers.ok >= 2, 60)
        stack("kill", name)
        try:

            def promoted() -> bool:
                try:
                    client_any.nodes_manager.initialize()
                    node = client_any.get_node_from_key(feature_key(version, refs[0]))
                    return bool(node.port != victim.port)
                except redis.exceptions.RedisError:
                    return False

            assert wait_until(promoted, 60)
            w, r = writer.ok, readers.ok
            assert wait_until(lambda: writer.ok >= w + 5 and readers.ok >= r + 2, 60)
        finally:
            stack("start", name)
    finally:
        writer.stop()
        readers.stop()
    # Not asserted: that the loops saw an error. redis-py's cluster client retries a
    # command through a failover itself, and can see none when the kill lands between
    # commands (a CI run had 0 + 0); the promotion waited on above proves the master went.
    # Quiescent. A write acknowledged by the old master just before it died can be
    # lost (Redis replicates asynchronously); every entity the writer touched after
    # the failover was rewritten, the others are recomputed by the final pass below
    # exactly as a consumer catching up would, then audited against Postgres.
    store.write(compute(primary, TXN, [(tenant, str(u)) for u in range(1, USERS + 1)]))
    report = Auditor(cluster_redis, primary, version, rate=None, registry=REGISTRY).audit_refs(refs)
    assert report.checked == USERS and report.consistent, report
    client.close()
