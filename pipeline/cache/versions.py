"""Which schema versions readers read and writers write: the version pointer, as read.

The pointer is two Redis keys, *active* and *next* (see :mod:`freshline.pipeline.deploy.pointer`,
which moves it). Readers resolve the active version once per call
(:class:`VersionResolver`), so no response mixes versions; consumers ask
:class:`WriteVersions` once per batch which versions to write.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Final

import orjson
import redis

from freshline.pipeline.cache.subscription import Subscription
from freshline.pipeline.core.errors import DeployError
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.keys import (
    ACTIVE_SCHEMA_KEY,
    DEPLOY_CHANNEL,
    FIELDS_KEY,
    NEXT_SCHEMA_KEY,
    PREVIOUS_SCHEMA_KEY,
    PROCS_KEY,
    RETIRED_SCHEMA_KEY,
)
from freshline.pipeline.core.lock import Lock, LockedSet
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import text

log = logging.getLogger(__name__)

WRITE_VERSIONS_MAX_AGE_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class Pointer:
    """Where the pointer lives. ``Pointer.scoped(x)`` gives a private one (tests).

    Besides *active* and *next*, a flip leaves *previous* (the version it left, still
    written for one TTL so that a rollback finds it fresh) and a *retired* marker per
    version left, which lives until its last entries have expired.
    """

    active_key: str = ACTIVE_SCHEMA_KEY
    next_key: str = NEXT_SCHEMA_KEY
    channel: str = DEPLOY_CHANNEL
    previous_key: str = PREVIOUS_SCHEMA_KEY
    retired_prefix: str = RETIRED_SCHEMA_KEY
    scope: str = ""

    @classmethod
    def scoped(cls, scope: str) -> Pointer:
        return cls(
            f"{ACTIVE_SCHEMA_KEY}:{scope}",
            f"{NEXT_SCHEMA_KEY}:{scope}",
            f"{DEPLOY_CHANNEL}:{scope}",
            f"{PREVIOUS_SCHEMA_KEY}:{scope}",
            f"{RETIRED_SCHEMA_KEY}:{scope}",
            scope,
        )

    def retired_key(self, version: int) -> str:
        return f"{self.retired_prefix}:{version}"

    def fields_key(self, version: int) -> str:
        """Where ``version``'s field lists are published (:func:`publish_fields`)."""
        return f"{FIELDS_KEY}:{version}{':' + self.scope if self.scope else ''}"

    def procs_index(self, role: str) -> str:
        """The index of ``role``'s registrations (:mod:`freshline.pipeline.cache.roster`)."""
        return f"{PROCS_KEY}:{role}{':' + self.scope if self.scope else ''}"

    def proc_key(self, role: str, proc_id: str) -> str:
        """One registration: role first, so an ACL pattern gives each role its own."""
        return f"{PROCS_KEY}:{role}:{proc_id}"


DEFAULT_POINTER: Final = Pointer()


@dataclass(frozen=True, slots=True)
class DeployState:
    """The pointer as read: ``active`` falls back to the settings when unset."""

    active: int
    next: int | None
    active_raw: str
    next_raw: str
    previous: int | None = None


def _version(raw: str, key: str, lock: Lock | None) -> int | None:
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise DeployError(
            f"{key} holds {raw!r}, not a schema version; "
            "set it with `freshline deploy flip <version>`"
        )
    version = int(raw)
    if lock is not None and version not in lock:
        raise DeployError(
            f"{key} names schema version {version}, which is not in the lock "
            f"(locked: {', '.join(map(str, sorted(lock.versions)))}); "
            "point it at a locked version with `freshline deploy flip`"
        )
    return version


def state(
    client: redis.Redis,
    settings: Settings,
    *,
    pointer: Pointer = DEFAULT_POINTER,
    lock: Lock | None = None,
) -> DeployState:
    """Read the pointer in one MGET; with ``lock``, refuse versions it does not know."""
    active_raw, next_raw, previous_raw = (
        text(r) for r in client.mget([pointer.active_key, pointer.next_key, pointer.previous_key])
    )
    active = _version(active_raw, pointer.active_key, lock) or settings.schema_version
    return DeployState(
        active,
        _version(next_raw, pointer.next_key, lock),
        active_raw,
        next_raw,
        _version(previous_raw, pointer.previous_key, lock),
    )


def publish_fields(
    client: redis.Redis,
    lock: Lock,
    versions: list[int] | None = None,
    *,
    pointer: Pointer = DEFAULT_POINTER,
) -> list[int]:
    """Publish the lock's field lists of ``versions`` (all by default) for readers whose
    lock lacks them: what ``apply`` and the deploy commands do. A version's entry is
    never rewritten, so publishing again changes nothing; no TTL (see
    :data:`freshline.pipeline.core.keys.FIELDS_KEY`)."""
    done = [v for v in (sorted(lock.versions) if versions is None else versions) if v in lock]
    if done:
        client.mset(
            {
                pointer.fields_key(v): orjson.dumps(
                    {name: s.to_json() for name, s in lock.entry(v).items()}
                )
                for v in done
            }
        )
    return done


def published_decoders(
    client: redis.Redis, version: int, *, pointer: Pointer = DEFAULT_POINTER
) -> Registry | None:
    """``version``'s field lists as published, as a registry that decodes its entries."""
    raw = client.get(pointer.fields_key(version))
    if raw is None:
        return None
    doc = orjson.loads(raw)
    return Registry(LockedSet.from_json(name, body).decoder() for name, body in doc.items())


class WriteVersions:
    """The schema versions a consumer writes now: call it once per batch.

    The active, the next and the previous version (for one TTL after a flip, so a
    rollback finds it fresh), each only if this code computes it (its lock entry
    matches the registry, for ``feature_set`` or for all sets); if none,
    ``settings.schema_version``: a process never writes entries it cannot compute,
    and keeps its own namespace fresh for readers of its own version. Each answer is
    kept ``max_age_s`` per feature set, so it costs one GET a second at most.
    """

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        *,
        pointer: Pointer = DEFAULT_POINTER,
        lock: Lock | None = None,
        registry: Registry,
        max_age_s: float = WRITE_VERSIONS_MAX_AGE_S,
    ) -> None:
        self.redis = client
        self.settings = settings
        self.pointer = pointer
        self.lock = lock or Lock.load()
        self.registry = registry
        self.max_age_s = max_age_s
        self._answers: dict[str | None, tuple[float, list[int]]] = {}

    def __call__(self, feature_set: str | None = None) -> list[int]:
        now = time.monotonic()
        cached = self._answers.get(feature_set)
        if cached is not None and now - cached[0] < self.max_age_s:
            return list(cached[1])
        seen = state(self.redis, self.settings, pointer=self.pointer)
        versions = [
            v
            for v in dict.fromkeys((seen.active, seen.next, seen.previous))
            if v is not None and self.lock.compatible(v, self.registry, feature_set)
        ]
        versions = versions or [self.settings.schema_version]
        self._answers[feature_set] = (now, versions)
        return list(versions)


class VersionResolver:
    """Which schema version readers use now: resolved once per call, cached.

    Without :meth:`listen`, ``current()`` reads the pointer (one MGET) at most every
    ``max_age_s``. A listening resolver follows deploy messages instead: it keeps the
    version it read for as long as its subscription stays confirmed
    (:mod:`freshline.pipeline.cache.subscription`: within ``FRESHLINE_SUBSCRIPTION_SILENCE_MS`` of
    the last contact, on the same connection it was read under), however old, and
    drops it when a deploy command publishes, so readers follow a flip at once and a
    request costs no Redis call. While the subscription is not confirmed, every call
    reads the pointer. The deploy commands move the pointer and publish in one script
    (:mod:`freshline.pipeline.deploy.pointer`); a pointer edited by hand is followed once the
    subscription reconnects, or by resolvers that do not listen. A reader's whole call
    uses the one version it resolved.

    Readers always follow the pointer, a rollback included. A version this code does
    not compute is decoded with its field lists (:meth:`decoders`: the lock's, else
    those ``apply`` published); a reader answers its misses from its own version while
    that one is written (:meth:`written`), else refuses them
    (:class:`~freshline.pipeline.core.errors.SchemaVersionUnknown`, the API's 503).
    """

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        *,
        pointer: Pointer = DEFAULT_POINTER,
        lock: Lock | None = None,
        max_age_s: float = 1.0,
    ) -> None:
        self.redis = client
        self.settings = settings
        self.pointer = pointer
        self.lock = lock or Lock.load()
        self.max_age_s = max_age_s
        # (read at, version, the subscription epoch it was read under, if confirmed)
        self._cached: tuple[float, int, int | None] | None = None
        self._refreshes = 0
        self._decoders: dict[int, Registry] = {}
        self._unpublished: dict[int, float] = {}  # version -> when it was last looked for
        self._compatible: dict[int, tuple[Registry, bool]] = {}
        self._warned: set[int] = set()
        self._written: tuple[float, tuple[int | None, ...]] | None = None
        self._subscription: Subscription | None = None
        self.foreign = 0
        """Calls that served a version this code does not compute."""
        self.refused = 0
        """Calls refused: such a version, and this code's own no longer written."""

    def current(self) -> int:
        """The active version, whatever this code computes: readers follow rollbacks."""
        version = self._kept()
        if version is None:
            version = self._read()
        return version

    def computes(self, version: int, registry: Registry) -> bool:
        """``lock.compatible(version, registry)``, asked once per version and registry
        (neither the lock nor a registry changes while the process runs); logs once for
        each version it does not."""
        known = self._compatible.get(version)
        if known is None or known[0] is not registry:
            known = self._compatible[version] = (registry, self.lock.compatible(version, registry))
            if not known[1] and version not in self._warned:
                self._warned.add(version)
                log.warning(
                    "schema version %d is active, which this code does not compute (it "
                    "computes %d): its entries are decoded from its field lists and misses "
                    "are answered from version %d while it is written, else refused",
                    version,
                    self.settings.schema_version,
                    self.settings.schema_version,
                )
        return known[1]

    def written(self, version: int) -> bool:
        """Whether consumers still write ``version`` (active, next or previous); the
        pointer is read at most every ``WRITE_VERSIONS_MAX_AGE_S``."""
        now = time.monotonic()
        if self._written is None or now - self._written[0] >= WRITE_VERSIONS_MAX_AGE_S:
            seen = state(self.redis, self.settings, pointer=self.pointer)
            self._written = (now, (seen.active, seen.next, seen.previous))
        return version in self._written[1]

    def _kept(self) -> int | None:
        """The cached version, if it may still be relied on."""
        cached = self._cached
        if cached is None:
            return None
        sub = self._subscription
        if sub is None:
            return cached[1] if time.monotonic() - cached[0] < self.max_age_s else None
        return cached[1] if sub.live and sub.epoch == cached[2] else None

    def _read(self) -> int:
        """Read the pointer; cache it unless a deploy message came in meanwhile.

        The subscription's state is taken *before* the GET: a flip published after
        the GET reaches a subscription that was confirmed before it.
        """
        sub = self._subscription
        epoch = sub.epoch if sub is not None and sub.live else None
        refreshes = self._refreshes
        now = time.monotonic()
        version = state(self.redis, self.settings, pointer=self.pointer).active
        if self._refreshes == refreshes:
            self._cached = (now, version, epoch)
        return version

    def refresh(self) -> None:
        """Drop the cached version; the next call reads the pointer."""
        self._refreshes += 1
        self._cached = None

    def decoders(self, version: int) -> Registry | None:
        """Field lists for decoding ``version``'s entries: the lock's, else the published
        ones (looked for again at most every ``max_age_s`` while absent), else None."""
        found = self._decoders.get(version)
        if found is not None:
            return found
        if version in self.lock:
            found = self.lock.decoders(version)
        else:
            asked = self._unpublished.get(version)
            if asked is not None and time.monotonic() - asked < max(self.max_age_s, 1.0):
                return None
            found = published_decoders(self.redis, version, pointer=self.pointer)
            if found is None:
                self._unpublished[version] = time.monotonic()
                return None
        self._decoders[version] = found
        return found

    @property
    def silence_s(self) -> float:
        """How long a listening resolver relies on its subscription without contact."""
        return self.settings.subscription_silence_ms / 1000

    @property
    def listening(self) -> bool:
        """True while the deploy subscription is confirmed."""
        return self._subscription is not None and self._subscription.live

    def listen(self) -> None:
        """Follow deploy messages on the pointer's channel in a thread of their own.

        The thread reconnects by itself after Redis restarts or the connection goes
        silent, logging one line; meanwhile every call reads the pointer.
        """
        if self._subscription is None:
            self._subscription = Subscription(
                self.redis,
                [self.pointer.channel],
                on_message=lambda _channel, _data: self.refresh(),
                silence_s=self.silence_s,
                name=f"freshline-deploy-{uuid.uuid4().hex[:12]}",
            ).start()

    def close(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
