"""Schema-version deployments: moving the version pointer (start, flip, cancel).

A deploy moves readers from one key namespace (``feat:<version>:...``) to another
without a miss storm:

1. ``start(V)`` records V as the *next* version. Consumers ask
   :class:`~pipeline.cache.versions.WriteVersions` per batch, and from then on write
   both the active and the next version (each one their code can compute, see
   :meth:`Lock.compatible`).
2. :func:`pipeline.deploy.warm.warm` materializes V for the hottest (or all active)
   entities, in batches, through the set-based queries, at a bounded rate.
3. ``flip(V)`` sets active=V and clears next in one Lua script, which also
   publishes on the pointer's channel. Readers
   (:class:`~pipeline.cache.versions.VersionResolver`) follow within their cache
   age, at once if listening; consumers stop writing the old one.
4. The old namespace expires by TTL, or :func:`pipeline.deploy.purge.purge` removes
   it in small SCAN + UNLINK batches.

Every step checks the lock and the pointer first and changes nothing when refusing.
"""

from __future__ import annotations

from typing import Final

import redis

from pipeline.cache.versions import DEFAULT_POINTER, DeployState, Pointer, state
from pipeline.core.cluster import is_cluster
from pipeline.core.errors import DeployError
from pipeline.core.features import Registry
from pipeline.core.lock import Lock
from pipeline.core.repository import REGISTRY
from pipeline.core.settings import Settings

# KEYS[1] active, KEYS[2] next, KEYS[3] previous, KEYS[4] retired marker of the version
# left, KEYS[5] retired marker of the version flipped to; ARGV[1] expected active,
# ARGV[2] expected next ('' for absent), ARGV[3] new active ('' keeps it), ARGV[4] new
# next ('' clears it), ARGV[5] channel, ARGV[6] the version left ('' when not a flip),
# ARGV[7] one TTL in ms, ARGV[8] PUBLISH or SPUBLISH (a cluster: the channel shares
# the keys' slot). Compare-and-set on active and next, so a concurrent deploy
# command cannot be lost.
_MOVE_LUA: Final = """
local active = redis.call('GET', KEYS[1]) or ''
local nxt = redis.call('GET', KEYS[2]) or ''
if active ~= ARGV[1] or nxt ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' then redis.call('SET', KEYS[1], ARGV[3]) end
if ARGV[4] ~= '' then redis.call('SET', KEYS[2], ARGV[4]) else redis.call('DEL', KEYS[2]) end
if ARGV[6] ~= '' then
  redis.call('SET', KEYS[3], ARGV[6], 'PX', ARGV[7])
  redis.call('SET', KEYS[4], '1', 'PX', 2 * tonumber(ARGV[7]))
  redis.call('DEL', KEYS[5])
end
redis.call(ARGV[8], ARGV[5], (ARGV[3] ~= '' and ARGV[3] or active) .. ' ' .. ARGV[4])
return 1
"""


def keep_ms(registry: Registry) -> int:
    """How long a version left by a flip is still written: the longest TTL of a set."""
    return max(fs.ttl_s for fs in registry) * 1000


def locked(lock: Lock, version: int, action: str) -> None:
    if version not in lock:
        raise DeployError(
            f"cannot {action} schema version {version}: it has no lock entry; "
            "add it with `freshline check --update-lock` under that version"
        )


def _move(
    client: redis.Redis,
    pointer: Pointer,
    seen: DeployState,
    *,
    active: int | None,
    nxt: int | None,
    keep: int = 0,
) -> None:
    script = client.register_script(_MOVE_LUA)
    left = str(seen.active) if active is not None and active != seen.active else ""
    done = script(
        keys=[
            pointer.active_key,
            pointer.next_key,
            pointer.previous_key,
            pointer.retired_key(seen.active),
            pointer.retired_key(active or 0),
        ],
        args=[
            seen.active_raw,
            seen.next_raw,
            active or "",
            nxt or "",
            pointer.channel,
            left,
            keep,
            "SPUBLISH" if is_cluster(client) else "PUBLISH",
        ],
    )
    if not done:
        raise DeployError(
            "the version pointer changed while this command ran "
            "(another deploy?); nothing was changed, check and retry"
        )


def start(
    client: redis.Redis,
    settings: Settings,
    version: int,
    lock: Lock,
    *,
    pointer: Pointer = DEFAULT_POINTER,
) -> DeployState:
    """Mark ``version`` as next: consumers start writing it alongside the active one."""
    locked(lock, version, "warm")
    seen = state(client, settings, pointer=pointer, lock=lock)
    if version == seen.active:
        raise DeployError(f"schema version {version} is already active")
    if seen.next not in (None, version):
        raise DeployError(
            f"a deploy of schema version {seen.next} is in progress; "
            "flip to it or cancel it first (`freshline deploy cancel`)"
        )
    if seen.next != version:
        _move(client, pointer, seen, active=None, nxt=version)
    return state(client, settings, pointer=pointer, lock=lock)


def cancel(
    client: redis.Redis, settings: Settings, lock: Lock, *, pointer: Pointer = DEFAULT_POINTER
) -> DeployState:
    """Forget the next version; consumers stop writing it. Its keys expire by TTL."""
    seen = state(client, settings, pointer=pointer, lock=lock)
    if seen.next is not None:
        _move(client, pointer, seen, active=None, nxt=None)
    return state(client, settings, pointer=pointer, lock=lock)


def flip(
    client: redis.Redis,
    settings: Settings,
    version: int,
    lock: Lock,
    *,
    pointer: Pointer = DEFAULT_POINTER,
    registry: Registry = REGISTRY,
) -> DeployState:
    """Make ``version`` active and clear next, atomically; readers follow.

    The version left stays *previous* for one TTL (the longest of ``registry``'s sets):
    consumers keep writing it, so flipping back to it (a rollback) serves fresh
    entries. After that its entries may be frozen until they expire, and a flip to it
    is refused until they have (its *retired* marker is gone) or it was purged.
    """
    locked(lock, version, "flip to")
    seen = state(client, settings, pointer=pointer, lock=lock)
    if seen.next not in (None, version):
        raise DeployError(
            f"schema version {seen.next} is being warmed; flip to it, or "
            "cancel it first (`freshline deploy cancel`)"
        )
    if version not in (seen.active, seen.previous):
        left_ms = int(client.pttl(pointer.retired_key(version)))
        if left_ms > 0:
            raise DeployError(
                f"schema version {version} has not been written for over a TTL and its "
                f"entries may be stale for up to {left_ms // 1000:,} s more; purge it first "
                f"(`freshline purge --version {version}`), then warm it and flip"
            )
    if seen.active_raw != str(version) or seen.next is not None:
        _move(client, pointer, seen, active=version, nxt=None, keep=keep_ms(registry))
    return state(client, settings, pointer=pointer, lock=lock)
