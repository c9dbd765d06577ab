from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from fraud.training import (
    FEATURE_NAMES,
    MODEL_NAME,
    dataset,
    train,
    vector,
)
from freshline.pipeline.inference.models import ModelRegistry, load_model
from freshline.pipeline.inference.predictions import InferenceCache


def test_the_example_model_trains_on_seeded_features_and_serves_through_the_cache(
    engine: Engine,
    redis_client: redis.Redis,
    tenant_factory: Callable[..., SeedSummary],
    tmp_path: Path,
) -> None:
    tenant = tenant_factory(users=300, transactions=12000).tenants[0]
    x, y = dataset(engine, tenant)
    assert x.shape == (300, len(FEATURE_NAMES))
    assert 0 < y.sum() < len(y)  # both classes present
    model, path = train(engine, tenant, tmp_path)
    assert model.name == MODEL_NAME and path.exists()
    assert load_model(path).version == model.version
    scores = model.predict(x)
    assert scores.shape == (300,) and np.all((scores >= 0) & (scores <= 1))
    # Users with a chargeback score higher on average than those without.
    assert scores[y == 1].mean() > scores[y == 0].mean()
    registry = ModelRegistry(redis_client)
    registry.register(path)
    served = InferenceCache(redis_client).predict(registry.get(MODEL_NAME), x[:20], tenant=tenant)
    assert np.array_equal(served.values, scores[:20])
    assert vector({"txn_90d": {"txn_count": 3}})[0] == 3.0
