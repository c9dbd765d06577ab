"""Session fixtures on the real services started by ``scripts/stack up``.

Tests get their own Postgres database (``freshline_test_<pid>``, created afresh and
migrated once per session, dropped at the end) and their own Redis logical database,
so a test run never touches the demo's data. Within the session each test isolates
itself by tenant: the ``tenant_factory`` fixture seeds fresh tenants with unique ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

import migrations
from fraud.seed import SeedSummary, seed
from pipeline.core.db import make_engine
from pipeline.core.features import Registry
from pipeline.core.maintenance import install_missing
from pipeline.core.repository import REGISTRY
from pipeline.core.services import redis_client as make_redis_client
from pipeline.core.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
FRAUD_MIGRATIONS = migrations.Chain.of(ROOT / "examples" / "fraud" / "migrations", "fraud")


def migrate(url: str, fraud_revision: str = "head") -> None:
    """freshline's schema at head, and the fraud example's tables at ``fraud_revision``;
    at head, also the derived incremental paths ``apply --alter-tables`` installs."""
    migrations.upgrade(url, repo=FRAUD_MIGRATIONS, repo_revision=fraud_revision)
    if fraud_revision == "head":
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            with engine.begin() as conn:
                install_missing(conn, REGISTRY.maintenances())
        finally:
            engine.dispose()


def load_stack_env(path: Path = ROOT / ".stack" / "env") -> None:
    """Take the local stack's connection settings from ``.stack/env`` (``scripts/stack up``
    writes it) unless the environment names a Postgres already; set variables win."""
    if "FRESHLINE_POSTGRES_URL" in os.environ or not path.is_file():
        return
    for line in path.read_text().splitlines():
        key, sep, value = line.strip().partition("=")
        if not sep or key.startswith("#"):
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        os.environ.setdefault(key, value)


def act_as_operator() -> None:
    """Tests act as the operator: the Postgres owner and the Redis admin, in this process
    and in the ``freshline`` processes they start. The least-privilege logins that
    ``.stack/env`` names as the defaults stay at hand, as ``FRESHLINE_STACK_POSTGRES_API_URL``
    and ``FRESHLINE_STACK_REDIS_API_{USER,PASSWORD}``, for the tests of those logins."""
    admin_url = os.environ.pop("FRESHLINE_POSTGRES_ADMIN_URL", "")
    if admin_url and os.environ.get("FRESHLINE_POSTGRES_URL", admin_url) != admin_url:
        os.environ["FRESHLINE_STACK_POSTGRES_API_URL"] = os.environ["FRESHLINE_POSTGRES_URL"]
        os.environ["FRESHLINE_POSTGRES_URL"] = admin_url
    admin_user = os.environ.get("FRESHLINE_STACK_REDIS_ADMIN_USER", "")
    if admin_user and os.environ.get("FRESHLINE_REDIS_USERNAME") != admin_user:
        os.environ["FRESHLINE_STACK_REDIS_API_USER"] = os.environ.get(
            "FRESHLINE_REDIS_USERNAME", ""
        )
        os.environ["FRESHLINE_STACK_REDIS_API_PASSWORD"] = os.environ.get(
            "FRESHLINE_REDIS_PASSWORD", ""
        )
        os.environ["FRESHLINE_REDIS_USERNAME"] = admin_user
        os.environ["FRESHLINE_REDIS_PASSWORD"] = os.environ.get(
            "FRESHLINE_STACK_REDIS_ADMIN_PASSWORD", ""
        )


load_stack_env()
act_as_operator()
# The tests run on the fraud example's repository unless told otherwise; the freshline
# processes they start inherit it.
os.environ.setdefault("FRESHLINE_REPO", str(ROOT / "examples" / "fraud"))

# One database per test session, so sessions running side by side never collide.
TEST_DB = os.environ.get("FRESHLINE_TEST_DB", f"freshline_test_{os.getpid()}")
TEST_REDIS_DB = int(os.environ.get("FRESHLINE_TEST_REDIS_DB", "1"))
ANCHOR = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _admin_engine(base: Settings) -> Engine:
    url = make_url(base.postgres_url).set(database="postgres")
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or the deadline passes; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)  # polling interval, not synchronisation
    return predicate()


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(app: Any, timeout: float = 30.0) -> Iterator[int]:
    """``app`` on a real loopback socket (uvicorn in a thread, lifespan on): its port,
    until the block ends and the server shuts down."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), timeout)
        if not server.started:
            pytest.fail("the API did not start on a real socket")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def recreate_database(base: Settings, name: str) -> str:
    """Drop and create ``name``; return its URL."""
    admin = _admin_engine(base)
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return make_url(base.postgres_url).set(database=name).render_as_string(hide_password=False)


def drop_database(base: Settings, name: str) -> None:
    admin = _admin_engine(base)
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


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


def with_login(url: str, base: Settings) -> str:
    """``url`` with the settings' Redis login in it, so that the tests' own
    ``redis.Redis.from_url(settings.redis_url)`` and child processes log in too."""
    user, password = base.redis_username, base.redis_password.get_secret_value()
    if not user or "@" in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{rest}"


def make_url_redis(url: str, db: int) -> str:
    head, _, _ = url.rpartition("/")
    return f"{head}/{db}" if head.count("/") >= 2 else f"{url}/{db}"


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
    client.close()


_tenant_counter = itertools.count(1)
# Schema versions for tests' own Redis namespaces: consecutive within a session, from
# a block of a thousand that the session reserves in the tests' Redis, so sessions side
# by side (a developer's and CI's, or several at once) never share one. Never random per
# test: a session's tests would collide on the birthday bound.
VERSION_BLOCKS = "freshline:test:version_blocks"


def _version_block() -> int:
    base = Settings()
    client = redis.Redis.from_url(with_login(make_url_redis(base.redis_url, TEST_REDIS_DB), base))
    try:
        block = int(client.incr(VERSION_BLOCKS))
        client.expire(VERSION_BLOCKS, 86_400)  # every key has a TTL, this one too
    finally:
        client.close()
    return 100_000 + (block % 899) * 1000


@functools.cache
def _session_versions() -> Iterator[int]:
    return itertools.count(_version_block())


def fresh_version() -> int:
    """A schema version no other test of this session, or of a session beside it, uses."""
    return next(_session_versions())


@pytest.fixture
def version() -> int:
    return fresh_version()


UNWINDOWED = Registry(dataclasses.replace(fs, horizon=None) for fs in REGISTRY)
"""The feature sets without their horizons: an in-process tier serves their entries
at once, without reading their Redis TTL first (tests of the tier's other rules, with
entries that are not in Redis)."""


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
    binary = shutil.which("redis-server")
    if binary is None:
        # Under CI a missing tool is a broken install step, not a reason to skip.
        message = "redis-server is not installed: apt-get install redis-server (scripts/test does)"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs: list[subprocess.Popen[bytes]] = []

    def answers(client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False

    # The settings' Redis login (the stack's admin) works here too; so does no login.
    user, password = (
        os.environ.get("FRESHLINE_REDIS_USERNAME"),
        os.environ.get("FRESHLINE_REDIS_PASSWORD", ""),
    )
    login = ["--user", user, "on", f">{password}", "~*", "&*", "+@all"] if user and password else []

    def start() -> None:
        procs.append(
            subprocess.Popen(
                [
                    binary,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    *login,
                ],
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
