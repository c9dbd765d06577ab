"""POST /v1/models/{name}/predict through the inference cache, on the real Redis."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from pipeline.api import create_app
from pipeline.api.auth import create_api_key
from pipeline.core.settings import Settings
from pipeline.inference.models import LogisticModel, ModelRegistry
from tests.helpers import Api, running

FEATURES = ("a", "b", "c")


def train(name: str, version: str, seed: int = 0) -> LogisticModel:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(200, len(FEATURES)))
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(float)
    return LogisticModel.fit(
        x, y, version=version, feature_names=FEATURES, name=name, epochs=50, seed=seed
    )


@pytest.fixture
def model_name() -> str:
    return f"m_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def registered(model_name: str, tmp_path: Path, redis_client: redis.Redis) -> LogisticModel:
    model = train(model_name, "v1")
    ModelRegistry(redis_client).register(model.save(tmp_path / "v1.json"))
    return model


@pytest.fixture
def tenants(tenant_factory: Callable[..., SeedSummary]) -> list[str]:
    return tenant_factory(users=5, transactions=50, tenants=2).tenants


@pytest.fixture
def api(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenants: list[str]
) -> Iterator[Api]:
    app = create_app(
        settings.model_copy(update={"api_batch_limit": 50}),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
    )
    with running(app, create_api_key(engine, tenants[0])) as client:
        yield client


INPUTS = [[0.1, 0.2, 0.3], [1.0, -1.0, 0.5], [0.1, 0.2, 0.3], [-2.0, 0.0, 1.5]]


def test_predictions_are_the_models_own_then_hits(
    api: Api, registered: LogisticModel, model_name: str
) -> None:
    first = api.post(f"/v1/models/{model_name}/predict", json={"inputs": INPUTS})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["model"] == model_name and body["model_version"] == "v1"
    expected = registered.predict(np.array(INPUTS)).tolist()
    assert [p["value"] for p in body["predictions"]] == expected
    assert [p["hit"] for p in body["predictions"]] == [False] * 4

    again = api.post(f"/v1/models/{model_name}/predict", json={"inputs": INPUTS}).json()
    assert [p["value"] for p in again["predictions"]] == expected
    assert all(p["hit"] for p in again["predictions"])


def test_versions_arms_and_tenants_are_kept_apart(
    api: Api,
    registered: LogisticModel,
    model_name: str,
    tmp_path: Path,
    redis_client: redis.Redis,
    engine: Engine,
    tenants: list[str],
) -> None:
    url = f"/v1/models/{model_name}/predict"
    api.post(url, json={"inputs": INPUTS[:1]})
    assert api.post(url, json={"inputs": INPUTS[:1]}).json()["predictions"][0]["hit"]
    assert not api.post(url, json={"inputs": INPUTS[:1], "arm": "b"}).json()["predictions"][0][
        "hit"
    ]
    other = api.post(url, json={"inputs": INPUTS[:1]}, key=create_api_key(engine, tenants[1]))
    assert not other.json()["predictions"][0]["hit"]

    v2 = dataclasses.replace(train(model_name, "v2", seed=1))
    ModelRegistry(redis_client).register(v2.save(tmp_path / "v2.json"))
    out = api.post(url, json={"inputs": INPUTS[:1]}).json()
    assert out["model_version"] == "v2"
    assert out["predictions"][0] == {
        "value": v2.predict(np.array(INPUTS[:1])).tolist()[0],
        "hit": False,
    }


@pytest.mark.parametrize(
    ("inputs", "code"),
    [
        ([[1.0, 2.0]], "invalid_input"),  # wrong width
        ([[1.0, 2.0, 3.0], [1.0]], "invalid_input"),  # ragged
        ([["a", "b", "c"]], "invalid_input"),
        ([[True, False, True]], "invalid_input"),
        ([1.0, 2.0, 3.0], "invalid_input"),  # 1-D
        ([[{"x": 1}, 2.0, 3.0]], "invalid_input"),
        ([[None, 2.0, 3.0]], "invalid_input"),
    ],
)
def test_bad_inputs_are_422(
    api: Api, registered: LogisticModel, model_name: str, inputs: object, code: str
) -> None:
    response = api.post(f"/v1/models/{model_name}/predict", json={"inputs": inputs})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == code
