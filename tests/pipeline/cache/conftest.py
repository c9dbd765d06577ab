"""Fixtures of the cache's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from freshline.pipeline.cache.local import LocalTier
from tests.helpers import UNWINDOWED


@pytest.fixture
def tier(redis_client: redis.Redis) -> Iterator[LocalTier]:
    """An in-process tier on the shared Redis, live, with a heartbeat every 0.2 s."""
    local = LocalTier(redis_client, max_entries=100, heartbeat_s=0.2, registry=UNWINDOWED).start()
    assert local.wait_live(5)
    yield local
    local.close()
