"""Each tenant's share of a worker's thread pool (issue 30, "Leases always end"), on the
real Postgres and Redis: one tenant's slow misses hold at most its share of threads."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future

import httpx
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY, Api, fresh_version, running, wait_until

SHARE = 2
REQUESTS = 6


@pytest.fixture(scope="module")
def tenants(tenant_factory_module: Callable[..., SeedSummary]) -> list[str]:
    return tenant_factory_module(users=REQUESTS, transactions=60, tenants=1).tenants


def waiting_on(engine: Engine, table: str) -> int:
    """Backends waiting for a lock on ``table``."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = "
                    "CAST(:t AS regclass)"
                ),
                {"t": table},
            ).scalar_one()
        )


def reads_held_to(
    api: Api, engine: Engine, key: str, tenant: str, requests: int, allowed: int, query: str = ""
) -> list[httpx.Response]:
    """Send ``requests`` reads of ``tenant`` (each with ``query``, such as
    ``?max_staleness_ms=0``) whose read-throughs all block in Postgres (``users``
    locked), check that only ``allowed`` of them reach it while the rest wait for a
    slot, then lift the lock; the answers."""
    slots = getattr(api.app.state, "tenant_slots", None)
    with engine.connect() as locker:
        # Every read-through of this tenant now blocks in Postgres, holding its thread.
        locker.execute(sa.text("LOCK TABLE users IN ACCESS EXCLUSIVE MODE"))
        sent: list[Future[httpx.Response]] = [
            api.portal.start_task_soon(
                functools.partial(
                    api.client.get,
                    f"/v1/features/txn_90d/{entity}{query}",
                    headers={"Authorization": f"Bearer {key}"},
                )
            )
            for entity in range(1, requests + 1)
        ]

        def settled() -> bool:
            blocked = waiting_on(engine, "users")
            every_one_in = slots is not None and slots.busy(tenant) == requests
            return blocked == requests or (every_one_in and blocked == allowed)

        assert wait_until(settled, timeout=30)
        assert waiting_on(engine, "users") == allowed, "a tenant took more than its threads"
        locker.rollback()  # the lock goes; the waiting requests take their turns
        return [f.result(timeout=60) for f in sent]


def test_one_tenants_slow_misses_hold_at_most_its_share_of_threads(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenants: list[str]
) -> None:
    [tenant] = tenants
    app = create_app(
        settings.model_copy(
            update={
                "schema_version": fresh_version(),  # every read a miss
                "local_cache_size": 0,
                "api_tenant_concurrency": SHARE,
            }
        ),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        registry=REGISTRY,
    )
    key = create_api_key(engine, tenant)
    with running(app, key) as api:
        slots = getattr(app.state, "tenant_slots", None)
        answers = reads_held_to(api, engine, key, tenant, REQUESTS, SHARE)
    assert [a.status_code for a in answers] == [200] * REQUESTS
    assert slots is not None and slots.busy(tenant) == 0
