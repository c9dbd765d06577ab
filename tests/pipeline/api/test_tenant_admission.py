"""Each tenant's budget of thread-pool time (issue 30): work is charged by what it
costs, a tenant over its share waits or is refused, and no other tenant notices; on
the real Postgres and Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.api.limits import PoolBudget, TenantOverBudget
from freshline.pipeline.core.settings import Settings
from tests.helpers import api_app, running


@pytest.fixture(scope="module")
def tenants(tenant_factory_module: Callable[..., SeedSummary]) -> list[str]:
    return tenant_factory_module(users=4, transactions=40, tenants=2).tenants


def test_a_tenant_over_its_pool_share_gets_429_before_its_body_and_others_do_not(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenants: list[str],
    audit: Callable[[], list[dict[str, Any]]],
) -> None:
    greedy, other = tenants
    # Any read-through costs far more than this share pays back in a second, so one
    # miss leaves the tenant owing seconds, over the 0.05 s it may wait.
    app = api_app(
        settings,
        engine,
        redis_client,
        api_tenant_pool_share=0.0001,
        api_tenant_pool_burst_s=0.0001,
        api_tenant_pool_wait_s=0.05,
    )
    other_key = create_api_key(engine, other)
    with running(app, create_api_key(engine, greedy)) as api:
        assert api.get("/v1/features/txn_90d/1").status_code == 200  # a miss: the pool
        refused = api.get("/v1/features/txn_90d/2")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "tenant_over_budget"
        assert int(refused.headers["Retry-After"]) >= 1
        # Refused before its body is read: a body that is no JSON gets 429, not 400.
        bad_body = api.post("/v1/features/batch", content=b"{not json")
        assert (bad_body.status_code, bad_body.json()["error"]["code"]) == (
            429,
            "tenant_over_budget",
        )
        # The budget is the tenant's: another tenant's misses are served.
        assert api.get("/v1/features/txn_90d/1", key=other_key).status_code == 200
    over = [line for line in audit() if line["event"] == "tenant.over_budget"]
    assert len(over) == 2 and {line["tenant"] for line in over} == {greedy}


def test_pool_budget_charges_work_and_refuses_only_past_the_wait() -> None:
    now = [0.0]
    budget = PoolBudget(0.5, 1.0, 0.5, clock=lambda: now[0])
    budget.charge("a", 1.0)  # the whole burst: no debt yet
    assert budget.owed("a") == 0
    budget.charge("a", 1.5)  # 1.5 s of work over: 3 s to pay back at 0.5 s/s
    assert budget.owed("a") == pytest.approx(3.0)
    with pytest.raises(TenantOverBudget) as over:
        asyncio.run(budget.check("a"))  # waits the 0.5 s it may (the test's clock stands)
    assert over.value.status == 429 and over.value.retry_after == 3
    assert budget.owed("b") == 0
    asyncio.run(budget.check("b"))  # another tenant owes nothing
    now[0] = 2.5
    assert budget.owed("a") == pytest.approx(0.5)
    asyncio.run(budget.check("a"))  # within the wait: let through, to wait in the pool
    assert PoolBudget(0, 1.0, 0.0).owed("a") == 0  # share 0: no limit
