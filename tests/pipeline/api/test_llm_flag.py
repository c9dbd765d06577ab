"""POST /v1/llm/cache/flag for a namespace never stored into (issue 30): answered from
one Redis command on the event loop, with no key written and no thread-pool work."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api.tenancy import TenantSlots
from freshline.pipeline.core.settings import Settings
from tests.helpers import Api, api_for

ENTRY = "00000000000000aa"


@pytest.fixture(scope="module")
def tenant(tenant_factory_module: Callable[..., SeedSummary]) -> str:
    return str(tenant_factory_module(users=1, transactions=1).tenants[0])


@pytest.fixture
def api(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> Iterator[Api]:
    # A pool share so small that any job the tenant runs in the thread pool, however
    # short, leaves it owing pool time: what it owes shows whether a job ran.
    tight = settings.model_copy(
        update={
            "semantic_enabled": True,
            "api_tenant_pool_share": 1e-6,
            "api_tenant_pool_burst_s": 1e-9,
        }
    )
    with api_for(tight, engine, redis_client, tenant) as client:
        client.app.state.semantic.cache()  # the model loaded, outside any tenant's share
        yield client


def tenant_keys(client: redis.Redis, tenant: str) -> set[bytes]:
    return set(client.scan_iter(match=f"*{tenant}*", count=1000))


@pytest.mark.parametrize("prompt", [None, "How do I reset my password?"])
def test_a_flag_for_a_namespace_never_stored_into_stores_nothing_and_runs_no_job(
    api: Api, redis_client: redis.Redis, tenant: str, prompt: str | None
) -> None:
    before = tenant_keys(redis_client, tenant)
    flag = {
        "model": f"ghost-{uuid.uuid4().hex[:8]}",
        "model_version": "v1",
        "template_version": "t1",
        "entry_id": ENTRY,
        **({"prompt": prompt} if prompt else {}),
    }
    answer = api.post("/v1/llm/cache/flag", json=flag)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"entry_id": ENTRY, "removed": False}
    assert tenant_keys(redis_client, tenant) == before
    slots: TenantSlots = api.app.state.tenant_slots
    assert slots.budget is not None and slots.budget.owed(tenant) == 0


def test_a_flag_for_a_namespace_never_stored_into_still_checks_the_entry_id(api: Api) -> None:
    flag = {"model": "ghost", "model_version": "v1", "template_version": "t1", "entry_id": "zz"}
    answer = api.post("/v1/llm/cache/flag", json=flag)
    assert answer.status_code == 422 and answer.json()["error"]["code"] == "invalid_request"
