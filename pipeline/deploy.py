"""Schema-version deployments: the active-version pointer, warming, the flip, purging.

A deploy moves readers from one key namespace (``feat:<version>:...``) to another
without a miss storm:

1. ``start(V)`` records V as the *next* version. Consumers call
   :func:`write_versions` per batch and from then on write both the active and the
   next version (each one their code can compute, see :meth:`Lock.compatible`).
2. :func:`pipeline.warm.warm` materializes V for the hottest (or all active)
   entities, in batches, through the set-based queries, at a bounded rate.
3. ``flip(V)`` sets active=V and clears next in one Lua script, which also
   publishes on :data:`DEPLOY_CHANNEL`. Readers (:class:`VersionResolver`) follow
   within their cache age, at once if listening; consumers stop writing the old one.
4. The old namespace expires by TTL, or :func:`purge` removes it in small
   SCAN + UNLINK batches.

Every step checks the lock and the pointer first and changes nothing when refusing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import redis

from pipeline.errors import DeployError
from pipeline.features import REGISTRY, Registry
from pipeline.keys import (
    ACTIVE_SCHEMA_KEY,
    LEASE_PREFIX,
    META_PREFIX,
    NEXT_SCHEMA_KEY,
    feature_pattern,
)
from pipeline.lock import Lock
from pipeline.settings import Settings

log = logging.getLogger(__name__)

DEPLOY_CHANNEL: Final = f"{META_PREFIX}:deploy"
WRITE_VERSIONS_MAX_AGE_S: Final = 1.0

# KEYS[1] active, KEYS[2] next; ARGV[1] expected active, ARGV[2] expected next ('' for
# absent), ARGV[3] new active ('' keeps it), ARGV[4] new next ('' clears it), ARGV[5]
# channel. Compare-and-set on both, so a concurrent deploy command cannot be lost.
_MOVE_LUA: Final = """
local active = redis.call('GET', KEYS[1]) or ''
local nxt = redis.call('GET', KEYS[2]) or ''
if active ~= ARGV[1] or nxt ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' then redis.call('SET', KEYS[1], ARGV[3]) end
if ARGV[4] ~= '' then redis.call('SET', KEYS[2], ARGV[4]) else redis.call('DEL', KEYS[2]) end
redis.call('PUBLISH', ARGV[5], (ARGV[3] ~= '' and ARGV[3] or active) .. ' ' .. ARGV[4])
return 1
"""


@dataclass(frozen=True, slots=True)
class Pointer:
    """Where the pointer lives. ``Pointer.scoped(x)`` gives a private one (tests)."""

    active_key: str = ACTIVE_SCHEMA_KEY
    next_key: str = NEXT_SCHEMA_KEY
    channel: str = DEPLOY_CHANNEL

    @classmethod
    def scoped(cls, scope: str) -> Pointer:
        return cls(f"{ACTIVE_SCHEMA_KEY}:{scope}", f"{NEXT_SCHEMA_KEY}:{scope}",
                   f"{DEPLOY_CHANNEL}:{scope}")


DEFAULT_POINTER: Final = Pointer()


@dataclass(frozen=True, slots=True)
class DeployState:
    """The pointer as read: ``active`` falls back to the settings when unset."""

    active: int
    next: int | None
    active_raw: str
    next_raw: str


def _text(raw: bytes | str | None) -> str:
    return raw.decode() if isinstance(raw, bytes) else (raw or "")


def _version(raw: str, key: str, lock: Lock | None) -> int | None:
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise DeployError(f"{key} holds {raw!r}, not a schema version; "
                          "set it with `freshline deploy flip <version>`")
    version = int(raw)
    if lock is not None and version not in lock:
        raise DeployError(f"{key} names schema version {version}, which is not in the lock "
                          f"(locked: {', '.join(map(str, sorted(lock.versions)))}); "
                          "point it at a locked version with `freshline deploy flip`")
    return version


def state(client: redis.Redis, settings: Settings, *, pointer: Pointer = DEFAULT_POINTER,
          lock: Lock | None = None) -> DeployState:
    """Read the pointer in one MGET; with ``lock``, refuse versions it does not know."""
    active_raw, next_raw = (_text(r) for r in client.mget([pointer.active_key,
                                                          pointer.next_key]))
    active = _version(active_raw, pointer.active_key, lock) or settings.schema_version
    return DeployState(active, _version(next_raw, pointer.next_key, lock), active_raw, next_raw)


def locked(lock: Lock, version: int, action: str) -> None:
    if version not in lock:
        raise DeployError(f"cannot {action} schema version {version}: it has no lock entry; "
                          "add it with `freshline check --update-lock` under that version")


def _move(client: redis.Redis, pointer: Pointer, seen: DeployState, *,
          active: int | None, nxt: int | None) -> None:
    script = client.register_script(_MOVE_LUA)
    done = script(keys=[pointer.active_key, pointer.next_key],
                  args=[seen.active_raw, seen.next_raw, active or "", nxt or "", pointer.channel])
    if not done:
        raise DeployError("the version pointer changed while this command ran "
                          "(another deploy?); nothing was changed, check and retry")


def start(client: redis.Redis, settings: Settings, version: int, lock: Lock, *,
          pointer: Pointer = DEFAULT_POINTER) -> DeployState:
    """Mark ``version`` as next: consumers start writing it alongside the active one."""
    locked(lock, version, "warm")
    seen = state(client, settings, pointer=pointer, lock=lock)
    if version == seen.active:
        raise DeployError(f"schema version {version} is already active")
    if seen.next not in (None, version):
        raise DeployError(f"a deploy of schema version {seen.next} is in progress; "
                          "flip to it or cancel it first (`freshline deploy cancel`)")
    if seen.next != version:
        _move(client, pointer, seen, active=None, nxt=version)
    return state(client, settings, pointer=pointer, lock=lock)


def cancel(client: redis.Redis, settings: Settings, lock: Lock, *,
           pointer: Pointer = DEFAULT_POINTER) -> DeployState:
    """Forget the next version; consumers stop writing it. Its keys expire by TTL."""
    seen = state(client, settings, pointer=pointer, lock=lock)
    if seen.next is not None:
        _move(client, pointer, seen, active=None, nxt=None)
    return state(client, settings, pointer=pointer, lock=lock)


def flip(client: redis.Redis, settings: Settings, version: int, lock: Lock, *,
         pointer: Pointer = DEFAULT_POINTER) -> DeployState:
    """Make ``version`` active and clear next, atomically; readers follow.

    Flipping back to the previous version is a rollback and works the same way.
    """
    locked(lock, version, "flip to")
    seen = state(client, settings, pointer=pointer, lock=lock)
    if seen.next not in (None, version):
        raise DeployError(f"schema version {seen.next} is being warmed; flip to it, or "
                          "cancel it first (`freshline deploy cancel`)")
    if seen.active_raw != str(version) or seen.next is not None:
        _move(client, pointer, seen, active=version, nxt=None)
    return state(client, settings, pointer=pointer, lock=lock)


_shipped: Lock | None = None


def shipped_lock() -> Lock:
    """``schemas/features.lock.json``, read once per process."""
    global _shipped  # noqa: PLW0603
    if _shipped is None:
        _shipped = Lock.load()
    return _shipped


_write_cache: dict[tuple[Any, ...], tuple[float, list[int]]] = {}


def write_versions(client: redis.Redis, settings: Settings, *, feature_set: str | None = None,
                   pointer: Pointer = DEFAULT_POINTER, lock: Lock | None = None,
                   registry: Registry = REGISTRY,
                   max_age_s: float = WRITE_VERSIONS_MAX_AGE_S) -> list[int]:
    """The schema versions a consumer writes now: call it once per batch.

    The active and the next version, each only if this code computes it (its lock
    entry matches the registry, for ``feature_set`` or for all sets); if neither,
    ``settings.schema_version``: a process never writes entries it cannot compute,
    and keeps its own namespace fresh for readers of its own version. Cached for
    ``max_age_s`` per pointer, so it costs one GET a second at most.
    """
    cache_key = (id(client), pointer, settings.schema_version, feature_set, id(lock))
    now = time.monotonic()
    cached = _write_cache.get(cache_key)
    if cached is not None and now - cached[0] < max_age_s:
        return list(cached[1])
    lock = lock or shipped_lock()
    seen = state(client, settings, pointer=pointer)
    versions = [v for v in (seen.active, seen.next)
                if v is not None and lock.compatible(v, registry, feature_set)]
    versions = versions or [settings.schema_version]
    _write_cache[cache_key] = (now, versions)
    return list(versions)


class VersionResolver:
    """Which schema version readers use now: resolved once per call, cached briefly.

    ``current()`` does a GET at most every ``max_age_s``; ``listen()`` also drops the
    cache as soon as a deploy command publishes, so readers follow a flip at once.
    A reader's whole call uses the one version it resolved, so no response mixes
    versions. A pointer naming a version missing from the lock raises
    :class:`DeployError` rather than serve entries nobody can decode.
    """

    def __init__(self, client: redis.Redis, settings: Settings, *,
                 pointer: Pointer = DEFAULT_POINTER, lock: Lock | None = None,
                 max_age_s: float = 1.0) -> None:
        self.redis = client
        self.settings = settings
        self.pointer = pointer
        self.lock = lock or shipped_lock()
        self.max_age_s = max_age_s
        self._cached: tuple[float, int] | None = None
        self._decoders: dict[int, Registry] = {}
        self._warned: set[int] = set()
        self._listener: Any = None

    def current(self, registry: Registry | None = None) -> int:
        """The active version; with ``registry``, only if that code can compute it.

        A read-through passes its registry: where the active version's definitions
        differ from its code it stays on ``settings.schema_version`` (and logs once).
        """
        cached = self._cached
        now = time.monotonic()
        if cached is None or now - cached[0] >= self.max_age_s:
            version = state(self.redis, self.settings, pointer=self.pointer,
                            lock=self.lock).active
            self._cached = cached = (now, version)
        version = cached[1]
        if registry is not None and not self.lock.compatible(version, registry):
            if version not in self._warned:
                self._warned.add(version)
                log.warning("active schema version %d differs from this code's definitions; "
                            "staying on %d", version, self.settings.schema_version)
            return self.settings.schema_version
        return version

    def refresh(self) -> None:
        """Drop the cached version; the next call reads the pointer."""
        self._cached = None

    def decoders(self, version: int) -> Registry:
        """Field lists for ``version`` from the lock, for decoding its entries."""
        if version not in self._decoders:
            self._decoders[version] = self.lock.decoders(version)
        return self._decoders[version]

    def listen(self) -> None:
        """Follow deploy messages on the pointer's channel in a daemon thread."""
        if self._listener is None:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            pubsub.subscribe(**{self.pointer.channel: lambda _msg: self.refresh()})
            self._listener = pubsub.run_in_thread(sleep_time=0.5, daemon=True)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
            self._listener.join(timeout=2)
            self._listener = None


def purgeable(client: redis.Redis, settings: Settings, version: int, *,
              pointer: Pointer = DEFAULT_POINTER) -> None:
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


def purge(client: redis.Redis, settings: Settings, version: int, *,
          pointer: Pointer = DEFAULT_POINTER, count: int = 500, max_batches: int | None = None,
          progress: Callable[[int], None] | None = None) -> PurgeResult:
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
    for pattern in result.patterns:
        cursor = 0
        while True:
            if max_batches is not None and result.scans >= max_batches:
                return result
            purgeable(client, settings, version, pointer=pointer)
            cursor, keys = client.scan(cursor=cursor, match=pattern, count=count)
            result.scans += 1
            for start_at in range(0, len(keys), count):
                chunk = keys[start_at:start_at + count]
                result.removed += int(client.unlink(*chunk))
                result.unlinks += 1
                result.largest_unlink = max(result.largest_unlink, len(chunk))
            if progress is not None:
                progress(result.removed)
            if cursor == 0:
                break
    result.done = True
    return result


def purge_model(client: redis.Redis, name: str, version: str, *, count: int = 500,
                progress: Callable[[int], None] | None = None) -> int:
    """Remove a model version's cached predictions; refuses the registered version."""
    from pipeline.inference import purge as purge_predictions
    from pipeline.models import ModelRegistry, UnknownModel

    try:
        current = ModelRegistry(client).record(name).version
    except UnknownModel:
        current = None
    if current == version:
        raise DeployError(f"model {name!r} version {version!r} is the registered one; "
                          "register the new version first, then purge the old")
    return purge_predictions(client, name, version, batch=count, progress=progress)

