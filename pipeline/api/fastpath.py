"""The read API's fast path to Redis: the asyncio client its event loop reads with.

:func:`async_client` makes it from the settings, as the synchronous client is made
(:func:`freshline.pipeline.core.services.async_redis_client`: the same server, login, database
and TLS options), with three departures from redis-py. Each works around a gap in
redis-py and has a test in ``tests/pipeline/api/test_fastpath.py`` that fails once the
installed redis-py no longer has the gap; the workaround can go then.

* **No socket timeout.** redis-py's asyncio ``socket_timeout`` is an
  ``asyncio.timeout`` around every read (redis-py #3454; its open PR #4106 would time
  each chunk read instead): a timer pushed on the loop's heap and cancelled, per
  command. The reader bounds its calls instead, with one check per loop
  (:class:`freshline.pipeline.api.deadlines.Deadlines`,
  :class:`freshline.pipeline.api.reader.FeatureReader`).
* **Commands packed by hiredis** (:class:`HiredisPacking`), for redis-py #4176, "Async
  Redis cannot use hiredis pack_command". The packer PR #4191 gives asyncio
  connections, which the installed redis-py 8.2 has, encodes each argument in Python
  before hiredis packs them: no faster than packing in Python for an MGET of 101 keys.
* **MGETs on connections held between calls** (:class:`HeldConnections`), for redis-py
  #3692, "Async performance issue since version 5.3.0": the pool takes an
  ``asyncio.Lock`` on every acquire and release, and checks the socket's readiness on
  every acquire.

A cluster client keeps redis-py's packing and pool: its commands go through the
cluster's own routing (:func:`freshline.pipeline.core.cluster.amget`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import hiredis
import redis
import redis.asyncio

from freshline.pipeline.core.cluster import is_cluster
from freshline.pipeline.core.services import async_redis_client
from freshline.pipeline.core.settings import Settings


def async_client(settings: Settings) -> redis.asyncio.Redis:
    """The asyncio client to ``settings.redis_url``: no socket timeout, commands packed
    in C (none of its connections is open yet; it belongs to the loop that first uses
    it). A cluster client with ``settings.redis_cluster``."""
    client = async_redis_client(
        settings,
        socket_connect_timeout=settings.api_redis_connect_timeout_s,
        socket_timeout=None,  # bounded by the caller: redis-py's costs a timer per read
    )
    if not is_cluster(client):
        pool = client.connection_pool
        pool.connection_class = PACKED.get(pool.connection_class, pool.connection_class)
    return client


class HiredisPacking:
    """A mixin for redis.asyncio connections: commands packed by ``hiredis.pack_command``.

    hiredis takes ``str``, ``bytes`` and ``int`` arguments as they are, so the
    command's arguments reach C in one call; the bytes sent are redis-py's. Floats
    (which redis-py writes with ``repr``), and what hiredis refuses (``None``,
    ``bool``, ``bytearray``, ``memoryview``...), are left to redis-py to pack or
    refuse. Works around redis-py #4176 (see the module's docstring).
    """

    def pack_command(self, *args: Any) -> list[bytes]:
        head = args[0]
        if isinstance(head, str):
            command = (*head.encode().split(), *args[1:])
        elif isinstance(head, bytes) and b" " in head:
            command = (*head.split(), *args[1:])
        else:
            command = args
        if float not in set(map(type, command)):  # redis-py writes floats its own way
            try:
                return [hiredis.pack_command(command)]
            except TypeError:
                pass  # None, bool, bytearray...: redis-py's to take or refuse
        return super().pack_command(*args)  # type: ignore[misc, no-any-return]


class PackedConnection(HiredisPacking, redis.asyncio.Connection):
    """A TCP connection packing with hiredis."""


class PackedSSLConnection(HiredisPacking, redis.asyncio.SSLConnection):
    """A TLS connection packing with hiredis."""


class PackedUnixConnection(HiredisPacking, redis.asyncio.UnixDomainSocketConnection):
    """A Unix socket connection packing with hiredis."""


PACKED: dict[type, type] = {
    redis.asyncio.Connection: PackedConnection,
    redis.asyncio.SSLConnection: PackedSSLConnection,
    redis.asyncio.UnixDomainSocketConnection: PackedUnixConnection,
}
"""redis-py's connection class for a URL's scheme, and the one :func:`async_client` uses."""


class HeldConnections:
    """``await held.mget(keys)``: the MGET's replies, on a connection held between calls.

    redis-py runs every command through its pool (an ``asyncio.Lock`` and a socket
    readiness check on each acquire, the lock again on each release: redis-py #3692),
    a retry wrapper and observability hooks, about 25 µs of CPU per MGET of a GET's two
    keys, more than sending it and reading the reply. Connections taken from the
    client's pool once and kept here skip all of it: each MGET is a send and a read.

    Failures are redis-py's own: its connection drops itself on any error or
    interruption (a deadline cancelling the read) and is handed back to the pool, which
    reconnects it when it is next taken. A connection found closed after it sat idle
    here (a server restart, its idle timeout) is no outage: the MGET, safe to repeat, is
    sent once more on a connection fresh from the pool.

    One instance serves one client, on the client's event loop. Held connections stay
    checked out of the client's pool, so closing the client (``aclose()``, which closes
    the connections in use too) closes them.
    """

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self._pool: Any = client.connection_pool  # get_connection is untyped
        self._idle: list[Any] = []  # redis.asyncio connections, connected or not

    async def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        if self._idle:
            try:
                return await self._call(self._idle.pop(), keys)
            except redis.exceptions.ConnectionError:
                pass  # closed while idle, most likely: once more, on a fresh connection
        return await self._call(await self._pool.get_connection(), keys)

    async def _call(self, conn: Any, keys: Sequence[str]) -> list[bytes | None]:
        try:
            await conn.send_packed_command(conn.pack_command("MGET", *keys), check_health=False)
            reply: list[bytes | None] = await conn.read_response()
        except BaseException:
            # Disconnected by redis-py unless the reply was an error (read in full):
            # the pool reconnects it, or reuses it, the next time it is taken.
            await self._pool.release(conn)
            raise
        self._idle.append(conn)
        return reply

    @property
    def held(self) -> int:
        """Connections held idle right now."""
        return len(self._idle)
