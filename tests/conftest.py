"""Session fixtures on the real services started by ``scripts/stack up``.

Tests get their own Postgres database (``freshline_test_<pid>``, created afresh and
migrated once per session, dropped at the end) and their own Redis logical database,
so a test run never touches the demo's data. Within the session each test isolates
itself by tenant: the ``tenant_factory`` fixture seeds fresh tenants with unique ids.
"""

from __future__ import annotations

import itertools
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary, seed
from pipeline.core.db import make_engine
from pipeline.core.services import redis_client as make_redis_client
from pipeline.core.settings import Settings
from tests.helpers import (
    ANCHOR,
    TEST_DB,
    TEST_REDIS_DB,
    drop_database,
    fresh_version,
    make_url_redis,
    migrate,
    recreate_database,
    redis_login_args,
    redis_server,
    with_login,
)


@pytest.fixture(scope="session")
def base_settings() -> Settings:
    return Settings()


@pytest.fixture(scope="session")
def settings(base_settings: Settings) -> Iterator[Settings]:
    url = recreate_database(base_settings, TEST_DB)
    migrate(url)
    redis_url = with_login(make_url_redis(base_settings.redis_url, TEST_REDIS_DB), base_settings)
    yield base_settings.model_copy(update={"postgres_url": url, "redis_url": redis_url})
    drop_database(base_settings, TEST_DB)


@pytest.fixture(scope="session")
def engine(settings: Settings) -> Iterator[Engine]:
    eng = make_engine(settings, pool_size=8)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def redis_client(settings: Settings) -> Iterator[redis.Redis]:
    # The test runs' own logical database, never the demo's. Tests keep apart by
    # tenant ids and schema versions of their own, never by flushing.
    client = make_redis_client(settings)
    yield client
    try:
        # Every key the session's writers left has a TTL, but the documented control
        # keys (docs/guarantees.md): a failure here names the keys, not a test.
        from tests.pipeline.core.test_ttl_everywhere import keys_without_ttl

        immortal = keys_without_ttl(client)
        if immortal:
            shown = ", ".join(immortal[:10]) + (" ..." if len(immortal) > 10 else "")
            raise AssertionError(
                f"{len(immortal)} key(s) without a TTL, not in pipeline.core.keys.UNEXPIRING: "
                f"{shown}"
            )
    finally:
        client.close()


_tenant_counter = itertools.count(1)


@pytest.fixture
def version() -> int:
    return fresh_version()


def _tenant_maker(engine: Engine) -> Callable[..., SeedSummary]:
    def make(
        users: int = 50, transactions: int = 2000, tenants: int = 1, seed_value: int = 42
    ) -> SeedSummary:
        prefix = f"t{next(_tenant_counter)}{uuid.uuid4().hex[:6]}-"
        return seed(
            engine,
            users=users,
            transactions=transactions,
            tenants=tenants,
            seed=seed_value,
            tenant_prefix=prefix,
            anchor=ANCHOR,
        )

    return make


@pytest.fixture
def tenant_factory(engine: Engine) -> Callable[..., SeedSummary]:
    """Seed fresh tenants with unique ids: ``tenant_factory(users=50, transactions=2000)``."""
    return _tenant_maker(engine)


@pytest.fixture
def private_redis() -> Iterator[tuple[str, Callable[[], None], Callable[[], None]]]:
    """A throwaway redis-server of this test's own, to stop and start: a real outage.

    Yields ``(url, stop, start)``; it is running when the test begins.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The settings' Redis login (the stack's admin) works here too; so does no login.
    argv = redis_server(port, *redis_login_args())
    procs: list[subprocess.Popen[bytes]] = []

    def answers(client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False

    def start() -> None:
        procs.append(
            subprocess.Popen(
                argv,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        probe = redis.Redis(port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while not answers(probe):
            if time.monotonic() > deadline:
                pytest.fail("the private redis-server did not start")
            time.sleep(0.02)  # polling interval while the server starts
        probe.close()

    def stop() -> None:
        procs[-1].terminate()
        procs[-1].wait(5)

    start()
    yield f"redis://127.0.0.1:{port}/0", stop, start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(5)


@pytest.fixture(scope="module")
def tenant_factory_module(engine: Engine) -> Callable[..., SeedSummary]:
    """Like ``tenant_factory``, for data a whole module reads but never changes."""
    return _tenant_maker(engine)
