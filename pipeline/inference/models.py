"""Models freshline can serve: the shipped logistic regression and a small registry.

A model file is one JSON document (floats written in shortest round-trip form, so a
loaded model predicts bit for bit what the saved one did)::

    {"format": "freshline.model/1", "kind": "logistic", "name": "risk",
     "version": "lr-3f2a...", "deterministic": true, "feature_names": [...],
     "weights": [...], "bias": 0.1, "mean": [...], "scale": [...], "info": {...}}

The registry keeps ``name -> {version, path, feature_names, deterministic}`` in the
Redis hash :data:`freshline.pipeline.core.keys.MODELS_KEY`; registering a file with a new version
moves every process's :meth:`ModelRegistry.get` to it on its next call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import redis

from freshline.pipeline.core.errors import DeployError, InvalidId, ModelError
from freshline.pipeline.core.keys import MODELS_KEY, validate_id, validate_name
from freshline.pipeline.inference.predictions import Array
from freshline.pipeline.inference.predictions import purge as purge_predictions

FILE_FORMAT = "freshline.model/1"


class UnknownModel(ModelError, KeyError):
    """A model name that is not registered."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name = name
        shown = ", ".join(sorted(known)) or "none"
        super().__init__(f"unknown model {name!r}; registered: {shown}")

    def __str__(self) -> str:
        return str(self.args[0])


def _sigmoid(logits: Array) -> Array:
    # exp(-|l|) never overflows; both branches are exact rearrangements of 1/(1+e^-l).
    e = np.exp(-np.abs(logits))
    out: Array = np.where(logits >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return out


def _vector(value: object, what: str) -> Array:
    arr = np.array(value, dtype=np.float64)
    if arr.ndim != 1 or not np.all(np.isfinite(arr)):
        raise ModelError(f"{what} must be a 1-D array of finite numbers")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class LogisticModel:
    """Logistic regression on standardised inputs: ``sigmoid((x - mean) / scale @ w + b)``.

    ``predict`` works row by row (an elementwise product summed along each row, not a
    BLAS matrix product), so a row's score never depends on the batch it came in: the
    inference cache can compute misses in any grouping and still return exactly what a
    direct call would.
    """

    name: str
    version: str
    feature_names: tuple[str, ...]
    weights: Array
    bias: float
    mean: Array
    scale: Array
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            validate_name("model", self.name)
            validate_id("model version", self.version)
        except InvalidId as exc:
            raise ModelError(str(exc)) from exc
        d = len(self.feature_names)
        for attr in ("weights", "mean", "scale"):
            arr = _vector(getattr(self, attr), attr)
            if arr.shape[0] != d:
                raise ModelError(f"{attr} has {arr.shape[0]} values for {d} feature names")
            object.__setattr__(self, attr, arr)
        if np.any(self.scale <= 0):
            raise ModelError("scale must be positive")
        if not np.isfinite(self.bias):
            raise ModelError("bias must be finite")
        object.__setattr__(self, "feature_names", tuple(self.feature_names))
        object.__setattr__(self, "bias", float(self.bias))

    @property
    def deterministic(self) -> bool:
        return True

    @property
    def n_features(self) -> int:
        return len(self.feature_names)

    def predict(self, x: Array, /) -> Array:
        """The probability of the positive class for each row of ``x`` (shape ``(n, d)``)."""
        arr = np.asarray(x, dtype=np.float64)
        if arr.ndim != 2 or arr.shape[1] != self.n_features:
            raise ModelError(
                f"model {self.name!r} expects inputs of shape (n, {self.n_features}), "
                f"got {arr.shape}"
            )
        z = (arr - self.mean) / self.scale
        logits = (z * self.weights).sum(axis=1) + self.bias
        return _sigmoid(logits)

    @classmethod
    def fit(
        cls,
        X: Array,
        y: Array,
        *,
        feature_names: Sequence[str],
        version: str | None = None,
        name: str = "model",
        epochs: int = 500,
        learning_rate: float = 0.5,
        l2: float = 1e-3,
        seed: int = 0,
    ) -> LogisticModel:
        """Train by full-batch gradient descent on the log loss with an L2 penalty.

        Inputs are standardised with the training mean and standard deviation, which
        the model keeps. ``X`` must be finite (impute before fitting); ``y`` holds 0/1.
        Without ``version``, the version is ``lr-`` and the parameters' fingerprint: a
        retrain on the same data keeps the version (and its cached predictions), any
        change in the parameters gets a new one.
        """
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64).ravel()
        if X.ndim != 2 or X.shape[0] == 0:
            raise ModelError(f"X must be a non-empty 2-D array, got shape {X.shape}")
        if X.shape[1] != len(feature_names):
            raise ModelError(f"X has {X.shape[1]} columns for {len(feature_names)} feature names")
        if y.shape[0] != X.shape[0]:
            raise ModelError(f"y has {y.shape[0]} labels for {X.shape[0]} rows")
        if not np.all(np.isfinite(X)):
            raise ModelError("X contains NaN or infinite values; impute them before fitting")
        if not np.all((y == 0) | (y == 1)):
            raise ModelError("y must hold only 0 and 1")
        if epochs < 1:
            raise ModelError(f"epochs must be positive, got {epochs}")

        mean = X.mean(axis=0)
        scale = X.std(axis=0)
        scale[scale == 0] = 1.0
        Z = (X - mean) / scale
        rng = np.random.default_rng(seed)
        w = np.asarray(rng.normal(0.0, 0.01, size=X.shape[1]), dtype=np.float64)
        b = 0.0
        n = X.shape[0]
        for _ in range(epochs):
            error = _sigmoid(Z @ w + b) - y
            w -= learning_rate * (Z.T @ error / n + l2 * w)
            b -= learning_rate * float(error.mean())
        info = {
            "rows": n,
            "positives": int(y.sum()),
            "epochs": epochs,
            "learning_rate": learning_rate,
            "l2": l2,
            "seed": seed,
        }
        model = cls(
            name=name,
            version=version or "pending",
            feature_names=tuple(feature_names),
            weights=w,
            bias=b,
            mean=mean,
            scale=scale,
            info=info,
        )
        if version is None:
            model = dataclasses.replace(model, version=f"lr-{model.fingerprint()}")
        return model

    def fingerprint(self) -> str:
        """A short digest of the parameters: equal for models that predict alike."""
        h = hashlib.blake2b(digest_size=8)
        h.update(orjson.dumps(self.feature_names))
        for arr in (self.weights, self.mean, self.scale, np.array([self.bias])):
            h.update(np.ascontiguousarray(arr, dtype="<f8").tobytes())
        return h.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FILE_FORMAT,
            "kind": "logistic",
            "name": self.name,
            "version": self.version,
            "deterministic": True,
            "feature_names": list(self.feature_names),
            "weights": self.weights.tolist(),
            "bias": self.bias,
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "info": self.info,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the model file atomically (temporary file, then rename); return its path."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2))
        os.replace(tmp, target)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LogisticModel:
        """Read a file written by :meth:`save`."""
        doc = _read_model_file(Path(path))
        if doc.get("kind") != "logistic":
            raise ModelError(f"{path}: kind {doc.get('kind')!r} is not a logistic model")
        try:
            return cls(
                name=doc["name"],
                version=doc["version"],
                feature_names=tuple(doc["feature_names"]),
                weights=doc["weights"],
                bias=doc["bias"],
                mean=doc["mean"],
                scale=doc["scale"],
                info=doc.get("info", {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{path}: not a valid model file ({exc!r})") from exc


def _read_model_file(path: Path) -> dict[str, Any]:
    try:
        doc = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc.strerror}") from exc
    except orjson.JSONDecodeError as exc:
        raise ModelError(f"model file {path} is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
        raise ModelError(f"{path} is not a freshline model file (format {FILE_FORMAT!r})")
    return doc


def load_model(path: str | os.PathLike[str]) -> LogisticModel:
    """Load any model file freshline knows (so far: logistic regression)."""
    return LogisticModel.load(path)


def feature_inputs(feature_names: Sequence[str]) -> list[tuple[str, str]]:
    """``(feature_set, field)`` of each of a model's feature names, spelled
    ``<feature_set>.<field>``: the features the predict route's entity form reads.
    :class:`ModelError` names the first that is not spelled so."""
    inputs = []
    for name in feature_names:
        feature_set, dot, field_name = name.partition(".")
        if not (dot and feature_set and field_name):
            raise ModelError(
                f"feature name {name!r} is not <feature_set>.<field>, so the model cannot "
                "be fed from an entity's features"
            )
        inputs.append((feature_set, field_name))
    return inputs


def input_row(inputs: Sequence[tuple[str, str]], features: Mapping[str, Any]) -> list[float]:
    """One model input row from ``{feature_set: values}``: each ``(feature_set, field)``
    of ``inputs`` as a float, ``True``/``False`` as 1/0, and a value that is missing,
    null or not a number as 0 (the rule a model trained on served features learned with,
    as the fraud example's trainer does)."""
    row = []
    for feature_set, field_name in inputs:
        value = (features.get(feature_set) or {}).get(field_name)
        row.append(float(value) if isinstance(value, (int, float)) else 0.0)
    return row


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """What the registry knows about one model name."""

    name: str
    version: str
    path: str
    feature_names: tuple[str, ...]
    deterministic: bool

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "version": self.version,
                "path": self.path,
                "feature_names": list(self.feature_names),
                "deterministic": self.deterministic,
            }
        )

    @classmethod
    def from_json(cls, name: str, raw: bytes | str) -> ModelRecord:
        doc = orjson.loads(raw)
        return cls(
            name=name,
            version=doc["version"],
            path=doc["path"],
            feature_names=tuple(doc["feature_names"]),
            deterministic=bool(doc["deterministic"]),
        )


class ModelRegistry:
    """Model names -> the registered version's file, in Redis; loaded models, in process.

    :meth:`get` costs one ``HGET``; it reloads the file only when the registered
    version or path has changed since this process last loaded it.
    """

    def __init__(self, redis_client: redis.Redis) -> None:
        self.redis = redis_client
        self._loaded: dict[str, tuple[str, str, LogisticModel]] = {}
        self._lock = threading.Lock()

    def register(self, model_path: str | os.PathLike[str]) -> ModelRecord:
        """Record the model file at ``model_path`` as its name's current version."""
        path = Path(model_path).resolve()
        model = load_model(path)
        record = ModelRecord(
            model.name, model.version, str(path), model.feature_names, model.deterministic
        )
        self.redis.hset(MODELS_KEY, model.name, record.to_json())
        return record

    def record(self, name: str) -> ModelRecord:
        """The registered record of ``name``; :class:`UnknownModel` if there is none."""
        raw = self.redis.hget(MODELS_KEY, name)
        if raw is None:
            raise UnknownModel(name, self.names())
        return ModelRecord.from_json(name, raw)

    def get(self, name: str) -> LogisticModel:
        """The registered version of ``name``, loaded once per version per process."""
        record = self.record(name)
        cached = self._loaded.get(name)
        if cached is not None and cached[:2] == (record.version, record.path):
            return cached[2]
        with self._lock:
            model = load_model(record.path)
            if model.name != name or model.version != record.version:
                raise ModelError(
                    f"model file {record.path} holds {model.name!r} version {model.version!r}, "
                    f"but {name!r} version {record.version!r} is registered; register it again"
                )
            self._loaded[name] = (record.version, record.path, model)
        return model

    def names(self) -> list[str]:
        """Every registered model name, sorted."""
        return sorted(
            key.decode() if isinstance(key, bytes) else str(key)
            for key in self.redis.hkeys(MODELS_KEY)
        )


def purge_model(
    client: redis.Redis,
    name: str,
    version: str,
    *,
    count: int = 500,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Remove a model version's cached predictions; refuses the registered version."""
    try:
        current = ModelRegistry(client).record(name).version
    except UnknownModel:
        current = None
    if current == version:
        raise DeployError(
            f"model {name!r} version {version!r} is the registered one; "
            "register the new version first, then purge the old"
        )
    return purge_predictions(client, name, version, batch=count, progress=progress)
