"""Session fixtures on the real services started by ``scripts/stack up``.

Tests get their own Postgres database (``freshline_test_<pid>``, created afresh and
migrated once per session, dropped at the end) and their own Redis logical database,
so a test run never touches the demo's data. Within the session each test isolates
itself by tenant: the ``tenant_factory`` fixture seeds fresh tenants with unique ids.

Every test lands in one tier (docs/contributing.md), chosen here, never by hand:
``faults`` and ``cluster`` by their marker or directory, ``stack`` when a fixture it
uses reaches a service (``STACK_FIXTURES``, directly or through another fixture) or it
is in a module of ``STACK_MODULES``, ``unit`` otherwise. A unit test runs with every
service address pointing at a closed port, so one that reaches for a service fails at
once, in every run, and is moved to the stack tier by using a service fixture.
"""

from __future__ import annotations

import itertools
import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import hypothesis
import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary, seed
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.services import redis_client as make_redis_client
from freshline.pipeline.core.settings import Settings
from tests.helpers import (
    ANCHOR,
    HYPOTHESIS_PROFILE,
    TEST_DB,
    TEST_REDIS_DB,
    drop_database,
    free_port,
    fresh_version,
    make_url_redis,
    migrate,
    recreate_database,
    redis_login_args,
    redis_server,
    wait_until,
    with_login,
)

# Hypothesis profiles (tests.helpers.HYPOTHESIS_PROFILE): a property test's own number of
# examples goes through tests.helpers.examples; these are the defaults of the rest.
hypothesis.settings.register_profile("ci", print_blob=True)
hypothesis.settings.register_profile("dev", max_examples=10, print_blob=True)
hypothesis.settings.load_profile(HYPOTHESIS_PROFILE)

STACK_FIXTURES = frozenset(
    {
        # Settings() from the stack's environment: every service fixture builds on it
        # (settings, engine, redis_client, tenant_factory, admin, producer, ...).
        "base_settings",
        # A schema version reserved in the tests' Redis.
        "version",
        # A redis-server, or a Postgres, of the test's own.
        "private_redis",
        "lagging",  # tests/consumers/test_durability.py
        "late_epoch",  # tests/pipeline/cache/test_visibility.py
    }
)
"""Fixtures that reach a service; a test whose fixture closure holds one is ``stack``."""

STACK_MODULES = frozenset[str]()
"""Modules whose tests reach the stack without a fixture (they call ``Settings()`` or run
``freshline`` against it), by path from the repository root."""

# The addresses a unit test sees: a closed loopback port for every service, so a
# connection is refused at once instead of reaching the stack or hanging.
_CLOSED = "127.0.0.1:1"
NO_STACK_ENV = {
    "FRESHLINE_POSTGRES_URL": f"postgresql+psycopg://unit-tier:unit-tier@{_CLOSED}/no_stack",
    "FRESHLINE_POSTGRES_REPLICA_URL": "",
    "FRESHLINE_REDIS_URL": f"redis://{_CLOSED}/0",
    "FRESHLINE_KAFKA_BOOTSTRAP": _CLOSED,
    "FRESHLINE_CONNECT_URL": f"http://{_CLOSED}",
    "PGHOST": "127.0.0.1",
    "PGPORT": "1",
}


def tier_of(item: pytest.Item) -> str:
    """The tier ``item`` belongs to (module docstring)."""
    path = item.path.relative_to(item.config.rootpath).as_posix()
    if item.get_closest_marker("faults") is not None:
        return "faults"
    if item.get_closest_marker("cluster") is not None or path.startswith("tests/cluster/"):
        return "cluster"
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & STACK_FIXTURES or path in STACK_MODULES:
        return "stack"
    return "unit"


def drives_a_connector(item: pytest.Item) -> bool:
    """Whether ``item`` needs Kafka Connect: its ``connect`` marker, or a module that
    drives connectors itself (it imports ``ConnectClient``)."""
    module = getattr(item, "module", None)
    return item.get_closest_marker("connect") is not None or hasattr(module, "ConnectClient")


# First: pytest-xdist reads the xdist_group markers in its own hook.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item))
        if drives_a_connector(item):
            # The stack's one Connect worker rebalances every connector when one comes or
            # goes: the tests that add them run one at a time, on one xdist worker.
            item.add_marker(pytest.mark.xdist_group("connect"))
            if getattr(config.option, "loadgroup", False):  # an xdist worker, loadgroup
                name_the_group(item, "connect")


def name_the_group(item: pytest.Item, group: str) -> None:
    """Suffix ``item``'s id with ``@group``, as pytest-xdist does for its loadgroup
    scheduler (``ModuleOrGroup`` below reads it). xdist 3.8 sets ``item._nodeid``, which
    pytest 9 no longer reads (its id is ``item._id``): without this, no test ran in its
    group and the connector tests ran on both workers at once."""
    if "@" in item.nodeid.rpartition("]")[2] or not hasattr(item, "_id"):
        return  # named already, or a pytest whose id xdist's own suffix reaches
    from _pytest.nodeid import NodeId

    item._id = NodeId.parse(f"{item.nodeid}@{group}")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadgroup`` (scripts/test): a module's tests on one worker, as
    ``loadfile`` has it (its module-scoped fixtures run once), and every test of an
    xdist_group on one worker."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleOrGroup(LoadGroupScheduling):  # type: ignore[misc]  # xdist has no types
        def _split_scope(self, nodeid: str) -> str:
            if "@" in nodeid.rpartition("]")[2]:
                return nodeid.rsplit("@", 1)[-1]
            return nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node: Any) -> None:
            # The connector tests first: one at a time, they are the longest unit (some
            # 4 minutes of the tier's 12 on CI), and started late they would end last.
            if "connect" in self.workqueue:
                self.workqueue.move_to_end("connect", last=False)
            super()._assign_work_unit(node)

    return ModuleOrGroup(config, log)


@pytest.fixture(autouse=True)
def _unit_tier_has_no_stack(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit test sees no stack: every service address is a closed port (NO_STACK_ENV)."""
    if request.node.get_closest_marker("unit") is None:
        return
    for name, value in NO_STACK_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("FRESHLINE_POSTGRES_ADMIN_URL", raising=False)


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
                f"{len(immortal)} key(s) without a TTL, not in "
                "freshline.pipeline.core.keys.UNEXPIRING: "
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
    port = free_port()
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
        if not wait_until(lambda: answers(probe), timeout=10):
            pytest.fail("the private redis-server did not start")
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
