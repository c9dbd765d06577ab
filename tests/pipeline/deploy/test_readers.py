"""Deploys never take a reader down (issue 54): readers of versions they do not compute,
flips that check who is running, rollbacks every reader follows.

Real Redis and Postgres. The readers (the API, a listening ``FeatureClient``) log in to
Redis and Postgres as the API does (``.stack/env``'s least-privilege logins), consumers'
registrations as the writers do; the deploy commands run as the operator. Two codes
stand for the code before and after a bump: ``CODE_A`` (the repository's) and
``CODE_B`` (``txn_90d`` with another TTL, so it computes version B only). Every test
has a pointer of its own (``Pointer.scoped``) and fresh schema versions.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.roster import CONSUMER, READER, Kind, Proc, Registration, roster
from freshline.pipeline.cache.versions import Pointer, publish_fields, state
from freshline.pipeline.core.errors import DeployError
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.lock import Lock, LockedSet
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.deploy.pointer import flip, retire, start
from freshline.pipeline.deploy.warm import warm
from tests.helpers import (
    REGISTRY,
    Api,
    as_user,
    fresh_version,
    need,
    observe_refreshes,
    role_engine,
    running,
    wait_until,
)

CODE_A = REGISTRY
CODE_B = Registry(
    dataclasses.replace(fs, ttl_s=fs.ttl_s + 1) if fs.name == "txn_90d" else fs for fs in REGISTRY
)
USERS = 12
WARM = [str(u) for u in range(1, 7)]
"""Users warmed into both versions."""
COLD = [str(u) for u in range(7, USERS + 1)]
"""Users warmed into version A only: misses in B."""


def entry(code: Registry) -> dict[str, LockedSet]:
    return {fs.name: LockedSet.of(fs) for fs in code}


@dataclass
class World:
    """One test's deploy: versions A and B, the locks before and after the bump."""

    admin: redis.Redis
    api_redis: redis.Redis
    writer_redis: redis.Redis
    settings: Settings
    api_settings: Settings
    engine: Engine
    api_engine: Engine
    tenant: str
    key: str
    a: int
    b: int
    pointer: Pointer

    @property
    def old(self) -> Lock:
        """The lock before the bump: version A only."""
        return Lock({self.a: entry(CODE_A)})

    @property
    def new(self) -> Lock:
        return Lock({self.a: entry(CODE_A), self.b: entry(CODE_B)})

    def warm(self, version: int, code: Registry, users: list[str] = WARM) -> None:
        warm(
            self.admin,
            self.engine,
            version,
            "txn_90d",
            [[(self.tenant, u) for u in users]],
            self.new,
            registry=code,
        )

    def flip(self, version: int, *, force: bool = False) -> None:
        flip(
            self.admin,
            self.settings,
            version,
            self.new,
            pointer=self.pointer,
            registry=CODE_B,
            force=force,
        )

    @contextmanager
    def api(self, code: Registry, lock: Lock, version: int) -> Iterator[Api]:
        """The read API on ``code`` (its own version ``version``), as the API logs in."""
        from freshline.pipeline.api import create_app

        app = create_app(
            self.api_settings.model_copy(update={"schema_version": version, "local_cache_size": 0}),
            engine=self.api_engine,
            redis_client=self.api_redis,
            registry=code,
            pointer=self.pointer,
            lock=lock,
        )
        with running(app, self.key) as api:
            assert wait_until(lambda: app.state.services.reader.readthrough.versions.listening)
            yield api

    @contextmanager
    def client(self, code: Registry, lock: Lock, version: int) -> Iterator[FeatureClient]:
        """A listening ``FeatureClient.following`` on ``code``, as the API logs in."""
        features = FeatureClient.following(
            self.api_redis,
            self.api_settings.model_copy(update={"schema_version": version}),
            registry=code,
            pointer=self.pointer,
            lock=lock,
        )
        try:
            assert features.versions is not None
            assert wait_until(lambda: features.versions is not None and features.versions.listening)
            yield features
        finally:
            features.close()

    def consumer(self, code: Registry, lock: Lock, group: str) -> Registration:
        """A consumer's registration (what ``freshline.consumers.worker.Worker`` keeps while it
        runs), as the writers log in."""
        proc = Proc.of("consume", lock, code, group=group, pointer=self.pointer)
        return Registration(self.writer_redis, proc, pointer=self.pointer).start()


def served(api: Api, world: World, user: str) -> tuple[int, int | str | None]:
    """(status, schema version or error code) of the API's answer for ``user``."""
    got = api.get(f"/v1/features/txn_90d/{user}")
    body = got.json()
    if got.status_code == 200:
        return 200, body["schema_version"]
    return got.status_code, body.get("error", {}).get("code")


def client_version(features: FeatureClient, world: World, user: str) -> int | None:
    found = features.get("txn_90d", world.tenant, user)
    return None if found is None else found.schema_version


@pytest.fixture
def world(
    settings: Settings,
    redis_client: redis.Redis,
    engine: Engine,
    tenant_factory: Callable[..., SeedSummary],
) -> Iterator[World]:
    tenant = tenant_factory(users=USERS, transactions=300).tenants[0]
    api_settings = as_user(
        settings, need("FRESHLINE_STACK_REDIS_API_USER"), need("FRESHLINE_STACK_REDIS_API_PASSWORD")
    )
    writer_settings = as_user(
        settings,
        need("FRESHLINE_STACK_REDIS_WRITER_USER"),
        need("FRESHLINE_STACK_REDIS_WRITER_PASSWORD"),
    )
    a, b = fresh_version(), fresh_version()
    pointer = Pointer.scoped(uuid.uuid4().hex)
    with ExitStack() as stack:
        api_redis = redis_client_for(api_settings, stack)
        registrations_allowed(api_redis, pointer)
        writer_redis = redis_client_for(writer_settings, stack)
        api_engine = role_engine(settings, "FRESHLINE_STACK_POSTGRES_API_URL")
        stack.callback(api_engine.dispose)
        world = World(
            redis_client,
            api_redis,
            writer_redis,
            settings.model_copy(update={"schema_version": a}),
            api_settings,
            engine,
            api_engine,
            tenant,
            create_api_key(engine, tenant),
            a,
            b,
            pointer,
        )
        flip(redis_client, world.settings, a, world.old, pointer=pointer, registry=REGISTRY)
        world.warm(a, CODE_A, WARM + COLD)
        yield world
        redis_client.delete(
            pointer.active_key,
            pointer.next_key,
            pointer.previous_key,
            pointer.retired_key(a),
            pointer.retired_key(b),
            pointer.fields_key(a),
            pointer.fields_key(b),
        )


def redis_client_for(settings: Settings, stack: ExitStack) -> redis.Redis:
    client = redis_client(settings)
    stack.callback(client.close)
    return client


def registrations_allowed(client: redis.Redis, pointer: Pointer, kind: Kind = "client") -> None:
    """Skip (fail in CI) on a Redis still running the ACL rules from before the logins
    could register: ``scripts/stack up`` loads the current ones into it."""
    probe = Registration(client, Proc.of(kind, Lock(), REGISTRY, pointer=pointer))
    try:
        probe.renew()
    except redis.exceptions.NoPermissionError:
        message = "the running Redis has ACL rules without registrations: run scripts/stack up"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    probe.close()


# ---------------------------------------------------------------- registrations


def test_each_login_writes_its_own_registrations_only_and_every_key_expires(
    world: World,
) -> None:
    reader = Proc.of("client", world.old, CODE_A, pointer=world.pointer)
    consumer = Proc.of("consume", world.new, CODE_B, group="g", pointer=world.pointer)
    with ExitStack() as stack:
        stack.callback(Registration(world.api_redis, reader, pointer=world.pointer).start().close)
        stack.callback(
            Registration(world.writer_redis, consumer, pointer=world.pointer).start().close
        )
        assert {
            (p.kind, p.knows, p.computes, p.group)
            for p in roster(world.api_redis, pointer=world.pointer)
        } == {
            ("client", (world.a,), (world.a,), None),
            ("consume", (world.a, world.b), (world.b,), "g"),
        }
        for role, proc in ((READER, reader), (CONSUMER, consumer)):
            assert world.admin.pttl(world.pointer.proc_key(role, proc.id)) > 0
            assert world.admin.pttl(world.pointer.procs_index(role)) > 0
        # Neither login may write the other's role, nor the pointer.
        forged = Proc.of("consume", world.new, CODE_B, group="g", pointer=world.pointer)
        with pytest.raises(redis.exceptions.NoPermissionError):
            Registration(world.api_redis, forged, pointer=world.pointer).renew()
        with pytest.raises(redis.exceptions.NoPermissionError):
            Registration(world.writer_redis, reader, pointer=world.pointer).renew()
        with pytest.raises(redis.exceptions.NoPermissionError):
            world.api_redis.set(world.pointer.active_key, world.b)
    assert roster(world.admin, pointer=world.pointer) == []  # closed: gone


# ---------------------------------------------------------------- flips that check


def test_flip_refuses_while_a_registered_process_does_not_know_the_target(world: World) -> None:
    start(world.admin, world.settings, world.b, world.new, pointer=world.pointer)
    world.warm(world.b, CODE_B)
    with world.client(CODE_A, world.old, world.a):
        with pytest.raises(DeployError, match=r"client .* does not compute schema version"):
            world.flip(world.b)
        assert state(world.admin, world.settings, pointer=world.pointer).active == world.a
    # A consumer group split between codes would leave partitions unwritten.
    split = [world.consumer(CODE_B, world.new, "v2"), world.consumer(CODE_A, world.old, "v2")]
    old_group = world.consumer(CODE_A, world.old, "v1")  # keeps writing A: fine
    try:
        with pytest.raises(DeployError, match=r"consume .* of group v2 does not write") as refused:
            world.flip(world.b)
        assert "group v1" not in str(refused.value)
        split.pop().close()
        world.flip(world.b)  # nothing in the way now
        # A rollback is always accepted, though no consumer of group v2 computes A.
        world.flip(world.a)
        assert state(world.admin, world.settings, pointer=world.pointer).active == world.a
    finally:
        for registration in (*split, old_group):
            registration.close()


# ---------------------------------------------------------------- readers never 500


def test_a_reader_past_a_forced_flip_serves_its_own_version_or_503_never_500(
    world: World,
) -> None:
    """The reader started before the bump: its lock has A only."""
    with (
        world.api(CODE_A, world.old, world.a) as api,
        world.client(CODE_A, world.old, world.a) as features,
    ):
        start(world.admin, world.settings, world.b, world.new, pointer=world.pointer)
        world.warm(world.b, CODE_B)
        with pytest.raises(DeployError, match="--force"):
            world.flip(world.b)
        world.flip(world.b, force=True)
        # B's hits, decoded with the field lists the flip published...
        assert wait_until(lambda: served(api, world, WARM[0]) == (200, world.b))
        assert client_version(features, world, WARM[0]) == world.b
        # ...and its misses from A, still written (previous, for a rollback).
        assert served(api, world, COLD[0]) == (200, world.a)
        assert client_version(features, world, COLD[1]) == world.a
        status = api.ops("/status.json").json()
        assert any(f"schema version {world.b} is active" in p for p in status["problems"])
        assert {p["kind"] for p in status["processes"]} == {"serve", "client"}
        # A no longer written: misses are refused, hits still served.
        retire(
            world.admin,
            world.settings,
            world.a,
            world.new,
            pointer=world.pointer,
            registry=REGISTRY,
        )
        assert wait_until(
            lambda: served(api, world, COLD[2]) == (503, "schema_version_unknown"), timeout=10
        )
        assert served(api, world, WARM[1]) == (200, world.b)
        # A miss, not an error, once the client reads the pointer again (it keeps what is
        # written for WRITE_VERSIONS_MAX_AGE_S, as the API does).
        assert wait_until(lambda: client_version(features, world, COLD[3]) is None)
        [refused] = [
            float(line.split()[-1])
            for line in api.ops("/metrics").text.splitlines()
            if line.startswith("freshline_api_schema_version_unknown_total ")
        ]
        assert refused >= 1


def test_an_unpublished_version_is_served_from_the_own_one_then_refused(world: World) -> None:
    """Nothing decodes B (its field lists are not published): every read is a miss."""
    with world.api(CODE_A, world.old, world.a) as api:
        start(world.admin, world.settings, world.b, world.new, pointer=world.pointer)
        world.warm(world.b, CODE_B)
        world.flip(world.b, force=True)
        world.admin.delete(world.pointer.fields_key(world.b))
        assert wait_until(lambda: served(api, world, WARM[2]) == (200, world.a), timeout=10)
        retire(
            world.admin,
            world.settings,
            world.a,
            world.new,
            pointer=world.pointer,
            registry=REGISTRY,
        )
        assert wait_until(
            lambda: served(api, world, WARM[2]) == (503, "schema_version_unknown"), timeout=10
        )


# ---------------------------------------------------------------- the runbook


def test_the_runbook_with_readers_started_before_the_bump(world: World) -> None:
    """docs/deploys.md step by step, with an API and a listening client started before
    the bump: no 500 at any step; the flip waits for readers that know B; they follow
    it (and the rollback) as soon as its message arrives; a restart follows the pointer."""
    seen: list[tuple[str, int, int | str | None]] = []

    def check(step: str, api: Api, features: FeatureClient) -> set[int | str | None]:
        """Every reader's answers now; none is a 500. The versions served."""
        versions: set[int | str | None] = set()
        for user in (WARM[0], COLD[0]):
            status, version = served(api, world, user)
            seen.append((step, status, version))
            versions.add(version)
            versions.add(client_version(features, world, user) or None)
        assert all(status != 500 for _, status, _ in seen), seen
        return versions - {None}

    with ExitStack() as readers:
        api = readers.enter_context(world.api(CODE_A, world.old, world.a))
        features = readers.enter_context(world.client(CODE_A, world.old, world.a))
        v1 = world.consumer(CODE_A, world.old, "freshline")
        readers.callback(v1.close)
        assert check("before", api, features) == {world.a}
        # 1. Bump (the lock now has B) and 2. apply: its field lists are published.
        assert publish_fields(world.admin, world.new, pointer=world.pointer) == [world.a, world.b]
        v2 = world.consumer(CODE_B, world.new, "freshline-v2")
        readers.callback(v2.close)
        # 3. Warm.
        start(world.admin, world.settings, world.b, world.new, pointer=world.pointer)
        world.warm(world.b, CODE_B)
        assert check("warmed", api, features) == {world.a}
        # 4. Flip: refused while the readers started before the bump run, naming them.
        with pytest.raises(DeployError) as refused:
            world.flip(world.b)
        assert "serve " in str(refused.value) and "client " in str(refused.value)
        readers.close()  # restart them on the new code
    with ExitStack() as readers:
        api = readers.enter_context(world.api(CODE_B, world.new, world.b))
        features = readers.enter_context(world.client(CODE_B, world.new, world.b))
        v1 = world.consumer(CODE_A, world.old, "freshline")
        v2 = world.consumer(CODE_B, world.new, "freshline-v2")
        readers.callback(v1.close)
        readers.callback(v2.close)
        assert check("restarted", api, features) <= {world.a, world.b}
        api_versions = api.app.state.services.reader.readthrough.versions
        assert features.versions is not None
        heard = [observe_refreshes(api_versions), observe_refreshes(features.versions)]
        world.flip(world.b)
        # Listening readers drop the pointer on the flip's message, then serve B.
        assert all(event.wait(10) for event in heard)
        assert check("flipped", api, features) == {world.b}
        for event in heard:
            event.clear()
        # Rollback: accepted, and followed by both, though neither computes A.
        world.flip(world.a)
        assert all(event.wait(10) for event in heard)
        assert served(api, world, WARM[0]) == (200, world.a)
        assert client_version(features, world, WARM[0]) == world.a
        assert check("rolled back", api, features) <= {world.a, world.b}
    # Restarted after the rollback, on the new code: A, not "staying on B".
    with (
        world.api(CODE_B, world.new, world.b) as api,
        world.client(CODE_B, world.new, world.b) as features,
    ):
        assert served(api, world, WARM[1]) == (200, world.a)
        assert client_version(features, world, WARM[1]) == world.a
        check("restarted after the rollback", api, features)


def test_deploy_status_lists_the_running_processes(world: World) -> None:
    """What ``freshline deploy status`` prints comes from the same roster."""
    with world.client(CODE_A, world.old, world.a) as features:
        assert features.versions is not None
        [proc] = roster(world.admin, pointer=world.pointer)
        assert (proc.kind, proc.computes) == ("client", (world.a,))
        assert wait_until(lambda: roster(world.admin, pointer=world.pointer)[0].serving == world.a)


def test_the_cli_flip_names_who_is_in_the_way_and_status_lists_them(
    settings: Settings,
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
    tmp_path: Path,
) -> None:
    """``freshline deploy flip`` and ``status`` on a Redis of their own (they move the
    shared pointer), with a reader registered whose code computes version 1 only."""
    from tests.pipeline.deploy.test_markers import refused, run

    url = private_redis[0]
    lock_file = tmp_path / "features.lock.json"
    lock = Lock({1: entry(CODE_A), 2: entry(CODE_B)})
    lock.save(lock_file)
    env = {
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": url,
        "FRESHLINE_SCHEMA_VERSION": "1",
    }
    client = redis.Redis.from_url(url)
    reader = Proc.of("serve", Lock({1: entry(CODE_A)}), CODE_A)
    registration = Registration(client, reader).start()
    try:
        assert run(env, "deploy", "start", "2", "--lock", str(lock_file)).returncode == 0
        said = refused(run(env, "deploy", "flip", "2", "--lock", str(lock_file)), "--force")
        assert f"serve {reader.host}:{reader.pid} does not compute schema version 2" in said
        status = run(env, "deploy", "status", "--lock", str(lock_file)).stdout
        assert f"serve {reader.host}:{reader.pid}: computes 1, knows 1" in status
        forced = run(env, "deploy", "flip", "2", "--force", "--lock", str(lock_file))
        assert forced.returncode == 0, forced.stdout + forced.stderr
        assert "active schema version:   2" in forced.stdout
    finally:
        registration.close()
        client.close()
