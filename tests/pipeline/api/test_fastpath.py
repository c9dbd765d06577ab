"""The read API's fast path to Redis (:mod:`freshline.pipeline.api.fastpath`): its client, made
from the settings; commands packed by hiredis as redis-py would pack them; MGETs on
held connections, reused, replaced when found closed, closed with the client.

The ``test_redis_py_still_...`` tests check the gaps in redis-py that each workaround
answers. One that fails means the installed redis-py has closed that gap: drop the
workaround it names (and the test) rather than the assertion.
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVarTuple

import pytest
import redis
import redis.asyncio

from freshline.pipeline.api.fastpath import (
    HeldConnections,
    PackedConnection,
    PackedSSLConnection,
    PackedUnixConnection,
    async_client,
)
from freshline.pipeline.core.services import async_redis_client
from freshline.pipeline.core.settings import Settings


@pytest.fixture
def keys(redis_client: redis.Redis) -> Iterator[list[str]]:
    prefix = f"test:held:{uuid.uuid4().hex}"
    names = [f"{prefix}:{i}" for i in range(4)]
    for i, name in enumerate(names[:3]):
        redis_client.set(name, f"v{i}".encode() * (i * 1000 + 1), ex=60)
    yield names  # the last one is never set
    redis_client.delete(*names)


# -- the client ----------------------------------------------------------------------


def test_the_client_reaches_the_settings_server_with_no_socket_timeout(
    settings: Settings, redis_client: redis.Redis, keys: list[str]
) -> None:
    async def go() -> tuple[list[Any], Any]:
        client = async_client(settings)
        try:
            return await client.mget(keys), client.connection_pool.connection_kwargs
        finally:
            await client.aclose()

    replies, kwargs = asyncio.run(go())
    assert replies == redis_client.mget(keys)  # same server, login and database
    assert kwargs["socket_timeout"] is None  # the reader bounds its calls instead
    assert kwargs["socket_connect_timeout"] == settings.api_redis_connect_timeout_s


@pytest.mark.parametrize(
    ("url", "packed"),
    [
        ("redis://127.0.0.1:6379/0", PackedConnection),
        ("rediss://127.0.0.1:6379/0", PackedSSLConnection),
        ("unix:///run/redis.sock?db=0", PackedUnixConnection),
    ],
)
def test_each_kind_of_connection_packs_in_c(url: str, packed: type) -> None:
    client = async_client(Settings(redis_url=url))  # no connection is made
    assert client.connection_pool.connection_class is packed


# -- packing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("MGET", "feat:1:txn_90d:{t:1}", "feat:1:txn_90d:{t:2}", "floor:1:txn_90d"),
        ("MGET", *[f"feat:7:geo:{{tenant-a:{i}}}" for i in range(300)]),
        ("CONFIG GET", "maxmemory"),
        (b"CLIENT SETNAME", "x"),
        ("SET", "k", 7),
        ("SET", "k", 0.1 + 0.2),
        ("SET", "k", b"\xff\x00"),
        ("SET", "k", "\u00e9"),
        ("SET", "k", memoryview(b"v")),
        ("SET", "k", bytearray(b"v")),
        ("SET", "k", "v" * 10000),
    ],
)
def test_the_client_packs_commands_in_c_as_redis_py_would(
    settings: Settings, args: tuple[Any, ...]
) -> None:
    assert async_client(settings).connection_pool.connection_class is PackedConnection
    packing = PackedConnection()
    plain = redis.asyncio.Connection()
    assert b"".join(packing.pack_command(*args)) == b"".join(plain.pack_command(*args))


def test_the_client_refuses_what_redis_py_refuses() -> None:
    packing = PackedConnection()
    for bad in (None, True):
        with pytest.raises(redis.exceptions.DataError):
            packing.pack_command("SET", "k", bad)


class Key(str):
    """A key that counts the times it is encoded in Python."""

    encoded = 0

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        Key.encoded += 1
        return super().encode(encoding, errors)


def test_redis_py_still_encodes_each_argument_in_python_before_hiredis() -> None:
    """redis-py #4176: the asyncio connection's packer (PR #4191's, in redis-py 8.2)
    runs each argument through its encoder in Python, then hands the bytes to hiredis;
    :class:`HiredisPacking` hands the arguments to hiredis as they are."""
    keys = [Key(f"feat:7:geo:{{t:{i}}}") for i in range(100)]
    Key.encoded = 0
    redis.asyncio.Connection().pack_command("MGET", *keys)
    assert Key.encoded >= len(keys)
    Key.encoded = 0
    PackedConnection().pack_command("MGET", *keys)
    assert Key.encoded == 0


# -- held connections ----------------------------------------------------------------


class CountingLock(asyncio.Lock):
    acquired = 0

    async def acquire(self) -> Literal[True]:
        self.acquired += 1
        return await super().acquire()


def test_redis_py_still_locks_its_pool_on_every_acquire_and_release(
    settings: Settings, keys: list[str]
) -> None:
    """redis-py #3692: each command takes the pool's ``asyncio.Lock`` to get a
    connection and again to release it; :class:`HeldConnections` takes it once."""

    async def go() -> tuple[int, int]:
        client = async_client(settings)
        lock = client.connection_pool._lock = CountingLock()
        try:
            for _ in range(3):
                await client.mget(keys)
            by_redis_py = lock.acquired
            lock.acquired = 0
            held = HeldConnections(client)
            for _ in range(3):
                await held.mget(keys)
            return by_redis_py, lock.acquired
        finally:
            await client.aclose()

    by_redis_py, held = asyncio.run(go())
    assert by_redis_py >= 2 * 3
    assert held == 1


def test_held_mgets_answer_as_redis_py_does_on_one_connection(
    settings: Settings, keys: list[str]
) -> None:
    async def go() -> int:
        client = async_client(settings)
        held = HeldConnections(client)
        try:
            assert await held.mget(keys) == [b"v0", b"v1" * 1001, b"v2" * 2001, None]
            for ks in (keys[:1], keys[-1:], keys[::-1] * 50):
                assert await held.mget(ks) == await client.mget(ks)
            return held.held
        finally:
            await client.aclose()

    assert asyncio.run(go()) == 1  # one connection, taken once and reused


def test_concurrent_mgets_each_take_a_connection_and_keep_it(
    settings: Settings, redis_client: redis.Redis, keys: list[str]
) -> None:
    async def go() -> tuple[list[list[bytes | None]], int, int]:
        client = async_client(settings)
        held = HeldConnections(client)
        try:
            answers = await asyncio.gather(*(held.mget(keys) for _ in range(5)))
            after_burst = held.held
            await held.mget(keys)
            return answers, after_burst, held.held
        finally:
            await client.aclose()

    answers, after_burst, after_one = asyncio.run(go())
    expected = redis_client.mget(keys)
    assert answers == [expected] * 5
    assert after_burst == after_one == 5


def test_closing_the_client_closes_the_held_connections(
    settings: Settings, keys: list[str]
) -> None:
    async def go() -> tuple[bool, bool]:
        client = async_client(settings)
        held = HeldConnections(client)
        await held.mget(keys)
        [conn] = held._idle
        before = conn.is_connected
        await client.aclose()
        return before, conn.is_connected

    assert asyncio.run(go()) == (True, False)


def test_an_error_reply_is_raised_and_the_next_mget_answers(
    settings: Settings, redis_client: redis.Redis, keys: list[str]
) -> None:
    async def go() -> tuple[list[bytes | None], bool]:
        client = async_client(settings)
        held = HeldConnections(client)
        try:
            await held.mget(keys)
            [conn] = held._idle
            with pytest.raises(redis.exceptions.ResponseError, match="wrong number"):
                await held.mget([])  # MGET without a key: Redis answers an error
            answer = await held.mget(keys)
            # The connection went back to the pool (the reply was read in full), and
            # the pool gave the same one again: none was leaked or made anew.
            return answer, held._idle == [conn]
        finally:
            await client.aclose()

    assert asyncio.run(go()) == (redis_client.mget(keys), True)


def test_a_connection_closed_while_held_is_replaced_and_the_mget_answers(
    private_redis: tuple[str, Callable[[], None], Callable[[], None]], settings: Settings
) -> None:
    url, stop, start = private_redis
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)

    async def go() -> tuple[list[bytes | None], list[bytes | None]]:
        fast = async_client(settings.model_copy(update={"redis_url": url}))
        held = HeldConnections(fast)
        try:
            client.set("k", b"before")
            first = await held.mget(["k"])
            # A real restart: the held connection's server end is gone.
            stop()
            start()
            client.set("k", b"after")
            return first, await held.mget(["k"])
        finally:
            await fast.aclose()

    try:
        assert asyncio.run(go()) == ([b"before"], [b"after"])
    finally:
        client.close()


def test_an_outage_is_a_connection_error_and_the_connections_recover(
    private_redis: tuple[str, Callable[[], None], Callable[[], None]], settings: Settings
) -> None:
    url, stop, start = private_redis
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)

    async def go() -> list[bytes | None]:
        fast = async_client(settings.model_copy(update={"redis_url": url}))
        held = HeldConnections(fast)
        try:
            client.set("k", b"v")
            await held.mget(["k"])
            stop()
            with pytest.raises(redis.exceptions.ConnectionError):
                await held.mget(["k"])
            start()
            client.set("k", b"w")
            return await held.mget(["k"])
        finally:
            await fast.aclose()

    try:
        assert asyncio.run(go()) == [b"w"]
    finally:
        client.close()


# -- no socket timeout ---------------------------------------------------------------


Ts = TypeVarTuple("Ts")


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts the timers scheduled on it."""

    timers = 0

    def call_at(
        self,
        when: float,
        callback: Callable[[*Ts], object],
        *args: *Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        self.timers += 1
        return super().call_at(when, callback, *args, context=context)


def test_redis_py_still_times_each_read_with_a_timer_of_its_own(
    settings: Settings, keys: list[str]
) -> None:
    """redis-py's asyncio ``socket_timeout`` is an ``asyncio.timeout`` around each read
    (redis-py #3454; its PR #4106 would time each chunk read instead): a timer pushed
    on the loop's heap and cancelled, per command. :func:`async_client` has none; the
    reader bounds its calls with :class:`freshline.pipeline.api.deadlines.Deadlines`."""

    async def timers(client: redis.asyncio.Redis) -> int:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, CountingLoop)
        try:
            await client.mget(keys)  # connected, outside the count
            before = loop.timers
            for _ in range(10):
                await client.mget(keys)
            return loop.timers - before
        finally:
            await client.aclose()

    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        assert runner.run(timers(async_redis_client(settings, socket_timeout=5.0))) >= 10
        assert runner.run(timers(async_client(settings))) == 0
