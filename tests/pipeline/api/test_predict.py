"""POST /v1/models/{name}/predict through the inference cache, on the real Redis."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.inference.models import (
    LogisticModel,
    ModelRegistry,
    feature_inputs,
    input_row,
)
from tests.helpers import REGISTRY, Api, running

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
        registry=REGISTRY,
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


# The entity form: the server reads the entity's features the model takes.

ENTITY_FEATURES = ("txn_90d.txn_count", "txn_90d.txn_sum", "geo.distinct_countries_30d")


@pytest.fixture
def entity_model(model_name: str, tmp_path: Path, redis_client: redis.Redis) -> LogisticModel:
    rng = np.random.default_rng(3)
    x = rng.normal(loc=(5, 500, 1), scale=(3, 300, 1), size=(200, 3))
    y = (x[:, 0] > 5).astype(float)
    model = LogisticModel.fit(
        x, y, version="e1", feature_names=ENTITY_FEATURES, name=model_name, epochs=50
    )
    ModelRegistry(redis_client).register(model.save(tmp_path / "e1.json"))
    return model


def served_row(engine: Engine, tenant: str, user: str) -> list[float]:
    """The model's input row for ``user``, from the defining queries (not the API)."""
    features = {
        fs: compute(engine, REGISTRY[fs], [(tenant, user)]).values[(tenant, user)]
        for fs in ("txn_90d", "geo")
    }
    return input_row(feature_inputs(ENTITY_FEATURES), features)


def test_entity_form_predicts_on_the_entitys_served_features(
    api: Api, entity_model: LogisticModel, model_name: str, engine: Engine, tenants: list[str]
) -> None:
    users = ["1", "2", "3"]
    url = f"/v1/models/{model_name}/predict"
    first = api.post(url, json={"entities": users})
    assert first.status_code == 200, first.text
    rows = [served_row(engine, tenants[0], u) for u in users]
    expected = entity_model.predict(np.array(rows)).tolist()
    assert [p["entity"] for p in first.json()["predictions"]] == users
    assert [p["value"] for p in first.json()["predictions"]] == expected
    again = api.post(url, json={"entities": users}).json()["predictions"]
    assert [p["value"] for p in again] == expected
    assert [p["hit"] for p in again] == [True] * 3


def test_a_changed_feature_never_gets_the_older_prediction(
    api: Api, entity_model: LogisticModel, model_name: str, engine: Engine, tenants: list[str]
) -> None:
    url = f"/v1/models/{model_name}/predict"
    before = api.post(url, json={"entities": ["2"]}).json()["predictions"][0]
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip, "
                "created_at) VALUES (:t, 2, 250, 'm-new', '10.0.0.9', now())"
            ),
            {"t": tenants[0]},
        )
    # max_staleness_ms=0: the features are recomputed, so the row is the new one.
    after = api.post(url, json={"entities": ["2"], "max_staleness_ms": 0}).json()
    [answer] = after["predictions"]
    row = served_row(engine, tenants[0], "2")
    assert answer["value"] == entity_model.predict(np.array([row])).tolist()[0]
    assert answer["value"] != before["value"]
    assert answer["hit"] is False


def test_entity_form_refuses_a_model_fed_by_no_feature_here(
    api: Api, registered: LogisticModel, model_name: str, tmp_path: Path, redis_client: redis.Redis
) -> None:
    url = f"/v1/models/{model_name}/predict"
    plain = api.post(url, json={"entities": ["1"]})  # feature names "a", "b", "c"
    assert plain.status_code == 409, plain.text
    assert plain.json()["error"]["code"] == "model_inputs_unknown"
    other = dataclasses.replace(
        train(model_name, "v2"), feature_names=("txn_90d.txn_count", "geo.nope", "geo.x")
    )
    ModelRegistry(redis_client).register(other.save(tmp_path / "v2.json"))
    unknown = api.post(url, json={"entities": ["1"]})
    assert unknown.status_code == 409 and "geo.nope" in unknown.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"entities": ["1"], "inputs": [[1, 2, 3]]}, "not both"),
        ({"entities": []}, "'entities' must be a non-empty array"),
        ({"entities": "1"}, "'entities' must be a non-empty array"),
        ({"entities": ["1"], "arm": 7}, "'arm' must be a string id"),
        ({"entities": ["1"], "max_staleness_ms": -1}, "max_staleness_ms"),
    ],
)
def test_entity_form_bad_bodies_are_422(
    api: Api, entity_model: LogisticModel, model_name: str, body: dict[str, object], message: str
) -> None:
    response = api.post(f"/v1/models/{model_name}/predict", json=body)
    assert response.status_code == 422, response.text
    assert message in response.json()["error"]["message"]
