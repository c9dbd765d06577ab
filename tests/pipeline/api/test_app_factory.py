"""The app factory that ``freshline serve`` runs in each worker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from freshline.pipeline.api import create_app
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY


def test_a_worker_moves_its_long_lived_objects_out_of_the_collector(settings: Settings) -> None:
    """A full collection then skips the ~100,000 objects made at start-up (gc.freeze):
    walking them stalled every request in flight (README, read path)."""
    code = (
        "import gc; from freshline.pipeline.api.app import app_from_env; "
        "before = gc.get_freeze_count(); app_from_env(); "
        "print(before, gc.get_freeze_count(), len(gc.get_objects()))"
    )
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    before, frozen, tracked = map(int, out.stdout.split()[-3:])
    assert before == 0
    assert frozen > 10_000 and tracked < frozen / 10  # nearly all of it, right after start


def test_one_close_that_raises_skips_none_of_the_others(settings: Settings) -> None:
    """The app's start-up and shutdown run on one exit stack: every close runs, in the
    reverse order of start-up, though the first one (the status board's) raises."""
    app = create_app(settings.model_copy(update={"local_cache_size": 10}), registry=REGISTRY)
    services = app.state.services
    closed: list[str] = []

    def recorded(name: str, close: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            closed.append(name)
            close()

        return run

    def broken() -> None:
        closed.append("status board")
        raise RuntimeError("the status board would not stop")

    # Set before start-up: the exit stack takes each close as it starts its service.
    app.state.status.close = broken
    services.auth.close = recorded("auth", services.auth.close)
    services.reader.close = recorded("reader", services.reader.close)
    services.reader.local.close = recorded("local tier", services.reader.local.close)
    services.redis.close = recorded("redis", services.redis.close)
    services.engine.dispose = recorded("engine", services.engine.dispose)

    async def serve_and_stop() -> None:
        async with app.router.lifespan_context(app):
            assert services.reader.aredis is not None
            assert await services.reader.aredis.ping()

    with pytest.raises(RuntimeError, match="would not stop"):
        asyncio.run(serve_and_stop())
    assert closed == ["status board", "auth", "reader", "local tier", "redis", "engine"]
    assert services.reader.aredis is None  # the asyncio client was closed as well
