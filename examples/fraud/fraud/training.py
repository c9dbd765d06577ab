"""The shipped example model: fraud risk from the three feature sets.

Inputs are the numeric features below, in this order (what a scoring service sends
to ``POST /v1/models/fraud_example/predict``). It is an example of the wiring, trained
in seconds with numpy, not a fraud model to deploy.

Where the repository records history (``[history]`` in ``freshline.toml``), the training
set is one row per transaction whose moment (``created_at``) history answers for (from
its start to what it is complete to): the features as freshline would have served them
at that moment, from :func:`freshline.training_set`, and the label whether that
transaction was reversed (a chargeback). No row committed later, and no later
correction, reaches a row's features (docs/training.md). Without history, or while
history holds too few transactions to train on (fewer than :data:`MIN_ROWS`, or one
class), it falls back to one row per user with today's features and, as label, whether
the user had a transaction reversed in the last 90 days: those features already hold
the reversed transactions, so that fallback leaks and only shows the wiring.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud import own_store
from freshline import LogisticModel, input_row, training_set

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
ACTIVE = Path(__file__).resolve().parents[1]
"""The fraud example's repository, whose feature sets the training set reads."""


def vector(features: dict[str, dict[str, object]]) -> list[float]:
    """One model input row from ``{feature_set: values}`` (missing values count as 0),
    as the predict route's entity form builds it."""
    return input_row(MODEL_INPUTS, features)


SPINE_LIMIT = 50_000
"""The most recent transactions a history-based training set holds."""
MIN_ROWS = 10
"""The fewest transactions a history-based training set trains on."""


def spine(engine: Engine, tenant: str) -> Any | None:
    """The training spine from history: ``tenant``'s transactions at moments history
    answers for (after it starts, up to what it is complete to, before any break), at
    most :data:`SPINE_LIMIT`, the latest, each at its ``created_at`` and labelled with
    whether it was reversed; None without history of ``transactions``."""
    import pyarrow as pa

    with engine.connect() as conn:
        recorded = own_store().history(conn)
        if recorded.get("transactions") is None:
            return None
        tables = recorded.values()
        if any(c.start is None or c.complete_to is None for c in tables):
            return None
        # The feature sets read every captured table: a moment must be one all answer for.
        start = max(c.start for c in tables if c.start is not None)
        end = min(c.complete_to for c in tables if c.complete_to is not None)
        broken = [c.broken_from for c in tables if c.broken_from is not None]
        rows = conn.execute(
            sa.text(
                "SELECT user_id, created_at, status = 'reversed' FROM ("
                "  SELECT user_id, created_at, status, id FROM transactions "
                "  WHERE tenant_id = :t AND created_at >= :start AND created_at <= :end "
                "    AND created_at <= now() AND (CAST(:broken AS timestamptz) IS NULL "
                "    OR created_at < CAST(:broken AS timestamptz)) "
                "  ORDER BY created_at DESC, id DESC LIMIT :n) AS x ORDER BY created_at, id"
            ),
            {
                "t": tenant,
                "start": start,
                "end": end,
                "broken": min(broken) if broken else None,
                "n": SPINE_LIMIT,
            },
        ).all()
    return pa.table(
        {
            "tenant_id": [tenant] * len(rows),
            "user_id": pa.array([r[0] for r in rows], pa.int64()),
            "timestamp": pa.array([r[1] for r in rows], pa.timestamp("us", tz="UTC")),
            "reversed": [bool(r[2]) for r in rows],
        }
    )


def dataset(
    engine: Engine, tenant: str, progress: Callable[[int, int], None] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels: from history where it is recorded (a row per transaction,
    features as of its moment), else today's per user (see the module docstring)."""
    rows = spine(engine, tenant) if _has_arrow() else None
    if rows is not None and _trainable(rows.column("reversed").to_pylist()):
        table = features(engine, rows, progress)
        columns = [table.column(f"{fs}__{name}").to_pylist() for fs, name in MODEL_INPUTS]
        x = np.array(
            [[float(v or 0) for v in row] for row in zip(*columns, strict=True)],
            dtype=np.float64,
        ).reshape(-1, len(MODEL_INPUTS))
        return x, np.array(table.column("reversed").to_pylist(), dtype=np.float64)
    return _today(engine, tenant, progress)


def features(engine: Engine, rows: Any, progress: Callable[[int, int], None] | None = None) -> Any:
    """The training set of ``rows`` (a :func:`spine`): the model's feature sets as of
    each row's moment, from :func:`freshline.training_set`."""
    sets = list(dict.fromkeys(fs for fs, _ in MODEL_INPUTS))
    return training_set(ACTIVE, rows, sets, engine=engine, progress=progress)


def _trainable(labels: list[bool]) -> bool:
    return len(labels) >= MIN_ROWS and len(set(labels)) == 2


def _has_arrow() -> bool:
    import importlib.util

    return importlib.util.find_spec("pyarrow") is not None


def _today(
    engine: Engine, tenant: str, progress: Callable[[int, int], None] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Today's features (computed in batches) and labels for every user of ``tenant``."""
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
    store = own_store()
    rows: list[list[float]] = []
    for start in range(0, len(users), BATCH):
        chunk = users[start : start + BATCH]
        refs = [(tenant, u) for u in chunk]
        batches = {fs.name: store.compute(fs, refs, db=engine) for fs in store.registry}
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
