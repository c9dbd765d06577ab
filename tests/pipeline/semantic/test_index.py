"""The semantic cache's per-process indexes: built off the request path, rebuilt while
serving, never wrong meanwhile, within a budget; on the real Redis.

Vectors here are synthetic (unit rows of width 32), stored and looked up with
``store_many(..., vectors)`` and ``lookup_vector``: the index does not care where a
vector came from, and the embedding model would only slow these tests down.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from freshline.pipeline.core.keys import semantic_log_key
from freshline.pipeline.semantic.cache import Scope, SemanticCache
from freshline.pipeline.semantic.embed import normalise
from freshline.pipeline.semantic.entry import entry_id
from freshline.pipeline.semantic.index import STREAM_RETENTION_MS, NamespaceIndex
from freshline.pipeline.semantic.namespaces import live_namespaces
from freshline.pipeline.semantic.pool import IndexPool
from tests.helpers import wait_until

DIM = 32
ZERO = {"temperature": 0}


class Vectors:
    """An embedder that is never called: these tests pass their vectors."""

    name = "synthetic"
    dim = DIM

    def embed(self, texts: Any, /) -> np.ndarray:
        raise AssertionError("the tests pass vectors")


@pytest.fixture
def scope() -> Scope:
    return Scope(f"t{uuid.uuid4().hex[:12]}", "bot", "v1", "t1")


@pytest.fixture
def caches(redis_client: redis.Redis) -> Iterator[list[SemanticCache]]:
    made: list[SemanticCache] = []
    yield made
    for c in made:
        c.close()


def cache(redis_client: redis.Redis, made: list[SemanticCache], **kwargs: Any) -> SemanticCache:
    c = SemanticCache(redis_client, Vectors(), ttl_s=600, **kwargs)
    made.append(c)
    return c


def fill(writer: SemanticCache, scope: Scope, n: int, seed: int = 0) -> np.ndarray:
    vectors = normalise(np.random.default_rng(seed).normal(size=(n, DIM)))
    writer.store_many(
        scope, [(f"prompt {seed}-{i}", f"response {i}") for i in range(n)], ZERO, vectors
    )
    return vectors


def answer(c: SemanticCache, scope: Scope, prompt: str, vector: np.ndarray) -> str | None:
    return c.lookup_vector(scope, prompt, ZERO, vector).response


class PausedPool(IndexPool):
    """The real pool, paused inside its first build right after reading a chunk of
    entries, so a test can change Redis at that exact point of the build."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read = threading.Event()
        self.resume = threading.Event()

    def load(self, namespace: str, ids: Any) -> Any:
        out = super().load(namespace, ids)
        if not self.read.is_set():
            self.read.set()
            assert self.resume.wait(30)
        return out


def test_a_large_namespace_builds_in_the_background_and_changes_made_meanwhile_hold(
    redis_client: redis.Redis, caches: list[SemanticCache], scope: Scope
) -> None:
    writer = cache(redis_client, caches)
    vectors = fill(writer, scope, 300)
    worker = cache(redis_client, caches)
    worker.pool = pool = PausedPool(redis_client, DIM, worker.background, inline_max=100)

    # The first lookup does not wait for the build: a miss, marked warming.
    first = worker.lookup_vector(scope, "prompt 0-0", ZERO, vectors[0])
    assert not first.hit and first.warming
    assert pool.read.wait(30)  # the build has read the entries and is paused

    # Meanwhile: a flag, a new entry, a changed response.
    assert writer.flag(scope, f"{entry_id('prompt 0-1'):016x}")
    late = normalise(np.random.default_rng(99).normal(size=(1, DIM)))
    writer.store_many(scope, [("a late prompt", "late response")], ZERO, late)
    writer.store_many(scope, [("prompt 0-2", "changed")], ZERO, vectors[2:3])
    during = worker.lookup_vector(scope, "prompt 0-0", ZERO, vectors[0])
    assert not during.hit and during.warming  # still a miss, never a guess

    pool.resume.set()
    idx = pool.get(scope.namespace)
    assert wait_until(lambda: idx.ready, timeout=30)
    assert entry_id("prompt 0-1") not in idx.live  # the stream's removal reached the index
    assert entry_id("a late prompt") in idx.live  # and its add
    assert answer(worker, scope, "prompt 0-0", vectors[0]) == "response 0"
    assert answer(worker, scope, "prompt 0-1", vectors[1]) is None
    assert answer(worker, scope, "prompt 0-2", vectors[2]) == "changed"
    assert answer(worker, scope, "a late prompt", late[0]) == "late response"
    assert pool.builds == 1


def test_a_rebuild_runs_while_the_old_index_serves(
    redis_client: redis.Redis, caches: list[SemanticCache], scope: Scope
) -> None:
    writer = cache(redis_client, caches)
    vectors = fill(writer, scope, 40)
    worker = cache(redis_client, caches)
    assert answer(worker, scope, "prompt 0-3", vectors[3]) == "response 3"  # built inline
    gate = threading.Event()
    worker.background.submit(gate.wait, 30)  # holds the one builder thread
    assert worker.pool.schedule(scope.namespace)
    assert not worker.pool.schedule(scope.namespace)  # queued once

    # The old index keeps serving, and keeps up with the stream, while the rebuild waits.
    assert writer.flag(scope, f"{entry_id('prompt 0-4'):016x}")
    late = normalise(np.random.default_rng(7).normal(size=(1, DIM)))
    writer.store_many(scope, [("a late prompt", "late")], ZERO, late)
    assert answer(worker, scope, "prompt 0-3", vectors[3]) == "response 3"
    assert answer(worker, scope, "prompt 0-4", vectors[4]) is None
    assert answer(worker, scope, "a late prompt", late[0]) == "late"

    gate.set()
    assert wait_until(lambda: worker.pool.builds == 2 and not worker.pool.pending(), timeout=30)
    idx = worker.pool.get(scope.namespace)
    assert len(idx) == 40 and entry_id("prompt 0-4") not in idx.live
    assert answer(worker, scope, "a late prompt", late[0]) == "late"
    assert answer(worker, scope, "prompt 0-3", vectors[3]) == "response 3"


def test_a_grown_flat_index_becomes_ivf_and_still_finds_every_entry(
    redis_client: redis.Redis, caches: list[SemanticCache], scope: Scope
) -> None:
    writer = cache(redis_client, caches)
    worker = cache(redis_client, caches)
    worker.pool.flat_max = 50
    first = fill(writer, scope, 40, seed=1)
    assert answer(worker, scope, "prompt 1-0", first[0]) == "response 0"
    idx = worker.pool.get(scope.namespace)
    assert idx.kind == "flat"
    more = fill(writer, scope, 400, seed=2)
    assert answer(worker, scope, "prompt 2-0", more[0]) == "response 0"  # via the stream
    assert wait_until(lambda: worker.pool.get(scope.namespace).kind == "ivf", timeout=60)
    assert len(idx) == 440 and idx.trained_for == 440
    for i in range(0, 400, 7):  # each entry is found from its own vector
        assert answer(worker, scope, f"prompt 2-{i}", more[i]) == f"response {i}"
    with idx.lock:  # removals are real in the IVF index too
        idx.remove([entry_id("prompt 2-7")])
        assert all(e != entry_id("prompt 2-7") for e, _ in idx.search(more[7:8], 8)[0])


def test_the_budget_drops_the_least_recently_used_index(
    redis_client: redis.Redis, caches: list[SemanticCache]
) -> None:
    worker = cache(redis_client, caches, max_index_vectors=2500)  # two small indexes
    writer = cache(redis_client, caches)
    tenant = f"t{uuid.uuid4().hex[:12]}"
    scopes = [Scope(tenant, "bot", f"v{i}", "t1") for i in range(3)]
    vectors = [fill(writer, s, 5, seed=i) for i, s in enumerate(scopes)]
    for i, s in enumerate(scopes):
        assert answer(worker, s, f"prompt {i}-0", vectors[i][0]) == "response 0"
    assert worker.pool.namespaces() == sorted(s.namespace for s in scopes[1:])
    assert worker.pool.dropped == 1
    assert answer(worker, scopes[0], "prompt 0-1", vectors[0][1]) == "response 1"
    assert worker.pool.namespaces() == sorted([scopes[0].namespace, scopes[2].namespace])


def test_warm_builds_namespaces_before_any_lookup_most_recent_first_within_the_budget(
    redis_client: redis.Redis, caches: list[SemanticCache]
) -> None:
    writer = cache(redis_client, caches)
    tenant = f"t{uuid.uuid4().hex[:12]}"
    old, new = Scope(tenant, "bot", "v1", "t1"), Scope(tenant, "bot", "v2", "t1")
    fill(writer, old, 3)
    stored_ms = int(time.time() * 1000)
    assert wait_until(lambda: int(time.time() * 1000) > stored_ms + 1)  # a later score
    vectors = fill(writer, new, 4, seed=1)
    found = dict(live_namespaces(redis_client))
    assert found[old.namespace] == 3 and found[new.namespace] == 4
    order = [ns for ns, _ in live_namespaces(redis_client)]
    assert order.index(new.namespace) < order.index(old.namespace)

    worker = cache(redis_client, caches, max_index_vectors=1500)
    assert worker.pool.warm([(new.namespace, 4), (old.namespace, 3)]) == 1  # budget: one
    assert wait_until(lambda: not worker.pool.pending(), timeout=30)
    assert worker.pool.builds == 1 and worker.pool.namespaces() == [new.namespace]
    assert answer(worker, new, "prompt 1-2", vectors[2]) == "response 2"
    assert worker.pool.builds == 1  # the lookup found it built


def test_events_apply_once_and_in_order() -> None:
    idx = NamespaceIndex("{t:bot:v1:t1}", DIM)
    v = normalise(np.ones((1, DIM))).tobytes()
    idx.apply([(b"5-0", {b"op": b"add", b"id": b"000000000000000a", b"v": v})])
    assert idx.live == {10} and idx.stream_id == "5-0"
    idx.apply([(b"4-9", {b"op": b"purge"}), (b"5-0", {b"op": b"purge"})])  # replayed
    assert idx.live == {10}
    idx.apply(
        [
            (b"5-1", {b"op": b"remove", b"id": b"000000000000000a"}),
            (b"5-2", {b"op": b"add", b"id": b"000000000000000a", b"v": v}),
        ]
    )
    assert idx.live == {10}  # removed, then added again: the stream's order
    idx.apply([(b"6-0", {b"op": b"purge"})])
    assert idx.live == set() and idx.stream_id == "6-0"


def warm_worker(
    redis_client: redis.Redis, caches: list[SemanticCache], scope: Scope
) -> tuple[SemanticCache, SemanticCache]:
    """Two caches: a writer that stored three entries in the namespace, and a worker
    that answered from them (so its index of the namespace is built)."""
    writer = cache(redis_client, caches)
    worker = cache(redis_client, caches)
    vectors = fill(writer, scope, 3)
    assert answer(worker, scope, "prompt 0-0", vectors[0]) == "response 0"
    return writer, worker


def test_a_namespace_stream_is_read_from_the_index_position(
    redis_client: redis.Redis, caches: list[SemanticCache], scope: Scope
) -> None:
    _, worker = warm_worker(redis_client, caches, scope)
    idx = worker.pool.get(scope.namespace)
    last: Any = redis_client.xrevrange(semantic_log_key(scope.namespace), count=1)
    assert idx.stream_id == last[0][0].decode()


def test_an_idle_index_is_rebuilt_only_if_its_stream_lost_events(
    redis_client: redis.Redis, caches: list[SemanticCache], scope: Scope
) -> None:
    writer, worker = warm_worker(redis_client, caches, scope)
    idx = worker.pool.get(scope.namespace)
    retention_s = STREAM_RETENTION_MS / 1000

    # Idle past half the retention, but the stream still holds all that came since.
    late = normalise(np.random.default_rng(5).normal(size=(2, DIM)))
    writer.store_many(scope, [("late one", "one")], ZERO, late[:1])
    idx.synced_at -= retention_s
    assert answer(worker, scope, "late one", late[0]) == "one"
    assert worker.pool.builds == 1 and not worker.pool.pending()

    # Idle again, and the stream trimmed past its position: the add is gone from it.
    writer.store_many(scope, [("late two", "two")], ZERO, late[1:])
    last: Any = redis_client.xrevrange(semantic_log_key(scope.namespace), count=1)
    redis_client.xtrim(semantic_log_key(scope.namespace), minid=last[0][0], approximate=False)
    idx.synced_at -= retention_s
    worker.pool.get(scope.namespace)
    assert wait_until(lambda: worker.pool.builds == 2, timeout=30)
    assert entry_id("late two") in idx.live
    assert answer(worker, scope, "late two", late[1]) == "two"


def test_one_tenants_fresh_namespaces_never_drop_another_tenants_index(
    redis_client: redis.Redis, caches: list[SemanticCache]
) -> None:
    worker = cache(redis_client, caches, max_index_vectors=4000)  # four small indexes
    writer = cache(redis_client, caches)
    quiet = Scope(f"t{uuid.uuid4().hex[:12]}", "bot", "v1", "t1")
    vectors = fill(writer, quiet, 5)
    assert answer(worker, quiet, "prompt 0-0", vectors[0]) == "response 0"
    noisy = f"t{uuid.uuid4().hex[:12]}"
    for i in range(20):  # lookups on namespaces nobody stored into
        assert answer(worker, Scope(noisy, "bot", f"v{i}", "t1"), "x", vectors[1]) is None
    assert quiet.namespace in worker.pool.namespaces()
    assert worker.pool.dropped >= 17  # the noisy tenant's own, oldest first
    assert worker.pool.peek(quiet.namespace) is not None
    assert answer(worker, quiet, "prompt 0-1", vectors[1]) == "response 1"
