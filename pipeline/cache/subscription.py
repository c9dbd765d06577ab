"""A Redis pub/sub subscription that knows, at every moment, whether it can be relied on.

Readers that skip a Redis round trip because "a message would have told us" (the
in-process tier, the version resolver) need more than redis-py's pub/sub gives: it
resubscribes silently after a reconnect (messages published in between vanish without
a trace), a half-open connection looks like a quiet channel, and ``run_in_thread``'s
worker dies with a traceback once its retries run out. :class:`Subscription` keeps one
subscription in a thread of its own:

* **Confirmed contact.** Every ``heartbeat_s`` it sends a numbered PING down the
  subscribed connection. Redis answers in order, so each PONG proves that every
  message published before the PING was *sent* has arrived; that send time is the
  last confirmed contact. The subscription is :attr:`~Subscription.live` only while the
  last confirmed contact is less than ``silence_s`` old: a reader relying on it misses
  a message by ``silence_s`` at most, whatever the network does. The bound is checked
  on every read of ``live``, not by the thread, so a stalled thread cannot stretch it.
* **Dark on any doubt.** A connection error, a timeout or ``silence_s`` without
  confirmed contact drops the connection and calls ``on_dark``; the owner stops relying
  on the messages (messages published while dark are lost). Each confirmed
  (re)subscription starts a new :attr:`~Subscription.epoch` and calls ``on_live``.
* **It comes back.** It reconnects for as long as it runs, with jittered exponential
  backoff (50 ms to 2 s). An outage is one warning line and its end one info line;
  an error is never a thread-killing traceback.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline.core.cluster import is_cluster
from pipeline.core.errors import FreshlineError

log = logging.getLogger(__name__)

DEFAULT_SILENCE_S: Final = 1.0
BACKOFF_FIRST_S: Final = 0.05
BACKOFF_MAX_S: Final = 2.0
CONNECTION_ERRORS: Final = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
)

MessageHandler = Callable[[str, bytes | str], None]


class SubscriptionLost(FreshlineError):
    """The subscription stopped answering, or the server ended it."""


def _nothing() -> None:
    return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Subscription:
    """One pub/sub subscription, heartbeated and reconnected; see the module docstring.

    >>> sub = Subscription(client, ["freshline:invalidations"], on_message=handle).start()
    >>> sub.wait_live(5)

    ``on_message(channel, data)``, ``on_live()`` and ``on_dark()`` run in the
    subscription's thread. ``heartbeat_s`` defaults to a quarter of ``silence_s``.
    """

    def __init__(
        self,
        client: redis.Redis,
        channels: Sequence[str],
        *,
        on_message: MessageHandler,
        on_live: Callable[[], None] = _nothing,
        on_dark: Callable[[], None] = _nothing,
        silence_s: float = DEFAULT_SILENCE_S,
        heartbeat_s: float | None = None,
        name: str | None = None,
    ) -> None:
        if not channels:
            raise ValueError("a subscription needs at least one channel")
        if silence_s <= 0:
            raise ValueError(f"silence_s must be positive, got {silence_s}")
        heartbeat_s = silence_s / 4 if heartbeat_s is None else heartbeat_s
        if not 0 < heartbeat_s < silence_s:
            raise ValueError(
                f"heartbeat_s must be positive and under silence_s ({silence_s}), got {heartbeat_s}"
            )
        self.channels = tuple(channels)
        self.silence_s = silence_s
        self.heartbeat_s = heartbeat_s
        self.name = name or f"freshline-sub-{uuid.uuid4().hex[:12]}"
        self.epoch = 0
        self.heartbeats = 0
        self._on_message = on_message
        self._on_live = on_live
        self._on_dark = on_dark
        # Written by the thread (and by close() after it), read by any thread without
        # a lock: ``_until`` before ``_subscribed`` going live, ``_subscribed`` first
        # going dark, so a reader never sees a live flag with a stale deadline.
        self._subscribed = False
        self._until = 0.0
        self._pings = 0
        self._down_since: float | None = None  # when the current outage began
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cluster: Any = cast(Any, client) if is_cluster(client) else None
        if self._cluster is not None:
            slots = {self._cluster.keyslot(c) for c in self.channels}
            if len(slots) > 1:
                raise ValueError(
                    "on Redis Cluster a subscription's channels must share "
                    f"a slot (sharded pub/sub): {', '.join(self.channels)}"
                )
            self._client = redis.Redis()  # replaced by _node_client on every connect
        else:
            self._client = self._subscriber_client(client)

    def _node_client(self) -> redis.Redis:
        """On a cluster: a client of the master that owns the channels' slot now.

        The slot map is refreshed first, so after a failover the promoted replica is
        found; messages published while dark are lost, as on one node.
        """
        cluster = self._cluster
        cluster.nodes_manager.initialize()
        node = cluster.get_node_from_key(self.channels[0])
        return self._subscriber_client(node.redis_connection)

    def _subscriber_client(self, client: redis.Redis) -> redis.Redis:
        """A client of its own: no silent retries, no read longer than ``silence_s``.

        redis-py would reconnect and resubscribe by itself, losing what was published
        in between; with no retries the error reaches :meth:`_run`, which goes dark
        first. The client name lets an operator (or a test) find it in ``CLIENT LIST``.
        """
        pool = client.connection_pool
        kwargs = dict(pool.connection_kwargs)
        kwargs.update(
            retry=Retry(NoBackoff(), 0),
            client_name=self.name,
            socket_keepalive=True,
            socket_timeout=self.silence_s,
            socket_connect_timeout=self.silence_s,
            health_check_interval=0,
        )
        return redis.Redis(
            connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
        )

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Subscription:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (it is dark from here on) and close the connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._go_dark()
        self._client.close()
        self._client.connection_pool.disconnect()

    @property
    def live(self) -> bool:
        """Subscribed, with contact confirmed less than ``silence_s`` ago."""
        return self._subscribed and time.monotonic() < self._until

    def wait_live(self, timeout: float) -> bool:
        """Block until the subscription is confirmed, or ``timeout`` seconds pass."""
        with self._changed:
            return self._changed.wait_for(lambda: self.live, timeout)

    # -- the thread --------------------------------------------------------------------

    def _go_live(self, until: float) -> None:
        with self._changed:
            self.epoch += 1
            self._until = until
            self._subscribed = True
            self._changed.notify_all()
        self._on_live()
        if self._down_since is not None:
            log.info(
                "%s: subscribed to %s again after %.1fs",
                self.name,
                ", ".join(self.channels),
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    def _go_dark(self) -> bool:
        """Dark now; True if it was subscribed."""
        with self._changed:
            was = self._subscribed
            self._subscribed = False
            self._until = 0.0
            self._changed.notify_all()
        self._on_dark()
        return was

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._listen()
                continue
            except (*CONNECTION_ERRORS, SubscriptionLost) as exc:
                error = f"{type(exc).__name__}: {exc}"
            except Exception:  # a bug, not the network: say where, and carry on dark
                log.exception("%s: subscription to %s failed", self.name, ", ".join(self.channels))
                error = "see the traceback above"
            was_live = self._go_dark()
            if self._stop.is_set():
                break
            if was_live:
                failures = 0
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning(
                    "%s: subscription to %s lost (%s); not relied on until it is confirmed again",
                    self.name,
                    ", ".join(self.channels),
                    error,
                )
            else:
                log.debug("%s: still no subscription (%s)", self.name, error)
            delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**failures) * random.uniform(0.5, 1)
            failures += 1
            self._stop.wait(delay)

    def _listen(self) -> None:
        """One connection, until it fails or the subscription closes."""
        sharded = self._cluster is not None
        if sharded:
            self._client.close()
            self._client = self._node_client()
        pubsub = self._client.pubsub()
        try:
            sent = time.monotonic()
            if sharded:
                pubsub.ssubscribe(*self.channels)
            else:
                pubsub.subscribe(*self.channels)
            contact = sent  # the send time of the latest command Redis has answered
            waiting = set(self.channels)
            pending: OrderedDict[str, float] = OrderedDict()
            next_ping = sent + self.heartbeat_s
            while not self._stop.is_set():
                now = time.monotonic()
                if now - contact >= self.silence_s:
                    raise SubscriptionLost(f"no answer from Redis for {now - contact:.2f}s")
                if now >= next_ping:
                    self._pings += 1
                    token = str(self._pings)
                    pending[token] = now
                    pubsub.ping(token)
                    next_ping = now + self.heartbeat_s
                wait = max(0.0, min(next_ping, contact + self.silence_s) - now)
                message = pubsub.get_message(timeout=wait)
                if message is None:
                    continue
                kind = _text(message["type"])
                if kind in ("message", "smessage"):
                    self._on_message(_text(message["channel"]), message["data"])
                elif kind == "pong":
                    token = _text(message["data"])
                    if token in pending:
                        while pending:  # answers come in order: older PINGs are lost
                            seen, at = pending.popitem(last=False)
                            if seen == token:
                                break
                        contact = at
                        self.heartbeats += 1
                        if self._subscribed:
                            self._until = contact + self.silence_s
                elif kind in ("subscribe", "ssubscribe"):
                    waiting.discard(_text(message["channel"]))
                    if not waiting:
                        self._go_live(contact + self.silence_s)
                elif kind in ("unsubscribe", "sunsubscribe"):
                    raise SubscriptionLost("unsubscribed by the server")
        finally:
            try:
                pubsub.close()
            except (*CONNECTION_ERRORS, redis.exceptions.RedisError):
                log.debug("%s: closing a broken subscription", self.name, exc_info=True)
