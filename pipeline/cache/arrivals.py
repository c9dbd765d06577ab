"""Waiting for an entity's next write: woken by its invalidation message.

A reader that needs a newer entry than Redis holds (a freshness token the entry does
not reach yet) waits for the consumer's write rather than polling the key. Every write
is followed by an invalidation message on :data:`freshline.pipeline.core.keys.INVALIDATION_CHANNEL`
(:mod:`freshline.pipeline.cache.invalidation`), so one subscription per process
(:class:`Arrivals`, on :class:`freshline.pipeline.cache.subscription.Subscription`) wakes the
:class:`Watch` of every reader waiting on that entity, whatever the schema version; a
message naming every entity of a feature set, or one that does not decode, wakes all
watches of that set, or all. A woken reader reads the key again.

The subscription is only relied on while it is confirmed live. Until then (it starts
with the first watch) and whenever it goes dark, a waiting reader reads the key every
:data:`POLL_S` instead: a bounded poll, never a missed write.

Order, so that no write slips between a read and the wait: register the watch, then
for each round :meth:`Watch.clear`, read the key, wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Final, Literal

import redis

from freshline.pipeline.cache.invalidation import ALL, Invalidation
from freshline.pipeline.cache.subscription import DEFAULT_SILENCE_S, Subscription
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.keys import INVALIDATION_CHANNEL
from freshline.pipeline.core.types import EntityRef

POLL_S: Final = 0.02
"""How often a waiting reader reads its keys while the subscription is not live."""


class WaitHistory:
    """Whether waiting for the consumer's writes pays, from this process's recent waits.

    A wait that ends without the write it waited for (the consumer runs behind by more
    than the wait) cost its reader the whole wait and spared the database nothing: the
    read then computed anyway. After :attr:`misses` such waits in a row, :meth:`worth`
    says no, and reads go straight to the recompute, except one probe every
    :attr:`probe_s` that waits as before; a wait that gets its write starts the count
    over. Only waits a caller did not size itself consult it (a ``wait_ms`` given with
    the request is waited in full). Correctness does not depend on it: a read that does
    not wait computes from a snapshot taken after the token. One event loop or one
    thread per instance: no lock.
    """

    def __init__(
        self,
        *,
        misses: int = 4,
        probe_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.misses = misses
        self.probe_s = probe_s
        self.clock = clock
        self.missed = 0  # waits in a row that ended without their write
        self.skipped = 0  # waits not made, since this instance began
        self._probed = -math.inf  # the clock at the last wait that missed, or probe

    def worth(self) -> bool:
        """Whether to wait now (a probe counts as waiting)."""
        if self.missed < self.misses:
            return True
        now = self.clock()
        if now - self._probed >= self.probe_s:
            self._probed = now
            return True
        self.skipped += 1
        return False

    def record(self, arrived: bool) -> None:
        """A wait's outcome: its writes came within it, or not (then the next probe is
        :attr:`probe_s` after it)."""
        if arrived:
            self.missed = 0
        else:
            self.missed += 1
            self._probed = self.clock()


Key = tuple[str, str, str]  # feature set, tenant, entity


class Watch:
    """One reader's wait for writes to some entities; a context manager that registers
    and unregisters it. Woken from the subscription's thread; waited on by a thread
    (:meth:`wait`) or, if made with ``loop``, by a coroutine on it (:meth:`until`)."""

    def __init__(
        self,
        arrivals: Arrivals,
        keys: frozenset[Key],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.arrivals = arrivals
        self.keys = keys
        self.feature_sets = frozenset(k[0] for k in keys)
        self._loop = loop
        self._event = threading.Event()
        self._async_event = asyncio.Event() if loop is not None else None

    def __enter__(self) -> Watch:
        self.arrivals._register(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.arrivals._unregister(self)

    def wake(self) -> None:
        self._event.set()
        if self._loop is not None and self._async_event is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                self._loop.call_soon_threadsafe(self._async_event.set)

    def clear(self) -> None:
        self._event.clear()
        if self._async_event is not None:
            self._async_event.clear()

    def timeout(self, remaining_s: float) -> float:
        """How long to wait now: until woken while the subscription is live, else a poll."""
        return remaining_s if self.arrivals.live else min(remaining_s, POLL_S)

    def wait(self, remaining_s: float) -> bool:
        """Block until woken or :meth:`timeout`; True if woken."""
        return self._event.wait(self.timeout(remaining_s))

    async def until(self, remaining_s: float) -> bool:
        """:meth:`wait` for a coroutine on the watch's loop."""
        if self._async_event is None:
            raise FreshlineError("this watch was made without an event loop")
        try:
            async with asyncio.timeout(self.timeout(remaining_s)):
                await self._async_event.wait()
        except TimeoutError:
            return False
        return True


class Arrivals:
    """The writes readers wait for, in one process; see the module docstring.

    The subscription starts with the first :meth:`watch`; :meth:`close` ends it.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        channel: str = INVALIDATION_CHANNEL,
        silence_s: float = DEFAULT_SILENCE_S,
    ) -> None:
        self._subscription = Subscription(
            client,
            [channel],
            on_message=self._handle,
            on_dark=self._wake_all,
            silence_s=silence_s,
            name=f"freshline-arrivals-{uuid.uuid4().hex[:12]}",
        )
        self._watches: defaultdict[Key, set[Watch]] = defaultdict(set)
        self._lock = threading.Lock()
        self._state: Literal["new", "started", "closed"] = "new"
        self.watches = 0
        """Watches made so far (for tests and metrics)."""

    @property
    def live(self) -> bool:
        return self._subscription.live

    def wait_live(self, timeout: float) -> bool:
        self._start()
        return self._subscription.wait_live(timeout)

    def watch(
        self, refs: Iterable[EntityRef], loop: asyncio.AbstractEventLoop | None = None
    ) -> Watch:
        """A watch on ``refs``' entities, to use as a context manager."""
        self._start()
        return Watch(self, frozenset((r.feature_set, r.tenant, r.entity) for r in refs), loop)

    def close(self) -> None:
        """End the subscription for good: watches made after this poll."""
        with self._lock:
            started = self._state == "started"
            self._state = "closed"
        if started:
            self._subscription.close()

    def _start(self) -> None:
        if self._state != "new":
            return
        with self._lock:
            if self._state == "new":
                self._subscription.start()
                self._state = "started"

    def _register(self, watch: Watch) -> None:
        with self._lock:
            self.watches += 1
            for key in watch.keys:
                self._watches[key].add(watch)

    def _unregister(self, watch: Watch) -> None:
        with self._lock:
            for key in watch.keys:
                waiting = self._watches.get(key)
                if waiting is not None:
                    waiting.discard(watch)
                    if not waiting:
                        del self._watches[key]

    def _handle(self, channel: str, data: bytes | str) -> None:
        try:
            msg = Invalidation.decode(data)
        except FreshlineError:
            self._wake_all()
            return
        with self._lock:
            if msg.entity == ALL:
                woken = {w for ws in self._watches.values() for w in ws}
                woken = {w for w in woken if msg.feature_set in w.feature_sets}
            else:
                woken = set(self._watches.get((msg.feature_set, msg.tenant, msg.entity), ()))
        for watch in woken:
            watch.wake()

    def _wake_all(self) -> None:
        with self._lock:
            woken = {w for ws in self._watches.values() for w in ws}
        for watch in woken:
            watch.wake()
