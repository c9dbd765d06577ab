from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import orjson
import pytest
import redis

from freshline.pipeline.core.errors import ModelError
from freshline.pipeline.core.keys import MODELS_KEY
from freshline.pipeline.dev.models import SlowModel
from freshline.pipeline.inference.models import (
    LogisticModel,
    ModelRegistry,
    UnknownModel,
)
from freshline.pipeline.inference.predictions import Array, InferenceCache

FEATURES = ("txn_count_90d", "txn_amount_90d", "device_users", "geo_distance_km")


def unique_name() -> str:
    return f"m_{uuid.uuid4().hex[:12]}"


def dataset(n: int = 2000, seed: int = 0) -> tuple[Array, Array]:
    """Labels from a known logistic model on features of very different scales."""
    rng = np.random.default_rng(seed)
    X = np.column_stack(
        [
            rng.poisson(20, n),
            rng.lognormal(5, 1, n),
            rng.integers(1, 6, n),
            rng.exponential(300, n),
        ]
    ).astype(np.float64)
    z = (X - X.mean(axis=0)) / X.std(axis=0)
    logits = z @ np.array([1.5, 2.0, -1.0, 2.5]) - 1.0
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logits))).astype(np.float64)
    return X, y


def test_fit_learns_the_signal() -> None:
    X, y = dataset()
    model = LogisticModel.fit(X, y, version="v1", feature_names=FEATURES, name="fraud", seed=3)
    p = model.predict(X)
    assert p.shape == (len(X),) and p.dtype == np.float64
    assert np.all((p > 0) & (p < 1))
    accuracy = float(np.mean((p > 0.5) == (y == 1)))
    assert accuracy > 0.8
    assert np.all(np.sign(model.weights) == np.sign([1.5, 2.0, -1.0, 2.5]))
    assert model.deterministic and model.n_features == 4
    assert model.info["rows"] == len(X)


def test_a_rows_score_does_not_depend_on_its_batch() -> None:
    X, y = dataset(n=500)
    model = LogisticModel.fit(X, y, version="v1", feature_names=FEATURES, epochs=50)
    batch = model.predict(X)
    singles = np.array([model.predict(X[i : i + 1])[0] for i in range(len(X))])
    assert np.array_equal(batch, singles)
    assert np.array_equal(model.predict(X[::-1])[::-1], batch)


def test_save_and_load_give_identical_predictions(tmp_path: Path) -> None:
    X, y = dataset()
    model = LogisticModel.fit(X, y, version="2024-06-01.1", feature_names=FEATURES, name="fraud")
    path = model.save(tmp_path / "fraud.json")
    loaded = LogisticModel.load(path)
    assert (loaded.name, loaded.version, loaded.feature_names) == (
        "fraud",
        "2024-06-01.1",
        FEATURES,
    )
    assert np.array_equal(loaded.predict(X), model.predict(X))
    assert loaded.fingerprint() == model.fingerprint()
    assert orjson.loads(path.read_bytes())["deterministic"] is True


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        b'{"format": "other/1"}',
        b'{"format": "freshline.model/1", "kind": "tree"}',
        b'{"format": "freshline.model/1", "kind": "logistic", "name": "x"}',
        b'{"format": "freshline.model/1", "kind": "logistic", "name": "x", "version": "1",'
        b' "feature_names": ["a"], "weights": [1, 2], "bias": 0, "mean": [0], "scale": [1]}',
    ],
)
def test_a_bad_model_file_is_a_model_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ModelError):
        LogisticModel.load(path)


def test_a_missing_model_file_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="cannot read"):
        LogisticModel.load(tmp_path / "absent.json")


def test_fit_refuses_what_it_cannot_learn_from() -> None:
    X, y = dataset(n=50)
    with pytest.raises(ModelError, match="impute"):
        LogisticModel.fit(np.where(X > 100, np.nan, X), y, version="1", feature_names=FEATURES)
    with pytest.raises(ModelError, match="0 and 1"):
        LogisticModel.fit(X, y * 2, version="1", feature_names=FEATURES)
    with pytest.raises(ModelError, match="feature names"):
        LogisticModel.fit(X, y, version="1", feature_names=FEATURES[:3])
    with pytest.raises(ModelError, match="model version"):
        LogisticModel.fit(X, y, version="a:b", feature_names=FEATURES)
    with pytest.raises(ModelError, match="model"):
        LogisticModel.fit(X, y, version="1", feature_names=FEATURES, name="Bad Name")


def test_predict_refuses_the_wrong_width() -> None:
    X, y = dataset(n=50)
    model = LogisticModel.fit(X, y, version="1", feature_names=FEATURES, epochs=5)
    with pytest.raises(ModelError, match=r"\(n, 4\)"):
        model.predict(X[:, :3])


def test_without_a_version_the_parameters_name_it() -> None:
    X, y = dataset()
    a = LogisticModel.fit(X, y, feature_names=FEATURES)
    b = LogisticModel.fit(X, y, feature_names=FEATURES)
    c = LogisticModel.fit(X[:1000], y[:1000], feature_names=FEATURES)
    assert a.version.startswith("lr-") and a.version == b.version
    assert c.version != a.version
    assert LogisticModel.fit(X, y, feature_names=FEATURES, version="7").version == "7"


def test_the_registry_loads_and_follows_a_version_change(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    name = unique_name()
    X, y = dataset()
    v1 = LogisticModel.fit(X, y, feature_names=FEATURES, name=name, version="v1")
    v2 = LogisticModel.fit(X[:800], y[:800], feature_names=FEATURES, name=name, version="v2")
    registry = ModelRegistry(redis_client)
    other_process = ModelRegistry(redis_client)

    record = registry.register(v1.save(tmp_path / "model.json"))
    assert (record.version, record.feature_names, record.deterministic) == ("v1", FEATURES, True)
    assert name in registry.names()
    loaded = other_process.get(name)
    assert loaded.version == "v1"
    assert other_process.get(name) is loaded  # loaded once per version

    registry.register(v2.save(tmp_path / "model.json"))  # same path, new version
    assert other_process.get(name).version == "v2"
    assert np.array_equal(other_process.get(name).predict(X), v2.predict(X))

    registry.register(v1.save(tmp_path / "rollback.json"))
    assert other_process.get(name).version == "v1"


def test_registered_models_go_through_the_cache(redis_client: redis.Redis, tmp_path: Path) -> None:
    name = unique_name()
    X, y = dataset(n=300)
    registry = ModelRegistry(redis_client)
    registry.register(
        LogisticModel.fit(X, y, feature_names=FEATURES, name=name, epochs=50).save(
            tmp_path / "m.json"
        )
    )
    model = SlowModel(registry.get(name))
    cache = InferenceCache(redis_client)
    first = cache.predict(model, X)
    again = cache.predict(model, X)
    assert np.array_equal(first.values, registry.get(name).predict(X))
    assert again.hit.all() and model.calls == 1


def test_an_unknown_model_is_named_in_the_error(redis_client: redis.Redis) -> None:
    registry = ModelRegistry(redis_client)
    with pytest.raises(UnknownModel, match="unknown model") as info:
        registry.get(unique_name())
    assert isinstance(info.value, ModelError) and isinstance(info.value, KeyError)


def test_a_file_replaced_behind_the_registrys_back_is_refused(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    name = unique_name()
    X, y = dataset(n=200)
    path = tmp_path / "m.json"
    registry = ModelRegistry(redis_client)
    registry.register(
        LogisticModel.fit(X, y, feature_names=FEATURES, name=name, version="v1", epochs=5).save(
            path
        )
    )
    LogisticModel.fit(X, y, feature_names=FEATURES, name=name, version="v2", epochs=5).save(path)
    with pytest.raises(ModelError, match="register it again"):
        registry.get(name)
    assert redis_client.hexists(MODELS_KEY, name)


def test_slow_model_counts_calls_and_rows() -> None:
    X, y = dataset(n=100)
    inner = LogisticModel.fit(X, y, version="1", feature_names=FEATURES, epochs=5, name="m")
    slow = SlowModel(inner, cost_s=0.0, version="2", deterministic=False)
    assert np.array_equal(slow.predict(X[:7]), inner.predict(X[:7]))
    slow.predict(X[:3])
    assert slow.calls == 2 and slow.rows == [7, 3]
    assert slow.last_input is not None and np.array_equal(slow.last_input, X[:3])
    assert (slow.name, slow.version, slow.deterministic, slow.n_features) == ("m", "2", False, 4)
