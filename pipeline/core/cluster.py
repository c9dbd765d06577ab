"""What differs on Redis Cluster, in one place: asking, batched reads, scans.

A client from :func:`freshline.pipeline.core.services.redis_client` is redis-py's ``RedisCluster``
when ``FRESHLINE_REDIS_CLUSTER`` is set. It answers single-slot commands as a plain
client does; these helpers cover the multi-key ones that would fail with CROSSSLOT or
return another shape:

* :func:`mget`: one ``MGET`` per slot, pipelined, so one round trip per node that
  holds keys (never one per key);
* :func:`scan_chunks`: ``SCAN`` on every master (redis-py walks each one's cursor);
* :func:`publish`: sharded pub/sub (``SPUBLISH``) on a cluster. A classic ``PUBLISH``
  reaches other nodes over the cluster bus, after the publishing node answered, so a
  subscriber's PING to its own node would no longer prove that earlier messages have
  arrived (:mod:`freshline.pipeline.cache.subscription` relies on that). A sharded channel lives
  on the master of its slot: publisher and subscriber talk to the same node, and its
  answers stay in order. Each subscription's channels must share one slot;
* :func:`rerouted_on_failure`: a connection failure refreshes the slot table before it
  reaches the caller, so a retry goes to the master that replaced a dead one. redis-py's
  cluster pipeline did not always do so: after a master was killed, a writer kept
  sending to the dead node for over two minutes after its replica was promoted, in
  about one failover in five (``tests/cluster/test_redis_cluster.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

_CLUSTER_TYPES: dict[type, bool] = {}


def is_cluster(client: object) -> bool:
    """True for a Redis Cluster client (sync or asyncio).

    Answered once per client class: redis-py's client classes are typing Protocols'
    subclasses, whose ``isinstance`` walks the protocol machinery (microseconds on
    every read that asks).
    """
    kind = type(client)
    known = _CLUSTER_TYPES.get(kind)
    if known is None:
        known = _CLUSTER_TYPES[kind] = isinstance(client, RedisCluster | AsyncRedisCluster)
    return known


@contextlib.contextmanager
def rerouted_on_failure(client: Any) -> Iterator[None]:
    """On a sync cluster client, refresh the slot table when the block fails to reach a
    node, then let the failure go on: the caller's retry goes to whichever master owns
    the slot now. When no node answers the refresh, the next failure tries again."""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        if isinstance(client, RedisCluster):
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                client.nodes_manager.initialize()
        raise


def mget(client: Any, keys: Sequence[str]) -> list[Any]:
    """``MGET`` of ``keys`` in order; on a cluster grouped by slot and pipelined."""
    if is_cluster(client):
        with rerouted_on_failure(client):
            return list(client.mget_nonatomic(keys))
    return list(client.mget(keys))


async def amget(client: Any, keys: Sequence[str]) -> list[Any]:
    """:func:`mget` for an asyncio client."""
    if is_cluster(client):
        return list(await client.mget_nonatomic(keys))
    return list(await client.mget(keys))


def publish(client: Any, channel: str, message: bytes | str, *, cluster: bool) -> None:
    """``PUBLISH``, or ``SPUBLISH`` on a cluster; ``client`` may be a pipeline."""
    if cluster:
        client.execute_command("SPUBLISH", channel, message)
    else:
        client.publish(channel, message)


def scan_chunks(client: Any, pattern: str, count: int) -> Iterator[list[Any]]:
    """Lists of at most ``count`` keys matching ``pattern``, from every master."""
    chunk: list[Any] = []
    for key in client.scan_iter(match=pattern, count=count):
        chunk.append(key)
        if len(chunk) >= count:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
