"""The semantic response cache on the real Redis, with the real local embedding model."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import numpy as np
import orjson
import pytest
import redis

from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.keys import SEMANTIC_PREFIX, semantic_pattern, semantic_registry_key
from freshline.pipeline.semantic.cache import (
    InvalidPrompt,
    NonDeterministicParams,
    Scope,
    SemanticCache,
    check_deterministic,
)
from freshline.pipeline.semantic.embed import (
    BatchingEmbedder,
    EmbeddingError,
    HttpEmbedder,
    MiniLM,
    local_model,
)
from freshline.pipeline.semantic.entry import literals, literals_match, names_match
from freshline.pipeline.semantic.namespaces import stats
from freshline.pipeline.semantic.prior import group_of
from freshline.pipeline.semantic.tune import HOLDOUT, PAIRS, load_pairs, sweep
from tests.helpers import http_server, wait_until

ZERO = {"temperature": 0}
PROMPT = "How do I reset the password of my account?"
NEAR = "How do I reset the password of my account ?"  # similarity >= 0.99


@pytest.fixture(scope="module")
def model() -> MiniLM:
    return local_model()


@pytest.fixture
def tenant() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def other_tenant() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def cache(redis_client: redis.Redis, model: MiniLM) -> Iterator[SemanticCache]:
    c = SemanticCache(redis_client, model, ttl_s=600)
    yield c
    c.close()


def scope(
    tenant: str, model_version: str = "v1", template_version: str = "t1", model: str = "support-bot"
) -> Scope:
    return Scope(tenant, model, model_version, template_version)


def test_the_local_model_is_all_minilm_l6_v2(model: MiniLM) -> None:
    # The first values sentence-transformers gives for this sentence with this model.
    v = model.embed(["This is an example sentence"])[0]
    assert v.shape == (384,)
    np.testing.assert_allclose(v[:5], [0.0677, 0.0635, 0.0487, 0.0793, 0.0374], atol=2e-4)
    assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
    # A batch gives what one at a time gives, whatever the padding.
    texts = ["short", "a much longer prompt about order 12345 and its refund, please"]
    np.testing.assert_allclose(
        model.embed(texts), np.vstack([model.embed([t]) for t in texts]), atol=1e-5
    )


def test_a_paraphrase_hits_and_another_number_does_not(cache: SemanticCache, tenant: str) -> None:
    s = scope(tenant)
    stored = cache.store(s, "How do I get a refund for order 123?", ZERO, "Open Orders.")
    hit = cache.lookup(s, "how can I get a refund for order 123", ZERO)
    assert hit.hit and hit.response == "Open Orders." and hit.entry_id == stored.entry_id
    assert hit.similarity is not None and hit.similarity >= cache.threshold
    assert hit.age_ms is not None and hit.age_ms >= 0
    other = cache.lookup(s, "How do I get a refund for order 124?", ZERO)
    assert not other.hit and other.response is None
    # The embedding alone would have served it: only the numbers check refuses it.
    assert other.similarity is not None and other.similarity >= cache.threshold


def test_tenants_never_see_each_others_responses(
    cache: SemanticCache, model: MiniLM, tenant: str, other_tenant: str
) -> None:
    a, b = model.embed([PROMPT, NEAR])
    assert float(a @ b) >= 0.99
    cache.store(scope(tenant), PROMPT, ZERO, "answer for A")
    assert not cache.lookup(scope(other_tenant), NEAR, ZERO).hit
    assert not cache.lookup(scope(other_tenant), PROMPT, ZERO).hit
    cache.store(scope(other_tenant), NEAR, ZERO, "answer for B")
    assert cache.lookup(scope(tenant), NEAR, ZERO).response == "answer for A"
    assert cache.lookup(scope(other_tenant), PROMPT, ZERO).response == "answer for B"


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7},
        {},
        {"temperature": "0"},
        {"temperature": -1},
        {"temperature": True},
        {"temperature": 0.2, "deterministic": False},
        {"deterministic": "yes"},
    ],
)
def test_non_deterministic_generations_are_refused(
    cache: SemanticCache, tenant: str, redis_client: redis.Redis, params: dict[str, Any]
) -> None:
    with pytest.raises(NonDeterministicParams):
        cache.store(scope(tenant), PROMPT, params, "sampled")
    with pytest.raises(NonDeterministicParams):
        cache.lookup(scope(tenant), PROMPT, params)
    # Nothing is written for a namespace never stored into, counters included: the
    # refusals are held until it is.
    assert not list(redis_client.scan_iter(match=semantic_pattern(tenant)))
    cache.store(scope(tenant), PROMPT, ZERO, "deterministic")
    cache.close()
    assert stats(redis_client, tenant)[0].counts["refused"] == 2


def test_declared_deterministic_is_accepted(cache: SemanticCache, tenant: str) -> None:
    params = {"temperature": 0.8, "deterministic": True, "seed": 7}
    cache.store(scope(tenant), PROMPT, params, "seeded")
    assert cache.lookup(scope(tenant), PROMPT, params).response == "seeded"
    check_deterministic({"temperature": 0.0})
    # Other parameters must match: another seed is another response.
    assert not cache.lookup(scope(tenant), PROMPT, {**params, "seed": 8}).hit


def test_versions_never_cross(cache: SemanticCache, tenant: str) -> None:
    cache.store(scope(tenant, "v1", "t1"), PROMPT, ZERO, "v1 t1")
    assert not cache.lookup(scope(tenant, "v2", "t1"), PROMPT, ZERO).hit
    assert not cache.lookup(scope(tenant, "v1", "t2"), PROMPT, ZERO).hit
    assert not cache.lookup(scope(tenant, model="other-bot"), PROMPT, ZERO).hit
    cache.store(scope(tenant, "v2", "t1"), PROMPT, ZERO, "v2 t1")
    assert cache.lookup(scope(tenant, "v1", "t1"), PROMPT, ZERO).response == "v1 t1"
    assert cache.lookup(scope(tenant, "v2", "t1"), PROMPT, ZERO).response == "v2 t1"


def test_purge_by_version_and_by_tenant(
    cache: SemanticCache, redis_client: redis.Redis, model: MiniLM, tenant: str, other_tenant: str
) -> None:
    cache.store(scope(tenant, "v1"), PROMPT, ZERO, "old")
    cache.store(scope(tenant, "v2"), PROMPT, ZERO, "new")
    cache.store(scope(other_tenant, "v1"), PROMPT, ZERO, "theirs")
    worker = SemanticCache(redis_client, model)  # another process's index, built now
    assert worker.lookup(scope(tenant, "v1"), PROMPT, ZERO).hit

    removed = cache.purge(tenant=tenant, model_version="v1")
    assert list(removed) == [scope(tenant, "v1").namespace]
    assert not worker.lookup(scope(tenant, "v1"), PROMPT, ZERO).hit
    idx = worker.pool.peek(scope(tenant, "v1").namespace)
    assert idx is not None and len(idx) == 0  # emptied by the stream
    assert worker.lookup(scope(tenant, "v2"), PROMPT, ZERO).response == "new"
    assert worker.lookup(scope(other_tenant, "v1"), PROMPT, ZERO).response == "theirs"

    cache.purge(tenant=tenant)
    assert not worker.lookup(scope(tenant, "v2"), PROMPT, ZERO).hit
    assert worker.lookup(scope(other_tenant, "v1"), PROMPT, ZERO).response == "theirs"
    with pytest.raises(InvalidPrompt):
        cache.purge(model="support-bot")
    worker.close()


def test_a_flag_removes_the_entry_and_is_counted(
    cache: SemanticCache, redis_client: redis.Redis, tenant: str
) -> None:
    s = scope(tenant)
    cache.store(s, PROMPT, ZERO, "wrong answer")
    hit = cache.lookup(s, NEAR, ZERO)
    assert hit.hit and hit.entry_id is not None
    assert cache.flag(s, hit.entry_id) is True
    assert not cache.lookup(s, NEAR, ZERO).hit
    assert cache.flag(s, hit.entry_id) is False  # already gone, still counted
    cache.close()
    [row] = stats(redis_client, tenant)
    assert row.counts["flagged"] == 2 and row.counts["hits"] == 1 and row.entries == 0
    with pytest.raises(InvalidPrompt):
        cache.flag(s, "not-hex")


def test_two_workers_keep_their_indexes_in_step(
    redis_client: redis.Redis, model: MiniLM, tenant: str
) -> None:
    a = SemanticCache(redis_client, model)
    b = SemanticCache(redis_client, model)
    s = scope(tenant)
    assert not b.lookup(s, PROMPT, ZERO).hit  # b builds its (empty) index now
    stored = a.store(s, PROMPT, ZERO, "from a")
    # b learns of the add from the stream, not by rebuilding.
    assert b.lookup(s, NEAR, ZERO).response == "from a"
    assert b.pool.builds == 1
    held = b.pool.peek(s.namespace)
    assert held is not None and stored.entry_id in {f"{e:016x}" for e in held.live}
    assert b.flag(s, stored.entry_id)
    assert not a.lookup(s, NEAR, ZERO).hit
    assert wait_until(lambda: len(a.pool.get(s.namespace)) == 0)
    a.close()
    b.close()


def test_every_key_has_a_ttl(cache: SemanticCache, redis_client: redis.Redis, tenant: str) -> None:
    s = scope(tenant)
    e = cache.store(s, PROMPT, ZERO, "x").entry_id
    cache.lookup(s, NEAR, ZERO)
    cache.flag(s, e)
    cache.store(s, "Where is order 5?", ZERO, "y")
    cache.close()
    cache.purge(tenant=tenant, model_version="v9")  # nothing there: no stream made
    keys = list(redis_client.scan_iter(match=semantic_pattern(tenant)))
    kinds = {k.decode().split(":")[1] for k in keys}
    assert kinds == {"e", "ids", "log", "stats"}
    for key in [*keys, semantic_registry_key(tenant)]:
        assert redis_client.pttl(key) > 0, key
    cache.purge(tenant=tenant)
    assert not redis_client.exists(semantic_registry_key(tenant))
    for key in redis_client.scan_iter(match=f"{SEMANTIC_PREFIX}:*{tenant}*"):
        assert redis_client.pttl(key) > 0, key  # the purge marker too


def test_get_or_generate_calls_the_model_once(cache: SemanticCache, tenant: str) -> None:
    calls: list[str] = []

    def generate(prompt: str) -> str:
        calls.append(prompt)
        return f"generated for {prompt}"

    first, found = cache.get_or_generate(scope(tenant), PROMPT, ZERO, generate)
    assert not found.hit and calls == [PROMPT]
    again, found = cache.get_or_generate(scope(tenant), NEAR, ZERO, generate)
    assert found.hit and again == first and calls == [PROMPT]
    with pytest.raises(NonDeterministicParams):
        cache.get_or_generate(scope(tenant), PROMPT, {"temperature": 1}, generate)
    assert calls == [PROMPT]


def test_bad_ids_and_prompts_are_refused(cache: SemanticCache, tenant: str) -> None:
    with pytest.raises(InvalidId):
        cache.lookup(Scope(tenant, "bot:*", "v1", "t1"), PROMPT, ZERO)
    with pytest.raises(InvalidId):
        cache.lookup(Scope("{evil}", "bot", "v1", "t1"), PROMPT, ZERO)
    with pytest.raises(InvalidPrompt):
        cache.lookup(scope(tenant), "   ", ZERO)
    with pytest.raises(InvalidPrompt):
        cache.store(scope(tenant), PROMPT, ZERO, "")


def test_concurrent_callers_share_batches(model: MiniLM) -> None:
    batching = BatchingEmbedder(model)
    texts = [f"question number {i} about order {i * 7}" for i in range(24)]
    results: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(8)

    def call(i: int) -> None:
        barrier.wait()
        results[i] = batching.embed(texts[i * 3 : i * 3 + 3])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batching.close()
    np.testing.assert_allclose(
        np.vstack([results[i] for i in range(8)]), model.embed(texts), atol=1e-5
    )
    assert batching.batches < 8


class _Embeddings(BaseHTTPRequestHandler):
    """An OpenAI-style endpoint with deterministic vectors: a hash of each input's
    lower-cased words, so texts that differ in case or punctuation embed alike."""

    def do_POST(self) -> None:
        body = orjson.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/embeddings" or body.get("model") != "test-embed":
            self.send_response(404)
            self.end_headers()
            return
        data = []
        for i, text in enumerate(body["input"]):
            v = np.zeros(16)
            for word in "".join(c for c in text.lower() if c.isalnum() or c == " ").split():
                v[sum(word.encode()) % 16] += 1.0
            data.append({"object": "embedding", "index": i, "embedding": v.tolist()})
        payload = orjson.dumps({"object": "list", "data": data[::-1], "model": "test-embed"})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    with http_server(_Embeddings) as url:
        yield f"{url}/v1"


def test_an_embeddings_endpoint_replaces_the_local_model(
    endpoint: str, tenant: str, redis_client: redis.Redis
) -> None:
    embedder = HttpEmbedder(endpoint, "test-embed")
    assert embedder.dim == 16
    cache = SemanticCache(redis_client, embedder)
    cache.store(scope(tenant), "Where is order 77?", ZERO, "on its way")
    assert cache.lookup(scope(tenant), "where is ORDER 77", ZERO).response == "on its way"
    assert not cache.lookup(scope(tenant), "cancel order 77", ZERO).hit
    cache.close()
    with pytest.raises(EmbeddingError):
        HttpEmbedder(endpoint, "unknown-model").embed(["x"])


def test_the_labelled_set_and_the_sweep() -> None:
    pairs = load_pairs(PAIRS)
    assert len(pairs) >= 300
    labels = {p.label for p in pairs}
    assert labels == {"paraphrase", "different"}
    hard = [p for p in pairs if p.label == "different" and "differs" in p.kind]
    assert len(hard) >= 100
    assert any(literals(p.a) != literals(p.b) for p in hard)  # numbers
    assert any(literals(p.a) == literals(p.b) for p in hard)  # names, places
    assert not any(literals_match(p.a, p.b) for p in hard)  # the names check stops them
    assert any(literals_match(p.a, p.b) for p in pairs if " vs " in p.kind)  # intents
    sims = np.array([0.99 if p.label == "paraphrase" else 0.5 for p in pairs])
    rows = sweep(pairs, sims)
    assert rows[0].threshold == 0.85 and rows[-1].threshold == 0.97
    assert rows[0].hit_rate == pytest.approx(
        np.mean([literals_match(p.a, p.b) for p in pairs if p.label == "paraphrase"])
    )
    assert all(r.false_hit_rate == 0 for r in rows)


def test_store_many_embeds_once_and_stores_all(
    cache: SemanticCache, tenant: str, redis_client: redis.Redis
) -> None:
    items = [(f"Where is order {n}?", f"order {n} ships today") for n in (11, 12, 13)]
    ids = cache.store_many(scope(tenant), items, ZERO)
    assert len(set(ids)) == 3
    for n in (11, 12, 13):
        assert (
            cache.lookup(scope(tenant), f"where is order {n}", ZERO).response
            == f"order {n} ships today"
        )
    with pytest.raises(NonDeterministicParams):
        cache.store_many(scope(tenant), [("Where is order 14?", "x")], {"temperature": 1})
    with pytest.raises(InvalidPrompt):
        cache.store_many(scope(tenant), items, ZERO, np.zeros((2, 384), dtype=np.float32))
    assert redis_client.zcard(f"sem:ids:{scope(tenant).namespace}") == 3


def test_a_flag_in_upper_case_hex_removes_the_entry_everywhere(
    cache: SemanticCache, redis_client: redis.Redis, tenant: str
) -> None:
    s = scope(tenant)
    e = cache.store(s, PROMPT, ZERO, "x").entry_id
    assert cache.flag(s, e.upper()) is True
    assert redis_client.zcard(f"sem:ids:{s.namespace}") == 0
    assert not cache.lookup(s, NEAR, ZERO).hit


def test_names_must_match_as_numbers_do() -> None:
    assert names_match("Where is Li Wei's card?", "Li Wei's card: where is it?")
    assert not names_match("Where is Li Wei's card?", "Where is Lu Wei's card?")
    assert not names_match("Is shipping to Lisbon free?", "Is shipping to Porto free?")
    assert names_match("Can I return order 5?", "Please refund order 5.")  # openers
    assert names_match("Show the risk score", "What is the risk score?")
    assert not names_match("Add Anna Berg to the team.", "Add Hanna Berg to the team.")
    assert not literals_match("Refund order 5 for Anna Berg", "Refund order 5 for Hanna Berg")


def test_the_holdout_set_is_apart_from_the_shipped_one() -> None:
    shipped, holdout = load_pairs(PAIRS), load_pairs(HOLDOUT)
    assert len(holdout) >= 300
    assert {p.label for p in holdout} == {"paraphrase", "different"}
    assert not {group_of(p) for p in shipped} & {group_of(p) for p in holdout}
    texts = [{p.a for p in ps} | {p.b for p in ps} for ps in (shipped, holdout)]
    assert not texts[0] & texts[1]
