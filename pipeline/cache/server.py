"""The Redis server readers read from, and whether the consumers vouch for what it holds.

A Redis server can come back holding less than it acknowledged: restarted from an
older snapshot (RDB persistence), or a replica promoted before it had every write. It
then holds entries since overwritten or voided, and older floors. The consumers find
out (:mod:`freshline.consumers.processor`): the server's identity (:data:`RedisIdentity`) is not
the one they recorded in :data:`~freshline.pipeline.core.keys.SERVER_KEY`, so they raise every
feature set's floor, then record the new identity. Until then the server is
*unvouched*, and readers treat every entry on it as absent
(:class:`freshline.pipeline.cache.store.EntryStore`'s reads, the API's fast path in
:class:`freshline.pipeline.api.reader.FeatureReader`): a miss, read through or answered as one.

:class:`ServerGate` tells them, for an attribute read per read. There is one per
connection pool, and each new connection of the pool reads the server's identity and
the record in its handshake (redis-py's ``redis_connect_func``: ``INFO server
replication`` and ``GET floor:server``, pipelined: one round trip per connection, none
per read). A restarted server drops every connection, so the first read after it
reconnects, and that connection finds the server unvouched before the read's command
is sent; the read asks the gate once its reply is in. While unvouched, a read asks the
server again at most every :data:`RECHECK_S`. No record (none written yet, or expired)
vouches for any server: there is nothing to compare. A login that may not run ``INFO``
cannot tell, and is trusted (one warning).

Not on Redis Cluster, whose servers the consumers do not watch either.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
import redis.asyncio

from freshline.pipeline.core.cluster import is_cluster
from freshline.pipeline.core.keys import SERVER_KEY

log = logging.getLogger(__name__)

RedisIdentity = tuple[str, str]
"""A Redis server's run id and replication id: a change means writes may be lost."""

RECHECK_S = 0.2
"""While a server is unvouched, reads ask it again at most this often."""

HANDSHAKE = (("INFO", "server", "replication"), ("GET", SERVER_KEY))
"""What a new connection asks before its first command: the identity and the record."""

_installing = threading.Lock()


def redis_identity(info: Mapping[str, Any]) -> RedisIdentity:
    """The :data:`RedisIdentity` in an ``INFO server replication`` reply, parsed."""
    return str(info.get("run_id", "")), str(info.get("master_replid", ""))


def recorded_identity(raw: bytes | str | None) -> RedisIdentity | None:
    """The identity :data:`~freshline.pipeline.core.keys.SERVER_KEY` holds (``<run_id>:<replid>``),
    or ``None`` if it holds none."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    run_id, sep, replid = (text or "").partition(":")
    return (run_id, replid) if sep else None


def _info_fields(raw: bytes | str) -> dict[str, str]:
    """The ``name:value`` lines of an ``INFO`` reply as read off a connection."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return dict(line.partition(":")[::2] for line in text.splitlines() if ":" in line)


class ServerGate:
    """Whether the entries of the server a connection pool reaches may be served.

    Get it with :func:`server_gate` (or :func:`async_server_gate`); a read asks
    ``gate.vouched or gate.admits(client)`` once its reply is in.
    """

    def __init__(self, chained: Callable[..., Any] | None = None, *, vouched: bool = False) -> None:
        self.vouched = vouched
        """True while the server is the one the consumers recorded (or none is)."""
        self.identity: RedisIdentity | None = None
        self._chained = chained  # a redis_connect_func the pool had before
        self._looked = -RECHECK_S  # monotonic; unknown until first asked
        self._blind = False

    def due(self) -> bool:
        """Whether an unvouched server should be asked again now (and note that it is)."""
        now = time.monotonic()
        if self.vouched or now - self._looked < RECHECK_S:
            return False
        self._looked = now
        return True

    def observe(self, info: Mapping[str, Any] | Exception, recorded: object) -> None:
        """Take the replies of :data:`HANDSHAKE`: the server's identity and the record."""
        refused = next((r for r in (info, recorded) if isinstance(r, redis.ResponseError)), None)
        if refused is not None:
            if not self._blind:
                log.warning(
                    "this Redis login may not read the server's identity (%s): readers "
                    "cannot tell a restarted server from the one the consumers wrote to "
                    "(grant it +info and ~floor:*)",
                    refused,
                )
            self._blind = self.vouched = True
            return
        if isinstance(info, Exception):
            raise info
        identity = redis_identity(info)
        noted = recorded_identity(recorded if isinstance(recorded, bytes | str) else None)
        if noted is not None and noted != identity:
            if self.vouched or identity != self.identity:
                log.warning(
                    "the Redis server (run id %s, replication id %s) is not the one the "
                    "consumers last wrote to (%s, %s): its entries read as absent until a "
                    "consumer has raised the floors",
                    *identity,
                    *noted,
                )
            self.identity, self.vouched = identity, False
            return
        if not self.vouched and self.identity is not None:
            log.info("the Redis server (run id %s) is vouched for again", identity[0])
        self.identity, self.vouched = identity, True

    def admits(self, client: redis.Redis) -> bool:
        """For an unvouched server: ask it again, if due; True once it is vouched."""
        if self.due():
            try:
                replies = _asked(client).execute(raise_on_error=False)
            except redis.RedisError as exc:  # the read was answered; a later one asks again
                log.debug("asking Redis for its identity: %s", exc)
            else:
                self.observe(*replies)
        return self.vouched

    async def aadmits(self, client: redis.asyncio.Redis) -> bool:
        """:meth:`admits` for an asyncio client."""
        if self.due():
            try:
                replies = await _asked(client).execute(raise_on_error=False)
            except redis.RedisError as exc:
                log.debug("asking Redis for its identity: %s", exc)
            else:
                self.observe(*replies)
        return self.vouched

    def connect(self, conn: Any) -> None:
        """The pool's ``redis_connect_func``: the handshake, then :data:`HANDSHAKE`."""
        if self._chained is None:
            conn.on_connect()
        else:
            self._chained(conn)
        conn.send_packed_command(conn.pack_commands(HANDSHAKE), check_health=False)
        replies: list[Any] = []
        for _ in HANDSHAKE:
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as exc:  # read whole: the next reply follows
                replies.append(exc)
        self._handshake(*replies)

    async def aconnect(self, conn: Any) -> None:
        """:meth:`connect` for an asyncio connection."""
        done = conn.on_connect() if self._chained is None else self._chained(conn)
        if inspect.isawaitable(done):  # redis-py takes either kind of redis_connect_func
            await done
        await conn.send_packed_command(conn.pack_commands(HANDSHAKE), check_health=False)
        replies: list[Any] = []
        for _ in HANDSHAKE:
            try:
                replies.append(await conn.read_response())
            except redis.ResponseError as exc:
                replies.append(exc)
        self._handshake(*replies)

    def _handshake(self, info: bytes | str | Exception, recorded: object) -> None:
        self.observe(info if isinstance(info, Exception) else _info_fields(info), recorded)


def _asked(client: Any) -> Any:
    """A pipeline of :data:`HANDSHAKE` on ``client`` (sync or asyncio)."""
    pipe = client.pipeline(transaction=False)
    for command in HANDSHAKE:
        pipe.execute_command(*command)
    return pipe


def server_gate(client: redis.Redis) -> ServerGate:
    """The gate of ``client``'s connection pool, installed on the first call (its
    connections made from then on, and those it holds, run :meth:`ServerGate.connect`).
    Always vouched on a cluster."""
    if is_cluster(client):
        return ServerGate(vouched=True)
    return _installed(client.connection_pool, "connect")


def async_server_gate(client: redis.asyncio.Redis) -> ServerGate:
    """:func:`server_gate` for an asyncio client."""
    if is_cluster(client):
        return ServerGate(vouched=True)
    return _installed(client.connection_pool, "aconnect")


def _installed(pool: Any, method: str) -> ServerGate:
    with _installing:
        kwargs = pool.connection_kwargs
        before = kwargs.get("redis_connect_func")
        gate = getattr(before, "__self__", None)
        if isinstance(gate, ServerGate):
            return gate
        gate = ServerGate(before)
        hook = getattr(gate, method)
        kwargs["redis_connect_func"] = hook
        # Connections the pool made already reconnect with the hook too; whether their
        # server is vouched for is asked by the first read (the gate starts unvouched).
        idle = getattr(pool, "_available_connections", ())
        for conn in [*idle, *getattr(pool, "_in_use_connections", ())]:
            conn.redis_connect_func = hook
        return gate
