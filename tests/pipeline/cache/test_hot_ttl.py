"""Hot-read counts: every sorted set a flush writes has its TTL, even a flush cut short.

A flush is one pipeline; a process killed (or a connection dropped) partway through it
has had only the first commands applied. That fault is emulated by executing a prefix
of the flush's own pipeline against the real Redis (killing a process at an exact
command is not something a test can do reliably); every prefix must leave every key
it created with a TTL.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from freshline.pipeline.api.reader import Lookup
from freshline.pipeline.cache.hot import HotReads
from freshline.pipeline.core.keys import hot_key
from tests.helpers import fresh_version


class CutShort:
    """A client whose pipelines apply only their first ``applied`` commands."""

    def __init__(self, client: redis.Redis, applied: int) -> None:
        self.client = client
        self.applied = applied
        self.queued = 0

    def pipeline(self, transaction: bool = True) -> Any:
        pipe = self.client.pipeline(transaction=transaction)
        real = pipe.execute
        outer = self

        def execute(raise_on_error: bool = True) -> list[Any]:
            outer.queued = len(pipe.command_stack)
            del pipe.command_stack[outer.applied :]
            return list(real(raise_on_error))

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe


def record(hot: HotReads, version: int, tenants: list[str]) -> None:
    for tenant in tenants:
        for fs in ("geo", "txn_90d"):
            hot.record(version, Lookup(tenant, [fs], [str(i) for i in range(5)]))


def test_a_flush_leaves_every_key_with_its_ttl(redis_client: redis.Redis) -> None:
    version = fresh_version()
    tenants = [f"hot-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    hot = HotReads(redis_client, sample=1, flush_s=3600, ttl_s=600)
    record(hot, version, tenants)
    hot.close()
    keys = [hot_key(version, fs, t) for t in tenants for fs in ("geo", "txn_90d")]
    ttls = [redis_client.ttl(key) for key in keys]
    assert all(0 < ttl <= 600 for ttl in ttls), ttls


@pytest.mark.parametrize("applied", [1, 2, 3])
def test_a_flush_cut_short_leaves_no_key_without_a_ttl(
    redis_client: redis.Redis, applied: int
) -> None:
    version = fresh_version()
    tenants = [f"hot-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    client = CutShort(redis_client, applied)
    hot = HotReads(client, sample=1, flush_s=3600, ttl_s=600)  # type: ignore[arg-type]
    record(hot, version, tenants)
    hot.flush()
    assert client.queued > applied  # the flush was cut short
    keys = [hot_key(version, fs, t) for t in tenants for fs in ("geo", "txn_90d")]
    written = [key for key in keys if redis_client.exists(key)]
    assert written  # some counts landed ...
    assert all(redis_client.ttl(key) > 0 for key in written)  # ... none without a TTL
    redis_client.delete(*keys)
