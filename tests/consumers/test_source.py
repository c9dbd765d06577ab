"""The record of the Postgres history each schema version's entries came from.

The consumer's side is in ``test_durability`` (a consumer started on another history
refuses to write); here the record itself, on the shared Redis: racing consumers agree,
a refusal records nothing, Redis is asked again only when it must be, and renewals
leave in-process tiers alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from freshline.consumers.source import RECHECK_S, SourceRecord, encode
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.recompute import SourceIdentity
from freshline.pipeline.core.keys import feature_key, source_key
from freshline.pipeline.core.types import EntityRef
from tests.helpers import UNWINDOWED, fresh_version, wait_until

OLD = SourceIdentity("7000000000000000001", 1)
NEW = SourceIdentity("7000000000000000001", 2)  # the same cluster, a promoted standby
TTL_MS = 60_000


@pytest.fixture
def versions(redis_client: redis.Redis) -> Iterator[list[int]]:
    """Two schema versions of the test's own; their records removed after it."""
    ours = [fresh_version(), fresh_version()]
    yield ours
    redis_client.delete(*(source_key(v) for v in ours))


def recorded(client: redis.Redis, version: int) -> bytes | str | None:
    return client.get(source_key(version))


def test_consumers_racing_on_a_fresh_version_agree(
    redis_client: redis.Redis, versions: list[int]
) -> None:
    [v, _] = versions
    first, second = SourceRecord(redis_client, TTL_MS), SourceRecord(redis_client, TTL_MS)
    assert first.other(OLD, [v]) is None  # nothing recorded: records its own
    assert second.other(NEW, [v]) == OLD
    assert second.other(NEW, [v]) == OLD  # a refusal is not remembered: asked again
    assert SourceRecord(redis_client, TTL_MS).other(OLD, [v]) is None  # the same history
    assert recorded(redis_client, v) == encode(OLD).encode()
    assert 0 < redis_client.pttl(source_key(v)) <= TTL_MS


def test_another_history_in_one_version_records_nothing(
    redis_client: redis.Redis, versions: list[int]
) -> None:
    [old, fresh] = versions
    assert SourceRecord(redis_client, 1_000).other(OLD, [old]) is None
    assert SourceRecord(redis_client, TTL_MS).other(NEW, [fresh, old]) == OLD
    assert recorded(redis_client, fresh) is None
    assert recorded(redis_client, old) == encode(OLD).encode()
    assert redis_client.pttl(source_key(old)) <= 1_000  # not renewed either


def test_redis_is_asked_again_when_the_versions_change_or_after_the_recheck(
    redis_client: redis.Redis, versions: list[int]
) -> None:
    [v, w] = versions
    now = [100.0]
    record = SourceRecord(redis_client, TTL_MS, clock=lambda: now[0])
    assert record.other(OLD, [v]) is None
    redis_client.delete(source_key(v))
    now[0] += RECHECK_S / 2
    assert record.other(OLD, [v]) is None
    assert recorded(redis_client, v) is None  # not asked: checked a moment ago
    assert record.other(OLD, [v, w]) is None  # a version more (a deploy): asked
    assert recorded(redis_client, v) == recorded(redis_client, w) == encode(OLD).encode()
    redis_client.delete(source_key(v))
    now[0] += RECHECK_S
    assert record.other(OLD, [v, w]) is None
    assert recorded(redis_client, v) == encode(OLD).encode()  # renewed once due


def test_recording_and_renewing_do_not_flush_in_process_tiers(
    redis_client: redis.Redis, versions: list[int]
) -> None:
    [v, _] = versions
    tier = LocalTier(redis_client, max_entries=100, heartbeat_s=0.2, registry=UNWINDOWED).start()
    marker = feature_key(v, EntityRef("txn_90d", "source-test", "1"))
    try:
        assert tier.wait_live(5)
        flushes, tracked = tier.stats.flushes, tier.stats.tracked
        assert SourceRecord(redis_client, TTL_MS).other(OLD, [v]) is None  # records
        assert SourceRecord(redis_client, TTL_MS).other(OLD, [v]) is None  # renews
        # Redis reports key changes in order: once the tier has seen a later one, it
        # has seen the record's.
        redis_client.set(marker, b"x", px=TTL_MS)
        assert wait_until(lambda: tier.stats.tracked > tracked)
        assert tier.stats.flushes == flushes
    finally:
        tier.close()
        redis_client.delete(marker)
