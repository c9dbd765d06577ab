"""The in-process tier follows Redis's own key tracking, not the writer's publish.

A consumer writes Redis, then publishes the invalidation; one that dies between the
two must not leave API workers serving the old entry from memory. Every write here
goes to Redis as a consumer's would (:meth:`EntryStore.write`), and nothing is
published.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy.engine import Engine

from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_tenant
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.recompute import Batch
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.keys import feature_key
from freshline.pipeline.core.services import redis_client as make_redis_client
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef, Entry
from tests.helpers import (
    REGISTRY,
    TXN_VALUES,
    UNWINDOWED,
    as_user,
    fresh_version,
    need,
    running,
    wait_until,
)


@pytest.fixture
def tenant() -> str:
    """A tenant of the test's own, with no rows: Redis answers every read."""
    return f"track-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def store(redis_client: redis.Redis) -> EntryStore:
    """The store of a schema version of the test's own."""
    return EntryStore(redis_client, fresh_version(), registry=REGISTRY)


def write(store: EntryStore, tenant: str, entity: str, count: int, watermark: int) -> None:
    """Write as a consumer does, and publish nothing."""
    batch = Batch(
        REGISTRY["txn_90d"],
        {(tenant, entity): dict(TXN_VALUES, txn_count=count)},
        watermark,
        time.time_ns() // 1_000_000,
    )
    assert store.write(batch).written == 1


def warm(tier: LocalTier, store: EntryStore, ref: EntityRef) -> None:
    """Read ``ref`` from Redis into the tier, as the API does, until the tier holds it.

    A put is refused while a change of the key that happened before the read is still
    on its way to the tier (the write that made the entry), so read again until one
    sticks.
    """

    def held() -> bool:
        token = tier.token()
        entry = store.read([ref])[0]
        assert entry is not None
        tier.put(ref, entry, token)
        return tier.get(ref, store.schema_version) is not None

    assert wait_until(held)


def test_a_write_with_no_publish_stops_the_api_serving_the_old_entry(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    store: EntryStore,
) -> None:
    key = create_tenant(engine, tenant)
    api_settings = settings.model_copy(
        update={"schema_version": store.schema_version, "local_cache_size": 100}
    )
    write(store, tenant, "77", count=1, watermark=10)
    app = create_app(
        api_settings,
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        registry=REGISTRY,
    )
    with running(app, key) as api:
        local: LocalTier = app.state.services.reader.local
        assert local.wait_live(5)

        def served() -> dict[str, object]:
            response = api.get("/v1/features/txn_90d/77")
            assert response.status_code == 200, response.text
            body: dict[str, object] = response.json()
            return body

        # The tier is warm: the entry is served from memory.
        assert wait_until(lambda: served()["source"] == "local")
        assert served()["values"] == TXN_VALUES

        write(store, tenant, "77", count=2, watermark=20)  # the writer dies here: no publish

        def follows() -> bool:
            body = served()
            values = body["values"]
            return isinstance(values, dict) and values["txn_count"] == 2

        assert wait_until(follows, timeout=5)
        # ... and it is served from memory again once the new entry is read.
        assert wait_until(lambda: served()["source"] == "local")
        assert served()["values"] == dict(TXN_VALUES, txn_count=2)


def test_an_entry_goes_when_its_key_is_deleted_or_expires(
    tier: LocalTier, redis_client: redis.Redis, tenant: str, store: EntryStore
) -> None:
    gone, expiring = EntityRef("txn_90d", tenant, "1"), EntityRef("txn_90d", tenant, "2")
    for ref in (gone, expiring):
        write(store, tenant, ref.entity, count=1, watermark=10)
        warm(tier, store, ref)

    redis_client.delete(feature_key(store.schema_version, gone))  # a purge's UNLINK, say
    assert wait_until(lambda: tier.get(gone, store.schema_version) is None)

    redis_client.pexpire(feature_key(store.schema_version, expiring), 1)
    assert wait_until(lambda: redis_client.exists(feature_key(store.schema_version, expiring)) == 0)
    assert wait_until(lambda: tier.get(expiring, store.schema_version) is None)


def test_a_truncate_floor_flushes_the_tier(tier: LocalTier, tenant: str, store: EntryStore) -> None:
    refs = [EntityRef("txn_90d", tenant, str(i)) for i in range(3)]
    for ref in refs:
        write(store, tenant, ref.entity, count=1, watermark=10)
        warm(tier, store, ref)
    flushes = tier.stats.flushes

    store.truncate("txn_90d", 11)  # raises the set's floor; nothing is published

    assert wait_until(lambda: tier.stats.flushes > flushes)
    assert all(tier.get(ref, store.schema_version) is None for ref in refs)


@pytest.fixture
def login_without_tracking(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """A Redis login that may read features and subscribe to freshline's channels, but
    not to Redis's tracking channel: the ACL of a deployment not yet given the grant."""
    user, password = f"freshline-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    redis_client.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{password}"],
        keys=["feat:*", "floor:*"],
        channels=["freshline:*"],
        commands=["+@all", "-@dangerous"],
    )
    pool = redis_client.connection_pool
    kwargs = dict(pool.connection_kwargs, username=user, password=password)
    client = redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    )
    yield client
    client.close()
    redis_client.acl_deluser(user)


def test_a_login_refused_tracking_keeps_the_tier_dark_and_says_why(
    login_without_tracking: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="freshline.pipeline.cache.subscription")
    tier = LocalTier(login_without_tracking, max_entries=10, registry=UNWINDOWED).start()
    try:
        assert wait_until(lambda: "__redis__:invalidate" in caplog.text)
        assert "the login needs CLIENT TRACKING and the channel __redis__:invalidate" in caplog.text
        assert "Traceback" not in caplog.text
        assert not tier.live
        ref = EntityRef("txn_90d", "t", "1")
        entry = Entry(dict(TXN_VALUES), 1, time.time_ns() // 1_000_000, 1)
        assert tier.put(ref, entry, tier.token()) is False
    finally:
        tier.close()


def test_a_computed_entry_is_held_only_once_redis_holds_it(
    tier: LocalTier, tenant: str, store: EntryStore
) -> None:
    stored, overtaken = EntityRef("txn_90d", tenant, "1"), EntityRef("txn_90d", tenant, "2")
    now = time.time_ns() // 1_000_000
    # A read-through's fill: it wrote the entry, and its write's report voids the token.
    token = tier.token()
    write(store, tenant, "1", count=1, watermark=10)
    assert tier.put(
        stored, Entry(dict(TXN_VALUES), store.schema_version, now, 10), token, verify=True
    )
    assert wait_until(lambda: tier.get(stored, store.schema_version) is not None)

    # A fill whose store was refused: Redis holds a newer entry, never to be shadowed.
    write(store, tenant, "2", count=2, watermark=20)
    refused = tier.stats.refused
    computed = Entry(dict(TXN_VALUES), store.schema_version, now, 10)
    assert tier.put(overtaken, computed, tier.token(), verify=True)
    assert wait_until(lambda: tier.stats.refused > refused)
    assert tier.get(overtaken, store.schema_version) is None


@pytest.mark.parametrize("login", ["API", "WRITER"])
def test_the_stacks_logins_may_track_keys(settings: Settings, login: str) -> None:
    """The API and the Python client read with these logins (scripts/stack's ACL)."""
    user = as_user(
        settings,
        need(f"FRESHLINE_STACK_REDIS_{login}_USER"),
        need(f"FRESHLINE_STACK_REDIS_{login}_PASSWORD"),
    )
    client = make_redis_client(user)
    tier = LocalTier(client, max_entries=10, registry=UNWINDOWED).start()
    try:
        assert tier.wait_live(5)
    finally:
        tier.close()
        client.close()


def test_a_late_report_of_a_write_the_read_saw_does_not_lose_the_entry(
    tier: LocalTier, tenant: str, store: EntryStore
) -> None:
    """The report of a write reaches the tier after a read that saw the write: the
    entry goes back to Redis for a check, and stays only if Redis still holds it."""
    kept, changed = EntityRef("txn_90d", tenant, "1"), EntityRef("txn_90d", tenant, "2")
    for ref in (kept, changed):
        write(store, tenant, ref.entity, count=1, watermark=10)
    assert wait_until(lambda: tier.stats.tracked >= 2)  # both writes reported
    for ref in (kept, changed):
        token = tier.token()
        entry = store.read([ref])[0]
        assert entry is not None and tier.put(ref, entry, token)
    # A report as late as can be: before the subscription answers a PING sent after
    # the put, the tier cannot tell it from the report of the write the read saw.
    rechecked = tier.stats.rechecked
    tier.invalidate("txn_90d", tenant, "1")
    assert tier.stats.rechecked == rechecked + 1
    assert wait_until(lambda: tier.get(kept, store.schema_version) is not None)
    entry = tier.get(kept, store.schema_version)
    assert entry is not None and entry.values["txn_count"] == 1
    # A write after the read: checked against Redis too if its report comes that soon,
    # and then not kept, as Redis holds another entry.
    write(store, tenant, "2", count=2, watermark=20)
    assert wait_until(lambda: tier.get(changed, store.schema_version) is None)
    assert wait_until(lambda: not tier._unverified)
    assert tier.get(changed, store.schema_version) is None
