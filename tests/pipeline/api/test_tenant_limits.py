"""A tenant's own API limits (issue 30: a platform gives a tenant it does not trust less
than the servers' defaults, and a trusted one more), on the real Postgres and Redis:
stored with the tenant, read with its key, applied by every worker on the tenant's next
request, and by no other tenant."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api.accounts import (
    TenantLimits,
    UnknownTenant,
    create_api_key,
    set_tenant_limits,
    tenant_limits,
)
from freshline.pipeline.api.buckets import TokenBuckets
from freshline.pipeline.api.limits import PoolBudget
from freshline.pipeline.core.settings import Settings
from tests.helpers import api_app, cli, running, wait_until
from tests.pipeline.api.test_tenancy import reads_held_to

REQUESTS = 3


@pytest.fixture
def two_tenants(tenant_factory: Callable[..., SeedSummary]) -> list[str]:
    return tenant_factory(users=REQUESTS, transactions=30, tenants=2).tenants


def test_a_names_own_rate_and_burst_replace_the_buckets() -> None:
    now = [0.0]
    buckets = TokenBuckets(1000.0, 2000, clock=lambda: now[0])
    assert [buckets.reserve("slow", 0, rate=1.0, burst=2) for _ in range(2)] == [0.0, 0.0]
    assert buckets.reserve("slow", 0, rate=1.0, burst=2) is None  # its own burst is spent
    assert buckets.wait("slow", rate=1.0, burst=2) == pytest.approx(1.0)
    assert [buckets.reserve("other", 0) for _ in range(3)] == [0.0] * 3  # the bucket's
    # A name whose limit is lowered keeps no more than its new burst.
    assert buckets.reserve("other", 0, rate=1.0, burst=1) == 0.0
    assert buckets.reserve("other", 0, rate=1.0, burst=1) is None
    assert buckets.reserve("free", 0, rate=0.0) == 0.0  # its own 0: no limit


def test_a_tenants_own_pool_share_is_charged_at_its_rate() -> None:
    now = [0.0]
    budget = PoolBudget(1.0, 1.0, 2.0)
    budget._spent.clock = lambda: now[0]
    budget.charge("small", 1.5, share=0.01)
    budget.charge("default", 1.5)
    # The server's burst is 1 s, the small tenant's 0.01 s (its share of it): 0.5 s of
    # debt paid back in 0.5 s at the server's share, 1.49 s of debt in 149 s at 0.01.
    assert budget.owed("default") == pytest.approx(0.5)
    assert budget.owed("small", share=0.01) == pytest.approx(149.0)


def test_a_small_share_is_a_small_burst_after_an_idle_spell() -> None:
    """A tenant of share 0.01 under the server's 5 s burst may not spend 5 s of a
    worker's threads at once (500 s of its share) after a quiet spell: its bucket holds
    its share of the burst, 0.05 s, as a default tenant's holds 5 s."""
    now = [0.0]
    budget = PoolBudget(1.0, 5.0, 2.0)
    budget._spent.clock = lambda: now[0]
    now[0] = 3600.0  # an hour idle: both buckets are full
    budget.charge("small", 0.1, share=0.01)
    budget.charge("default", 0.1)
    assert budget.owed("default") == 0.0
    assert budget.left("default") == pytest.approx(4.9)
    assert budget.owed("small", share=0.01) == pytest.approx(5.0)  # 0.05 s of debt at 0.01/s
    now[0] += 5.0
    assert budget.owed("small", share=0.01) == 0.0
    assert budget.left("small", share=0.01) == pytest.approx(0.0)
    # A share above the server's has a burst above it, in proportion.
    assert budget.left("big", share=2.0) == pytest.approx(10.0)


def test_a_tenants_own_rate_applies_to_its_cached_keys_at_once_and_to_no_one_else(
    settings: Settings, engine: Engine, redis_client: redis.Redis, two_tenants: list[str]
) -> None:
    limited, other = two_tenants
    app = api_app(settings, engine, redis_client, api_rate_hold_s=0.05)  # rate 1000/s
    key = create_api_key(engine, limited)
    other_key = create_api_key(engine, other)
    with running(app, key) as api:
        auth = app.state.services.auth
        assert auth.wait_live(10), "the API's key subscription did not come up"
        assert [api.get("/v1/features/txn_90d/1").status_code for _ in range(3)] == [200] * 3
        assert auth.cached(key)[1] is not None  # the key, and its limits, are cached
        limits = set_tenant_limits(
            engine, redis_client, limited, {"rate_per_s": 0.01, "rate_burst": 2}
        )
        assert limits == TenantLimits(rate_per_s=0.01, rate_burst=2)
        # The change is published: the worker drops the cached key and reads the new
        # limits with it, so the tenant is held to 2 requests, then refused.
        statuses: list[int] = []

        def held_to_its_rate() -> bool:
            statuses.append(api.get("/v1/features/txn_90d/1").status_code)
            return statuses[-1] == 429

        assert wait_until(held_to_its_rate, timeout=10), statuses
        refused = api.get("/v1/features/txn_90d/1")
        assert refused.status_code == 429
        assert "over 0.01 requests/s" in refused.json()["error"]["message"]
        # Another tenant, at the server's rate, is served.
        answers = [api.get("/v1/features/txn_90d/1", key=other_key) for _ in range(10)]
        assert [a.status_code for a in answers] == [200] * 10
        # Cleared: the server's rate again.
        set_tenant_limits(engine, redis_client, limited, {"rate_per_s": None, "rate_burst": None})
        assert wait_until(lambda: api.get("/v1/features/txn_90d/1").status_code == 200, 10)
    assert tenant_limits(engine, limited) == TenantLimits()


def test_a_tenants_own_concurrency_bounds_its_threads_below_the_servers(
    settings: Settings, engine: Engine, redis_client: redis.Redis, two_tenants: list[str]
) -> None:
    limited, _ = two_tenants
    set_tenant_limits(engine, None, limited, {"concurrency": 1})
    app = api_app(settings, engine, redis_client, api_tenant_concurrency=4)
    key = create_api_key(engine, limited)
    with running(app, key) as api:
        answers = reads_held_to(api, engine, key, limited, REQUESTS, allowed=1)
    assert [a.status_code for a in answers] == [200] * REQUESTS


def test_a_tenants_own_row_limit_counts_what_its_requests_ask_for(
    settings: Settings, engine: Engine, redis_client: redis.Redis, two_tenants: list[str]
) -> None:
    """A request's rate counts a batch of 100 ids once; the tenant's rows count each
    (entities times feature sets, prediction rows): past its burst a request is 413,
    past its rate 429, each after the hold; another tenant is not held to them."""
    limited, other = two_tenants
    set_tenant_limits(engine, None, limited, {"rows_per_s": 0.01, "rows_burst": 40})
    app = api_app(settings, engine, redis_client, api_rate_hold_s=0.05)
    key = create_api_key(engine, limited)
    other_key = create_api_key(engine, other)

    def batch(ids: int, sets: list[str], key: str = key) -> tuple[int, str]:
        body = {"feature_sets": sets, "entities": [str(i) for i in range(1, ids + 1)]}
        answer = api.post("/v1/features/batch", json=body, key=key)
        return answer.status_code, answer.json().get("error", {}).get("code", "")

    with running(app, key) as api:
        assert batch(100, ["txn_90d"]) == (413, "over_rows_burst")
        assert batch(10, ["txn_90d", "geo"]) == (200, "")  # 20 rows of its 40
        assert batch(20, ["txn_90d"]) == (200, "")  # 40
        assert batch(1, ["txn_90d"]) == (429, "rows_limited")  # its next row in 100 s
        refused = api.post("/v1/features/batch", json={"feature_sets": ["geo"], "entities": ["1"]})
        assert int(refused.headers["Retry-After"]) >= 60
        rows = [[1.0, 2.0, 3.0, 4.0]] * 50
        predicted = api.post("/v1/models/fraud/predict", json={"inputs": rows})
        assert predicted.status_code == 413, predicted.text
        assert batch(100, ["txn_90d"], other_key) == (200, "")  # the server's: no limit
        assert api.get("/v1/features/txn_90d/1").status_code == 200  # one request: its rate
    assert tenant_limits(engine, limited) == TenantLimits(rows_per_s=0.01, rows_burst=40)


def test_unknown_limits_and_tenants_are_refused(engine: Engine, two_tenants: list[str]) -> None:
    with pytest.raises(ValueError, match="no such limit: rate"):
        set_tenant_limits(engine, None, two_tenants[0], {"rate": 3})
    with pytest.raises(UnknownTenant):
        set_tenant_limits(engine, None, "no-such-tenant", {"rate_per_s": 3})
    with pytest.raises(sa.exc.IntegrityError):  # the table's checks: no negative limit
        set_tenant_limits(engine, None, two_tenants[0], {"pool_share": -1})


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return cli("tenants", "limits", *args, **env)


def test_cli_shows_sets_and_resets_a_tenants_limits(
    settings: Settings, engine: Engine, two_tenants: list[str], tmp_path: Path
) -> None:
    tenant = two_tenants[0]
    audit_file = tmp_path / "audit.log"
    env = {
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_AUDIT_LOG": str(audit_file),
    }
    done = _cli(env, tenant, "--rate", "20", "--burst", "40", "--pool-share", "0.01")
    assert done.returncode == 0, done.stderr
    assert tenant_limits(engine, tenant) == TenantLimits(20.0, 40, None, 0.01)
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[1:]}
    assert rows["rate_per_s"][:2] == ["20", "1000"] and rows["concurrency"][0] == "-"
    assert f"requests of all tenant {tenant}'s API keys together" in done.stderr
    done = _cli(env, tenant, "--reset", "rate", "--reset", "pool-share")
    assert done.returncode == 0, done.stderr
    assert tenant_limits(engine, tenant) == TenantLimits(rate_burst=40)
    assert _cli(env, tenant, "--reset", "all").returncode == 0
    assert tenant_limits(engine, tenant) == TenantLimits()
    audited = [json.loads(line) for line in audit_file.read_text().splitlines()]
    assert [a["event"] for a in audited] == ["tenant.limits"] * 3
    assert audited[0]["rate_per_s"] == 20.0 and "rate_per_s" not in audited[1]
    bad = _cli(env, tenant, "--reset", "bogus")
    assert bad.returncode == 2 and "is none of" in bad.stderr
    assert _cli(env, tenant, "--rate", "-1").returncode == 2
    unknown = _cli(env, "no-such-tenant", "--rate", "1")
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert "unknown tenant 'no-such-tenant'" in unknown.stderr
