"""Schema-version deployments: moving the version pointer (start, flip, cancel, retire).

A deploy moves readers from one key namespace (``feat:<version>:...``) to another
without a miss storm:

1. ``start(V)`` records V as the *next* version. Consumers ask
   :class:`~freshline.pipeline.cache.versions.WriteVersions` per batch, and from then on write
   both the active and the next version (each one their code can compute, see
   :meth:`Lock.compatible`).
2. :func:`freshline.pipeline.deploy.warm.warm` materializes V for the hottest (or all active)
   entities, in batches, through the set-based queries, at a bounded rate.
3. ``flip(V)`` sets active=V and clears next in one Lua script, which also
   publishes on the pointer's channel. Readers
   (:class:`~freshline.pipeline.cache.versions.VersionResolver`) follow within their cache
   age, at once if listening. The version left becomes *previous*: still written for
   one TTL, so a flip back to it (a rollback) serves fresh entries.
4. The old namespace expires by TTL, or :func:`freshline.pipeline.deploy.purge.purge` removes
   it in small SCAN + UNLINK batches.

Every move that stops writing a version leaves a *retired* marker on it in the same
script, until every entry written before has expired (:data:`IN_FLIGHT_MS` plus the
longest TTL); a version is started or flipped to only while nothing of it can be
stale. Every step checks the lock and the pointer first and changes nothing when
refusing; the script checks them again, atomically. Why: docs/deploys.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import redis

from freshline.pipeline.cache.roster import roster, strangers
from freshline.pipeline.cache.versions import (
    DEFAULT_POINTER,
    DeployState,
    Pointer,
    publish_fields,
    state,
)
from freshline.pipeline.core.cluster import is_cluster
from freshline.pipeline.core.errors import DeployError
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.lock import Lock
from freshline.pipeline.core.settings import Settings

IN_FLIGHT_MS: Final = 210_000
"""How long after a version stops being written a write computed before may still land:
a consumer's cached answer (``WRITE_VERSIONS_MAX_AGE_S``), a batch in flight or a warm's
batch, and at most the store's age limit for a key with no state (half the tombstone
fence, 150 s at the default ``FRESHLINE_TOMBSTONE_TTL_S``; :mod:`freshline.pipeline.cache.store`),
with a minute to spare."""

# KEYS[1] active, KEYS[2] next, KEYS[3] previous, KEYS[4] the marker of the version
# this move stops writing, KEYS[5] the marker of the version it starts writing or
# reading. ARGV[1..3] expected active, next, previous ('' for absent); ARGV[4] new
# active ('' keeps it); ARGV[5] new next ('' clears it); ARGV[6] new previous ('' keeps
# it, '-' clears it), ARGV[7] its TTL in ms; ARGV[8] ms from now until writes stop
# ('' sets no marker), ARGV[9] the marker's TTL in ms (an existing marker's is never
# shortened); ARGV[10] 'absent' (refuse, returning -1, if KEYS[5] exists) or 'clear'
# (delete it: the version was written all along) or ''; ARGV[11] channel, ARGV[12]
# PUBLISH or SPUBLISH (a cluster: the channel shares the keys' slot). Compare-and-set
# on active, next and previous, so a concurrent deploy command cannot be lost.
_MOVE_LUA: Final = """
local active = redis.call('GET', KEYS[1]) or ''
local nxt = redis.call('GET', KEYS[2]) or ''
local previous = redis.call('GET', KEYS[3]) or ''
if active ~= ARGV[1] or nxt ~= ARGV[2] or previous ~= ARGV[3] then return 0 end
if ARGV[10] == 'absent' and redis.call('EXISTS', KEYS[5]) == 1 then return -1 end
if ARGV[10] == 'clear' then redis.call('DEL', KEYS[5]) end
if ARGV[8] ~= '' then
  local now = redis.call('TIME')
  local stop = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[8])
  local ttl = math.max(tonumber(ARGV[9]), redis.call('PTTL', KEYS[4]))
  redis.call('SET', KEYS[4], string.format('%d', stop), 'PX', ttl)
end
if ARGV[4] ~= '' then redis.call('SET', KEYS[1], ARGV[4]) end
if ARGV[5] ~= '' then redis.call('SET', KEYS[2], ARGV[5]) else redis.call('DEL', KEYS[2]) end
if ARGV[6] == '-' then
  redis.call('DEL', KEYS[3])
elseif ARGV[6] ~= '' then
  redis.call('SET', KEYS[3], ARGV[6], 'PX', ARGV[7])
end
redis.call(ARGV[12], ARGV[11], (ARGV[4] ~= '' and ARGV[4] or active) .. ' ' .. ARGV[5])
return 1
"""


@dataclass(frozen=True, slots=True)
class Retirement:
    """A version a move stops writing: in ``in_ms`` from now, marked for ``ttl_ms``."""

    version: int
    in_ms: int
    ttl_ms: int


def keep_ms(registry: Registry) -> int:
    """How long a version left by a flip is still written: the longest TTL of a set."""
    return max(fs.ttl_s for fs in registry) * 1000


def longest_ttl_ms(lock: Lock, version: int, registry: Registry) -> int:
    """The longest TTL of ``version``'s entries: its lock entry's (the code that wrote
    them), or ``registry``'s for a version the lock does not know."""
    if version in lock:
        return max(s.ttl_s for s in lock.entry(version).values()) * 1000
    return keep_ms(registry)


def locked(lock: Lock, version: int, action: str) -> None:
    if version not in lock:
        raise DeployError(
            f"cannot {action} schema version {version}: it has no lock entry; "
            "add it with `freshline check --update-lock` under that version"
        )


def retired(
    client: redis.Redis, version: int, action: str, *, pointer: Pointer = DEFAULT_POINTER
) -> None:
    """Raise :class:`DeployError` if ``version`` has a retired marker: entries of it
    may be frozen since it stopped being written."""
    left_ms = int(client.pttl(pointer.retired_key(version)))
    if left_ms != -2:
        stale = f"for up to {left_ms // 1000:,} s more" if left_ms > 0 else "until it is purged"
        raise DeployError(
            f"cannot {action} schema version {version}: it is no longer written and its "
            f"entries may be stale {stale}; purge it first "
            f"(`freshline purge --version {version}`), then warm it and flip"
        )


def _move(
    client: redis.Redis,
    pointer: Pointer,
    seen: DeployState,
    *,
    active: int | None,
    nxt: int | None,
    keep: int = 0,
    retire: Retirement | None = None,
    enter: int | None = None,
    drop_previous: bool = False,
) -> None:
    """Move the pointer in one script: ``active`` (None keeps it; a new one makes the
    version left *previous* for ``keep`` ms), ``nxt`` (None clears it); mark ``retire``;
    ``enter``, the version this move starts writing or reading, must have no marker
    unless it is the previous version (whose marker goes)."""
    script = client.register_script(_MOVE_LUA)
    previous = "-" if drop_previous else ""
    if active is not None and active != seen.active:
        previous = str(seen.active)
    rule = "" if enter is None else "clear" if enter == seen.previous else "absent"
    done = script(
        keys=[
            pointer.active_key,
            pointer.next_key,
            pointer.previous_key,
            pointer.retired_key(retire.version if retire else 0),
            pointer.retired_key(enter or 0),
        ],
        args=[
            seen.active_raw,
            seen.next_raw,
            "" if seen.previous is None else str(seen.previous),
            active or "",
            nxt or "",
            previous,
            keep,
            "" if retire is None else retire.in_ms,
            0 if retire is None else retire.ttl_ms,
            rule,
            pointer.channel,
            "SPUBLISH" if is_cluster(client) else "PUBLISH",
        ],
    )
    if done == -1 and enter is not None:
        retired(client, enter, "deploy", pointer=pointer)
    if done != 1:
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
    """Mark ``version`` as next: consumers start writing it alongside the active one.

    Refused for a version with a retired marker (purge it first) and for the previous
    version (flip back to it instead).
    """
    locked(lock, version, "warm")
    seen = state(client, settings, pointer=pointer, lock=lock)
    if version == seen.active:
        raise DeployError(f"schema version {version} is already active")
    if version == seen.previous:
        raise DeployError(
            f"schema version {version} is the previous version, still written; roll back "
            f"to it with `freshline deploy flip {version}`"
        )
    if seen.next not in (None, version):
        raise DeployError(
            f"a deploy of schema version {seen.next} is in progress; "
            "flip to it or cancel it first (`freshline deploy cancel`)"
        )
    if seen.next != version:
        retired(client, version, "start", pointer=pointer)
        publish_fields(client, lock, [version], pointer=pointer)
        _move(client, pointer, seen, active=None, nxt=version, enter=version)
    return state(client, settings, pointer=pointer, lock=lock)


def cancel(
    client: redis.Redis,
    settings: Settings,
    lock: Lock,
    *,
    registry: Registry,
    pointer: Pointer = DEFAULT_POINTER,
) -> DeployState:
    """Forget the next version; consumers stop writing it and it is retired until its
    entries have expired (or it is purged)."""
    seen = state(client, settings, pointer=pointer, lock=lock)
    if seen.next is not None:
        ttl = longest_ttl_ms(lock, seen.next, registry) + IN_FLIGHT_MS
        _move(client, pointer, seen, active=None, nxt=None, retire=Retirement(seen.next, 0, ttl))
    return state(client, settings, pointer=pointer, lock=lock)


def retire(
    client: redis.Redis,
    settings: Settings,
    version: int,
    lock: Lock,
    *,
    registry: Registry,
    pointer: Pointer = DEFAULT_POINTER,
) -> DeployState:
    """Stop writing the previous version now, giving up the rollback to it: what a
    forced purge of it does first. It is retired until its entries have expired."""
    seen = state(client, settings, pointer=pointer, lock=lock)
    if version != seen.previous:
        raise DeployError(f"schema version {version} is not the previous version")
    ttl = longest_ttl_ms(lock, version, registry) + IN_FLIGHT_MS
    _move(
        client,
        pointer,
        seen,
        active=None,
        nxt=seen.next,
        retire=Retirement(version, 0, ttl),
        drop_previous=True,
    )
    return state(client, settings, pointer=pointer, lock=lock)


def writing(
    client: redis.Redis, settings: Settings, version: int, *, pointer: Pointer = DEFAULT_POINTER
) -> None:
    """Raise :class:`DeployError` unless ``version`` is active or next: a warm checks
    this before each batch, so it writes nothing the consumers do not keep fresh."""
    seen = state(client, settings, pointer=pointer)
    if version not in (seen.active, seen.next):
        raise DeployError(
            f"schema version {version} is not being deployed (neither active nor next: "
            "cancelled?); stopped warming it"
        )


def flip(
    client: redis.Redis,
    settings: Settings,
    version: int,
    lock: Lock,
    *,
    pointer: Pointer = DEFAULT_POINTER,
    registry: Registry,
    force: bool = False,
) -> DeployState:
    """Make ``version`` active and clear next, atomically; readers follow.

    Refused, unless ``force``, while a registered process would not serve or write
    ``version`` (:func:`freshline.pipeline.cache.roster.strangers`), naming each; a rollback (to
    the previous version, written all along) is always accepted.

    The version left stays *previous* for one TTL (the longest of ``registry``'s sets):
    consumers keep writing it, so flipping back to it (a rollback) serves fresh
    entries. It is marked retired until its last entries, written up to that TTL from
    now, have expired. A flip to a version with a marker is refused (purge it first);
    the previous version's marker goes, since it was written all along.
    """
    locked(lock, version, "flip to")
    seen = state(client, settings, pointer=pointer, lock=lock)
    if seen.next not in (None, version):
        raise DeployError(
            f"schema version {seen.next} is being warmed; flip to it, or "
            "cancel it first (`freshline deploy cancel`)"
        )
    if seen.active_raw == str(version) and seen.next is None:
        return seen
    if version not in (seen.active, seen.previous):
        retired(client, version, "flip to", pointer=pointer)
        unready = strangers(roster(client, pointer=pointer), version)
        if unready and not force:
            raise DeployError(
                f"cannot flip to schema version {version} while running processes do not "
                f"know it: {'; '.join(unready)}. Restart them on code whose lock has "
                f"version {version}, or flip with --force (they then serve the entries of "
                f"version {version} they can decode and answer their misses from their "
                "own version while it is written, else 503)"
            )
    publish_fields(client, lock, [version], pointer=pointer)
    keep = keep_ms(registry)
    left = None
    if version != seen.active:
        ttl = keep + longest_ttl_ms(lock, seen.active, registry) + IN_FLIGHT_MS
        left = Retirement(seen.active, keep, ttl)
    enter = None if version == seen.active else version
    _move(client, pointer, seen, active=version, nxt=None, keep=keep, retire=left, enter=enter)
    return state(client, settings, pointer=pointer, lock=lock)
