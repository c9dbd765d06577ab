"""The in-process tier: a small LRU of feature entries in front of Redis.

A hit costs a dict lookup instead of a network round trip. An entry lives no longer
than its Redis copy can (and a windowed set's entry only once its key's TTL is read);
it is dropped when Redis reports its key changed (key tracking, broadcast mode) and on
each published invalidation; the tier is *dark* (flushed, serving nothing) while its
subscription is not confirmed live. Storing is two-step: take :meth:`LocalTier.token`
before the Redis read, then :meth:`LocalTier.put` with it, refused if the entity was
invalidated since; an entry this process wrote itself is put with ``verify=True``.

The rules and why each keeps the tier from serving what Redis would not: docs/reading.md,
"The in-process tier's rules".
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from freshline.pipeline.cache.invalidation import ALL, Invalidation
from freshline.pipeline.cache.store import TTL_JITTER
from freshline.pipeline.cache.subscription import DEFAULT_SILENCE_S, Subscription
from freshline.pipeline.core.clock import now_ms
from freshline.pipeline.core.cluster import is_cluster
from freshline.pipeline.core.codec import ENTRY_TAG, watermark_hex
from freshline.pipeline.core.errors import FreshlineError, InvalidId
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.keys import (
    FEATURE_PREFIX,
    FLOOR_PREFIX,
    INVALIDATION_CHANNEL,
    feature_key,
    parse_feature_key,
)
from freshline.pipeline.core.types import EntityRef, Entry

log = logging.getLogger(__name__)

RECENT_LIMIT = 65_536
TRACKED_PREFIXES = (f"{FEATURE_PREFIX}:", f"{FLOOR_PREFIX}:")
"""The key prefixes whose changes Redis reports to the tier (see the docstring)."""
HORIZON_POLL_S = 0.02
"""How often entries held back for their Redis TTL are looked up (see the docstring)."""
VERIFY_TRIES = 8
"""Rounds a computed entry waits for the report of its own write (see the docstring)."""


@dataclass(slots=True)
class _Unverified:
    """An entry waiting to be seen in Redis (docs/reading.md, the tier's rules)."""

    entry: Entry
    deadline: float
    tries: int = 0
    token: int = 0
    """The tier's token before the read that saw it in Redis ..."""
    read_at: float = 0.0
    """... and when that read was answered (monotonic); 0 until then."""


@dataclass(slots=True)
class LocalStats:
    hits: int = 0
    misses: int = 0
    stored: int = 0
    refused: int = 0
    evicted: int = 0
    expired: int = 0
    held_back: int = 0
    """Entries of windowed feature sets stored after their Redis TTL was read."""
    verified: int = 0
    """Entries stored once Redis was seen holding them (computed, or rechecked)."""
    rechecked: int = 0
    """Puts refused for a change since their token, then checked against Redis."""
    invalidations: int = 0
    flushes: int = 0
    subscriptions: int = 0
    drops: int = 0
    bad_messages: int = 0
    tracked: int = 0
    """Key changes reported by Redis's key tracking."""


class LocalTier:
    """A bounded, invalidation-driven LRU of feature entries (module docstring).

    >>> tier = LocalTier(redis_client, max_entries=10_000).start()
    >>> tier.wait_live(5)

    ``silence_s`` bounds how long the tier serves without confirmed contact with Redis
    (``FRESHLINE_SUBSCRIPTION_SILENCE_MS``); ``heartbeat_s``, how often it asks,
    defaults to a quarter of it.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        max_entries: int,
        max_ttl_ms: int | None = None,
        registry: Registry,
        channel: str = INVALIDATION_CHANNEL,
        silence_s: float = DEFAULT_SILENCE_S,
        heartbeat_s: float | None = None,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.max_ttl_ms = max_ttl_ms
        self.registry = registry
        self.channel = channel
        self.name = f"freshline-local-{uuid.uuid4().hex[:12]}"
        self.stats = LocalStats()
        # One entry per entity and feature set, whatever its schema version: an
        # invalidation finds it in O(1), and a reader of another version sees a miss.
        self._entries: OrderedDict[EntityRef, tuple[Entry, float]] = OrderedDict()
        # Entries of windowed sets waiting for their key's TTL (see the docstring).
        self._held: dict[EntityRef, tuple[Entry, float]] = {}
        # Entries waiting to be seen in Redis (see the docstring).
        self._unverified: dict[EntityRef, _Unverified] = {}
        # When entries read from Redis were put, until the subscription has answered a
        # PING sent after that: a report arriving meanwhile may be of a change the read
        # saw, so it sends the entry to be checked against Redis, not away.
        self._settling: OrderedDict[EntityRef, float] = OrderedDict()
        self._held_wake = threading.Event()
        self._closing = threading.Event()
        self._client = client
        self._horizons: threading.Thread | None = None
        self._recent: OrderedDict[EntityRef, int] = OrderedDict()
        self._seq = 0
        self._floor = 0
        self._live = False
        self._lock = threading.Lock()
        self._live_changed = threading.Condition(self._lock)
        self.tracking = not is_cluster(client)
        self._subscription = Subscription(
            client,
            [channel],
            on_message=self._handle,
            on_live=self._go_live,
            on_dark=self._go_dark,
            silence_s=silence_s,
            heartbeat_s=heartbeat_s,
            name=self.name,
            tracking=TRACKED_PREFIXES if self.tracking else (),
            on_invalidate=self._changed if self.tracking else None,
        )

    @property
    def silence_s(self) -> float:
        return self._subscription.silence_s

    @property
    def heartbeat_s(self) -> float:
        return self._subscription.heartbeat_s

    @property
    def heartbeats(self) -> int:
        """Heartbeats answered so far."""
        return self._subscription.heartbeats

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> LocalTier:
        """Start the subscription thread; the tier serves once it is confirmed."""
        if not self.tracking and self._subscription.epoch == 0 and self._horizons is None:
            log.warning(
                "%s: on Redis Cluster the in-process tier relies on published "
                "invalidations alone: a writer that dies between its write and its "
                "publish leaves entries served until their TTL (FRESHLINE_LOCAL_CACHE_SIZE=0 "
                "turns the tier off)",
                self.name,
            )
        self._subscription.start()
        if self._horizons is None:
            self._horizons = threading.Thread(
                target=self._read_horizons, daemon=True, name=f"{self.name}-horizons"
            )
            self._horizons.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the subscription thread and flush."""
        self._closing.set()
        self._held_wake.set()
        self._subscription.close(timeout)
        if self._horizons is not None:
            self._horizons.join(timeout)

    def __enter__(self) -> LocalTier:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def live(self) -> bool:
        """True while the invalidation subscription is confirmed (see ``silence_s``)."""
        return self._live and self._subscription.live

    def wait_live(self, timeout: float) -> bool:
        """Block until the subscription is confirmed, or ``timeout`` seconds pass."""
        with self._live_changed:
            return self._live_changed.wait_for(lambda: self.live, timeout)

    def __len__(self) -> int:
        return len(self._entries)

    # -- reads and writes --------------------------------------------------------------

    def token(self) -> int:
        """Take before reading Redis; pass to :meth:`put`."""
        return self._seq

    def get(self, ref: EntityRef, schema_version: int) -> Entry | None:
        """The entry if held, live, unexpired and of ``schema_version``; else ``None``."""
        with self._lock:
            item = self._entries.get(ref) if self.live else None
            if item is None:
                self.stats.misses += 1
                return None
            entry, deadline = item
            if deadline <= time.monotonic():
                del self._entries[ref]
                self.stats.expired += 1
                self.stats.misses += 1
                return None
            if entry.schema_version != schema_version:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(ref)
            self.stats.hits += 1
            return entry

    def put(self, ref: EntityRef, entry: Entry, token: int, *, verify: bool = False) -> bool:
        """Hold ``entry`` unless it may be stale (docs/reading.md). True if it is
        held (or held back, or with ``verify`` waiting to be seen in Redis).

        ``verify`` for an entry this process computed and wrote rather than read: it is
        stored once Redis is seen holding it, whatever ``token``. A put refused because
        the entity changed (or the tier flushed) since ``token`` is checked the same way
        in the background: the change may be the very write whose entry it read, whose
        report came after the read (``stats.rechecked``).
        """
        lifetime_ms = self._lifetime_ms(ref, entry)
        with self._lock:
            if not self.live or lifetime_ms <= 0:
                self.stats.refused += 1
                return False
            now = time.monotonic()
            deadline = now + lifetime_ms / 1000
            stale = token < self._floor or self._recent.get(ref, -1) > token
            if verify or stale:
                self._unverified[ref] = _Unverified(entry, deadline)
                if len(self._unverified) > self.max_entries:
                    self._unverified.pop(next(iter(self._unverified)))
                    self.stats.evicted += 1
                self._held_wake.set()
                if stale and not verify:
                    self.stats.rechecked += 1
                    return False
                return True
            self._settle_from(ref, now)
            if self.registry[ref.feature_set].horizon is not None:
                self._entries.pop(ref, None)
                self._held[ref] = (entry, deadline)
                if len(self._held) > self.max_entries:
                    self._held.pop(next(iter(self._held)))
                    self.stats.evicted += 1
                self._held_wake.set()
                return True
            self._store_locked(ref, entry, deadline)
            return True

    def _settle_from(self, ref: EntityRef, put_at: float) -> None:
        """Note ``ref``'s put time (see ``_settling``), forgetting the settled ones."""
        settling, contact = self._settling, self._subscription.contact
        settling.pop(ref, None)
        while settling and (
            next(iter(settling.values())) < contact or len(settling) >= self.max_entries
        ):
            settling.popitem(last=False)
        settling[ref] = put_at

    def _store_locked(self, ref: EntityRef, entry: Entry, deadline: float) -> None:
        self._entries[ref] = (entry, deadline)
        self._entries.move_to_end(ref)
        self.stats.stored += 1
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.stats.evicted += 1

    def _read_horizons(self) -> None:
        """Store the held-back entries, each until its key's Redis TTL runs out, and
        the computed ones Redis is seen holding (docs/reading.md)."""
        while not self._closing.is_set():
            self._held_wake.wait()
            self._held_wake.clear()
            with self._lock:
                held = list(self._held.items())
                unverified = list(self._unverified.items())
            if held or unverified:
                try:
                    self._store_held(held, unverified)
                except redis.RedisError as exc:  # the subscription turns the tier dark
                    log.debug("reading held entries' TTLs: %s", exc)
            self._closing.wait(HORIZON_POLL_S)

    def _store_held(
        self,
        held: list[tuple[EntityRef, tuple[Entry, float]]],
        unverified: list[tuple[EntityRef, _Unverified]],
    ) -> None:
        contact = self._subscription.contact
        reading = [(ref, pending) for ref, pending in unverified if not pending.read_at]
        pipe = self._client.pipeline(transaction=False)
        for ref, (entry, _) in held:
            pipe.pttl(feature_key(entry.schema_version, ref))
        for ref, pending in reading:
            key = feature_key(pending.entry.schema_version, ref)
            pipe.get(key)
            pipe.pttl(key)
        token = self._seq  # before the keys are read, as for a put
        started = time.monotonic()  # before the TTLs are read: errs short
        replies = pipe.execute() if held or reading else []
        read_at = time.monotonic()
        ttls, seen = replies[: len(held)], replies[len(held) :]
        with self._lock:
            for (ref, item), ttl_ms in zip(held, ttls, strict=True):
                if self._held.get(ref) is not item:
                    continue  # invalidated, flushed or replaced meanwhile
                del self._held[ref]
                if ttl_ms is None or int(ttl_ms) <= 0:
                    self.stats.refused += 1  # gone from Redis (or, wrongly, no TTL)
                    continue
                self.stats.held_back += 1
                self._store_locked(ref, item[0], min(item[1], started + int(ttl_ms) / 1000))
            for ref, pending in unverified:
                if pending.read_at and self._unverified.get(ref) is pending:
                    self._settle_locked(ref, pending, contact)
            for i, (ref, pending) in enumerate(reading):
                if self._unverified.get(ref) is not pending:
                    continue  # flushed or replaced meanwhile
                raw, ttl_ms = seen[2 * i], seen[2 * i + 1]
                if token < self._floor or self._recent.get(ref, -1) > token:
                    self._retry_locked(ref, pending)
                elif not _holds(raw, pending.entry) or ttl_ms is None or int(ttl_ms) <= 0:
                    del self._unverified[ref]
                    self.stats.refused += 1
                else:  # seen in Redis: stored once every report older than the read is in
                    pending.token, pending.read_at = token, read_at
                    pending.deadline = min(pending.deadline, started + int(ttl_ms) / 1000)
                    self._held_wake.set()

    def _settle_locked(self, ref: EntityRef, pending: _Unverified, contact: float) -> None:
        """Store an entry seen in Redis, once the subscription has answered a PING sent
        after that read: every change the read saw has been reported by then."""
        if contact < pending.read_at:
            self._held_wake.set()  # the next heartbeat
            return
        if pending.token < self._floor or self._recent.get(ref, -1) > pending.token:
            self._retry_locked(ref, pending)
            return
        del self._unverified[ref]
        self.stats.verified += 1
        self._store_locked(ref, pending.entry, pending.deadline)

    def _retry_locked(self, ref: EntityRef, pending: _Unverified) -> None:
        """Changed since the read: maybe only by its own write, whose report came late.
        Read it again next round, a few times."""
        pending.tries += 1
        pending.read_at = 0.0
        if pending.tries < VERIFY_TRIES:
            self._held_wake.set()
        else:
            del self._unverified[ref]
            self.stats.refused += 1

    def _lifetime_ms(self, ref: EntityRef, entry: Entry) -> float:
        ttl_ms = self.registry[ref.feature_set].ttl_s * 1000 * (1 - TTL_JITTER)
        left = ttl_ms - (now_ms() - entry.computed_at_ms)
        return left if self.max_ttl_ms is None else min(left, self.max_ttl_ms)

    def invalidate(self, feature_set: str, tenant: str, entity: str) -> None:
        """Drop the entity's entry in every schema version, and refuse older puts of it."""
        ref = EntityRef(feature_set, tenant, entity)
        with self._lock:
            self._invalidate_locked(ref)

    def _invalidate_locked(self, ref: EntityRef) -> None:
        self._seq += 1
        self._recent[ref] = self._seq
        self._recent.move_to_end(ref)
        if len(self._recent) > RECENT_LIMIT:
            # Forgetting an invalidation: every token older than it becomes void.
            _, seq = self._recent.popitem(last=False)
            self._floor = max(self._floor, seq)
        stored, held = self._entries.pop(ref, None), self._held.pop(ref, None)
        item = stored or held
        self.stats.invalidations += 1
        put_at = self._settling.pop(ref, None)
        if item is not None and put_at is not None and put_at > self._subscription.contact:
            # Maybe the report of the very write its read saw: check it against Redis.
            self._unverified[ref] = _Unverified(*item)
            self.stats.rechecked += 1
            self._held_wake.set()

    def flush(self) -> None:
        """Drop everything, and void every token taken so far."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._seq += 1
        self._floor = self._seq
        self._entries.clear()
        self._held.clear()
        self._unverified.clear()
        self._settling.clear()
        self._recent.clear()
        self.stats.flushes += 1

    # -- the subscription --------------------------------------------------------------

    def _go_dark(self) -> None:
        with self._live_changed:
            if self._live:
                self.stats.drops += 1
            self._live = False
            self._flush_locked()
            self._live_changed.notify_all()

    def _go_live(self) -> None:
        with self._live_changed:
            self._flush_locked()
            self._live = True
            self.stats.subscriptions += 1
            self._live_changed.notify_all()

    def _handle(self, channel: str, data: bytes | str) -> None:
        try:
            msg = Invalidation.decode(data)
        except FreshlineError as exc:
            log.warning("%s; flushing the local tier", exc)
            self.flush()
            self.stats.bad_messages += 1  # counted once flushed: a reader of it sees the flush
            return
        if msg.entity == ALL:  # a truncated source table: every entity of the set
            self.flush()
            return
        self.invalidate(msg.feature_set, msg.tenant, msg.entity)

    def _changed(self, keys: Sequence[bytes | str] | None) -> None:
        """Keys Redis reports changed (its key tracking): drop their entities' entries.

        ``None`` is a flush of the database. An entity's own floor changes only with
        its entry, whose key is reported too; a feature set's floor (no hash tag) is a
        truncate, and a key that does not parse may be anything: both flush the tier.
        """
        if keys is None:
            self.flush()
            return
        refs: list[EntityRef] = []
        for raw in keys:
            key = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            if key.startswith(TRACKED_PREFIXES[1]):
                if "{" in key:
                    continue
                log.info("%s: a set floor changed (%s); flushing", self.name, key)
                self.flush()
                return
            try:
                refs.append(parse_feature_key(key)[1])
            except InvalidId:
                log.warning("%s: a changed key does not parse (%r); flushing", self.name, key)
                self.flush()
                return
        with self._lock:
            self.stats.tracked += len(refs)
            for ref in refs:
                self._invalidate_locked(ref)


def _holds(raw: bytes | str | None, entry: Entry) -> bool:
    """Whether ``raw``, a feature key's value, is ``entry``'s (same watermark, not a
    tombstone)."""
    if raw is None:
        return False
    data = raw.encode() if isinstance(raw, str) else raw
    return data.startswith(ENTRY_TAG + watermark_hex(entry.watermark))
