"""``freshline serve`` for real: granian, two worker processes, metrics summed across them
on the ops port (and not on the API's)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.dev.processes import DidNotStart, serving
from tests.helpers import FRESHLINE, free_port, wait_until


@pytest.fixture
def ops_port() -> int:
    return free_port()


@pytest.fixture
def server(settings: Settings, tmp_path: Path, ops_port: int) -> Iterator[str]:
    port = free_port()
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_OPS_PORT": str(ops_port),
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [FRESHLINE, "serve", "--port", str(port), "--workers", "2"]
    with (tmp_path / "serve.log").open("w+b") as log:
        try:
            with serving(argv, port, env=env, log=log) as url:
                yield url
        except DidNotStart as exc:
            pytest.fail(f"serve did not come up: {exc}")


@pytest.mark.slow
def test_serve_answers_and_sums_metrics_across_workers(
    server: str, ops_port: int, engine: Engine, tenant_factory: Callable[..., SeedSummary]
) -> None:
    tenant = tenant_factory(users=5, transactions=50).tenants[0]
    headers = {"Authorization": f"Bearer {create_api_key(engine, tenant)}"}
    n = 20
    for _ in range(n):
        # A connection each, so that both workers serve some of them.
        response = httpx.get(f"{server}/v1/features/device_risk/2", headers=headers, timeout=10)
        assert response.status_code == 200, response.text
    with httpx.Client(base_url=server, headers=headers, timeout=10) as client:
        assert client.get("/v1/features/nope/1").json()["error"]["code"] == "unknown_feature_set"
        assert client.get("/readyz").status_code == 200
        for page in ("/metrics", "/status", "/status.json"):  # the ops port's only
            assert client.get(page).status_code == 404, page
    ops = f"http://127.0.0.1:{ops_port}"
    assert wait_until(lambda: _answers(f"{ops}/readyz"), timeout=30), "no ops port"
    assert httpx.get(f"{ops}/status.json", timeout=10).status_code == 200
    with httpx.Client(base_url=ops, timeout=10) as client:

        def served() -> float:
            text = client.get("/metrics").text
            return sum(
                float(v)
                for name in ("hits", "misses")
                for v in re.findall(
                    rf'^freshline_api_feature_{name}_total\{{feature_set="device_risk"[^}}]*\}}'
                    r" ([0-9.e+]+)$",
                    text,
                    re.MULTILINE,
                )
            )

        # Each worker's requests within its flush interval (freshline.pipeline.api.metrics.FLUSH_S):
        # all n of them, from both workers.
        assert wait_until(lambda: served() == n, timeout=10), served()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False
