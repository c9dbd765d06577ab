"""``python -m bench.contracts [--rounds N]``: the decode cost of a request body and of
a domain event, hand-written checks against the pydantic models, in one run.

A decode is bytes to checked values: ``orjson.loads`` and the checks the route or the
consumer makes before any I/O. Per body (and per event) it reports the median CPU
nanoseconds (the thread's, so that other processes' turns on a shared machine do not
count) over interleaved rounds and each candidate's ratio to the same run's
reference:

* batch and predict bodies: the hand-written checks the routes made before the models
  (copied here as the reference) against what they call now
  (:func:`freshline.pipeline.api.contracts.feature_selection`, ``freshness.from_body``,
  :func:`~freshline.pipeline.api.contracts.predict_request`), and against validating the whole
  body by the model, which the batch route does not do (its fast path);
* domain events: the hand-written parser the consumer runs
  (:meth:`freshline.pipeline.core.events.Event.change`) against the event's pydantic model
  (:func:`freshline.pipeline.core.events.record_model`, from its declaration) by
  ``model_validate_json``, alone and with the ``ChangeEvent`` built after it.

No Redis, Kafka or Postgres: the fraud example's definitions only (``FRESHLINE_REPO``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson
from pydantic import BaseModel

from freshline.pipeline.api import freshness
from freshline.pipeline.api.contracts import (
    BatchRequest,
    PredictRequest,
    feature_selection,
    predict_request,
)
from freshline.pipeline.api.errors import ApiError
from freshline.pipeline.api.reader import parse_entities
from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.events import Event, record_model
from freshline.pipeline.core.keys import validate_id
from freshline.pipeline.core.repository import active
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import ChangeEvent
from tests.helpers import REGISTRY

LIMIT = 500
CALLS = 50
"""Calls per sample: short samples, many rounds, so the median sheds the machine's noise."""
SETTINGS = Settings.model_construct()


def hand_batch(raw: bytes) -> Any:
    """The batch route's checks before the models (``git show e4df17e:pipeline/api/routes.py``)."""
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        raise ApiError(422, "invalid_request", "the body must be a JSON object")
    lists = []
    for field in ("feature_sets", "entities"):
        value = body.get(field)
        if not isinstance(value, list) or not value:
            raise ApiError(422, "invalid_request", f"{field!r} must be a non-empty JSON array")
        lists.append(value)
    feature_sets, entities = lists
    if len(feature_sets) * len(entities) > LIMIT:
        raise ApiError(422, "batch_too_large", "over the limit")
    for name in feature_sets:
        if not isinstance(name, str):
            raise InvalidId("feature set", name, "must be a string")
        REGISTRY[name]
    if len(set(feature_sets)) != len(feature_sets):
        raise ApiError(422, "invalid_request", "'feature_sets' names a feature set twice")
    demand = _hand_demand(body)
    return feature_sets, parse_entities(entities), demand


def _hand_demand(body: dict[str, Any]) -> Any:
    if body.keys().isdisjoint(freshness.FIELDS):
        return None
    values: dict[str, int | None] = {}
    for name in ("max_staleness_ms", "wait_ms"):
        value = body.get(name)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if value is not None and (type(value) is not int):
            raise ApiError(422, "invalid_request", f"{name!r} must be an integer or null")
        values[name] = None if value is None else freshness._in_range(name, value, 422, "x")
    after = body.get("after")
    if after is not None and not isinstance(after, str):
        raise ApiError(400, "invalid_token", "'after' must be a freshness token")
    return freshness._demand(after, values, SETTINGS)


def model_batch(raw: bytes) -> Any:
    """What the batch route calls now: the fast path, the model for the rest."""
    body = orjson.loads(raw)
    feature_sets, entities = feature_selection(body, LIMIT, REGISTRY.__getitem__)
    return feature_sets, parse_entities(entities), freshness.from_body(body, SETTINGS)


def whole_model_batch(raw: bytes) -> Any:
    """The whole body through :class:`BatchRequest`, no fast path (not what runs)."""
    body = BatchRequest.model_validate(orjson.loads(raw))
    for name in body.feature_sets:
        REGISTRY[name]
    return body.feature_sets, parse_entities(body.entities), body.after


def hand_predict(raw: bytes) -> Any:
    """The predict route's checks before the models."""
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        raise ApiError(422, "invalid_request", "the body must be a JSON object")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ApiError(422, "invalid_request", "'inputs' must be a non-empty array of rows")
    if len(inputs) > LIMIT:
        raise ApiError(422, "batch_too_large", "over the limit")
    arm = body.get("arm")
    if arm is not None and not isinstance(arm, str):
        raise ApiError(422, "invalid_request", "'arm' must be a string id or null")
    if arm is not None:
        arm = validate_id("arm", arm)
    return inputs, arm


def model_predict(raw: bytes) -> Any:
    return predict_request(orjson.loads(raw), LIMIT)


def whole_model_predict(raw: bytes) -> Any:
    """The whole body through :class:`PredictRequest`, no fast path (not what runs)."""
    request = PredictRequest.model_validate(orjson.loads(raw))
    return request.inputs, request.arm


def hand_change(event: Event) -> Callable[[bytes], ChangeEvent]:
    """The record through the hand parser (:meth:`Event.change`)."""

    def change(raw: bytes) -> ChangeEvent:
        return event.change(orjson.loads(raw))

    return change


def model_change(event: Event, model: type[BaseModel]) -> Callable[[bytes], ChangeEvent]:
    """The record through ``model``, then the :class:`ChangeEvent` the parser makes
    (:meth:`Event.change_of`; a valid record only: no error translation)."""
    columns = [(c.name, c.column) for c in event.columns]
    bigints = [c.column for c in event.columns if c.type == "bigint"]

    def change(raw: bytes) -> ChangeEvent:
        record = model.model_validate_json(raw).__dict__
        row = {column: record[name] for name, column in columns}
        for column in bigints:
            row[column] = int(row[column])  # as the parser does a bigint's string
        occurred = record["occurred_at"]
        committed_at_ms = None if occurred is None else int(occurred.timestamp() * 1000)
        return event.change_of(row, committed_at_ms, record["version"])

    return change


def _median_ns(fn: Callable[[bytes], Any], raw: bytes, calls: int) -> float:
    started = time.thread_time_ns()  # CPU time: another process's turn is not ours
    for _ in range(calls):
        fn(raw)
    return (time.thread_time_ns() - started) / calls


def measure(
    cases: dict[str, bytes], candidates: dict[str, Callable[[bytes], Any]], rounds: int
) -> dict[str, dict[str, float]]:
    """Median ns per call of each candidate on each case, rounds interleaved."""
    samples: dict[tuple[str, str], list[float]] = {(c, n): [] for c in cases for n in candidates}
    for fn in candidates.values():  # each must accept each case
        for raw in cases.values():
            fn(raw)
    gc.disable()
    try:
        for _ in range(rounds):
            for case, raw in cases.items():
                for name, fn in candidates.items():
                    samples[case, name].append(_median_ns(fn, raw, CALLS))
    finally:
        gc.enable()
    return {
        case: {name: statistics.median(samples[case, name]) for name in candidates}
        for case in cases
    }


def report(title: str, figures: dict[str, dict[str, float]], reference: str) -> None:
    names = list(next(iter(figures.values())))
    print(f"\n{title} (median ns per decode; ratio to {reference}, same run)")
    print(f"{'case':<30}" + "".join(f"{n:>26}" for n in names))
    for case, row in figures.items():
        cells = [f"{row[n]:>10.0f} ({row[n] / row[reference]:.2f}x)" for n in names]
        print(f"{case:<30}" + "".join(f"{c:>26}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.contracts")
    parser.add_argument("--rounds", type=int, default=101)
    rounds = parser.parse_args().rounds

    ids = [str(i) for i in range(500)]
    batches = {
        "batch 1 set x 1 entity": {"feature_sets": ["txn_90d"], "entities": ["42"]},
        "batch 2 sets x 50 entities": {"feature_sets": ["txn_90d", "geo"], "entities": ids[:50]},
        "batch 1 set x 500 entities": {"feature_sets": ["txn_90d"], "entities": ids},
        "batch 2 x 50, max_staleness_ms": {
            "feature_sets": ["txn_90d", "geo"],
            "entities": ids[:50],
            "max_staleness_ms": 500,
        },
    }
    report(
        "Request bodies: POST /v1/features/batch",
        measure(
            {k: orjson.dumps(v) for k, v in batches.items()},
            {
                "hand (before)": hand_batch,
                "models (now)": model_batch,
                "whole model": whole_model_batch,
            },
            rounds,
        ),
        "hand (before)",
    )
    predicts = {
        "predict 1 row x 8": {"inputs": [[0.5] * 8], "arm": "a"},
        "predict 100 rows x 8": {"inputs": [[0.5] * 8] * 100, "arm": "a"},
    }
    report(
        "Request bodies: POST /v1/models/{name}/predict",
        measure(
            {k: orjson.dumps(v) for k, v in predicts.items()},
            {
                "hand (before)": hand_predict,
                "models (now)": model_predict,
                "whole model": whole_model_predict,
            },
            rounds,
        ),
        "hand (before)",
    )
    events = {e.topic: e for e in active().events}
    records = {
        "transaction.updated": {
            "tenant": "acme",
            "transaction_id": 123456,
            "user_id": "42",
            "device_id": "dev-7",
            "occurred_at": "2026-01-01T00:00:00Z",
            "version": 3,
        },
        "user.updated": {"tenant": "acme", "user_id": 42},
    }
    for topic, given in records.items():
        event = events[topic]
        fields = {*event.required, "occurred_at", "version"}
        raw = orjson.dumps({k: v for k, v in given.items() if k in fields})
        model = record_model(event)
        by_model = model_change(event, model)
        if by_model(raw) != event.change(orjson.loads(raw)):
            raise SystemExit(f"{topic}: the model's ChangeEvent is not the parser's")
        report(
            f"Domain event {topic}",
            measure(
                {topic: raw},
                {
                    "hand parser (now)": hand_change(event),
                    "pydantic, validate": model.model_validate_json,
                    "pydantic + ChangeEvent": by_model,
                },
                rounds,
            ),
            "hand parser (now)",
        )


if __name__ == "__main__":
    main()
