"""Every semantic key has a TTL, set in the same transaction as the write that made it:
a crash between a write and its ``EXPIRE`` must not be able to leave an immortal key.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis

from freshline.pipeline.core.keys import semantic_pattern, semantic_registry_key
from freshline.pipeline.semantic import prior
from freshline.pipeline.semantic.cache import Limits, Scope, SemanticCache
from freshline.pipeline.semantic.decision import Learned
from tests.pipeline.semantic.test_learning import Draws

DIM = 64
ZERO = {"temperature": 0}
EXPIRES = {"EXPIRE", "PEXPIRE", "EXPIREAT", "PEXPIREAT"}


class Recording(redis.Redis):
    """A client that notes, for every pipeline it runs, whether it was a transaction
    and which commands it held."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(connection_pool=client.connection_pool)
        self.runs: list[tuple[bool, set[str]]] = []

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        run = pipe.execute

        def execute(raise_on_error: bool = True) -> Any:
            names = {str(args[0]).upper() for args, _ in pipe.command_stack}
            self.runs.append((bool(pipe.transaction), names))
            return run(raise_on_error)

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe


class Near:
    """Texts placed at a similarity to one direction, each along its own."""

    name = "near"
    dim = DIM

    def __init__(self) -> None:
        self.vectors: dict[str, np.ndarray] = {}

    def at(self, text: str, similarity: float) -> str:
        v = np.zeros(DIM, dtype=np.float32)
        v[0] = similarity
        v[1 + len(self.vectors) % (DIM - 1)] = np.sqrt(max(0.0, 1 - similarity**2))
        self.vectors[text] = v
        return text

    def embed(self, texts: Sequence[str], /) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts])


def test_every_write_sets_its_ttl_atomically(redis_client: redis.Redis) -> None:
    client = Recording(redis_client)
    shipped = prior.shipped("all-MiniLM-L6-v2")
    assert shipped is not None
    table = Near()
    cache = SemanticCache(
        client,
        table,
        ttl_s=600,
        decision=Learned(shipped, 0.02),
        rng=Draws(0.0),  # explore whenever allowed
        limits=Limits(max_entries=3, max_namespaces=2),
    )
    tenant = f"t{uuid.uuid4().hex[:12]}"
    scope = Scope(tenant, "bot", "v1", "t1")
    try:
        cache.store(scope, table.at("How do I reset the password of account 1", 1.0), ZERO, "A")
        explored = table.at("I forgot the password of account 1", 0.8)
        miss = cache.lookup(scope, explored, ZERO)
        assert miss.candidate_id is not None
        cache.store(scope, explored, ZERO, "A")  # labels the candidate and its pair
        cache.rng = Draws(0.999999)  # never explores: a would-be hit is served
        served = cache.lookup(scope, table.at("password of account 1, reset", 0.99), ZERO)
        assert served.entry_id is not None
        cache.flag_for(scope, served.entry_id, table.at("reset account 1 pin", 0.7))
        for n in range(2, 6):  # past the namespace's limit: the oldest are evicted
            cache.store(scope, table.at(f"Reset the password of account {n}", 1.0), ZERO, "B")
        cache.store(Scope(tenant, "bot", "v2", "t1"), table.at("Other", 1.0), ZERO, "C")
    finally:
        cache.close()
    keys = list(redis_client.scan_iter(match=semantic_pattern(tenant), count=500))
    kinds = {k.decode().split(":")[1] for k in keys}
    assert {"e", "ids", "log", "stats", "o"} <= kinds
    for key in [*keys, semantic_registry_key(tenant)]:
        assert redis_client.pttl(key) > 0, key
    expiring = [(tx, names) for tx, names in client.runs if names & EXPIRES]
    assert expiring
    for tx, names in expiring:
        assert tx, f"a pipeline sets a TTL outside a transaction: {sorted(names)}"
    cache.purge(tenant=tenant)
