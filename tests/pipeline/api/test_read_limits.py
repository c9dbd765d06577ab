"""A tenant's limits on every read path (issue 48), on the real Postgres and Redis: reads
that ask for freshness keep to its concurrency and pay its pool time, and all its keys
share one rate."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api.accounts import create_api_key, set_tenant_limits
from freshline.pipeline.api.tenancy import TenantSlots
from freshline.pipeline.cache.tokens import freshline_token
from freshline.pipeline.core.settings import Settings
from tests.helpers import api_app, running
from tests.pipeline.api.test_tenancy import reads_held_to

REQUESTS = 6
SHARE = 0.05
BURST_S = 60.0  # the tenant's pool seconds: more than the lock below is ever held, so no
# read waits; its burst is the server's in proportion to its share over the server's (1)


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=REQUESTS, transactions=30).tenants[0]


@pytest.mark.parametrize("ask", ["max_staleness_ms", "after"])
def test_a_tenants_freshness_reads_keep_to_its_concurrency_and_pay_its_pool_time(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str, ask: str
) -> None:
    """``max_staleness_ms=0`` computes every read anew, and so does a token read that
    waits for nothing (``wait_ms=0``) of entries not there: each a recompute in the
    thread pool, held to the tenant's one job at once however many it sends."""
    set_tenant_limits(engine, None, tenant, {"concurrency": 1, "pool_share": SHARE})
    app = api_app(
        settings,
        engine,
        redis_client,
        api_tenant_concurrency=4,
        api_tenant_pool_share=1.0,
        api_tenant_pool_burst_s=BURST_S / SHARE,
    )
    key = create_api_key(engine, tenant)
    if ask == "after":
        query = f"?after={freshline_token(engine)}&wait_ms=0"
    else:
        query = "?max_staleness_ms=0"
    with running(app, key) as api:
        slots: TenantSlots = app.state.tenant_slots
        answers = reads_held_to(api, engine, key, tenant, REQUESTS, allowed=1, query=query)
        budget = slots.budget
        assert budget is not None
        assert budget.left("another tenant", SHARE) == pytest.approx(BURST_S)
        left = budget.left(tenant, SHARE)
    assert [a.status_code for a in answers] == [200] * REQUESTS
    assert {a.json()["source"] for a in answers} == {"computed"}
    # Each recompute was charged to the tenant's pool time: the first one's wait in
    # Postgres, at least.
    assert left < BURST_S


def test_a_tenants_keys_share_its_one_rate(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> None:
    """Three keys of one tenant get its rate between them, not three times it."""
    set_tenant_limits(engine, None, tenant, {"rate_per_s": 0.01, "rate_burst": 2})
    app = api_app(settings, engine, redis_client, api_rate_hold_s=0.05)
    keys = [create_api_key(engine, tenant) for _ in range(3)]
    with running(app) as api:
        answers = [api.get("/v1/features/txn_90d/1", key=k) for k in keys * 2]
    assert [a.status_code for a in answers] == [200, 200] + [429] * 4
    assert "requests/s for this tenant" in answers[-1].json()["error"]["message"]
