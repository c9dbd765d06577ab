"""Every key freshline writes has a TTL, but for the few control keys listed in
:data:`freshline.pipeline.core.keys.UNEXPIRING` (docs/guarantees.md). The stack tier's session
ends by scanning its Redis database with :func:`keys_without_ttl` (``tests/conftest.py``),
so a key pattern that any test made a writer leave without one fails the run."""

from __future__ import annotations

import fnmatch
import uuid

import redis

from freshline.pipeline.core.keys import UNEXPIRING, feature_key
from freshline.pipeline.core.types import EntityRef


def keys_without_ttl(client: redis.Redis) -> list[str]:
    """The keys of ``client``'s database that have no TTL and are not listed as
    unexpiring, sorted."""
    found = []
    for raw in client.scan_iter(count=1000):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in UNEXPIRING):
            continue
        if client.pttl(key) == -1:  # -2: it expired between the scan and now
            found.append(key)
    # Asked again, after the scan: a writer's SET and EXPIRE in one pipeline may have
    # been caught between the two.
    return sorted(key for key in found if client.pttl(key) == -1)


def test_a_key_without_a_ttl_is_found_and_the_control_keys_are_not(
    redis_client: redis.Redis,
) -> None:
    tenant = f"ttl-{uuid.uuid4().hex[:8]}"
    immortal = feature_key(999_999, EntityRef("txn_90d", tenant, "1"))
    replayed = f"freshline:dlq:replayed:ttl-check-{tenant}"
    redis_client.set(immortal, b"x")
    redis_client.hset(replayed, "0:1", "1")
    try:
        found = keys_without_ttl(redis_client)
        assert immortal in found
        assert replayed not in found
        redis_client.expire(immortal, 60)
        assert immortal not in keys_without_ttl(redis_client)
    finally:
        redis_client.delete(immortal, replayed)
