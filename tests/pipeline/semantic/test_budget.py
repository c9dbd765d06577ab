"""Per-tenant budgets of the semantic cache (issue 30, item 1), on the real Redis.

Nothing a caller sends for a namespace never stored into makes a key; a tenant's
entries are counted in keys and bytes, and past its budget its own oldest go, never
another tenant's; every key the cache makes, the budget's included, has a TTL.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis
from sqlalchemy.engine import Engine

from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key, create_tenant
from freshline.pipeline.core.budget import TenantBudget, usage
from freshline.pipeline.core.keys import (
    semantic_budget_keys,
    semantic_entry_key,
    semantic_ids_key,
    semantic_log_key,
)
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.semantic import prior, state
from freshline.pipeline.semantic.cache import EntryOverBudget, Scope, SemanticCache
from freshline.pipeline.semantic.decision import Learned
from freshline.pipeline.semantic.embed import Embedder, normalise
from freshline.pipeline.semantic.entry import entry_id
from freshline.pipeline.semantic.namespaces import purge_keys, stats
from tests.helpers import REGISTRY, running, wait_until
from tests.pipeline.semantic.test_index import DIM, Vectors, answer
from tests.pipeline.semantic.test_learning import Draws
from tests.pipeline.semantic.test_ttl import Near

ZERO = {"temperature": 0}
PROMPT = "How do I reset the password of my account?"


@pytest.fixture
def tenant() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def made() -> Iterator[Callable[..., SemanticCache]]:
    caches: list[SemanticCache] = []

    def make(client: redis.Redis, embedder: Embedder | None = None, **kwargs: Any) -> SemanticCache:
        c = SemanticCache(client, embedder or Vectors(), ttl_s=600, **kwargs)
        caches.append(c)
        return c

    yield make
    for c in caches:
        c.close()


def tenant_keys(client: redis.Redis, tenant: str) -> list[str]:
    """Every semantic key that names ``tenant``: its namespaces', its registry, its budget."""
    return sorted(k.decode() for k in client.scan_iter(match=f"sem:*{tenant}*", count=1000))


def later() -> None:
    """Let the clock move past the last store's millisecond, so the next scores higher."""
    now = int(time.time() * 1000)
    assert wait_until(lambda: int(time.time() * 1000) > now + 1)


def store(c: SemanticCache, scope: Scope, prompts: list[str]) -> np.ndarray:
    vectors = normalise(
        np.random.default_rng(entry_id(prompts[0])).normal(size=(len(prompts), DIM))
    )
    c.store_many(scope, [(p, f"answer to {p}") for p in prompts], ZERO, vectors)
    return vectors


def test_flags_and_lookups_of_namespaces_never_stored_into_leave_no_key(
    redis_client: redis.Redis, made: Callable[..., SemanticCache], tenant: str
) -> None:
    shipped = prior.shipped("all-MiniLM-L6-v2")
    assert shipped is not None
    table = Near()
    learned = made(redis_client, table, decision=Learned(shipped, 0.02), rng=Draws(0.0))
    static = made(redis_client, table)
    for n in range(50):
        for c in (learned, static):
            s = Scope(tenant, "bot" if c is learned else "fixed", f"v{n}", "t1")
            assert not c.lookup(s, table.at(f"question {n} {s.model}", 0.9), ZERO).hit
            assert c.flag(s, f"{n + 1:016x}") is False
            assert (
                c.flag_for(s, f"{n + 1:016x}", table.at(f"flag {n} {s.model}", 0.8)).removed
                is False
            )
    learned.close()  # what a worker has pending is written when it stops: nothing here either
    static.close()
    assert tenant_keys(redis_client, tenant) == []


def test_flags_of_ids_not_there_add_nothing_to_a_namespaces_stream(
    redis_client: redis.Redis, made: Callable[..., SemanticCache], tenant: str
) -> None:
    c = made(redis_client)
    s = Scope(tenant, "bot", "v1", "t1")
    store(c, s, ["old question 0"])
    before = redis_client.xlen(semantic_log_key(s.namespace))
    for n in range(200):
        assert c.flag(s, f"{n + 1:016x}") is False
    assert redis_client.xlen(semantic_log_key(s.namespace)) == before
    assert c.flag(s, f"{entry_id('old question 0'):016x}") is True  # a removal is told
    assert redis_client.xlen(semantic_log_key(s.namespace)) == before + 1
    c.close()
    [row] = stats(redis_client, tenant)
    assert row.counts["flagged"] == 201
    c.purge(tenant=tenant)


def test_counters_of_a_namespace_count_once_it_is_stored_into(
    redis_client: redis.Redis, made: Callable[..., SemanticCache], tenant: str
) -> None:
    c = made(redis_client)
    s = Scope(tenant, "bot", "v1", "t1")
    v = normalise(np.random.default_rng(1).normal(size=(1, DIM)))
    assert answer(c, s, PROMPT, v[0]) is None  # a miss before any store: held, not written
    assert tenant_keys(redis_client, tenant) == []
    c.store_many(s, [(PROMPT, "Use the reset link.")], ZERO, v)
    assert answer(c, s, PROMPT, v[0]) == "Use the reset link."
    c.close()
    [row] = stats(redis_client, tenant)
    assert (row.counts["misses"], row.counts["hits"], row.counts["stored"]) == (1, 1, 1)
    c.purge(tenant=tenant)


def test_counters_held_for_namespaces_never_stored_into_are_bounded(
    redis_client: redis.Redis,
    made: Callable[..., SemanticCache],
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state, "MAX_PENDING", 20)
    c = made(redis_client)
    real = Scope(tenant, "bot", "v1", "t1")
    v = normalise(np.random.default_rng(4).normal(size=(2, DIM)))
    c.store_many(real, [(PROMPT, "Use the reset link.")], ZERO, v[:1])
    for n in range(100):
        assert answer(c, Scope(tenant, "bot", f"ghost{n}", "t1"), PROMPT, v[0]) is None
    assert len(c._pending) <= 20
    assert answer(c, real, "another question", v[1]) is None  # still counted
    c.close()
    [row] = stats(redis_client, tenant)
    assert (row.counts["stored"], row.counts["misses"]) == (1, 1)
    c.purge(tenant=tenant)


def entry_bytes(client: redis.Redis, make: Callable[..., SemanticCache]) -> int:
    """What one entry of :func:`store`'s shape is counted for, measured on a scratch tenant."""
    scratch = f"t{uuid.uuid4().hex[:12]}"
    c = make(client, budget=TenantBudget(client, max_keys=10, max_bytes=1 << 20))
    store(c, Scope(scratch, "bot", "v1", "t1"), ["old question 0"])
    keys, size = usage(client, semantic_budget_keys(scratch))
    assert keys == 1 and size > 0
    c.purge(tenant=scratch)
    return size


def test_a_tenant_past_its_byte_budget_loses_its_own_oldest_entries(
    redis_client: redis.Redis, made: Callable[..., SemanticCache], tenant: str
) -> None:
    cost = entry_bytes(redis_client, made)
    budget = TenantBudget(redis_client, max_keys=1_000, max_bytes=5 * cost + cost // 2)
    writer = made(redis_client, budget=budget)
    reader = made(redis_client)
    other = f"{tenant}x"
    theirs = Scope(other, "bot", "v1", "t1")
    their_vectors = store(writer, theirs, [f"old question {i}" for i in range(5)])  # full
    their_usage = usage(redis_client, semantic_budget_keys(other))
    their_ids = redis_client.zrange(semantic_ids_key(theirs.namespace), 0, -1, withscores=True)

    first, second = Scope(tenant, "bot", "v1", "t1"), Scope(tenant, "bot", "v2", "t1")
    old = [f"old question {i}" for i in range(3)]
    old_vectors = store(writer, first, old)
    assert answer(reader, first, old[0], old_vectors[0]) is not None  # indexed
    later()
    new = [f"new question {i}" for i in range(4)]
    new_vectors = store(writer, second, new)

    keys, size = usage(redis_client, semantic_budget_keys(tenant))
    assert keys == 5 and size <= budget.max_bytes
    present = [
        p for p in old if redis_client.exists(semantic_entry_key(first.namespace, entry_id(p)))
    ]
    assert len(present) == 1
    assert redis_client.zcard(semantic_ids_key(first.namespace)) == 1
    for p, v in zip(new, new_vectors, strict=True):
        assert answer(reader, second, p, v) == f"answer to {p}"
    # The other worker's index dropped the evicted through the stream.
    gone = [i for i, p in enumerate(old) if p not in present]
    for i in gone:
        assert answer(reader, first, old[i], old_vectors[i]) is None
    idx = reader.pool.peek(first.namespace)
    assert idx is not None and idx.live == {entry_id(p) for p in present}

    # The other tenant, at its own budget all along, lost nothing.
    assert usage(redis_client, semantic_budget_keys(other)) == their_usage
    assert (
        redis_client.zrange(semantic_ids_key(theirs.namespace), 0, -1, withscores=True) == their_ids
    )
    for i, v in enumerate(their_vectors):
        assert answer(reader, theirs, f"old question {i}", v) == f"answer to old question {i}"

    # Every key the cache made, the budget's own included, expires.
    writer.close()
    found = tenant_keys(redis_client, tenant)
    assert set(semantic_budget_keys(tenant)) <= set(found)
    for key in found:
        assert redis_client.pttl(key) > 0, key
    [row] = [r for r in stats(redis_client, tenant) if r.model_version == "v1"]
    assert row.counts["evicted"] == 2
    writer.purge(tenant=tenant)
    writer.purge(tenant=other)
    # Only the streams stay a while, telling every worker of the purge.
    assert all(k.startswith("sem:log:") for k in tenant_keys(redis_client, tenant))


def test_a_prompt_stored_again_with_another_response_is_not_evicted_for_its_old_one(
    redis_client: redis.Redis, made: Callable[..., SemanticCache], tenant: str
) -> None:
    c = made(redis_client, budget=TenantBudget(redis_client, max_keys=3, max_bytes=1 << 20))
    s = Scope(tenant, "bot", "v1", "t1")
    v = normalise(np.random.default_rng(3).normal(size=(3, DIM)))
    c.store_many(s, [(PROMPT, "Use the link.")], ZERO, v[:1])
    later()
    [flagged] = c.store_many(s, [(PROMPT, "Use the link.")], ZERO, v[:1])
    assert c.flag(s, flagged)  # wrong: removed, its member counted until popped
    later()
    c.store_many(s, [(PROMPT, "Open Settings, then Security, then Reset.")], ZERO, v[:1])
    later()
    c.store_many(s, [("second question", "B")], ZERO, v[1:2])
    later()
    c.store_many(s, [("third question", "C")], ZERO, v[2:3])  # pops the old member
    assert answer(c, s, PROMPT, v[0]) == "Open Settings, then Security, then Reset."
    assert usage(redis_client, semantic_budget_keys(tenant))[0] == 3
    c.purge(tenant=tenant)


def test_an_entry_larger_than_the_budget_is_refused_and_nothing_is_written(
    redis_client: redis.Redis, made: Callable[..., SemanticCache], tenant: str
) -> None:
    cost = entry_bytes(redis_client, made)
    c = made(redis_client, budget=TenantBudget(redis_client, max_keys=10, max_bytes=3 * cost))
    s = Scope(tenant, "bot", "v1", "t1")
    kept = store(c, s, ["old question 0"])
    v = normalise(np.random.default_rng(2).normal(size=(1, DIM)))
    with pytest.raises(EntryOverBudget, match="bytes"):
        c.store_many(s, [("a long one", "x" * 4 * cost)], ZERO, v)
    with pytest.raises(EntryOverBudget, match="bytes"):  # a batch over it as a whole too
        store(c, s, [f"batch question {i}" for i in range(4)])
    assert redis_client.zcard(semantic_ids_key(s.namespace)) == 1
    assert answer(c, s, "old question 0", kept[0]) == "answer to old question 0"
    c.purge(tenant=tenant)


def test_the_api_answers_413_for_an_entry_larger_than_the_tenants_budget(
    settings: Settings, engine: Engine, redis_client: redis.Redis
) -> None:
    tenant = f"budget-{uuid.uuid4().hex[:8]}"
    create_tenant(engine, tenant)
    tuned = settings.model_copy(
        update={"semantic_enabled": True, "semantic_tenant_max_bytes": 16 * 1024}
    )
    app = create_app(
        tuned, engine=engine, redis_client=redis_client, follow_deploys=False, registry=REGISTRY
    )
    body = {
        "model": "bot",
        "model_version": "v1",
        "template_version": "t1",
        "prompt": PROMPT,
        "params": {"temperature": 0},
    }
    with running(app, create_api_key(engine, tenant)) as api:
        small = api.post("/v1/llm/cache/store", json={**body, "response": "Use the link."})
        assert small.status_code == 201, small.text
        large = api.post("/v1/llm/cache/store", json={**body, "response": "x" * 20_000})
        assert large.status_code == 413, large.text
        assert large.json()["error"]["code"] == "semantic_entry_too_large"
        assert "FRESHLINE_SEMANTIC_TENANT_MAX_BYTES" in large.json()["error"]["message"]
    keys, size = usage(redis_client, semantic_budget_keys(tenant))
    assert keys == 1 and 0 < size <= 16 * 1024
    purge_keys(redis_client, tenant=tenant)
