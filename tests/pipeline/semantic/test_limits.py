"""The semantic cache's bounds: entries per namespace, namespaces per tenant, TTLs;
on the real Redis, with synthetic vectors (see tests/pipeline/semantic/test_index.py)."""

from __future__ import annotations

import time
import uuid
from typing import cast

import numpy as np
import pytest
import redis

from freshline.pipeline.core.keys import (
    semantic_entry_key,
    semantic_ids_key,
    semantic_log_key,
    semantic_pattern,
    semantic_registry_key,
)
from freshline.pipeline.semantic.cache import Limits, Scope, SemanticCache
from freshline.pipeline.semantic.embed import normalise
from freshline.pipeline.semantic.entry import entry_id
from freshline.pipeline.semantic.namespaces import stats
from tests.helpers import wait_until
from tests.pipeline.semantic.test_index import DIM, ZERO, Vectors, answer


@pytest.fixture
def tenant() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def cache(redis_client: redis.Redis, made: list[SemanticCache], limits: Limits) -> SemanticCache:
    c = SemanticCache(redis_client, Vectors(), ttl_s=600, limits=limits)
    made.append(c)
    return c


def store(c: SemanticCache, scope: Scope, prompts: list[str]) -> np.ndarray:
    rng = np.random.default_rng(entry_id(prompts[0]))
    vectors = normalise(rng.normal(size=(len(prompts), DIM)))
    c.store_many(scope, [(p, f"answer to {p}") for p in prompts], ZERO, vectors)
    return vectors


def members(client: redis.Redis, key: str) -> set[str]:
    """The sorted set's members, decoded (the client returns them as bytes)."""
    return {m.decode() for m in cast(list[bytes], client.zrange(key, 0, -1))}


def later() -> None:
    """Let the clock move past the last store's millisecond, so the next scores higher."""
    now = int(time.time() * 1000)
    assert wait_until(lambda: int(time.time() * 1000) > now + 1)


def test_a_namespace_keeps_its_newest_entries_up_to_the_limit(
    redis_client: redis.Redis, made: list[SemanticCache], tenant: str
) -> None:
    c = cache(redis_client, made, Limits(max_entries=5))
    reader = cache(redis_client, made, Limits())
    s = Scope(tenant, "bot", "v1", "t1")
    old = [f"old question {i}" for i in range(3)]
    old_vectors = store(c, s, old)
    assert answer(reader, s, old[0], old_vectors[0]) == f"answer to {old[0]}"  # indexed
    later()
    new = [f"new question {i}" for i in range(5)]
    new_vectors = store(c, s, new)

    assert redis_client.zcard(semantic_ids_key(s.namespace)) == 5
    for p in old:
        assert not redis_client.exists(semantic_entry_key(s.namespace, entry_id(p)))
    for p, v in zip(new, new_vectors, strict=True):
        assert answer(reader, s, p, v) == f"answer to {p}"
    assert answer(reader, s, old[0], old_vectors[0]) is None
    # The other worker's index dropped them through the stream, not by chance.
    idx = reader.pool.peek(s.namespace)
    assert idx is not None and idx.live == {entry_id(p) for p in new}
    c.close()
    [row] = stats(redis_client, tenant)
    assert row.entries == 5 and row.counts["evicted"] == 3 and row.counts["stored"] == 8


def test_storing_a_prompt_again_makes_it_young(
    redis_client: redis.Redis, made: list[SemanticCache], tenant: str
) -> None:
    c = cache(redis_client, made, Limits(max_entries=2))
    s = Scope(tenant, "bot", "v1", "t1")
    store(c, s, ["first", "second"])
    later()
    store(c, s, ["first"])  # again: now the youngest
    later()
    store(c, s, ["third"])
    kept = members(redis_client, semantic_ids_key(s.namespace))
    assert kept == {f"{entry_id('first'):016x}", f"{entry_id('third'):016x}"}


def test_a_model_can_have_its_own_limit(
    redis_client: redis.Redis, made: list[SemanticCache], tenant: str
) -> None:
    c = cache(redis_client, made, Limits(max_entries=100, max_entries_per_model={"tiny": 2}))
    tiny, big = Scope(tenant, "tiny", "v1", "t1"), Scope(tenant, "big", "v1", "t1")
    prompts = [f"question {i}" for i in range(6)]
    store(c, tiny, prompts)
    store(c, big, prompts)
    assert redis_client.zcard(semantic_ids_key(tiny.namespace)) == 2
    assert redis_client.zcard(semantic_ids_key(big.namespace)) == 6


def test_a_tenant_keeps_its_most_recently_stored_namespaces(
    redis_client: redis.Redis, made: list[SemanticCache], tenant: str
) -> None:
    c = cache(redis_client, made, Limits(max_namespaces=2))
    reader = cache(redis_client, made, Limits())
    other = f"{tenant}x"
    versions = [Scope(tenant, "bot", f"v{i}", "t1") for i in range(1, 4)]
    mine = store(c, Scope(other, "bot", "v1", "t1"), ["theirs"])
    vectors = []
    for s in versions[:2]:
        vectors.append(store(c, s, ["where is my order", "reset my password"]))
        later()
    assert answer(reader, versions[0], "where is my order", vectors[0][0]) is not None
    vectors.append(store(c, versions[2], ["where is my order", "reset my password"]))

    # v1 was stored into least recently: purged in the background, every key of it.
    assert wait_until(
        lambda: (
            not list(
                redis_client.scan_iter(match=semantic_pattern(tenant, model_version="v1", kind="e"))
            )
        ),
        timeout=10,
    )
    assert not redis_client.exists(semantic_ids_key(versions[0].namespace))
    assert semantic_registry_key(tenant) == f"sem:ns:{tenant}"  # the README's key table
    registry = members(redis_client, semantic_registry_key(tenant))
    assert registry == {versions[1].namespace, versions[2].namespace}
    # The reader's index of v1 is emptied by the purge on its stream.
    assert answer(reader, versions[0], "where is my order", vectors[0][0]) is None
    idx = reader.pool.peek(versions[0].namespace)
    assert idx is not None and len(idx) == 0
    assert redis_client.xlen(semantic_log_key(versions[0].namespace)) >= 1
    for s, v in zip(versions[1:], vectors[1:], strict=True):
        assert answer(reader, s, "where is my order", v[0]) == "answer to where is my order"
    # Another tenant's namespaces are not counted against this one.
    assert answer(reader, Scope(other, "bot", "v1", "t1"), "theirs", mine[0]) == "answer to theirs"
