"""Schema-version deploys on the real Redis and Postgres: pointer, warm, flip, purge.

Every test uses its own pointer keys (``Pointer.scoped``) and random schema versions
with an in-memory lock, so it never touches the shared pointer or other tests' keys.
Threads synchronize on conditions and counts, never on sleeps or timings.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api.fastpath import async_client
from freshline.pipeline.api.reader import FeatureReader, Lookup
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.hot import HotReads
from freshline.pipeline.cache.readthrough import ReadThrough, Result
from freshline.pipeline.cache.recompute import Batch, compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.versions import Pointer, VersionResolver, WriteVersions, state
from freshline.pipeline.core.errors import DeployError
from freshline.pipeline.core.keys import LEASE_PREFIX, feature_pattern, inference_key
from freshline.pipeline.core.lock import Lock, LockedSet
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.deploy.pointer import IN_FLIGHT_MS, cancel, flip, keep_ms, start
from freshline.pipeline.deploy.purge import purge
from freshline.pipeline.deploy.warm import Throttle, active_entities, count_active, warm
from freshline.pipeline.inference.models import purge_model
from tests.helpers import REGISTRY, fresh_version, observe_refreshes, wait_until

TXN_90D = REGISTRY["txn_90d"]

USERS = 40


@dataclass
class Deploy:
    """One test's private deploy world: versions A (active) and B, a lock, a pointer."""

    redis: redis.Redis
    engine: Engine
    settings: Settings
    a: int
    b: int
    lock: Lock
    pointer: Pointer
    tenant: str

    def resolver(self) -> VersionResolver:
        return VersionResolver(
            self.redis, self.settings, pointer=self.pointer, lock=self.lock, max_age_s=0
        )

    def warm_all(self, version: int, names: tuple[str, ...] = ("txn_90d",)) -> None:
        for name in names:
            warm(
                self.redis,
                self.engine,
                version,
                name,
                active_entities(self.engine, REGISTRY[name].entity, [self.tenant], batch_size=16),
                self.lock,
                registry=REGISTRY,
            )

    def raw_pointer(self) -> list[bytes | str | None]:
        return list(self.redis.mget([self.pointer.active_key, self.pointer.next_key]))

    def count(self, pattern: str) -> int:
        return sum(1 for _ in self.redis.scan_iter(match=pattern, count=1000))


def locked_entry() -> dict[str, LockedSet]:
    return {fs.name: LockedSet.of(fs) for fs in REGISTRY}


@pytest.fixture(scope="module")
def module_tenant(tenant_factory_module: Callable[..., SeedSummary]) -> str:
    return tenant_factory_module(users=USERS, transactions=1200).tenants[0]


@contextmanager
def deploy_world(
    settings: Settings, client: redis.Redis, engine: Engine, tenant: str, a: int, b: int
) -> Iterator[Deploy]:
    """A private world of versions ``a`` and ``b`` with ``a`` active (flipped to), on a
    pointer of its own whose keys are deleted afterwards."""
    lock = Lock({a: locked_entry(), b: locked_entry()})
    pointer = Pointer.scoped(uuid.uuid4().hex)
    world = Deploy(
        client,
        engine,
        settings.model_copy(update={"schema_version": a}),
        a,
        b,
        lock,
        pointer,
        tenant,
    )
    flip(client, world.settings, a, lock, pointer=pointer, registry=REGISTRY)
    yield world
    client.delete(
        pointer.active_key,
        pointer.next_key,
        pointer.previous_key,
        pointer.retired_key(a),
        pointer.retired_key(b),
    )


@pytest.fixture
def world(
    settings: Settings, redis_client: redis.Redis, engine: Engine, module_tenant: str
) -> Iterator[Deploy]:
    # Versions no other test, of this session or one beside it, writes: random ones met
    # entries other runs had left in them within their TTL (1,513 where 1,500 were made).
    a, b = fresh_version(), fresh_version()
    with deploy_world(settings, redis_client, engine, module_tenant, a, b) as world:
        yield world


def test_the_pointer_moves_through_a_deploy(world: Deploy) -> None:
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    assert state(r, s, pointer=p, lock=lock).active == world.a
    writes = WriteVersions(r, s, pointer=p, lock=lock, max_age_s=0, registry=REGISTRY)
    assert writes() == [world.a]
    assert start(r, s, world.b, lock, pointer=p).next == world.b
    assert writes() == [world.a, world.b]
    after = flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    assert (after.active, after.next, after.previous) == (world.b, None, world.a)
    assert writes() == [world.b, world.a]  # A stays written for one TTL: a rollback is safe
    rollback = flip(r, s, world.a, lock, pointer=p, registry=REGISTRY)
    assert (rollback.active, rollback.next, rollback.previous) == (world.a, None, world.b)


def test_write_versions_is_cached_and_skips_versions_the_code_cannot_compute(
    world: Deploy,
) -> None:
    r, s, p = world.redis, world.settings, world.pointer
    lock = Lock(
        {
            world.a: locked_entry(),
            world.b: {
                **locked_entry(),
                "txn_90d": LockedSet("txn_90d", "0" * 16, TXN_90D.fields, 1, "user"),
            },
        }
    )
    start(r, s, world.b, lock, pointer=p)
    fresh = WriteVersions(r, s, pointer=p, lock=lock, max_age_s=0, registry=REGISTRY)
    assert fresh() == [world.a]
    assert fresh("geo") == [world.a, world.b]
    kept = WriteVersions(r, s, pointer=p, lock=lock, max_age_s=3600, registry=REGISTRY)
    cached = kept("geo")
    flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    assert kept("geo") == cached  # one GET per max_age_s at most
    assert fresh("geo") == [world.b, world.a]
    # After a flip to a version this code cannot compute, it keeps its own fresh.
    assert fresh() == [world.a]


def test_refusals_change_nothing(world: Deploy) -> None:
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    unlocked = world.b + 5000
    before = world.raw_pointer()
    with pytest.raises(DeployError, match="no lock entry"):
        start(r, s, unlocked, lock, pointer=p)
    with pytest.raises(DeployError, match="no lock entry"):
        flip(r, s, unlocked, lock, pointer=p, registry=REGISTRY)
    with pytest.raises(DeployError, match="no lock entry"):
        warm(r, world.engine, unlocked, "txn_90d", [[(world.tenant, "1")]], lock, registry=REGISTRY)
    with pytest.raises(DeployError, match="already active"):
        start(r, s, world.a, lock, pointer=p)
    with pytest.raises(DeployError, match="is active"):
        purge(r, s, world.a, pointer=p)
    assert world.raw_pointer() == before

    start(r, s, world.b, lock, pointer=p)
    during = world.raw_pointer()
    other = Lock({**lock.versions, unlocked: locked_entry()})
    with pytest.raises(DeployError, match="in progress"):
        start(r, s, unlocked, other, pointer=p)
    with pytest.raises(DeployError, match="being warmed"):
        flip(r, s, unlocked, other, pointer=p, registry=REGISTRY)
    with pytest.raises(DeployError, match="being warmed"):
        purge(r, s, world.b, pointer=p)
    assert world.raw_pointer() == during
    assert cancel(r, s, lock, pointer=p, registry=REGISTRY).next is None

    for bad in (str(unlocked).encode(), b"abc"):
        r.set(p.active_key, bad)
        with pytest.raises(DeployError, match=r"not in the lock|not a schema version"):
            flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
        if bad == b"abc":
            with pytest.raises(DeployError):
                world.resolver().current()
        else:  # readers follow it, decoding it or standing in (test_readers.py)
            assert world.resolver().current() == unlocked
        assert world.raw_pointer() == [bad, None]


def test_warm_refuses_a_definition_the_code_does_not_compute(world: Deploy) -> None:
    lock = Lock(
        {
            world.b: {
                **locked_entry(),
                "txn_90d": LockedSet("txn_90d", "0" * 16, TXN_90D.fields, 1, "user"),
            }
        }
    )
    with pytest.raises(DeployError, match="differs"):
        warm(
            world.redis,
            world.engine,
            world.b,
            "txn_90d",
            [[(world.tenant, "1")]],
            lock,
            registry=REGISTRY,
        )
    assert world.count(feature_pattern(world.b)) == 0


@dataclass
class Load:
    """A reader thread doing rounds of real batch reads until told to stop."""

    read: Callable[[], list[tuple[int, bool]]]
    rounds: list[list[tuple[int, bool]]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    stop: bool = False
    error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop:
                answer = self.read()
                with self.cond:
                    self.rounds.append(answer)
                    self.cond.notify_all()
        except BaseException as exc:
            self.error = exc
            with self.cond:
                self.cond.notify_all()

    def wait_rounds(self, n: int) -> int:
        """Block until ``n`` more rounds completed (a round may straddle the call)."""
        with self.cond:
            target = len(self.rounds) + n
            self.cond.wait_for(
                lambda: len(self.rounds) >= target or self.error is not None, timeout=60
            )
            if self.error is not None:
                raise self.error
            return len(self.rounds)


def under_load(
    read: Callable[[], list[tuple[int, bool]]], deploy: Callable[[], None]
) -> tuple[list[list[tuple[int, bool]]], int]:
    """Run ``deploy`` while a thread reads; return the rounds and how many came before."""
    load = Load(read)
    thread = threading.Thread(target=load.run, daemon=True)
    thread.start()
    try:
        load.wait_rounds(3)
        deploy()
        with load.cond:
            before = len(load.rounds)  # rounds finished before the deploy returned
        load.wait_rounds(4)
    finally:
        load.stop = True
        thread.join(timeout=60)
    return load.rounds, before


@pytest.mark.parametrize("warmed", [True, False])
def test_warm_then_flip_keeps_the_hit_rate_and_a_cold_flip_storms(
    world: Deploy, warmed: bool
) -> None:
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    world.warm_all(world.a)
    hot = [EntityRef("txn_90d", world.tenant, str(u)) for u in range(1, USERS // 2 + 1)]
    rt = ReadThrough(
        EntryStore(r, world.a, registry=REGISTRY),
        world.engine,
        early_refresh=False,
        versions=world.resolver(),
        hot=HotReads(r, sample=1),
    )

    def read() -> list[tuple[int, bool]]:
        results: list[Result] = rt.get_many(hot)
        return [(x.schema_version, x.source == "hit") for x in results]

    def deploy() -> None:
        if warmed:
            start(r, s, world.b, lock, pointer=p)
            top = HotReads(r).top(world.a, "txn_90d", [world.tenant], len(hot))
            assert sorted(top) == sorted((ref.tenant, ref.entity) for ref in hot)
            warm(r, world.engine, world.b, "txn_90d", [top], lock, registry=REGISTRY)
        flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)

    rounds, before = under_load(read, deploy)
    for answer in rounds:
        assert len({version for version, _ in answer}) == 1  # never mixed
    old = [a for a in rounds if a[0][0] == world.a]
    new = [a for a in rounds if a[0][0] == world.b]
    assert len(old) >= 3 and len(new) >= 3
    assert all(hit for a in old for _, hit in a)
    assert all(a[0][0] == world.b for a in rounds[before + 1 :])  # followed without restart
    first_new_hits = sum(hit for _, hit in new[0])
    if warmed:
        assert all(hit for a in new for _, hit in a)  # 100% hits through the flip
    else:
        assert first_new_hits == 0  # the miss storm: every key computed at once
        assert all(hit for a in new[1:] for _, hit in a)  # read-through refilled it


def test_no_response_mixes_versions(world: Deploy) -> None:
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    for version in (world.a, world.b):
        world.warm_all(version, ("txn_90d", "geo"))
    items = [(fs, world.tenant, u) for fs in ("txn_90d", "geo") for u in range(1, 21)]
    client = FeatureClient(r, world.a, versions=world.resolver(), registry=REGISTRY)
    rt = ReadThrough(
        EntryStore(r, world.a, registry=REGISTRY),
        world.engine,
        early_refresh=False,
        versions=world.resolver(),
    )
    refs = [EntityRef(fs, t, str(u)) for fs, t, u in items]
    turn = iter(range(1_000_000))

    def read() -> list[tuple[int, bool]]:
        if next(turn) % 2:
            return [(x.schema_version, x.hit) for x in rt.get_many(refs)]
        return [(f.schema_version, True) if f else (0, False) for f in client.get_many(items)]

    load = Load(read)
    thread = threading.Thread(target=load.run, daemon=True)
    thread.start()
    try:
        for i in range(12):
            flip(r, s, world.b if i % 2 == 0 else world.a, lock, pointer=p, registry=REGISTRY)
            load.wait_rounds(2)
    finally:
        load.stop = True
        thread.join(timeout=60)
    assert load.error is None
    seen: set[int] = set()
    for answer in load.rounds:
        versions = {version for version, _ in answer}
        assert len(versions) == 1, f"a response mixed versions: {versions}"
        assert all(hit for _, hit in answer)
        seen |= versions
    assert seen == {world.a, world.b}


def test_a_listening_resolver_follows_the_flip_at_once(world: Deploy) -> None:
    resolver = VersionResolver(
        world.redis, world.settings, pointer=world.pointer, lock=world.lock, max_age_s=3600
    )
    assert resolver.current() == world.a
    got = observe_refreshes(resolver)
    resolver.listen()
    try:
        channel = world.pointer.channel
        # The SUBSCRIBE is on the wire; wait until Redis has registered it.
        assert wait_until(lambda: world.redis.pubsub_numsub(channel)[0][1] >= 1, timeout=30)
        assert resolver.current() == world.a  # cached for an hour...
        flip(
            world.redis,
            world.settings,
            world.b,
            world.lock,
            pointer=world.pointer,
            registry=REGISTRY,
        )
        assert got.wait(10)
        assert resolver.current() == world.b  # ...but the deploy message dropped it
    finally:
        resolver.close()


def test_a_listening_resolver_keeps_the_pointer_until_a_deploy_message(world: Deploy) -> None:
    # max_age_s=0: a resolver that does not listen would read the pointer on every call.
    resolver = VersionResolver(
        world.redis, world.settings, pointer=world.pointer, lock=world.lock, max_age_s=0
    )
    resolver.listen()
    try:
        assert wait_until(lambda: resolver.listening)
        assert resolver.current() == world.a
        # An edit that no deploy command published is not seen: no read per call...
        world.redis.set(world.pointer.active_key, str(world.b))
        assert [resolver.current() for _ in range(3)] == [world.a] * 3
        world.redis.set(world.pointer.active_key, str(world.a))
        # ...while the deploy command's message drops the cached pointer.
        flip(
            world.redis,
            world.settings,
            world.b,
            world.lock,
            pointer=world.pointer,
            registry=REGISTRY,
        )
        assert wait_until(lambda: resolver.current() == world.b, timeout=10)
    finally:
        resolver.close()


def test_the_api_reader_serves_a_flip_with_the_pointer_cached(world: Deploy) -> None:
    """The read API's path (:class:`FeatureReader` on the event loop): the version it
    cached is dropped by the flip's message, however long it was kept."""
    resolver = VersionResolver(world.redis, world.settings, pointer=world.pointer, lock=world.lock)
    reader = FeatureReader(
        ReadThrough(
            EntryStore(world.redis, world.a, registry=REGISTRY), world.engine, versions=resolver
        ),
        timeout_s=5,
    )
    lookup = Lookup(world.tenant, ["txn_90d"], ["1"])

    def served() -> int:
        async def read() -> int:
            reader.aredis = async_client(world.settings)
            try:
                answers = await reader.cached(lookup, "cache-only")
            finally:
                await reader.aredis.aclose()
            assert answers is not None
            return answers[0]["schema_version"]

        return asyncio.run(read())

    resolver.listen()
    try:
        assert wait_until(lambda: resolver.listening)
        assert served() == world.a
        kept = resolver._cached
        assert kept is not None and kept[1] == world.a  # the pointer is cached...
        flip(
            world.redis,
            world.settings,
            world.b,
            world.lock,
            pointer=world.pointer,
            registry=REGISTRY,
        )
        # ...and a reader that kept it would serve version A forever: no age limit.
        assert wait_until(lambda: served() == world.b, timeout=10)
        flip(
            world.redis,
            world.settings,
            world.a,
            world.lock,
            pointer=world.pointer,
            registry=REGISTRY,
        )
        assert wait_until(lambda: served() == world.a, timeout=10)  # a rollback too
    finally:
        resolver.close()


def fill(store: EntryStore, engine: Engine, tenant: str, n: int) -> None:
    """``n`` entries in ``store``'s version, copies of one real user's features."""
    real = compute(engine, TXN_90D, [(tenant, "1")])
    values = real.values[(tenant, "1")]
    batch = Batch(
        TXN_90D,
        {(tenant, str(10_000 + i)): values for i in range(n)},
        real.watermark,
        real.computed_at_ms,
    )
    store.write(batch)


def test_purge_removes_exactly_the_old_namespace_in_batches_and_resumes(
    world: Deploy,
) -> None:
    r, s, p = world.redis, world.settings, world.pointer
    fill(EntryStore(r, world.b, registry=REGISTRY), world.engine, world.tenant, 1500)
    fill(EntryStore(r, world.a, registry=REGISTRY), world.engine, world.tenant, 300)
    r.set(f"{LEASE_PREFIX}:{world.b}:txn_90d:{{{world.tenant}:1}}", "x", px=60_000)
    active_before = world.count(feature_pattern(world.a))
    assert world.count(feature_pattern(world.b)) == 1500

    first = purge(r, s, world.b, pointer=p, count=100, max_batches=3)
    assert not first.done and first.scans == 3
    assert world.count(feature_pattern(world.b)) == 1500 - first.removed

    reported: list[int] = []
    rest = purge(r, s, world.b, pointer=p, count=100, progress=reported.append)
    assert rest.done
    assert first.removed + rest.removed == 1501  # entries and the lease
    assert rest.scans > 1 and rest.unlinks >= (1500 - first.removed) // 100
    assert max(first.largest_unlink, rest.largest_unlink) <= 100
    assert reported == sorted(reported) and reported[-1] == rest.removed
    assert world.count(feature_pattern(world.b)) == 0
    assert world.count(f"{LEASE_PREFIX}:{world.b}:*") == 0
    assert world.count(feature_pattern(world.a)) == active_before  # untouched
    again = purge(r, s, world.b, pointer=p, count=100)
    assert again.done and again.removed == 0


def test_purge_of_a_model_version(world: Deploy) -> None:
    name = f"m{uuid.uuid4().hex[:8]}"
    for i in range(30):
        world.redis.set(inference_key(name, "v1", f"{i:032x}"), b"x", ex=600)
        world.redis.set(inference_key(name, "v2", f"{i:032x}"), b"x", ex=600)
    assert purge_model(world.redis, name, "v1", count=7) == 30
    assert world.count(f"infer:{name}:v1:*") == 0
    assert world.count(f"infer:{name}:v2:*") == 30


def test_active_entities_pages_through_every_recent_user(world: Deploy) -> None:
    user = REGISTRY["txn_90d"].entity
    batches = list(active_entities(world.engine, user, [world.tenant], batch_size=7))
    flat = [ref for batch in batches for ref in batch]
    assert all(len(batch) <= 7 for batch in batches)
    assert len(flat) == len(set(flat)) == count_active(world.engine, user, [world.tenant])
    # Exactly the users the fraud example's condition selects: those with a recent row.
    with world.engine.connect() as conn:
        recent = {
            (world.tenant, str(u))
            for u in conn.execute(
                sa.text(
                    "SELECT DISTINCT user_id FROM transactions WHERE tenant_id = :t "
                    "AND created_at > now() - interval '90 days'"
                ),
                {"t": world.tenant},
            ).scalars()
        }
    assert set(flat) == recent and 0 < len(flat) <= USERS


def test_throttle_caps_the_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    throttle = Throttle(100, clock=lambda: now[0], sleep=sleep)
    for _ in range(4):
        throttle.add(50)
    assert now[0] == pytest.approx(2.0)  # 200 items at 100/s
    unlimited = Throttle(None, clock=lambda: 0.0, sleep=sleep)
    unlimited.add(10_000)
    assert len(slept) == 4


def test_a_rollback_serves_what_changed_after_the_flip(world: Deploy) -> None:
    from freshline.consumers.processor import Processor
    from freshline.pipeline.core.types import ChangeEvent

    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    world.warm_all(world.a)
    start(r, s, world.b, lock, pointer=p)
    world.warm_all(world.b)
    flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    writes = WriteVersions(r, s, pointer=p, lock=lock, max_age_s=0, registry=REGISTRY)
    assert writes() == [world.b, world.a]  # the version left is still written
    with world.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE transactions SET amount = amount + 500 WHERE tenant_id = :t AND user_id = 3"
            ),
            {"t": world.tenant},
        )
    Processor(world.engine, r, versions=writes, registry=REGISTRY).apply(
        [ChangeEvent("transactions", "u", world.tenant, {"tenant_id": world.tenant, "user_id": 3})]
    )
    flip(r, s, world.a, lock, pointer=p, registry=REGISTRY)  # the rollback
    [entry] = EntryStore(r, world.a, registry=REGISTRY).read(
        [EntityRef("txn_90d", world.tenant, "3")]
    )
    truth = compute(world.engine, TXN_90D, [(world.tenant, "3")]).values[(world.tenant, "3")]
    assert entry is not None and entry.values == truth


def test_a_version_not_written_for_a_ttl_is_purged_before_a_flip_back(world: Deploy) -> None:
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    # One TTL and a minute later: consumers stopped writing version A and every write
    # to it has landed (its marker holds when that happened).
    r.delete(p.previous_key)
    stopped = int(r.get(p.retired_key(world.a)) or 0)
    r.set(p.retired_key(world.a), stopped - keep_ms(REGISTRY) - IN_FLIGHT_MS, keepttl=True)
    assert WriteVersions(r, s, pointer=p, lock=lock, max_age_s=0, registry=REGISTRY)() == [world.b]
    with pytest.raises(DeployError, match="purge it first"):
        flip(r, s, world.a, lock, pointer=p, registry=REGISTRY)
    assert state(r, s, pointer=p).active == world.b  # nothing changed
    assert purge(r, s, world.a, pointer=p).done
    assert flip(r, s, world.a, lock, pointer=p, registry=REGISTRY).active == world.a
