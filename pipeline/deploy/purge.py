"""Removing an old schema version's keys: small SCAN + UNLINK batches, never blocking.

A purge refuses the versions consumers write: the active, the next and the previous
one (the rollback target; :func:`freshline.pipeline.deploy.pointer.retire` gives that up first,
as ``freshline purge --force`` does). Once the keys are gone it clears the version's
retired marker, but only if every write to it landed before the purge began.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from freshline.pipeline.cache.versions import DEFAULT_POINTER, Pointer, state
from freshline.pipeline.core.cluster import is_cluster, scan_chunks
from freshline.pipeline.core.errors import DeployError
from freshline.pipeline.core.keys import LEASE_PREFIX, feature_pattern, source_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import text
from freshline.pipeline.deploy.pointer import IN_FLIGHT_MS


def purgeable(
    client: redis.Redis, settings: Settings, version: int, *, pointer: Pointer = DEFAULT_POINTER
) -> None:
    """Raise :class:`DeployError` if ``version`` is active, next or previous."""
    seen = state(client, settings, pointer=pointer)
    if version in (seen.active, seen.next):
        role = "active" if version == seen.active else "being warmed (next)"
        raise DeployError(f"schema version {version} is {role}; refusing to purge it")
    if version == seen.previous:
        raise DeployError(
            f"schema version {version} is the previous version, still written so that a "
            f"flip back to it is a rollback; refusing to purge it (`freshline purge "
            f"--version {version} --force` gives up the rollback)"
        )


@dataclass(slots=True)
class PurgeResult:
    removed: int = 0
    scans: int = 0
    unlinks: int = 0
    largest_unlink: int = 0
    done: bool = False
    patterns: list[str] = field(default_factory=list)
    retired_ms: int = 0
    """How long the version stays retired (neither started nor flipped to) after this
    purge: a write may have landed after its scan. 0 once the marker is cleared."""
    rerun_in_ms: int = 0
    """From when on a rerun clears the marker: every write has landed by then."""


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
    """Remove schema version ``version``'s feature and lease keys in small batches,
    then its record of the Postgres history they came from
    (:func:`~freshline.pipeline.core.keys.source_key`).

    Each batch is one ``SCAN MATCH feat:<version>:* COUNT count`` step and an
    ``UNLINK`` of at most ``count`` keys (freed in the background), so Redis never
    blocks; the pointer is re-read before every batch, and the purge stops if the
    version became active, next or previous. Stopping early (``max_batches``, Ctrl-C)
    is safe: a rerun scans from the start and finds only what is left.

    Done, it clears the version's retired marker if the version stopped being written
    :data:`~freshline.pipeline.deploy.pointer.IN_FLIGHT_MS` before the purge began (so the scan
    saw every key); otherwise the marker stays and the result says for how long.
    """
    if count < 1:
        raise ValueError(f"count must be positive, got {count}")
    marker = pointer.retired_key(version)
    began_ms = _now_ms(client, marker)
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
    # The history the entries were computed from goes last: until they are all gone, a
    # consumer on another one must keep refusing to write beside them.
    client.delete(source_key(version))
    result.done = True
    _clear_marker(client, marker, began_ms, result)
    return result


_NOW_LUA = "return redis.call('TIME')"


def _now_ms(client: redis.Redis, key: str) -> int:
    """The clock of the node that holds ``key``: the one the pointer's script stamps
    markers with (a script on the key's slot, since TIME alone goes to any node)."""
    seconds, micros = client.register_script(_NOW_LUA)(keys=[key])
    return int(seconds) * 1000 + int(micros) // 1000


def _clear_marker(client: redis.Redis, key: str, began_ms: int, result: PurgeResult) -> None:
    stopped = text(client.get(key))
    if not stopped:
        return
    if stopped.isdigit() and int(stopped) + IN_FLIGHT_MS <= began_ms:
        client.delete(key)  # every write landed before the scan began: nothing is left
        return
    result.retired_ms = max(0, int(client.pttl(key)))
    if stopped.isdigit():
        result.rerun_in_ms = max(0, int(stopped) + IN_FLIGHT_MS - _now_ms(client, key))
