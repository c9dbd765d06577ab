"""A write to an absent key: refused when a newer state was there and is gone.

The compare-and-set refuses an older write while the newer entry or tombstone is in
Redis. These tests take the newer state away the ways it goes for real (an entry
expiring at its horizon, a tombstone's TTL running out, a purge of the version) and
then let a writer that computed before it arrive: a consumer held between its query
and its write, as a second consumer of the same entity or a retried pipeline makes.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.reader import Lookup
from freshline.pipeline.api.splice import Spliced
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.recompute import Batch, compute, current_watermark
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.versions import Pointer
from freshline.pipeline.core.keys import entity_floor_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.deploy.purge import purge
from tests.helpers import REGISTRY, fresh_version, running, wait_until

FULL = REGISTRY["txn_90d"].on_path("full")
USER = "9001"
"""Beyond the seeded users: only this module's rows are the user's."""


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=2, transactions=10).tenants[0]


def add_transaction(engine: Engine, tenant: str, created: str) -> None:
    """A transaction of :data:`USER` created at the SQL expression ``created``."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO transactions "
                "(tenant_id, user_id, amount, merchant_id, ip, created_at) "
                f"VALUES (:t, :u, 10, 'm-a', '10.0.0.1', {created})"
            ),
            {"t": tenant, "u": int(USER)},
        )


def recompute(engine: Engine, tenant: str) -> Batch:
    """:data:`USER`'s txn_90d, computed now on the full path."""
    return compute(engine, FULL, [(tenant, USER)])


@pytest.fixture
def store(redis_client: redis.Redis, version: int) -> EntryStore:
    return EntryStore(redis_client, version, registry=REGISTRY)


@pytest.fixture
def ref(tenant: str) -> EntityRef:
    return EntityRef("txn_90d", tenant, USER)


def assert_refused_when_held(store: EntryStore, batch: Batch, ref: EntityRef) -> None:
    """``batch``, held twice a fence since its query, is refused and stores nothing."""
    assert store.write(held(batch, 2 * (store.fence_ms / 1000))).refused == 1
    assert store.read([ref]) == [None]


def count(batch: Batch, tenant: str) -> object:
    return batch.values[(tenant, USER)]["txn_count"]


def held(batch: Batch, seconds: float) -> Batch:
    """``batch`` as a writer carries it that has held it ``seconds`` since its query:
    the same snapshot, its clock (the watermark's low bits, in µs) that much earlier."""
    return dataclasses.replace(
        batch,
        watermark=batch.watermark - int(seconds * 1_000_000),
        computed_at_ms=batch.computed_at_ms - int(seconds * 1000),
    )


def due_in(batch: Batch, tenant: str, ms: int) -> Batch:
    """``batch`` with a horizon ``ms`` from now (this host's clock, Postgres's too)."""
    return dataclasses.replace(batch, valid_until_ms={(tenant, USER): int(time.time() * 1000) + ms})


def written_due_soon(engine: Engine, store: EntryStore, tenant: str) -> tuple[Batch, Batch]:
    """Two computations, A then B, of a transaction of a day ago; B is stored, with a
    horizon 200 ms from now."""
    add_transaction(engine, tenant, "now() - interval '1 day'")
    a = recompute(engine, tenant)
    b = recompute(engine, tenant)
    assert store.write(due_in(b, tenant, 200)).written == 1
    return a, b


def expire_now(client: redis.Redis, *keys: str) -> None:
    """End ``keys`` as their TTLs would, a millisecond from now."""
    for key in keys:
        client.pexpire(key, 1)
    assert wait_until(lambda: not client.exists(*keys))


def test_an_older_batch_is_refused_after_the_newer_entry_expired_at_its_horizon(
    engine: Engine, redis_client: redis.Redis, tenant: str, store: EntryStore, ref: EntityRef
) -> None:
    """The issue's case: A computes and is held; B writes an entry that expires at its
    horizon; A arrives. Today A lands and serves a count Postgres no longer has."""
    add_transaction(engine, tenant, "now() - interval '1 day'")
    a = recompute(engine, tenant)
    assert count(a, tenant) == 1
    add_transaction(engine, tenant, "now() - interval '1 day'")
    # B counts a row that leaves the 90-day window a second from now.
    add_transaction(engine, tenant, "now() - interval '90 days' + interval '1 s'")
    b = recompute(engine, tenant)
    assert count(b, tenant) == 3 and b.valid_until_ms
    assert store.write(b).written == 1
    assert wait_until(lambda: not redis_client.exists(store.key(ref)))
    assert count(recompute(engine, tenant), tenant) == 2

    late = store.write(a)

    assert (late.written, late.refused) == (0, 1)
    assert store.read([ref]) == [None]
    # A later computation is stored as usual.
    assert store.write(recompute(engine, tenant)).written == 1
    [entry] = store.read([ref])
    assert entry is not None and entry.values["txn_count"] == 2


def test_an_older_batch_held_past_the_fence_is_refused_once_every_trace_is_gone(
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    version: int,
    store: EntryStore,
    ref: EntityRef,
) -> None:
    a, _ = written_due_soon(engine, store, tenant)
    # Everything the write left behind runs out, as it does a fence's length later.
    assert redis_client.exists(store.key(ref), entity_floor_key(version, ref)) == 2
    expire_now(redis_client, store.key(ref), entity_floor_key(version, ref))

    assert_refused_when_held(store, a, ref)
    # A write computed just now is stored: it is no older than anything that was there.
    assert store.write(recompute(engine, tenant)).written == 1


def test_an_older_batch_is_refused_after_the_tombstone_expired(
    engine: Engine, redis_client: redis.Redis, tenant: str, store: EntryStore, ref: EntityRef
) -> None:
    add_transaction(engine, tenant, "now() - interval '1 day'")
    a = recompute(engine, tenant)
    add_transaction(engine, tenant, "now() - interval '2 days'")
    assert store.invalidate([ref], current_watermark(engine)).written == 1
    # A writer that arrives after the tombstone's TTL computed at least that long ago.
    expire_now(redis_client, store.key(ref))

    assert_refused_when_held(store, a, ref)


def test_an_older_batch_is_refused_after_the_version_was_purged(
    engine: Engine, redis_client: redis.Redis, settings: Settings, tenant: str
) -> None:
    """A purged version stays empty: a writer held since before the purge (the version
    stopped being written a while before it could be purged) stores nothing."""
    old = fresh_version()
    store = EntryStore(redis_client, old, registry=REGISTRY)
    ref = EntityRef("txn_90d", tenant, USER)
    add_transaction(engine, tenant, "now() - interval '1 day'")
    a = recompute(engine, tenant)
    assert store.write(recompute(engine, tenant)).written == 1
    pointer = Pointer.scoped(uuid.uuid4().hex)
    assert purge(redis_client, settings, old, pointer=pointer).done
    assert not redis_client.exists(store.key(ref))

    assert_refused_when_held(store, a, ref)


def test_an_expired_entry_still_refuses_older_and_equal_writes_and_a_newer_one_replaces_it(
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    version: int,
    store: EntryStore,
    ref: EntityRef,
) -> None:
    a, b = written_due_soon(engine, store, tenant)
    assert a.watermark < b.watermark
    assert wait_until(lambda: not redis_client.exists(store.key(ref)))

    assert store.write(a).refused == 1
    assert store.write(dataclasses.replace(b, valid_until_ms={})).unchanged == 1
    assert store.read([ref]) == [None]
    c = recompute(engine, tenant)
    assert store.write(c).written == 1
    [entry] = store.read([ref])
    assert entry is not None and entry.watermark == c.watermark
    # Both keys have a TTL: the entry's, and the floor's (the fence from B's write).
    assert redis_client.pttl(store.key(ref)) > store.fence_ms
    assert 0 < redis_client.pttl(entity_floor_key(version, ref)) <= store.fence_ms


def test_a_write_held_past_its_horizon_is_not_served(
    engine: Engine,
    redis_client: redis.Redis,
    settings: Settings,
    tenant: str,
    version: int,
    store: EntryStore,
    ref: EntityRef,
) -> None:
    """A batch whose horizon passed while its writer was held: its values are no longer
    true, so no reader (the store, the client, the API's spliced batch) may serve them;
    and it still refuses what is older."""
    add_transaction(engine, tenant, "now() - interval '1 day'")
    older = recompute(engine, tenant)
    fresh = recompute(engine, tenant)
    now = int(time.time() * 1000)
    # Held 60 s since its query, with a horizon 30 s after it: due for 30 s now.
    late = dataclasses.replace(held(fresh, 60), valid_until_ms={(tenant, USER): now - 30_000})
    stored = store.write(late)

    assert store.read([ref]) == [None]
    assert (
        FeatureClient(redis_client, version, registry=REGISTRY).get("txn_90d", tenant, USER) is None
    )
    app = create_app(
        settings.model_copy(update={"schema_version": version, "local_cache_size": 0}),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        registry=REGISTRY,
    )
    with running(app) as api:
        got = api.portal.call(
            app.state.services.reader.cached_batch,
            Lookup(tenant, ["txn_90d"], [USER]),
            "cache-only",
        )
    assert not isinstance(got, Spliced) and got is not None
    assert [a["source"] for a in got] == ["miss"]
    assert (stored.written, stored.due) == (0, 1)  # a tombstone of its watermark
    assert store.write(held(older, 60)).refused == 1  # held as long, computed before

    # Due in 2 s, though computed a minute ago: it lives 2 s, not a minute and 2 s.
    soon = dataclasses.replace(
        held(fresh, 60),
        watermark=late.watermark + 1,
        valid_until_ms={(tenant, USER): now + 2_000},
    )
    assert store.write(soon).written == 1
    assert 0 < redis_client.pttl(store.key(ref)) <= 2_000
