"""/status and /status.json show each tenant's busiest semantic cache namespaces."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.semantic_status import busiest
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY, Api, api_for, running, serving
from tests.pipeline.api.test_status_browser import chromium, console_errors, run_chromium
from tests.pipeline.semantic.test_learning import NEVER

__all__ = ["chromium"]  # the fixture, imported for the page test

PROMPT = "How do I reset the password of my account?"
NEAR = "How do I reset the password of my account ?"


@pytest.fixture(scope="module")
def tenant(tenant_factory_module: Callable[..., SeedSummary]) -> str:
    return tenant_factory_module(users=2, transactions=10).tenants[0]


@pytest.fixture
def model() -> str:
    return f"bot-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def api(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str, model: str
) -> Iterator[Api]:
    named = settings.model_copy(update={"semantic_enabled": True, "semantic_models": [model]})
    with api_for(named, engine, redis_client, tenant) as client:
        client.app.state.semantic.cache().rng = NEVER  # no exploration draws
        yield client


def body(model: str, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    scope = {"model_version": "v1", "template_version": "t1", "params": {"temperature": 0}}
    return {"model": model, "prompt": prompt, **scope, **extra}


def flagged_hit(api: Api, model: str) -> float:
    """A miss, a store, a hit that its caller flags (removing the entry), a miss and
    its store (which writes the counters the process still held): the hit's estimated
    error."""
    assert api.post("/v1/llm/cache/lookup", json=body(model)).json()["hit"] is False
    stored = api.post("/v1/llm/cache/store", json=body(model, response="Use the link."))
    assert stored.status_code == 201, stored.text
    hit = api.post("/v1/llm/cache/lookup", json=body(model, NEAR)).json()
    assert hit["hit"] is True
    flag = api.post("/v1/llm/cache/flag", json={**body(model), "entry_id": hit["entry_id"]})
    assert flag.json()["removed"] is True
    assert api.post("/v1/llm/cache/lookup", json=body(model, NEAR)).json()["hit"] is False
    again = api.post("/v1/llm/cache/store", json=body(model, NEAR, response="Use the link."))
    assert again.status_code == 201, again.text
    return float(hit["estimated_error"])


def test_status_json_shows_a_namespaces_figures(api: Api, tenant: str, model: str) -> None:
    estimated = flagged_hit(api, model)
    secret = f"acme-secret-{uuid.uuid4().hex[:8]}"  # a model the settings do not name
    assert api.post("/v1/llm/cache/lookup", json=body(secret)).status_code == 200
    assert api.post("/v1/llm/cache/store", json=body(secret, response="yo")).status_code == 201

    text = api.ops("/status.json").text
    assert secret not in text
    shown = api.ops("/status.json").json()["semantic_namespaces"]
    rows = {(r["tenant"], r["model"]): r for r in shown["rows"]}
    row = rows[(tenant, model)]
    assert (row["lookups"], row["hits"], row["flagged"], row["entries"]) == (3, 1, 1, 1)
    assert row["hit_rate"] == pytest.approx(1 / 3)
    assert row["exploration_rate"] == 0
    assert row["estimated_error"] == pytest.approx(estimated, abs=1e-6)
    assert row["observed_error"] == 1.0  # flags over hits
    other = rows[(tenant, "other")]
    assert (other["lookups"], other["entries"]) == (1, 1)
    assert shown["namespaces"] >= 2


def test_the_ops_process_shows_them_without_running_the_cache(
    api: Api, settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str, model: str
) -> None:
    """``freshline serve``'s ops process runs no semantic cache, yet shows its figures."""
    flagged_hit(api, model)
    ops_settings = settings.model_copy(update={"semantic_models": [model]})
    assert not ops_settings.semantic_enabled
    for figures, shown in ((True, True), (None, False)):
        app = create_app(
            ops_settings,
            engine=engine,
            redis_client=redis_client,
            follow_deploys=False,
            semantic_figures=figures,
            registry=REGISTRY,
        )
        with running(app) as ops:
            report = ops.ops("/status.json").json()
        if shown:
            rows = report["semantic_namespaces"]["rows"]
            [row] = [r for r in rows if (r["tenant"], r["model"]) == (tenant, model)]
            assert (row["lookups"], row["flagged"]) == (3, 1)
        else:
            assert report["semantic_namespaces"] is None


def test_a_namespace_flagged_above_the_bound_is_a_problem(
    api: Api, redis_client: redis.Redis, tenant: str, model: str
) -> None:
    bound = api.app.state.ops.board.observer.settings.semantic_max_error
    ns = f"{{{tenant}:{model}:v9:t9}}"
    redis_client.zadd(f"sem:ns:{tenant}", {ns: 1e15})
    redis_client.hset(f"sem:stats:{ns}", mapping={"hits": 40, "misses": 10, "flagged": 2})
    try:
        problems = api.ops("/status.json").json()["problems"]
    finally:
        redis_client.zrem(f"sem:ns:{tenant}", ns)
        redis_client.delete(f"sem:stats:{ns}")
    assert bound < 2 / 40
    assert (
        f"semantic cache {tenant} {model}: 5.0% of hits flagged, above the {bound:.1%} bound"
        in (problems)
    )


def test_the_busiest_are_shown_and_models_are_labelled(redis_client: redis.Redis) -> None:
    """Rows are tenant and model label, versions summed; the most lookups first, top N."""
    run = uuid.uuid4().hex[:8]
    tenant = f"t{run}"
    models = [f"m{run}{i}" for i in range(4)]
    now_ms = 1e15  # far in the future: within any TTL
    for i, m in enumerate(models):
        for version in ("v1", "v2"):
            ns = f"{{{tenant}:{m}:{version}:t1}}"
            redis_client.zadd(f"sem:ns:{tenant}", {ns: now_ms})
            redis_client.hset(f"sem:stats:{ns}", mapping={"hits": i, "misses": 1})
    try:
        named = {models[3], models[2]}
        shown = busiest(redis_client, [tenant], lambda m: m if m in named else "other", ttl_s=60)
        top = busiest(redis_client, [tenant], lambda m: m, ttl_s=60, top=1)
    finally:
        redis_client.delete(f"sem:ns:{tenant}")
        for m in models:
            for version in ("v1", "v2"):
                redis_client.delete(f"sem:stats:{{{tenant}:{m}:{version}:t1}}")
    assert shown["namespaces"] == 8
    summary = [(r["model"], r["namespaces"], r["lookups"], r["hits"]) for r in shown["rows"]]
    assert summary == [(models[3], 2, 8, 6), (models[2], 2, 6, 4), ("other", 4, 6, 2)]
    assert [r["model"] for r in top["rows"]] == [models[3]]


@pytest.mark.slow
def test_the_page_shows_a_namespaces_figures(
    api: Api, tenant: str, model: str, chromium: str, tmp_path: Path
) -> None:
    flagged_hit(api, model)
    with serving(api.app.state.ops_app) as port:
        dom = run_chromium(chromium, tmp_path, "--dump-dom", f"http://127.0.0.1:{port}/status")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not console_errors(dom.stderr), console_errors(dom.stderr)
    figures = dict(
        re.findall(rf'data-metric="(ns_\w+)" data-set="{tenant}/{model}">([^<]+)<', dom.stdout)
    )
    assert figures == {
        "ns_lookups": "3",
        "ns_hit_rate": "33.3%",
        "ns_exploration_rate": "0.0%",
        "ns_estimated_error": figures["ns_estimated_error"],
        "ns_observed_error": "100.0%",
        "ns_entries": "1",
    }
    assert figures["ns_estimated_error"].endswith("%")
