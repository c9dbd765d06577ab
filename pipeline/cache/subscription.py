"""A Redis pub/sub subscription that knows, at every moment, whether it can be relied on.

Readers that skip a Redis round trip because "a message would have told us" (the
in-process tier, the version resolver) need more than redis-py's pub/sub gives.
:class:`Subscription` keeps one subscription in a thread of its own: a numbered PING
every ``heartbeat_s`` whose PONG confirms contact (:attr:`~Subscription.live` while the
last is under ``silence_s`` old), *dark* on any doubt (``on_dark``; each confirmed
resubscription a new :attr:`~Subscription.epoch` and ``on_live``), reconnecting with
backoff, and optionally Redis's key tracking (broadcast mode) on the same connection.

Why each rule, and what the login needs: docs/reading.md, "The subscription's rules".
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

from freshline.pipeline.core.cluster import is_cluster
from freshline.pipeline.core.errors import FreshlineError

log = logging.getLogger(__name__)

DEFAULT_SILENCE_S: Final = 1.0
BACKOFF_FIRST_S: Final = 0.05
BACKOFF_MAX_S: Final = 2.0
CONNECTION_ERRORS: Final = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
)

TRACKING_CHANNEL: Final = "__redis__:invalidate"
"""Redis's own channel for key-tracking messages (RESP2 redirect mode)."""
TRACKING_GRANTS: Final = "CLIENT TRACKING and the channel __redis__:invalidate"

MessageHandler = Callable[[str, bytes | str], None]
InvalidateHandler = Callable[[Sequence[bytes | str] | None], None]
"""Called with the keys Redis reports changed, or ``None`` for a whole-database flush."""


class SubscriptionLost(FreshlineError):
    """The subscription stopped answering, or the server ended it."""


def _nothing() -> None:
    return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Subscription:
    """One pub/sub subscription, heartbeated and reconnected (docs/reading.md).

    >>> sub = Subscription(client, ["freshline:invalidations"], on_message=handle).start()
    >>> sub.wait_live(5)

    ``on_message(channel, data)``, ``on_live()`` and ``on_dark()`` run in the
    subscription's thread. ``heartbeat_s`` defaults to a quarter of ``silence_s``.
    With ``tracking`` (key prefixes), ``on_invalidate(keys)`` runs there too, for
    every change Redis reports under them (docs/reading.md).
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
        tracking: Sequence[str] = (),
        on_invalidate: InvalidateHandler | None = None,
    ) -> None:
        if (on_invalidate is None) != (not tracking):
            raise ValueError("tracking needs both key prefixes and on_invalidate")
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
        self.tracking = tuple(tracking)
        self.silence_s = silence_s
        self.heartbeat_s = heartbeat_s
        self.name = name or f"freshline-sub-{uuid.uuid4().hex[:12]}"
        self.epoch = 0
        self.heartbeats = 0
        self.contact = 0.0
        """When (monotonic) the latest command Redis has answered on this subscription's
        connection was sent: every message Redis queued for it before that has arrived."""
        self._on_message = on_message
        self._on_live = on_live
        self._on_dark = on_dark
        self._on_invalidate = on_invalidate
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
            if self.tracking:
                raise ValueError("key tracking is not supported on Redis Cluster")
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
        if self.tracking:  # tracking messages as pub/sub messages (docs/reading.md)
            kwargs["protocol"] = 2
            kwargs.pop("maint_notifications_config", None)  # RESP3 only, in redis-py
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
            channels = self.channels
            if sharded:
                pubsub.ssubscribe(*channels)
            else:
                if self.tracking:
                    self._track(pubsub)
                    channels = (*channels, TRACKING_CHANNEL)
                pubsub.subscribe(*channels)
            contact = sent  # the send time of the latest command Redis has answered
            waiting = set(channels)
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
                    channel = _text(message["channel"])
                    if channel == TRACKING_CHANNEL and self._on_invalidate is not None:
                        self._on_invalidate(message["data"])
                    else:
                        self._on_message(channel, message["data"])
                elif kind == "pong":
                    token = _text(message["data"])
                    if token in pending:
                        while pending:  # answers come in order: older PINGs are lost
                            seen, at = pending.popitem(last=False)
                            if seen == token:
                                break
                        contact = self.contact = at
                        self.heartbeats += 1
                        if self._subscribed:
                            self._until = contact + self.silence_s
                elif kind in ("subscribe", "ssubscribe"):
                    waiting.discard(_text(message["channel"]))
                    if not waiting:
                        self.contact = contact
                        self._go_live(contact + self.silence_s)
                elif kind in ("unsubscribe", "sunsubscribe"):
                    raise SubscriptionLost("unsubscribed by the server")
        except redis.exceptions.ResponseError as exc:  # e.g. NOPERM for a channel
            hint = f"; the login needs {TRACKING_GRANTS}" if self.tracking else ""
            raise SubscriptionLost(f"Redis refused the subscription ({exc}){hint}") from exc
        finally:
            try:
                pubsub.close()
            except (*CONNECTION_ERRORS, redis.exceptions.RedisError):
                log.debug("%s: closing a broken subscription", self.name, exc_info=True)

    def _track(self, pubsub: redis.client.PubSub) -> None:
        """Turn on broadcast key tracking, redirected to this very connection.

        Sent before ``SUBSCRIBE`` (a RESP2 connection in pub/sub mode takes no other
        command). Changes reported before the subscription is confirmed are lost, as
        published messages are: the owner relies on nothing until it is live.
        """
        pubsub.execute_command("CLIENT", "ID")  # type: ignore[no-untyped-call]
        own_id = self._reply(pubsub, "CLIENT ID")
        prefixes = [arg for prefix in self.tracking for arg in ("PREFIX", prefix)]
        pubsub.execute_command(  # type: ignore[no-untyped-call]
            "CLIENT", "TRACKING", "ON", "REDIRECT", own_id, "BCAST", *prefixes
        )
        self._reply(pubsub, "CLIENT TRACKING")

    def _reply(self, pubsub: redis.client.PubSub, command: str) -> Any:
        """The reply to a command sent on the (not yet subscribed) pub/sub connection."""
        try:
            reply = pubsub.parse_response(  # type: ignore[no-untyped-call]
                block=False, timeout=self.silence_s
            )
        except redis.exceptions.ResponseError as exc:
            raise SubscriptionLost(
                f"Redis refused {command} ({exc}); the login needs {TRACKING_GRANTS}"
            ) from exc
        if reply is None:
            raise SubscriptionLost(f"no answer to {command} within {self.silence_s:g}s")
        return reply
