"""The semantic cache is an extra: the API imports none of it unless it is enabled.

Each test runs a fresh interpreter, since this one has long imported FAISS. "Not
installed" is the extra's modules set to None in ``sys.modules`` before anything runs,
so that importing them fails as if they were absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.semantic.extra import INSTALL, MODULES
from tests.helpers import fresh_version

# Starts the app from the environment's settings, reads one feature and tries the LLM
# routes, then prints what it saw and which of the extra's modules it imported.
SERVE = """
import json, os, sys
extra = os.environ["EXTRA"].split(",")
if os.environ["ABSENT"] == "1":
    for name in extra:
        sys.modules[name] = None
from starlette.testclient import TestClient
from freshline import FeatureStore
try:
    app = FeatureStore.from_env().app(follow_deploys=False)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    sys.exit(0)
key = {"Authorization": "Bearer " + os.environ["KEY"]}
with TestClient(app) as client:
    feature = client.get("/v1/features/txn_90d/1", headers=key)
    llm = client.post("/v1/llm/cache/lookup", json={}, headers=key)
    paths = list(client.get("/openapi.json").json()["paths"])
loaded = [m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in extra]
print(json.dumps({"feature": feature.status_code, "llm": llm.status_code,
                  "paths": paths, "loaded": loaded}))
"""


def imported_by(statement: str) -> list[str]:
    """Every module ``python -X importtime -c statement`` lists."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("import time:")]
    return [line.rsplit("|", 1)[1].strip() for line in lines[1:]]  # [0] is the header


def test_importing_the_app_imports_nothing_of_the_extra() -> None:
    modules = imported_by("import freshline.pipeline.api.app")
    assert "freshline.pipeline.api.app" in modules and "starlette.applications" in modules
    assert [m for m in modules if m.split(".")[0] in MODULES] == []
    assert "freshline.pipeline.api.llm" not in modules


@pytest.fixture(scope="module")
def key(engine: Engine, tenant_factory_module: Callable[..., SeedSummary]) -> str:
    [tenant] = tenant_factory_module(users=2, transactions=10).tenants
    return create_api_key(engine, tenant)


def serve(settings: Settings, key: str, *, absent: bool, enabled: bool) -> dict[str, object]:
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_SCHEMA_VERSION": str(fresh_version()),
        "FRESHLINE_LOCAL_CACHE_SIZE": "0",
        "FRESHLINE_SEMANTIC_ENABLED": "true" if enabled else "false",
        "EXTRA": ",".join(MODULES),
        "ABSENT": "1" if absent else "0",
        "KEY": key,
    }
    run = subprocess.run(
        [sys.executable, "-c", SERVE], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0, run.stderr
    answer: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return answer


@pytest.mark.parametrize("absent", [False, True], ids=["installed", "not-installed"])
def test_an_api_without_the_semantic_cache_serves_features_and_no_llm_routes(
    settings: Settings, key: str, absent: bool
) -> None:
    answer = serve(settings, key, absent=absent, enabled=False)
    assert answer["feature"] == 200
    assert answer["llm"] == 404
    assert answer["loaded"] == []
    paths = answer["paths"]
    assert isinstance(paths, list) and "/v1/features/batch" in paths
    assert [p for p in paths if p.startswith("/v1/llm/")] == []


def test_enabled_without_the_extra_the_api_refuses_to_start(settings: Settings, key: str) -> None:
    answer = serve(settings, key, absent=True, enabled=True)
    assert answer["error"] == "SemanticNotInstalled"
    message = str(answer["message"])
    assert message.startswith("FRESHLINE_SEMANTIC_ENABLED needs the semantic extra")
    assert message.endswith(INSTALL) and "faiss, tokenizers, safetensors" in message


def test_enabled_with_the_extra_the_llm_routes_are_served(settings: Settings, key: str) -> None:
    answer = serve(settings, key, absent=False, enabled=True)
    assert answer["feature"] == 200
    assert answer["llm"] == 422  # mounted: the empty body is refused, not unknown
    paths = answer["paths"]
    assert isinstance(paths, list) and "/v1/llm/cache/lookup" in paths
    loaded = answer["loaded"]
    assert isinstance(loaded, list) and "faiss" in loaded  # the model itself loads on first use
