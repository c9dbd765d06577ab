"""Per-tenant budgets of cached predictions (issue 30, item 1), on the real Redis.

A tenant's flood of distinct rows stays within its own budget, in keys and in bytes,
and evicts only its own oldest predictions: another tenant's are untouched.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key, create_tenant
from freshline.pipeline.core.budget import (
    ADMIT_CHUNK,
    TenantBudget,
    entry_cost,
    memory_problem,
    usage,
)
from freshline.pipeline.core.keys import inference_budget_keys, inference_prefix
from freshline.pipeline.core.lock import Lock
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.inference.models import LogisticModel, ModelRegistry
from freshline.pipeline.inference.predictions import InferenceCache
from tests.helpers import REGISTRY, Api, running

FEATURES = ("a", "b", "c")
BATCH = 50


@pytest.fixture
def model(tmp_path: Path, redis_client: redis.Redis) -> LogisticModel:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, len(FEATURES)))
    y = (x[:, 0] > 0).astype(float)
    fitted = LogisticModel.fit(
        x, y, version="v1", feature_names=FEATURES, name=f"m_{uuid.uuid4().hex[:10]}", epochs=5
    )
    ModelRegistry(redis_client).register(fitted.save(tmp_path / "v1.json"))
    return fitted


@pytest.fixture
def tenants(engine: Engine) -> list[str]:
    """Two tenants of their own (no source rows: predictions need none)."""
    names = [f"budget-{uuid.uuid4().hex[:8]}-{n}" for n in (1, 2)]
    for name in names:
        create_tenant(engine, name)
    return names


def serve(settings: Settings, engine: Engine, client: redis.Redis, **limits: int) -> Iterator[Api]:
    app = create_app(
        settings.model_copy(update={"api_batch_limit": BATCH, "local_cache_size": 0, **limits}),
        engine=engine,
        redis_client=client,
        follow_deploys=False,
        registry=REGISTRY,
    )
    with running(app) as api:
        yield api


def rows(start: int, n: int) -> list[list[float]]:
    """``n`` distinct rows (distinct after rounding to 4 decimals)."""
    return [[float(start + i), 0.5, -0.5] for i in range(n)]


def tenant_keys(client: redis.Redis, model: LogisticModel, tenant: str) -> set[str]:
    prefix = inference_prefix(model.name, model.version, tenant)
    return {k.decode() for k in client.scan_iter(match=f"{prefix}*", count=1000)}


def flood(api: Api, model: LogisticModel, key: str, requests: int) -> list[list[float]]:
    """``requests`` batches of distinct rows from one key; the last batch's rows."""
    url = f"/v1/models/{model.name}/predict"
    last: list[list[float]] = []
    for i in range(requests):
        last = rows(1000 + i * BATCH, BATCH)
        answer = api.post(url, json={"inputs": last}, key=key)
        assert answer.status_code == 200, answer.text
        assert not any(p["hit"] for p in answer.json()["predictions"])
    return last


@pytest.mark.parametrize("limit", ["keys", "bytes"])
def test_a_flood_of_distinct_rows_stays_within_its_tenants_budget(
    limit: str,
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    model: LogisticModel,
    tenants: list[str],
) -> None:
    abuser, other = tenants
    abuser_key, other_key = create_api_key(engine, abuser), create_api_key(engine, other)
    cost = entry_cost(
        inference_prefix(model.name, model.version, abuser) + "{" + "0" * 32 + "}", 11
    )
    budget = 30
    limits = (
        {"inference_tenant_max_keys": budget, "inference_tenant_max_bytes": 1 << 30}
        if limit == "keys"
        else {"inference_tenant_max_keys": 1_000_000, "inference_tenant_max_bytes": budget * cost}
    )
    for api in serve(settings, engine, redis_client, **limits):
        url = f"/v1/models/{model.name}/predict"
        theirs = rows(0, 20)
        assert api.post(url, json={"inputs": theirs}, key=other_key).status_code == 200
        kept = tenant_keys(redis_client, model, other)
        values = dict(zip(kept, redis_client.mget(list(kept)), strict=True))
        assert len(kept) == 20

        last = flood(api, model, abuser_key, requests=10)  # 500 distinct rows

        mine = tenant_keys(redis_client, model, abuser)
        assert len(mine) == budget, f"{len(mine)} predictions kept of a budget of {budget}"
        assert usage(redis_client, inference_budget_keys(abuser)) == (budget, budget * cost)
        # The newest stayed: every kept prediction is of the last batch, and hits.
        again = api.post(url, json={"inputs": last}, key=abuser_key).json()["predictions"]
        assert sum(p["hit"] for p in again) == budget

        # The other tenant's predictions are all there, as they were, and hit.
        assert dict(zip(kept, redis_client.mget(list(kept)), strict=True)) == values
        answer = api.post(url, json={"inputs": theirs}, key=other_key).json()["predictions"]
        assert all(p["hit"] for p in answer)
        assert usage(redis_client, inference_budget_keys(other)) == (20, 20 * cost)


def test_every_budget_key_has_a_ttl(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    model: LogisticModel,
    tenants: list[str],
) -> None:
    tenant = tenants[0]
    for api in serve(settings, engine, redis_client, inference_ttl_s=600):
        answer = api.post(
            f"/v1/models/{model.name}/predict",
            json={"inputs": rows(0, 3)},
            key=create_api_key(engine, tenant),
        )
        assert answer.status_code == 200, answer.text
    for key in inference_budget_keys(tenant):
        assert 0 < redis_client.pttl(key) <= 601_000, key


def test_the_stacks_redis_bounds_every_tenant_together(redis_client: redis.Redis) -> None:
    """scripts/stack sets maxmemory, under noeviction: nothing freshline relies on
    (floors, tombstones, the newest entry) is ever evicted, and the sum of every
    tenant's budget is bounded."""
    assert memory_problem(redis_client) is None


def test_check_warns_when_redis_has_no_maxmemory_or_may_evict(
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from freshline.pipeline.cli import app

    url, _stop, _start = private_redis
    monkeypatch.setenv("FRESHLINE_REDIS_URL", url)
    lock = tmp_path / "features.lock.json"
    Lock({}).save(lock)
    runner = CliRunner()
    made = runner.invoke(app, ["check", "--lock", str(lock), "--update-lock"])
    assert made.exit_code == 0, made.output

    def warnings() -> str:
        result = runner.invoke(app, ["check", "--lock", str(lock)])
        assert result.exit_code == 0, result.output
        return " ".join(line for line in result.output.splitlines() if "warning" in line)

    assert "no maxmemory" in warnings()
    client = redis.Redis.from_url(url, username=_login()[0], password=_login()[1])
    try:
        client.config_set("maxmemory", "100mb")
        assert warnings() == ""
        client.config_set("maxmemory-policy", "volatile-lru")
        assert "volatile-lru" in warnings()
    finally:
        client.close()


def _login() -> tuple[str | None, str | None]:
    """The settings' Redis login, which the private server takes too."""
    login = Settings()
    return login.redis_username or None, login.redis_password.get_secret_value() or None


def test_a_full_redis_still_answers_predictions_uncached(
    private_redis: tuple[str, Callable[[], None], Callable[[], None]], model: LogisticModel
) -> None:
    """At its maxmemory (noeviction) Redis refuses writes: predictions are answered
    all the same, and nothing is stored."""
    url, _stop, _start = private_redis
    user, password = _login()
    client = redis.Redis.from_url(url, username=user, password=password)
    try:
        client.config_set("maxmemory", "1")  # below what it holds: every write is refused
        cache = InferenceCache(
            client, ttl_s=60, budget=TenantBudget(client, max_keys=10, max_bytes=1 << 20)
        )
        out = cache.predict(model, rows(0, 3), tenant="acme")
        assert out.values.tolist() == model.predict(np.array(rows(0, 3))).tolist()
        assert not out.hit.any()
        client.config_set("maxmemory", "0")
        assert client.dbsize() == 0
    finally:
        client.close()


def test_a_large_write_is_counted_in_chunks_that_each_keep_the_budget(
    redis_client: redis.Redis,
) -> None:
    """No script call holds Redis for more than ``ADMIT_CHUNK`` entries (every tenant's
    reads wait on it), and counting in chunks keeps what counting at once kept: the
    limits, the oldest popped first, a re-counted key counted once, and a key with a
    '|' of its own priced by its last one."""
    tenant = f"chunks-{uuid.uuid4().hex[:8]}"
    keys = (f"test:_own:{{{tenant}}}", f"test:_bytes:{{{tenant}}}")
    budget = TenantBudget(redis_client, max_keys=150, max_bytes=1 << 30)
    calls: list[int] = []
    admit = budget._admit

    def counted(*, keys: list[str], args: list[Any]) -> Any:
        calls.append(len(args) - 3)
        return admit(keys=keys, args=args)

    budget._admit = counted  # type: ignore[assignment]
    first = [(f"k|{tenant}|{i:04d}", 10) for i in range(100)]
    assert budget.admit_costs(keys, first, 60_000) == []
    assert calls == [ADMIT_CHUNK] * (100 // ADMIT_CHUNK) + [100 % ADMIT_CHUNK]
    again = first[:10]  # counted again: moved to a later expiry, not counted twice
    assert budget.admit_costs(keys, again, 120_000) == []
    second = [(f"k|{tenant}|{i:04d}", 10) for i in range(100, 190)]
    popped = budget.admit_costs(keys, second, 90_000)
    # 190 keys for 150 places: the 40 expiring first go, never the re-counted ones.
    assert [key for key, _ in popped] == [key for key, _ in first[10:50]]
    assert all(cost == entry_cost(key, 10) for key, cost in popped)
    n, size = usage(redis_client, keys)
    assert n == 150 and size == sum(entry_cost(k, 10) for k, _ in [*first, *second]) - sum(
        c for _, c in popped
    )
    assert max(calls) <= ADMIT_CHUNK
    redis_client.delete(*keys)
