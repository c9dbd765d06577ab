"""A deploy never flips into a namespace nobody writes: the retired markers.

Every transition that stops writing a schema version leaves a *retired* marker that
outlives its last write: a flip (the version left stays previous, written for one
TTL), a cancel, a forced purge of the previous version. A version with a marker is
neither started nor flipped to; purge refuses the previous version, the rollback
target, unless forced. On the real Redis and Postgres, with a private pointer, random
versions and an in-memory lock, as in ``test_deploy.py``.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.versions import Pointer, WriteVersions, state
from freshline.pipeline.core.errors import DeployError
from freshline.pipeline.core.keys import feature_pattern
from freshline.pipeline.core.lock import Lock
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import ChangeEvent, EntityRef
from freshline.pipeline.deploy import pointer as deploy
from freshline.pipeline.deploy.pointer import cancel, flip, keep_ms, start
from freshline.pipeline.deploy.purge import purge
from freshline.pipeline.deploy.warm import active_entities, warm
from tests.helpers import REGISTRY, cli, fresh_version
from tests.pipeline.deploy.test_deploy import Deploy, deploy_world, fill, locked_entry

TXN_90D = REGISTRY["txn_90d"]


@pytest.fixture(scope="module")
def module_tenant(tenant_factory_module: Callable[..., SeedSummary]) -> str:
    return tenant_factory_module(users=20, transactions=600).tenants[0]


@pytest.fixture
def world(
    settings: Settings, redis_client: redis.Redis, engine: Engine, module_tenant: str
) -> Iterator[Deploy]:
    a, b = fresh_version(), fresh_version()  # no other test of the session writes them
    with deploy_world(settings, redis_client, engine, module_tenant, a, b) as world:
        yield world
    for version in (a, b):
        for key in redis_client.scan_iter(match=feature_pattern(version), count=1000):
            redis_client.unlink(key)


def whole_pointer(world: Deploy) -> list[bytes | str | None]:
    """Active, next, previous and both markers: what a refusal must leave as it was."""
    p = world.pointer
    keys = [p.active_key, p.next_key, p.previous_key, p.retired_key(world.a)]
    return [*world.redis.mget([*keys, p.retired_key(world.b)])]


def assert_not_deployable(world: Deploy, version: int) -> None:
    """Neither a flip to ``version`` nor a start of it is allowed ("purge it first"),
    and the refused attempts leave the pointer as it was."""
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    before = whole_pointer(world)
    with pytest.raises(DeployError, match="purge it first"):
        flip(r, s, version, lock, pointer=p, registry=REGISTRY)
    with pytest.raises(DeployError, match="purge it first"):
        start(r, s, version, lock, pointer=p)
    assert whole_pointer(world) == before


def age(world: Deploy, version: int, ms: int) -> None:
    """Pretend ``version`` stopped being written ``ms`` earlier than it did."""
    key = world.pointer.retired_key(version)
    stopped = int(world.redis.get(key) or 0)
    world.redis.set(key, str(stopped - ms), keepttl=True)


def longest_ms(lock: Lock, version: int) -> int:
    return max(s.ttl_s for s in lock.entry(version).values()) * 1000


def change(world: Deploy, user: int, writes: WriteVersions) -> None:
    """A real change in Postgres, applied by a consumer to the versions it writes now."""
    from freshline.consumers.processor import Processor

    with world.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE transactions SET amount = amount + 500 "
                "WHERE tenant_id = :t AND user_id = :u"
            ),
            {"t": world.tenant, "u": user},
        )
    event = ChangeEvent(
        "transactions", "u", world.tenant, {"tenant_id": world.tenant, "user_id": user}
    )
    Processor(world.engine, world.redis, versions=writes, registry=REGISTRY).apply([event])


def served(world: Deploy, version: int, user: int) -> dict[str, object] | None:
    [entry] = EntryStore(world.redis, version, registry=REGISTRY).read(
        [EntityRef("txn_90d", world.tenant, str(user))]
    )
    return None if entry is None else entry.values


def truth(world: Deploy, user: int) -> dict[str, object]:
    return compute(world.engine, TXN_90D, [(world.tenant, str(user))]).values[
        (world.tenant, str(user))
    ]


def test_purge_and_start_refuse_the_previous_version(world: Deploy) -> None:
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    world.warm_all(world.a)
    start(r, s, world.b, lock, pointer=p)
    flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    entries = world.count(feature_pattern(world.a))
    before = whole_pointer(world)
    # Purging the rollback target would leave it written but empty, then frozen.
    with pytest.raises(DeployError, match=r"previous version.*--force"):
        purge(r, s, world.a, pointer=p)
    with pytest.raises(DeployError, match=r"previous version.*deploy flip"):
        start(r, s, world.a, lock, pointer=p)
    assert whole_pointer(world) == before
    assert world.count(feature_pattern(world.a)) == entries
    assert (
        flip(r, s, world.a, lock, pointer=p, registry=REGISTRY).active == world.a
    )  # the rollback still works


def test_a_forced_purge_of_the_previous_version_leaves_it_unflippable(world: Deploy) -> None:
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    start(r, s, world.b, lock, pointer=p)
    flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    fill(EntryStore(r, world.a, registry=REGISTRY), world.engine, world.tenant, 50)
    deploy.retire(r, s, world.a, lock, pointer=p, registry=REGISTRY)
    assert state(r, s, pointer=p).previous is None
    assert WriteVersions(r, s, pointer=p, lock=lock, max_age_s=0, registry=REGISTRY)() == [world.b]
    result = purge(r, s, world.a, pointer=p)
    assert result.done and world.count(feature_pattern(world.a)) == 0
    # A consumer's last write to A may land after the purge's scan: the marker stays.
    assert result.retired_ms >= longest_ms(lock, world.a)
    assert r.pttl(p.retired_key(world.a)) >= longest_ms(lock, world.a)
    assert_not_deployable(world, world.a)
    # Once every write to A has landed, a purge clears the marker: A can be deployed.
    age(world, world.a, deploy.IN_FLIGHT_MS)
    again = purge(r, s, world.a, pointer=p)
    assert again.done and again.retired_ms == 0
    assert r.exists(p.retired_key(world.a)) == 0
    start(r, s, world.a, lock, pointer=p)
    assert flip(r, s, world.a, lock, pointer=p, registry=REGISTRY).active == world.a


def test_a_cancelled_version_is_refused_until_purged(world: Deploy) -> None:
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    writes = WriteVersions(r, s, pointer=p, lock=lock, max_age_s=0, registry=REGISTRY)
    world.warm_all(world.a)
    start(r, s, world.b, lock, pointer=p)
    world.warm_all(world.b)
    cancel(r, s, lock, pointer=p, registry=REGISTRY)
    assert writes() == [world.a]  # B is no longer written...
    change(world, 3, writes)
    assert served(world, world.a, 3) == truth(world, 3)
    frozen = served(world, world.b, 3)
    assert frozen is not None and frozen != truth(world, 3)  # ...so its entries are frozen
    assert_not_deployable(world, world.b)
    # The cancel left a marker that outlives every entry of B written before it.
    assert r.pttl(p.retired_key(world.b)) > longest_ms(lock, world.b)

    # Purged at once, a write computed before the cancel could still land: refused still.
    assert purge(r, s, world.b, pointer=p).retired_ms > 0
    with pytest.raises(DeployError, match="purge it first"):
        flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    age(world, world.b, deploy.IN_FLIGHT_MS)
    assert purge(r, s, world.b, pointer=p).retired_ms == 0
    start(r, s, world.b, lock, pointer=p)
    world.warm_all(world.b)
    flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    assert served(world, world.b, 3) == truth(world, 3)


def test_the_marker_of_the_version_left_outlives_its_longest_ttl(world: Deploy) -> None:
    """The marker's TTL comes from the version left's own lock entry, not the code's."""
    r, s, p = world.redis, world.settings, world.pointer
    longer = {n: dataclasses.replace(e, ttl_s=e.ttl_s * 24) for n, e in locked_entry().items()}
    lock = Lock({world.a: longer, world.b: locked_entry()})
    start(r, s, world.b, lock, pointer=p)
    flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    keep = keep_ms(REGISTRY)
    assert abs(r.pttl(p.previous_key) - keep) < 60_000  # A is written for one more TTL
    # Its last write lands up to ``keep`` from now and lives up to A's longest TTL.
    assert r.pttl(p.retired_key(world.a)) > keep + longest_ms(lock, world.a)


def test_warming_stops_when_the_version_is_no_longer_deployed(world: Deploy) -> None:
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    start(r, s, world.b, lock, pointer=p)

    def batches() -> Iterator[list[tuple[str, str]]]:
        yield [(world.tenant, "1")]
        cancel(r, s, lock, pointer=p, registry=REGISTRY)  # another operator, mid-warm
        yield [(world.tenant, "2")]

    def guard() -> None:
        deploy.writing(r, s, world.b, pointer=p)

    with pytest.raises(DeployError, match="not being deployed"):
        warm(r, world.engine, world.b, "txn_90d", batches(), lock, guard=guard, registry=REGISTRY)
    assert world.count(feature_pattern(world.b)) == 1  # nothing written after the cancel


def test_a_cold_flip_and_a_rollback_still_work(world: Deploy) -> None:
    """A version nobody wrote since its marker expired may be flipped to cold."""
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    users = active_entities(world.engine, TXN_90D.entity, [world.tenant], batch_size=50)
    warm(r, world.engine, world.a, "txn_90d", users, lock, registry=REGISTRY)
    assert flip(r, s, world.b, lock, pointer=p, registry=REGISTRY).previous == world.a
    assert flip(r, s, world.a, lock, pointer=p, registry=REGISTRY).previous == world.b
    assert r.exists(p.retired_key(world.a)) == 0  # written all along: no marker
    assert r.exists(p.retired_key(world.b)) == 1


# -- the commands --------------------------------------------------------------------


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return cli(*args, **env, COLUMNS="200")


def refused(result: subprocess.CompletedProcess[str], match: str) -> str:
    said = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, said
    assert "Traceback" not in said and len(said.splitlines()) == 1, said
    assert match in said, said
    return said


def test_the_commands_refuse_in_one_line_and_change_nothing(
    settings: Settings,
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
    tmp_path: Path,
) -> None:
    """On a Redis of its own: the commands move the shared pointer."""
    url = private_redis[0]
    lock_file = tmp_path / "features.lock.json"
    Lock({1: locked_entry(), 2: locked_entry()}).save(lock_file)
    lock = ("--lock", str(lock_file))
    env = {
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": url,
        "FRESHLINE_SCHEMA_VERSION": "1",
    }
    r = redis.Redis.from_url(url)
    pointer = [Pointer().active_key, Pointer().next_key, Pointer().previous_key]
    assert run(env, "deploy", "start", "2", *lock).returncode == 0
    assert run(env, "deploy", "flip", "2", *lock).returncode == 0
    before = r.mget(pointer)
    said = refused(run(env, "purge", "--version", "1"), "previous version")
    assert "freshline purge --version 1 --force" in said
    refused(run(env, "deploy", "start", "1", *lock), "freshline deploy flip 1")
    assert r.mget(pointer) == before

    forced = run(env, "purge", "--version", "1", "--force", *lock)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "stays retired" in forced.stdout + forced.stderr
    assert r.get(Pointer().previous_key) is None
    refused(run(env, "deploy", "flip", "1", *lock), "freshline purge --version 1")
    status = run(env, "deploy", "status", *lock)
    assert "previous schema version: -" in status.stdout
