"""POST /v1/llm/cache/{lookup,store,flag}: the semantic cache over HTTP, on the real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.api.llm import SemanticService
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.semantic.cache import Limits, Scope, SemanticCache
from freshline.pipeline.semantic.embed import local_model
from freshline.pipeline.semantic.prior import InvalidPrior
from tests.helpers import REGISTRY, Api, api_for, running, wait_until
from tests.pipeline.semantic.test_learning import EXPLORE, NEVER

PROMPT = "How do I reset the password of my account?"
NEAR = "How do I reset the password of my account ?"


@pytest.fixture(scope="module")
def tenants(tenant_factory_module: Callable[..., SeedSummary]) -> list[str]:
    return tenant_factory_module(users=2, transactions=10, tenants=2).tenants


@pytest.fixture
def enabled(settings: Settings) -> Settings:
    """The settings with the semantic cache on (FRESHLINE_SEMANTIC_ENABLED)."""
    return settings.model_copy(update={"semantic_enabled": True})


@pytest.fixture
def model() -> str:
    return f"bot-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def api(
    enabled: Settings, engine: Engine, redis_client: redis.Redis, tenants: list[str], model: str
) -> Iterator[Api]:
    named = enabled.model_copy(update={"semantic_models": [model]})  # named in the metrics
    with api_for(named, engine, redis_client, tenants[0]) as client:
        # No exploration or audit draws unless a test asks for them: a random audit
        # answers a would-be hit as a miss, and a test reading hits must not meet one.
        client.app.state.semantic.cache().rng = NEVER
        yield client


def body(model: str, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "model_version": "v1",
        "template_version": "t1",
        "prompt": prompt,
        "params": {"temperature": 0},
        **extra,
    }


def test_store_then_lookup_then_flag(api: Api, model: str) -> None:
    miss = api.post("/v1/llm/cache/lookup", json=body(model))
    assert miss.status_code == 200, miss.text
    assert miss.json()["hit"] is False and "response" not in miss.json()

    stored = api.post("/v1/llm/cache/store", json=body(model, response="Use the reset link."))
    assert stored.status_code == 201, stored.text
    hit = api.post("/v1/llm/cache/lookup", json=body(model, NEAR)).json()
    assert hit["hit"] is True and hit["response"] == "Use the reset link."
    # The learned decision, from the local model's prior: no fixed 0.93.
    assert hit["similarity"] >= hit["threshold"] == api.app.state.semantic.decision.start
    assert 0 <= hit["estimated_error"] <= 0.02
    assert hit["entry_id"] == stored.json()["entry_id"] and hit["age_ms"] >= 0

    flagged = api.post("/v1/llm/cache/flag", json={**body(model), "entry_id": hit["entry_id"]})
    assert flagged.status_code == 200 and flagged.json()["removed"] is True
    assert api.post("/v1/llm/cache/lookup", json=body(model, NEAR)).json()["hit"] is False
    metrics = api.ops("/metrics").text
    assert f'freshline_semantic_flagged_total{{model="{model}"}} 1.0' in metrics
    assert f'freshline_semantic_lookups_total{{model="{model}",outcome="hit"}} 1.0' in metrics
    assert f'freshline_semantic_lookup_seconds_count{{model="{model}"}}' in metrics
    status = api.ops("/status.json").json()
    [row] = [r for r in status["semantic"] if r["model"] == model]
    assert (row["hits"], row["misses"], row["flagged"]) == (1, 2, 1)
    assert row["hit_rate"] == pytest.approx(1 / 3)
    assert any(model in p and "flagged" in p for p in status["problems"])
    assert "Semantic cache" in api.ops("/status").text


def test_the_tenant_comes_from_the_key(
    api: Api, engine: Engine, tenants: list[str], model: str
) -> None:
    other = create_api_key(engine, tenants[1])
    api.post("/v1/llm/cache/store", json=body(model, response="tenant A's answer"))
    # A tenant named in the body changes nothing: the key decides.
    theirs = api.post(
        "/v1/llm/cache/lookup", key=other, json={**body(model, NEAR), "tenant": tenants[0]}
    ).json()
    assert theirs["hit"] is False
    assert api.post("/v1/llm/cache/lookup", json=body(model, NEAR)).json()["hit"] is True


def test_non_deterministic_params_are_refused(api: Api, model: str) -> None:
    hot = body(model, response="sampled")
    hot["params"] = {"temperature": 0.7}
    for path in ("/v1/llm/cache/store", "/v1/llm/cache/lookup"):
        answer = api.post(path, json=hot)
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["code"] == "not_deterministic" and "temperature 0.7" in error["message"]
    declared = {**hot, "params": {"temperature": 0.7, "deterministic": True}}
    assert api.post("/v1/llm/cache/store", json=declared).status_code == 201
    assert api.post("/v1/llm/cache/lookup", json=body(model)).json()["hit"] is False
    assert api.post("/v1/llm/cache/lookup", json=declared).json()["response"] == "sampled"


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        ({"model_version": "v1", "template_version": "t1", "prompt": "x"}, 422, "invalid_request"),
        (
            {"model": "bot", "model_version": "v1", "template_version": "t1", "prompt": ""},
            422,
            "invalid_request",
        ),
        (
            {
                "model": "b:*",
                "model_version": "v1",
                "template_version": "t1",
                "prompt": "x",
                "params": {"temperature": 0},
            },
            400,
            "invalid_id",
        ),
        (
            {
                "model": "bot",
                "model_version": "v1",
                "template_version": "t1",
                "prompt": "x",
                "params": [0],
            },
            422,
            "invalid_request",
        ),
        (
            {"model": "bot", "model_version": "v1", "template_version": "t1", "prompt": "x"},
            422,
            "not_deterministic",
        ),
        (["not", "an", "object"], 422, "invalid_request"),
    ],
)
def test_bad_requests_get_clear_errors(api: Api, payload: Any, status: int, code: str) -> None:
    answer = api.post("/v1/llm/cache/lookup", json=payload)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code


def test_a_key_is_required(api: Api, model: str) -> None:
    answer = api.post("/v1/llm/cache/lookup", key=None, json=body(model))
    assert answer.status_code == 401
    flag = api.post("/v1/llm/cache/flag", json={**body(model), "entry_id": "zz"})
    assert flag.status_code == 422 and flag.json()["error"]["code"] == "invalid_request"


def test_the_api_warms_the_indexes_at_start(
    enabled: Settings, engine: Engine, redis_client: redis.Redis, tenants: list[str], model: str
) -> None:
    scope = Scope(tenants[0], model, "v1", "t1")
    writer = SemanticCache(redis_client, local_model())
    writer.store(scope, PROMPT, {"temperature": 0}, "warmed")
    writer.close()
    with api_for(enabled, engine, redis_client, tenants[0]) as client:
        service = client.app.state.semantic
        # Built at start-up, before any request asked for it.
        assert wait_until(lambda: service.pool_ready(scope.namespace), timeout=60)
        hit = client.post("/v1/llm/cache/lookup", json=body(model, NEAR)).json()
        assert hit["hit"] is True and hit["response"] == "warmed"

    cold = create_app(
        enabled.model_copy(update={"semantic_warm": False}),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        registry=REGISTRY,
    )
    with running(cold):
        assert not cold.state.semantic.pool_ready(scope.namespace)


def test_the_limits_come_from_the_settings(settings: Settings, redis_client: redis.Redis) -> None:
    tuned = settings.model_copy(
        update={
            "semantic_max_entries": 7,
            "semantic_max_entries_per_model": {"tiny": 3},
            "semantic_max_namespaces": 4,
            "semantic_index_max_vectors": 12_345,
        }
    )
    service = SemanticService(tuned, redis_client)
    made = service.cache()
    try:
        assert made.limits == Limits(7, {"tiny": 3}, 4)
        assert made.pool.max_vectors == 12_345
    finally:
        service.close()
    with pytest.raises(ValueError, match="max entries 0"):
        Settings(semantic_max_entries_per_model={"tiny": 0})


def test_an_exploration_is_labelled_by_the_callers_store(api: Api, model: str) -> None:
    """The caller's code does not change: lookup, on a miss call the model and store.
    A miss that names a candidate is an exploration, and the store labels it."""
    cache = api.app.state.semantic.cache()
    api.post("/v1/llm/cache/store", json=body(model, response="Use the reset link."))
    cache.rng = EXPLORE
    near_miss = "How do I reset the password of my email?"  # 0.85: below a fresh entry's line
    miss = api.post("/v1/llm/cache/lookup", json=body(model, near_miss)).json()
    assert miss["hit"] is False and "response" not in miss
    assert miss["candidate_id"] and miss["estimated_error"] > 0.02
    stored = api.post(
        "/v1/llm/cache/store", json=body(model, near_miss, response="Ask your email provider.")
    )
    assert stored.status_code == 201 and stored.json()["agreed"] is False
    paraphrase = "I forgot my password, what should I do?"  # 0.80
    assert api.post("/v1/llm/cache/lookup", json=body(model, paraphrase)).json()["candidate_id"]
    agreed = api.post(
        "/v1/llm/cache/store", json=body(model, paraphrase, response="use the reset link")
    )
    assert agreed.json()["agreed"] is True
    # A store that answers no exploration says nothing about agreement.
    assert (
        "agreed"
        not in api.post("/v1/llm/cache/store", json=body(model, "Hi", response="Hello")).json()
    )
    cache.rng = NEVER
    metrics = api.ops("/metrics").text
    assert f'freshline_semantic_explored_total{{model="{model}"}} 2.0' in metrics
    assert f'freshline_semantic_labels_total{{model="{model}",outcome="agreed"}} 1.0' in metrics
    assert f'freshline_semantic_labels_total{{model="{model}",outcome="disagreed"}} 1.0' in metrics


def test_a_flag_with_its_prompt_keeps_the_entry_for_closer_prompts(api: Api, model: str) -> None:
    api.post("/v1/llm/cache/store", json=body(model, response="Use the reset link."))
    served = "How do I reset my password for this account?"  # 0.95
    hit = api.post("/v1/llm/cache/lookup", json=body(model, served)).json()
    assert hit["hit"] is True
    flagged = api.post(
        "/v1/llm/cache/flag", json={**body(model, served), "entry_id": hit["entry_id"]}
    ).json()
    assert flagged["removed"] is False and flagged["similarity"] == pytest.approx(hit["similarity"])
    assert flagged["threshold"] > hit["similarity"]
    assert api.post("/v1/llm/cache/lookup", json=body(model, served)).json()["hit"] is False
    assert api.post("/v1/llm/cache/lookup", json=body(model, NEAR)).json()["hit"] is True
    metrics = api.ops("/metrics").text
    assert f'freshline_semantic_flagged_total{{model="{model}"}} 1.0' in metrics
    assert f'freshline_semantic_estimated_error_total{{model="{model}"}}' in metrics


def test_the_decision_comes_from_the_settings(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    learned = SemanticService(
        settings.model_copy(update={"semantic_max_error": 0.05}), redis_client
    )
    assert learned.decision is not None and learned.decision.max_error == 0.05
    assert learned.decision.prior.embedding_model == "all-MiniLM-L6-v2"
    static = SemanticService(
        settings.model_copy(update={"semantic_decision": "static"}), redis_client
    )
    assert static.decision is None
    # An endpoint's embedding model has no shipped prior: the API does not start.
    endpoint = settings.model_copy(
        update={
            "semantic_embeddings_url": "http://127.0.0.1:9/v1",
            "semantic_embeddings_model": "text-embedding-3-small",
        }
    )
    with pytest.raises(InvalidPrior, match="FRESHLINE_SEMANTIC_PRIOR"):
        SemanticService(endpoint, redis_client)
    path = tmp_path / "prior.json"
    path.write_text('{"embedding_model": "text-embedding-3-small", "mean": 0.6, "sd": 0.1}')
    tuned = SemanticService(endpoint.model_copy(update={"semantic_prior": str(path)}), redis_client)
    assert tuned.decision is not None and tuned.decision.prior.mean == 0.6
    with pytest.raises(ValueError, match="semantic_max_error"):
        Settings(semantic_max_error=0)
