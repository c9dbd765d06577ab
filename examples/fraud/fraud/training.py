"""The shipped example model: fraud risk from the three feature sets.

Inputs are the numeric features below, in this order (what a scoring service sends
to ``POST /v1/models/fraud_example/predict``); the label is whether the user had a
transaction reversed (a chargeback) in the last 90 days. It is an example of the
wiring, trained in seconds with numpy, not a fraud model to deploy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from pipeline.cache.recompute import compute
from pipeline.core.repository import REGISTRY
from pipeline.inference.models import LogisticModel, input_row

MODEL_NAME = "fraud_example"
MODEL_INPUTS: tuple[tuple[str, str], ...] = (
    ("txn_90d", "txn_count"),
    ("txn_90d", "txn_sum"),
    ("txn_90d", "txn_mean"),
    ("txn_90d", "txn_max"),
    ("txn_90d", "txn_std"),
    ("txn_90d", "distinct_merchants"),
    ("txn_90d", "distinct_devices"),
    ("device_risk", "device_count"),
    ("device_risk", "max_device_risk"),
    ("device_risk", "new_device_24h"),
    ("device_risk", "shared_device_users"),
    ("geo", "distinct_countries_30d"),
)
FEATURE_NAMES = tuple(f"{fs}.{name}" for fs, name in MODEL_INPUTS)
BATCH = 1000


def vector(features: dict[str, dict[str, object]]) -> list[float]:
    """One model input row from ``{feature_set: values}`` (missing values count as 0),
    as the predict route's entity form builds it."""
    return input_row(MODEL_INPUTS, features)


def dataset(
    engine: Engine, tenant: str, progress: Callable[[int, int], None] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Features (computed in batches) and labels for every user of ``tenant``."""
    with engine.connect() as conn:
        users = [
            str(u)
            for (u,) in conn.execute(
                sa.text("SELECT id FROM users WHERE tenant_id = :t ORDER BY id"), {"t": tenant}
            )
        ]
        reversed_users = {
            str(u)
            for (u,) in conn.execute(
                sa.text(
                    "SELECT DISTINCT user_id FROM transactions WHERE tenant_id = :t "
                    "AND status = 'reversed' AND created_at > now() - interval '90 days'"
                ),
                {"t": tenant},
            )
        }
    rows: list[list[float]] = []
    for start in range(0, len(users), BATCH):
        chunk = users[start : start + BATCH]
        refs = [(tenant, u) for u in chunk]
        batches = {fs.name: compute(engine, fs, refs).values for fs in REGISTRY}
        rows.extend(
            vector({name: values[(tenant, u)] for name, values in batches.items()}) for u in chunk
        )
        if progress:
            progress(min(start + BATCH, len(users)), len(users))
    labels = np.array([u in reversed_users for u in users], dtype=np.float64)
    return np.array(rows, dtype=np.float64).reshape(-1, len(MODEL_INPUTS)), labels


def train(
    engine: Engine, tenant: str, out_dir: Path, progress: Callable[[int, int], None] | None = None
) -> tuple[LogisticModel, Path]:
    """Train the example on ``tenant``'s users and save it under ``out_dir``."""
    x, y = dataset(engine, tenant, progress)
    if len(x) < 10 or y.min() == y.max():
        raise ValueError(f"tenant {tenant!r} has too few users or a single class to train on")
    model = LogisticModel.fit(x, y, feature_names=FEATURE_NAMES, name=MODEL_NAME)
    path = model.save(out_dir / f"{model.name}-{model.version}.json")
    return model, path
