"""Removing an old schema version's keys: small SCAN + UNLINK batches, never blocking."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from pipeline.cache.versions import DEFAULT_POINTER, Pointer, state
from pipeline.core.cluster import is_cluster, scan_chunks
from pipeline.core.errors import DeployError
from pipeline.core.keys import LEASE_PREFIX, feature_pattern
from pipeline.core.settings import Settings


def purgeable(
    client: redis.Redis, settings: Settings, version: int, *, pointer: Pointer = DEFAULT_POINTER
) -> None:
    """Raise :class:`DeployError` if ``version`` is active or next."""
    seen = state(client, settings, pointer=pointer)
    if version in (seen.active, seen.next):
        role = "active" if version == seen.active else "being warmed (next)"
        raise DeployError(f"schema version {version} is {role}; refusing to purge it")


@dataclass(slots=True)
class PurgeResult:
    removed: int = 0
    scans: int = 0
    unlinks: int = 0
    largest_unlink: int = 0
    done: bool = False
    patterns: list[str] = field(default_factory=list)


def purge(
    client: redis.Redis,
    settings: Settings,
    version: int,
    *,
    pointer: Pointer = DEFAULT_POINTER,
    count: int = 500,
    max_batches: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> PurgeResult:
    """Remove schema version ``version``'s feature and lease keys in small batches.

    Each batch is one ``SCAN MATCH feat:<version>:* COUNT count`` step and an
    ``UNLINK`` of at most ``count`` keys (freed in the background), so Redis never
    blocks; the pointer is re-read before every batch, and the purge stops if the
    version became active or next. Stopping early (``max_batches``, Ctrl-C) is safe:
    a rerun scans from the start and finds only what is left.
    """
    if count < 1:
        raise ValueError(f"count must be positive, got {count}")
    result = PurgeResult(patterns=[feature_pattern(version), f"{LEASE_PREFIX}:{version}:*"])
    cluster = is_cluster(client)
    for pattern in result.patterns:
        if cluster:  # SCAN on every master; redis-py splits each UNLINK by slot
            for chunk in scan_chunks(client, pattern, count):
                if max_batches is not None and result.scans >= max_batches:
                    return result
                purgeable(client, settings, version, pointer=pointer)
                result.scans += 1
                result.removed += int(client.unlink(*chunk))
                result.unlinks += 1
                result.largest_unlink = max(result.largest_unlink, len(chunk))
                if progress is not None:
                    progress(result.removed)
            continue
        cursor = 0
        while True:
            if max_batches is not None and result.scans >= max_batches:
                return result
            purgeable(client, settings, version, pointer=pointer)
            cursor, keys = client.scan(cursor=cursor, match=pattern, count=count)
            result.scans += 1
            for start_at in range(0, len(keys), count):
                chunk = keys[start_at : start_at + count]
                result.removed += int(client.unlink(*chunk))
                result.unlinks += 1
                result.largest_unlink = max(result.largest_unlink, len(chunk))
            if progress is not None:
                progress(result.removed)
            if cursor == 0:
                break
    client.delete(pointer.retired_key(version))  # nothing of it is left to go stale
    result.done = True
    return result
