"""Plain helpers the tests share: the stack's environment, databases, versions, ports, an
in-process API client and least-privilege logins. Fixtures live in ``conftest.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio.from_thread
import httpx
import pytest
import redis
import sqlalchemy as sa
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import (
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from pydantic import SecretStr
from sqlalchemy.engine import Engine, make_url
from starlette.applications import Starlette

from freshline import migrations
from freshline.consumers.kafka import admin_client, client_config
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.readthrough import Hooks, ReadThrough, Result
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.versions import VersionResolver
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.errors import ServiceUnavailable
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.maintenance import install_missing, secure_installed
from freshline.pipeline.core.repository import Repository, active
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef, Entry, FeatureValues
from freshline.pipeline.dev import processes

ROOT = Path(__file__).resolve().parents[1]
FRESHLINE = str(Path(sys.executable).with_name("freshline"))
"""The ``freshline`` command installed beside this Python."""
FRAUD_MIGRATIONS = migrations.Chain.of(ROOT / "examples" / "fraud" / "migrations", "fraud")


def migrate(url: str, fraud_revision: str = "head") -> None:
    """freshline's schema at head, and the fraud example's tables at ``fraud_revision``;
    at head, also the derived incremental paths ``apply --alter-tables`` installs (and
    fixes in place, on a database an earlier freshline installed them in)."""
    migrations.upgrade(url, repo=FRAUD_MIGRATIONS, repo_revision=fraud_revision)
    if fraud_revision == "head":
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            with engine.begin() as conn:
                install_missing(conn, REGISTRY.maintenances())
                secure_installed(conn, REGISTRY.maintenances())
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
    """Tests act as the operator: the Postgres owner, the Redis admin and the Kafka admin,
    in this process and in the ``freshline`` processes they start. The least-privilege
    logins that ``.stack/env`` names as the defaults stay at hand, as
    ``FRESHLINE_STACK_POSTGRES_API_URL``, ``FRESHLINE_STACK_REDIS_API_{USER,PASSWORD}`` and
    ``FRESHLINE_STACK_KAFKA_CONSUMER_{USER,PASSWORD}``, for the tests of those logins."""
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
    kafka_admin = os.environ.get("FRESHLINE_STACK_KAFKA_ADMIN_USER", "")
    if kafka_admin and os.environ.get("FRESHLINE_KAFKA_SASL_USERNAME") != kafka_admin:
        env = os.environ
        env["FRESHLINE_STACK_KAFKA_CONSUMER_USER"] = env.get("FRESHLINE_KAFKA_SASL_USERNAME", "")
        env["FRESHLINE_STACK_KAFKA_CONSUMER_PASSWORD"] = env.get(
            "FRESHLINE_KAFKA_SASL_PASSWORD", ""
        )
        env["FRESHLINE_KAFKA_SASL_USERNAME"] = kafka_admin
        env["FRESHLINE_KAFKA_SASL_PASSWORD"] = env.get("FRESHLINE_STACK_KAFKA_ADMIN_PASSWORD", "")


# Importing the helpers (conftest.py does, first) sets the tests' environment up.
load_stack_env()
act_as_operator()
# The tests run on the fraud example's repository unless told otherwise; the freshline
# processes they start inherit it.
os.environ.setdefault("FRESHLINE_REPO", str(ROOT / "examples" / "fraud"))
FRAUD: Repository = active()
"""The repository the tests run on (the fraud example's, unless ``FRESHLINE_REPO`` names
another), as the command line would find it."""
REGISTRY: Registry = FRAUD.registry
"""Its feature sets, which the library takes explicitly and the tests pass on."""

# One database per test session, so sessions running side by side never collide.
TEST_DB = os.environ.get("FRESHLINE_TEST_DB", f"freshline_test_{os.getpid()}")
TEST_REDIS_DB = int(os.environ.get("FRESHLINE_TEST_REDIS_DB", "1"))
ANCHOR = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

# The tests' and the benchmarks' one copy (pipeline/dev/processes.py).
free_port = processes.free_port
wait_until = processes.wait_until

# The Hypothesis profile (tests/conftest.py registers both): ``ci`` (scripts/test, and CI,
# where CI=true) runs each property test's full number of examples; ``dev`` (scripts/test
# --fast, a developer's pytest) a tenth of it, for an answer in a minute.
HYPOTHESIS_PROFILE = os.environ.get(
    "FRESHLINE_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "dev"
)


def examples(n: int) -> int:
    """How many examples a property test that runs ``n`` in CI runs under this profile."""
    return n if HYPOTHESIS_PROFILE == "ci" else max(10, n // 10)


def _admin_engine(base: Settings) -> Engine:
    url = make_url(base.postgres_url).set(database="postgres")
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


@contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded HTTP server on a free loopback port answering with ``handler``: yields
    its base URL (``http://127.0.0.1:PORT``) and is shut down on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


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
    """Drop ``name`` as the owner, once no other login's session is on it: FORCE ends
    the owner's own, but the owner (no superuser) may not end another login's, and
    those of a process just stopped (a consumer, the API, Debezium's connector after
    `cdc remove`) end a moment after it."""
    admin = _admin_engine(base)
    others = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = :name "
        "AND usename IS DISTINCT FROM current_user"
    )
    with admin.connect() as conn:

        def alone() -> bool:
            return int(conn.execute(others, {"name": name}).scalar_one()) == 0

        assert wait_until(alone, timeout=60), f"other logins' sessions stay on {name}"
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def forget_repository(base_settings: Settings, db: str) -> None:
    """Remove, as the operator, what deploying a repository on database ``db`` with
    topic prefix ``db.`` made: its connector and slot, the database, and the topics and
    ACLs of its prefix."""
    prefix = f"{db}."
    operator = base_settings.model_copy(update={"topic_prefix": prefix})
    env = {
        **os.environ,
        "FRESHLINE_TOPIC_PREFIX": prefix,
        "FRESHLINE_POSTGRES_URL": re.sub(r"/[^/]*$", f"/{db}", operator.postgres_url),
    }
    removed = subprocess.run(
        [FRESHLINE, "cdc", "remove"], env=env, capture_output=True, text=True, timeout=120
    )
    assert removed.returncode == 0, removed.stdout + removed.stderr
    drop_database(base_settings, db)
    forget_prefix(admin_client(operator), prefix)


def forget_prefix(admin: AdminClient, prefix: str) -> None:
    """Delete the topics named ``prefix...`` (and Debezium's heartbeats for them) and
    every ACL on a topic or group named ``prefix...``, as the ``admin``'s login."""
    heartbeats = f"__debezium-heartbeat.{prefix}"
    topics = [t for t in admin.list_topics(timeout=15).topics if t.startswith((prefix, heartbeats))]
    if topics:
        for future in admin.delete_topics(topics, request_timeout=30).values():
            future.result()
    for kind in (ResourceType.TOPIC, ResourceType.GROUP):
        everything = AclBindingFilter(
            kind,
            None,  # type: ignore[arg-type]  # any name
            ResourcePatternType.ANY,
            None,  # type: ignore[arg-type]  # any principal
            None,  # type: ignore[arg-type]  # any host
            AclOperation.ANY,
            AclPermissionType.ANY,
        )
        ours = [
            AclBindingFilter(
                b.restype,
                b.name,
                b.resource_pattern_type,
                b.principal,
                b.host,
                b.operation,
                b.permission_type,
            )
            for b in admin.describe_acls(everything, request_timeout=30).result()
            if b.name.startswith(prefix)
        ]
        if ours:
            for future in admin.delete_acls(ours, request_timeout=30).values():
                future.result()


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


UNWINDOWED = Registry(dataclasses.replace(fs, horizon=None) for fs in REGISTRY)
"""The feature sets without their horizons: an in-process tier serves their entries
at once, without reading their Redis TTL first (tests of the tier's other rules, with
entries that are not in Redis)."""

TXN_VALUES: FeatureValues = {
    "txn_count": 1,
    "txn_sum": 2.0,
    "txn_mean": 2.0,
    "txn_max": 2.0,
    "txn_std": 0.0,
    "distinct_merchants": 1,
    "distinct_devices": 1,
    "last_txn_at": None,
}
"""A txn_90d entry's values, for tests that write entries without computing them."""


class Api:
    """A synchronous face on an httpx client talking ASGI to the app, in a portal thread."""

    def __init__(
        self,
        app: Starlette,
        portal: anyio.from_thread.BlockingPortal,
        client: httpx.AsyncClient,
        key: str | None,
    ) -> None:
        self.app = app
        self.portal = portal
        self.client = client
        self.key = key

    def request(
        self, method: str, url: str, *, key: str | None = "default", **kwargs: Any
    ) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        key = self.key if key == "default" else key
        if key is not None:
            headers.setdefault("Authorization", f"Bearer {key}")
        call = functools.partial(self.client.request, method, url, headers=headers, **kwargs)
        return self.portal.call(call)

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def ops(self, url: str, **kwargs: Any) -> httpx.Response:
        """GET ``url`` from the app's ops-port app (:mod:`freshline.pipeline.api.ops`), with no
        key."""

        async def get() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app.state.ops_app)
            async with httpx.AsyncClient(transport=transport, base_url="http://ops.test") as c:
                return await c.get(url, **kwargs)

        return self.portal.call(get)


@contextmanager
def running(app: Starlette, key: str | None = None) -> Iterator[Api]:
    """Run the app's lifespan and yield a client for it."""
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(app.router.lifespan_context(app)),
    ):
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://freshline.test"
        )
        try:
            yield Api(app, portal, client, key)
        finally:
            portal.call(client.aclose)


@contextmanager
def api_for(
    settings: Settings, engine: Engine, client: redis.Redis, tenant: str, **create: Any
) -> Iterator[Api]:
    """The API on ``settings`` running, following no deploys (``create``: more
    ``create_app`` arguments), and a client of it holding a new key of ``tenant``."""
    from freshline.pipeline.api import create_app  # imported here: see api_app
    from freshline.pipeline.api.accounts import create_api_key

    create.setdefault("registry", REGISTRY)
    app = create_app(settings, engine=engine, redis_client=client, follow_deploys=False, **create)
    with running(app, create_api_key(engine, tenant)) as api:
        yield api


def api_app(settings: Settings, engine: Engine, client: redis.Redis, **update: Any) -> Starlette:
    """The API on a schema version of its own, without the in-process tier, following no
    deploys; ``update`` changes these or other settings."""
    # Imported here: loading these helpers should not import prometheus_client, which
    # fixes its mode when first imported (freshline.pipeline.api imports it).
    from freshline.pipeline.api import create_app

    changed = {"schema_version": fresh_version(), "local_cache_size": 0, **update}
    return create_app(
        settings.model_copy(update=changed),
        engine=engine,
        redis_client=client,
        follow_deploys=False,
        registry=REGISTRY,
    )


def freshline(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``freshline args`` (60 s at most) with ``env`` added to this environment."""
    return subprocess.run(
        [FRESHLINE, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def cli(*args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """``freshline args`` in this process (``main`` under click's ``CliRunner``), with
    ``env`` added (a None unsets its variable): what ``freshline()`` answers without
    starting Python, for a test that is not about the process itself.

    What the command leaves behind that its process's exit would have ended is ended
    here: the engines it connected (disposed, as exit closes their connections), the
    audit logger it pointed at a file and the environment it set (``--repo``) are put
    back as they were. Its consoles take their size from ``env`` as a new process's
    would (rich reads ``COLUMNS`` and ``LINES`` once, when the CLI is imported: in an
    xdist worker, 80 and 24).
    """
    from click.testing import CliRunner

    from freshline.pipeline.cli import main
    from freshline.pipeline.cli.app import console, out

    command_thread = threading.get_ident()
    connected: dict[int, Engine] = {}

    def seen(conn: sa.Connection) -> None:
        if threading.get_ident() == command_thread:
            connected[id(conn.engine)] = conn.engine

    audit = logging.getLogger("freshline.audit")
    audit_state = (list(audit.handlers), audit.level, audit.propagate)
    argv, environ = sys.argv, dict(os.environ)
    sizes = [(c._width, c._height) for c in (console, out)]
    sa.event.listen(Engine, "engine_connect", seen)
    try:
        with CliRunner().isolation(env=env) as (stdout_bytes, stderr_bytes, _):
            for c in (console, out):
                c._width, c._height = _dimension("COLUMNS"), _dimension("LINES")
            sys.argv = [FRESHLINE, *args]
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            finally:
                sys.argv = argv
            stdout, stderr = stdout_bytes.getvalue().decode(), stderr_bytes.getvalue().decode()
    finally:
        for c, (width, height) in zip((console, out), sizes, strict=True):
            c._width, c._height = width, height
        sa.event.remove(Engine, "engine_connect", seen)
        for engine in connected.values():
            engine.dispose()
        for handler in audit.handlers:
            if handler not in audit_state[0]:
                handler.close()
        audit.handlers[:] = audit_state[0]
        audit.setLevel(audit_state[1])
        audit.propagate = audit_state[2]
        if os.environ != environ:
            os.environ.clear()
            os.environ.update(environ)
    return subprocess.CompletedProcess([FRESHLINE, *args], code, stdout, stderr)


def _dimension(name: str) -> int | None:
    """``COLUMNS`` or ``LINES`` as rich reads it when a console is made (None: unset)."""
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a command that failed as it should (exit status 1, no traceback)
    wrote to stderr."""
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


def installed(tool: str, package: str) -> str:
    """The path of the command ``tool``. Without it the test skips; under CI a missing
    tool is a broken install step, so it fails."""
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not installed: apt-get install {package} (scripts/test does)"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


def redis_server(port: int, *args: str) -> list[str]:
    """The command line of a redis-server of a test's own, on ``port`` of 127.0.0.1
    (0: no plain port), persisting nothing, ``args`` last; see :func:`installed`."""
    binary = installed("redis-server", "redis-server")
    local = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return [binary, *local, *args]


def self_signed_certificate(cert: Path, key: Path, subject: str, *options: str) -> None:
    """Write a self-signed certificate for ``subject`` (``/CN=...``) valid for two days,
    and its unencrypted RSA key, with openssl; ``options``: more ``openssl req`` options."""
    subprocess.run(
        [
            installed("openssl", "openssl"),
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            subject,
            "-keyout",
            str(key),
            "-out",
            str(cert),
            *options,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )


def redis_login_args() -> list[str]:
    """redis-server arguments that add the settings' Redis login (the stack's admin), so
    that it works on a private server too; none without one (no login works as well)."""
    user = os.environ.get("FRESHLINE_REDIS_USERNAME")
    password = os.environ.get("FRESHLINE_REDIS_PASSWORD")
    return ["--user", user, "on", f">{password}", "~*", "&*", "+@all"] if user and password else []


def interrupt(proc: subprocess.Popen[Any]) -> None:
    """Stop ``proc`` as Ctrl-C does, killing it if it has not exited 15 s later."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def dark_through_outage(
    tier: LocalTier,
    ref: EntityRef,
    entry: Callable[[], Entry],
    stop: Callable[[], None],
    start: Callable[[], None],
) -> None:
    """Check a live in-process tier holding ``ref`` through a Redis outage: ``stop``ped,
    it goes dark, serving and keeping nothing; ``start``ed, it is live again, still
    empty, and keeps entries."""
    stop()
    assert wait_until(lambda: not tier.live)
    assert tier.get(ref, 1) is None
    assert tier.put(ref, entry(), tier.token()) is False
    start()
    assert tier.wait_live(10)
    assert tier.get(ref, 1) is None
    assert tier.put(ref, entry(), tier.token())


def observe_refreshes(resolver: VersionResolver) -> threading.Event:
    """An event set each time a deploy message drops the resolver's cached version."""
    got = threading.Event()
    original = resolver.refresh

    def refresh() -> None:
        original()
        got.set()

    resolver.refresh = refresh  # type: ignore[method-assign]
    return got


def counting_readthrough(
    store: EntryStore, engine: Engine
) -> tuple[ReadThrough, list[list[EntityRef]]]:
    """A read-through without early refreshes, and the list of the refs of each compute
    it runs, appended as it runs them."""
    computed: list[list[EntityRef]] = []
    rt = ReadThrough(
        store, engine, hooks=Hooks(before_compute=computed.append), early_refresh=False
    )
    return rt, computed


@contextmanager
def nested_checkouts(engine: Engine) -> Iterator[list[str]]:
    """Watch ``engine``'s pool: yields the names of the threads that checked a connection
    out while holding one already, as they do. Enough such threads hold every connection
    and wait for one more, and the pool deadlocks until its timeout (issue 48)."""
    held: dict[int, int] = {}  # thread -> connections it holds
    owner: dict[int, int] = {}  # id of a checked-out connection record -> its thread
    nested: list[str] = []
    lock = threading.Lock()

    def checkout(_dbapi: Any, record: Any, _proxy: Any) -> None:
        me = threading.get_ident()
        with lock:
            owner[id(record)] = me
            held[me] = held.get(me, 0) + 1
            if held[me] > 1:
                nested.append(threading.current_thread().name)

    def checkin(_dbapi: Any, record: Any) -> None:
        with lock:
            thread = owner.pop(id(record), None)
            if thread is not None:
                held[thread] -= 1

    sa.event.listen(engine, "checkout", checkout)
    sa.event.listen(engine, "checkin", checkin)
    try:
        yield nested
    finally:
        sa.event.remove(engine, "checkout", checkout)
        sa.event.remove(engine, "checkin", checkin)


@dataclasses.dataclass
class PausedReader:
    """A reader thread held between its database query and its write to Redis."""

    thread: threading.Thread
    resume: threading.Event
    answers: list[Result] = dataclasses.field(default_factory=list)
    errors: list[BaseException] = dataclasses.field(default_factory=list)

    def finish(self) -> Result:
        """Let the reader write, wait for its thread to end; its one answer."""
        self.resume.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the paused reader never finished"
        assert not self.errors, f"the paused reader raised: {self.errors[0]!r}"
        assert len(self.answers) == 1
        return self.answers[0]


def paused_reader(rt: ReadThrough, ref: EntityRef) -> PausedReader:
    """Start a reader of ``ref`` and return once it has queried the database."""
    queried, resume = threading.Event(), threading.Event()

    def pause(_: list[EntityRef]) -> None:
        queried.set()
        if not resume.wait(timeout=30):
            raise TimeoutError("the test never resumed the reader")

    def read() -> None:
        try:
            paused.answers.append(rt.get(ref))
        except BaseException as exc:  # reported by finish(), in the test's thread
            paused.errors.append(exc)

    rt.hooks.after_compute = pause
    paused = PausedReader(threading.Thread(target=read), resume)
    paused.thread.start()
    assert queried.wait(timeout=30)
    return paused


def need(variable: str) -> str:
    """The value of a ``.stack/env`` variable this test needs."""
    value = os.environ.get(variable, "")
    if not value:
        message = (
            f"{variable} is not set: the stack runs without this login; restart it "
            "with scripts/stack down && scripts/stack up"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return value


def as_user(settings: Settings, user: str, password: str) -> Settings:
    return settings.model_copy(
        update={"redis_username": user, "redis_password": SecretStr(password)}
    )


def kafka_login(settings: Settings, login: str) -> Settings:
    """``settings`` logged in to Kafka as one of the stack's logins: ``consumer``,
    ``producer`` (domain events), ``connect`` or ``admin``."""
    return settings.model_copy(
        update={
            "kafka_security_protocol": "sasl_plaintext",
            "kafka_sasl_mechanism": "SCRAM-SHA-512",
            "kafka_sasl_username": need(f"FRESHLINE_STACK_KAFKA_{login.upper()}_USER"),
            "kafka_sasl_password": SecretStr(
                need(f"FRESHLINE_STACK_KAFKA_{login.upper()}_PASSWORD")
            ),
        }
    )


def role_url(settings: Settings, variable: str) -> str:
    """The test database's URL, logged in with the role ``variable`` names."""
    role = make_url(need(variable))
    url = make_url(settings.postgres_url).set(username=role.username, password=role.password)
    return url.render_as_string(hide_password=False)


def role_engine(settings: Settings, variable: str) -> Engine:
    """An engine on the test database, logged in with the role ``variable`` names."""
    return make_engine(settings.model_copy(update={"postgres_url": role_url(settings, variable)}))


def assert_kafka_refuses(settings: Settings) -> None:
    """Kafka refuses ``settings``' login: the admin client fails at start-up, and a
    producer is told ``_AUTHENTICATION`` within 30 s."""
    with pytest.raises(ServiceUnavailable):
        admin_client(settings)
    errors: list[KafkaError] = []
    producer = Producer(client_config(settings, "producer", error_cb=errors.append))
    assert wait_until(
        lambda: (
            producer.poll(0.2) >= 0 and any(e.code() == KafkaError._AUTHENTICATION for e in errors)
        ),
        timeout=30,
    ), errors
    producer.flush(0)


def kafka_header_pairs(msg: Message) -> list[tuple[str, str | bytes | None]]:
    """``msg``'s headers in order, as (name, value) pairs."""
    raw = msg.headers() or []
    return list(raw.items()) if isinstance(raw, dict) else raw


def kafka_headers(msg: Message) -> dict[str, bytes]:
    """``msg``'s headers by name (the last of a repeated name), as bytes; a header
    without a value fails the test."""
    out: dict[str, bytes] = {}
    for name, value in kafka_header_pairs(msg):
        assert value is not None, f"header {name!r} has no value"
        out[name] = value.encode() if isinstance(value, str) else value
    return out


def kafka_value(msg: Message) -> bytes:
    """``msg``'s value; a record without one (a tombstone) fails the test."""
    value = msg.value()
    assert value is not None, f"{msg.topic()}[{msg.partition()}]@{msg.offset()} has no value"
    return value
