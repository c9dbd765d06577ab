"""The in-process tier on the real Redis: invalidations, subscription loss, size and TTL."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.invalidation import ALL, Invalidation
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.recompute import Batch
from freshline.pipeline.cache.store import TTL_JITTER, EntryStore
from freshline.pipeline.core.keys import INVALIDATION_CHANNEL, feature_key
from freshline.pipeline.core.types import EntityRef, Entry
from tests.helpers import (
    REGISTRY,
    TXN_VALUES,
    UNWINDOWED,
    dark_through_outage,
    fresh_version,
    wait_until,
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def entry(version: int = 1, age_ms: int = 0, watermark: int = 1, **changes: object) -> Entry:
    return Entry(dict(TXN_VALUES, **changes), version, now_ms() - age_ms, watermark)


@pytest.fixture
def tenant() -> str:
    return f"local-{uuid.uuid4().hex[:10]}"


def publish(
    client: redis.Redis,
    tenant: str,
    entity: str,
    feature_set: str = "txn_90d",
    watermark: int = 2,
    version: int = 1,
) -> None:
    message = Invalidation(tenant, feature_set, entity, watermark, version)
    client.publish(INVALIDATION_CHANNEL, message.encode())


def test_nothing_is_served_before_the_subscription_is_confirmed(
    redis_client: redis.Redis, tenant: str
) -> None:
    local = LocalTier(redis_client, max_entries=10, registry=UNWINDOWED)
    ref = EntityRef("txn_90d", tenant, "1")
    assert not local.live
    assert local.put(ref, entry(), local.token()) is False
    assert local.get(ref, 1) is None
    local.close()


def test_an_invalidation_stops_serving_the_entry(
    tier: LocalTier, redis_client: redis.Redis, tenant: str
) -> None:
    ref = EntityRef("txn_90d", tenant, "1")
    assert tier.put(ref, entry(), tier.token())
    assert tier.get(ref, 1) is not None
    publish(redis_client, tenant, "2")  # another entity: untouched
    publish(redis_client, tenant, "1", version=7)  # any schema version drops it
    assert wait_until(lambda: tier.get(ref, 1) is None)
    assert tier.get(EntityRef("txn_90d", tenant, "1"), 1) is None


def test_a_truncate_invalidation_drops_every_entity(
    tier: LocalTier, redis_client: redis.Redis, tenant: str
) -> None:
    refs = [EntityRef("device_risk", tenant, str(u)) for u in range(1, 4)]
    for ref in refs:
        assert tier.put(ref, entry(), tier.token())
    publish(redis_client, ALL, ALL, feature_set="device_risk")
    assert wait_until(lambda: all(tier.get(ref, 1) is None for ref in refs))


def test_a_put_that_raced_an_invalidation_is_refused(tier: LocalTier, tenant: str) -> None:
    ref = EntityRef("geo", tenant, "3")
    token = tier.token()  # taken before the Redis read ...
    tier.invalidate("geo", tenant, "3")  # ... which an invalidation overtakes
    assert tier.put(ref, entry(), token) is False
    other = EntityRef("geo", tenant, "4")
    assert tier.put(other, entry(), token) is True  # other entities are unaffected
    assert tier.put(ref, entry(), tier.token()) is True


def test_the_client_follows_redis_after_an_invalidation(
    tier: LocalTier, redis_client: redis.Redis, tenant: str
) -> None:
    version = fresh_version()
    store = EntryStore(redis_client, version, registry=REGISTRY)
    client = FeatureClient(redis_client, version, local=tier, registry=REGISTRY)

    def write(count: int, watermark: int) -> None:
        store.write(
            Batch(
                REGISTRY["txn_90d"],
                {(tenant, "5"): dict(TXN_VALUES, txn_count=count)},
                watermark,
                now_ms(),
            )
        )

    write(1, 10)
    first = client.get("txn_90d", tenant, 5)
    assert first is not None and first.values["txn_count"] == 1
    # Until Redis's report of that write has reached the tier, a read does not fill it.
    ref = EntityRef("txn_90d", tenant, "5")
    assert wait_until(
        lambda: client.get("txn_90d", tenant, 5) is not None and tier.get(ref, version) is not None
    )
    hits = tier.stats.hits
    served = client.get("txn_90d", tenant, 5)
    # the same entry; its age is read off the wall clock, a millisecond apart or not
    assert served is not None and served._replace(age_ms=first.age_ms) == first
    assert tier.stats.hits == hits + 1

    # The consumer's order: write Redis, then publish.
    write(2, 20)
    publish(redis_client, tenant, "5", watermark=20, version=version)
    assert wait_until(
        lambda: (f := client.get("txn_90d", tenant, 5)) is not None and f.values["txn_count"] == 2
    )


def _kill_subscription(redis_client: redis.Redis, tier: LocalTier) -> int:
    """CLIENT KILL the tier's own subscription connection (found by its client name)."""
    ids = [c["id"] for c in redis_client.client_list() if c.get("name") == tier.name]
    assert ids, "the subscription connection is not in CLIENT LIST"
    return int(redis_client.client_kill_filter(_id=ids[0]))


def test_losing_the_subscription_flushes_the_tier(
    tier: LocalTier, redis_client: redis.Redis, tenant: str
) -> None:
    refs = [EntityRef("txn_90d", tenant, str(i)) for i in range(10)]
    for ref in refs:
        assert tier.put(ref, entry(), tier.token())
    stale_token = tier.token()
    assert len(tier) == 10

    assert _kill_subscription(redis_client, tier) == 1
    assert wait_until(lambda: tier.stats.drops >= 1)
    assert all(tier.get(ref, 1) is None for ref in refs)
    # A value read before the loss is never stored after it, even once resubscribed.
    assert wait_until(lambda: tier.stats.subscriptions >= 2)
    assert tier.live
    assert tier.put(refs[0], entry(), stale_token) is False
    assert tier.put(refs[0], entry(), tier.token()) is True
    assert tier.get(refs[0], 1) is not None


def test_the_tier_stays_dark_while_redis_is_unreachable(
    tier_on_private_redis: tuple[LocalTier, Callable[[], None], Callable[[], None]], tenant: str
) -> None:
    local, stop_redis, start_redis = tier_on_private_redis
    ref = EntityRef("txn_90d", tenant, "1")
    assert local.put(ref, entry(), local.token())
    dark_through_outage(local, ref, entry, stop_redis, start_redis)


@pytest.fixture
def tier_on_private_redis(
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
) -> Iterator[tuple[LocalTier, Callable[[], None], Callable[[], None]]]:
    """The tier on a throwaway redis-server we can stop and start: the outage is ours."""
    url, stop, start = private_redis
    client = redis.Redis.from_url(url)
    local = LocalTier(client, max_entries=10, heartbeat_s=0.2, registry=UNWINDOWED).start()
    assert local.wait_live(5)
    yield local, stop, start
    local.close()
    client.close()


def test_a_message_that_does_not_decode_flushes(
    tier: LocalTier, redis_client: redis.Redis, tenant: str
) -> None:
    ref = EntityRef("txn_90d", tenant, "1")
    assert tier.put(ref, entry(), tier.token())
    # Counted from after the put: another test's bad message may have come before it.
    seen = tier.stats.bad_messages
    redis_client.publish(INVALIDATION_CHANNEL, b'{"tenant": "x"}')
    assert wait_until(lambda: tier.stats.bad_messages > seen)
    assert tier.get(ref, 1) is None


def test_size_is_bounded_least_recently_used_first(redis_client: redis.Redis, tenant: str) -> None:
    with LocalTier(redis_client, max_entries=3, registry=UNWINDOWED) as local:
        assert local.wait_live(5)
        refs = [EntityRef("txn_90d", tenant, str(i)) for i in range(5)]
        for ref in refs[:3]:
            local.put(ref, entry(), local.token())
        assert local.get(refs[0], 1) is not None  # now the most recently used
        for ref in refs[3:]:
            local.put(ref, entry(), local.token())
        assert len(local) == 3
        assert [local.get(r, 1) is not None for r in refs] == [True, False, False, True, True]
        assert local.stats.evicted == 2


def test_an_entry_never_outlives_its_redis_copy(tier: LocalTier, tenant: str) -> None:
    ttl_ms = REGISTRY["txn_90d"].ttl_s * 1000 * (1 - TTL_JITTER)
    fresh = EntityRef("txn_90d", tenant, "1")
    nearly = EntityRef("txn_90d", tenant, "2")
    expired = EntityRef("txn_90d", tenant, "3")
    assert tier.put(fresh, entry(), tier.token())
    # A second of life left by the shortest TTL Redis may have given it: the tier counts
    # the entry's life from when it was computed, not from when it was put. How soon
    # after that it stops serving is a figure for bench/local_tier.py, not a test.
    assert tier.put(nearly, entry(age_ms=int(ttl_ms) - 1000), tier.token())
    assert tier.put(expired, entry(age_ms=int(ttl_ms) + 1), tier.token()) is False
    assert tier.get(nearly, 1) is not None
    assert wait_until(lambda: tier.get(nearly, 1) is None, timeout=30)
    assert tier.stats.expired == 1
    assert tier.get(fresh, 1) is not None


def test_max_ttl_caps_the_life_of_an_entry(redis_client: redis.Redis, tenant: str) -> None:
    with LocalTier(redis_client, max_entries=3, max_ttl_ms=50, registry=UNWINDOWED) as local:
        assert local.wait_live(5)
        ref = EntityRef("txn_90d", tenant, "1")
        assert local.put(ref, entry(), local.token())
        assert wait_until(lambda: local.get(ref, 1) is None, timeout=2)


def test_another_schema_version_is_a_miss(tier: LocalTier, tenant: str) -> None:
    ref = EntityRef("txn_90d", tenant, "1")
    assert tier.put(ref, entry(version=3), tier.token())
    assert tier.get(ref, 4) is None
    assert tier.get(ref, 3) is not None


def test_a_windowed_entry_is_served_no_longer_than_its_redis_copy_lives(
    redis_client: redis.Redis, tenant: str
) -> None:
    """txn_90d's Redis TTL is cut to end when a row leaves its window (FeatureSet.horizon),
    which the entry's bytes do not carry: the tier reads the key's TTL before serving it."""
    version = fresh_version()
    ref = EntityRef("txn_90d", tenant, "1")
    key = feature_key(version, ref)
    redis_client.set(key, b"the Redis copy", px=1500)
    with LocalTier(redis_client, max_entries=10, registry=REGISTRY) as local:
        assert local.wait_live(5)
        assert local.put(ref, entry(version), local.token())
        assert wait_until(lambda: local.get(ref, version) is not None)
        assert local.stats.held_back == 1
        while True:  # never served once Redis has forgotten it (checked in that order)
            gone = not redis_client.exists(key)
            served = local.get(ref, version) is not None
            assert not (gone and served)
            if gone:
                break
            time.sleep(0.005)  # polling the expiry; the assertion is per poll
        # A copy that is not in Redis any more is never served.
        other = EntityRef("txn_90d", tenant, "2")
        assert local.put(other, entry(version), local.token())
        assert wait_until(lambda: local.stats.refused == 1)
        assert local.get(other, version) is None


def test_a_windowed_entry_invalidated_while_held_back_is_dropped(
    redis_client: redis.Redis, tenant: str
) -> None:
    version = fresh_version()
    ref, other = EntityRef("geo", tenant, "1"), EntityRef("geo", tenant, "2")
    # Both written before the tier subscribes: Redis's report of a write still on its
    # way would refuse a put (see freshline.pipeline.cache.local).
    redis_client.set(feature_key(version, ref), b"the Redis copy", px=60_000)
    redis_client.set(feature_key(version, other), b"the Redis copy", px=60_000)
    with LocalTier(redis_client, max_entries=10, registry=REGISTRY) as local:
        assert local.wait_live(5)
        local._held_wake.clear()  # hold the thread off for this put
        with local._lock:  # and this invalidation, before it reads the TTL
            local._held[ref] = (Entry({}, version, now_ms(), 1), time.monotonic() + 60)
            local._entries.pop(ref, None)
        local.invalidate("geo", tenant, "1")
        local._held_wake.set()
        assert local.put(other, entry(version), local.token())
        assert wait_until(lambda: local.get(other, version) is not None)
        assert local.get(ref, version) is None
