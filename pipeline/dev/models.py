"""Models for tests and benchmarks; never served."""

from __future__ import annotations

import threading
import time

import numpy as np

from freshline.pipeline.inference.predictions import Array, Model


class SlowModel:
    """A test and benchmark helper: wraps a model, adds a per-call cost, counts calls.

    ``cost_s`` (plus ``per_row_s`` per input row) is spent in ``time.sleep`` inside
    ``predict``: it stands for the model's own compute, not for synchronisation.
    ``deterministic`` and ``version`` can be overridden to exercise the cache.
    """

    def __init__(
        self,
        inner: Model,
        *,
        cost_s: float = 0.0,
        per_row_s: float = 0.0,
        deterministic: bool | None = None,
        version: str | None = None,
    ) -> None:
        self.inner = inner
        self.cost_s = cost_s
        self.per_row_s = per_row_s
        self._deterministic = inner.deterministic if deterministic is None else deterministic
        self._version = inner.version if version is None else version
        self.calls = 0
        self.rows: list[int] = []
        self.last_input: Array | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def version(self) -> str:
        return self._version

    @property
    def deterministic(self) -> bool:
        return self._deterministic

    @property
    def n_features(self) -> int | None:
        n = getattr(self.inner, "n_features", None)
        return n if isinstance(n, int) else None

    def predict(self, x: Array, /) -> Array:
        with self._lock:
            self.calls += 1
            self.rows.append(int(np.shape(x)[0]))
            self.last_input = np.array(x, copy=True)
        delay = self.cost_s + self.per_row_s * int(np.shape(x)[0])
        if delay > 0:
            time.sleep(delay)
        return self.inner.predict(x)
