"""The API's MGETs on connections it holds, without redis-py's per-command machinery.

redis.asyncio runs every command through its pool (an asyncio lock, and a readiness
check that polls the socket, on each acquire and release), a retry wrapper and
observability hooks: about 25 µs of CPU per MGET of a GET's two keys, more than
sending the command and reading its reply (about 23 µs, mostly the system calls).
:class:`HeldConnections` takes connections from the client's pool once (same address,
credentials, database, TLS and packing), keeps them between calls, and runs each MGET
as a send and a read on one of them.

Failures are redis-py's own: its connection drops itself on any error or interruption
(a timeout cancelling the read), and is handed back to the pool, which reconnects it
when it is next taken. A connection that was idle here and is found closed (a server
restart, its idle timeout) is not an outage: the MGET, safe to repeat, is sent again
once on a connection fresh from the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis

if TYPE_CHECKING:
    import redis.asyncio


class HeldConnections:
    """``await held.mget(keys)``: the MGET's replies, on a connection held between calls.

    One instance serves one client, on the client's event loop. Connections stay
    checked out of the client's pool while held, so closing the client
    (``aclose()``, which closes the connections in use too) closes them.
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
