"""The API's MGETs on held connections (:mod:`pipeline.api.connections`): redis-py's
answers, connections reused, replaced when found closed, closed with the client."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from pipeline.api.app import async_twin
from pipeline.api.connections import HeldConnections


@pytest.fixture
def keys(redis_client: redis.Redis) -> Iterator[list[str]]:
    prefix = f"test:held:{uuid.uuid4().hex}"
    names = [f"{prefix}:{i}" for i in range(4)]
    for i, name in enumerate(names[:3]):
        redis_client.set(name, f"v{i}".encode() * (i * 1000 + 1), ex=60)
    yield names  # the last one is never set
    redis_client.delete(*names)


def test_held_mgets_answer_as_redis_py_does_on_one_connection(
    redis_client: redis.Redis, keys: list[str]
) -> None:
    async def go() -> int:
        twin = async_twin(redis_client)
        held = HeldConnections(twin)
        try:
            assert await held.mget(keys) == [b"v0", b"v1" * 1001, b"v2" * 2001, None]
            for ks in (keys[:1], keys[-1:], keys[::-1] * 50):
                assert await held.mget(ks) == await twin.mget(ks)
            return held.held
        finally:
            await twin.aclose()

    assert asyncio.run(go()) == 1  # one connection, taken once and reused


def test_concurrent_mgets_each_take_a_connection_and_keep_it(
    redis_client: redis.Redis, keys: list[str]
) -> None:
    async def go() -> tuple[list[list[bytes | None]], int, int]:
        twin = async_twin(redis_client)
        held = HeldConnections(twin)
        try:
            answers = await asyncio.gather(*(held.mget(keys) for _ in range(5)))
            after_burst = held.held
            await held.mget(keys)
            return answers, after_burst, held.held
        finally:
            await twin.aclose()

    answers, after_burst, after_one = asyncio.run(go())
    expected = redis_client.mget(keys)
    assert answers == [expected] * 5
    assert after_burst == after_one == 5


def test_closing_the_client_closes_the_held_connections(
    redis_client: redis.Redis, keys: list[str]
) -> None:
    async def go() -> tuple[bool, bool]:
        twin = async_twin(redis_client)
        held = HeldConnections(twin)
        await held.mget(keys)
        [conn] = held._idle
        before = conn.is_connected
        await twin.aclose()
        return before, conn.is_connected

    assert asyncio.run(go()) == (True, False)


def test_an_error_reply_is_raised_and_the_next_mget_answers(
    redis_client: redis.Redis, keys: list[str]
) -> None:
    async def go() -> tuple[list[bytes | None], bool]:
        twin = async_twin(redis_client)
        held = HeldConnections(twin)
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
            await twin.aclose()

    assert asyncio.run(go()) == (redis_client.mget(keys), True)


def test_a_connection_closed_while_held_is_replaced_and_the_mget_answers(
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
) -> None:
    url, stop, start = private_redis
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)

    async def go() -> tuple[list[bytes | None], list[bytes | None]]:
        twin = async_twin(client)
        held = HeldConnections(twin)
        try:
            client.set("k", b"before")
            first = await held.mget(["k"])
            # A real restart: the held connection's server end is gone.
            stop()
            start()
            client.set("k", b"after")
            return first, await held.mget(["k"])
        finally:
            await twin.aclose()

    try:
        assert asyncio.run(go()) == ([b"before"], [b"after"])
    finally:
        client.close()


def test_an_outage_is_a_connection_error_and_the_connections_recover(
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
) -> None:
    url, stop, start = private_redis
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)

    async def go() -> list[bytes | None]:
        twin = async_twin(client)
        held = HeldConnections(twin)
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
            await twin.aclose()

    try:
        assert asyncio.run(go()) == [b"w"]
    finally:
        client.close()
