"""Writers refuse a Redis that may evict keys.

Consumer writes hold no lease: under an ``allkeys-*`` or ``volatile-*`` policy a
newer entry or tombstone can be evicted between a slower worker's compute and its
write, and the older value lands. Every writer checks the policy at start-up.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from freshline.consumers.worker import Worker
from freshline.pipeline.cache.store import check_eviction_policy
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY

Server = tuple[str, Callable[[], None], Callable[[], None]]


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "allkeys-random"])
def test_a_worker_refuses_a_redis_that_evicts(
    settings: Settings, private_redis: Server, policy: str
) -> None:
    url, _, _ = private_redis
    client = redis.Redis.from_url(url)
    client.config_set("maxmemory", "100mb")
    client.config_set("maxmemory-policy", policy)
    worker = Worker(settings.model_copy(update={"redis_url": url}))
    with pytest.raises(ConfigError, match=f"maxmemory-policy {policy}") as refused:
        worker.run(timeout=30)  # refused before its first write, whatever it reads
    assert "noeviction" in str(refused.value)
    client.close()


@pytest.mark.parametrize(("maxmemory", "policy"), [("100mb", "noeviction"), ("0", "allkeys-lru")])
def test_a_redis_that_never_evicts_is_accepted(
    private_redis: Server, maxmemory: str, policy: str
) -> None:
    url, _, _ = private_redis
    client = redis.Redis.from_url(url)
    client.config_set("maxmemory", maxmemory)
    client.config_set("maxmemory-policy", policy)
    check_eviction_policy(client)  # no eviction can happen: nothing to refuse
    client.close()


def test_the_api_refuses_to_start_on_a_redis_that_evicts(
    settings: Settings, private_redis: Server
) -> None:
    import asyncio

    from freshline.pipeline.api import create_app

    url, _, _ = private_redis
    client = redis.Redis.from_url(url)
    client.config_set("maxmemory", "100mb")
    client.config_set("maxmemory-policy", "allkeys-lru")
    app = create_app(
        settings.model_copy(update={"redis_url": url}), follow_deploys=False, registry=REGISTRY
    )

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(ConfigError, match="maxmemory-policy allkeys-lru"):
        asyncio.run(start())
    client.close()
