"""The bodies' models: the committed OpenAPI document is generated from them, and the
bodies they refuse get the errors the API has always answered."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from freshline.pipeline.api.contracts import (
    MAX_MS,
    FeatureSelection,
    Freshness,
    PredictRequest,
    feature_selection,
    freshness_fields,
    predict_request,
)
from freshline.pipeline.api.errors import public_message, status_of
from freshline.pipeline.api.openapi import reference_text
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.repository import active
from tests.helpers import REGISTRY, examples

LIMIT = 12


def committed_document() -> str:
    return (active().path / "schemas" / "openapi.json").read_text()


def test_the_committed_openapi_document_is_the_generated_one() -> None:
    assert committed_document() == reference_text(REGISTRY), "run: scripts/contracts"


def test_the_committed_document_names_the_models() -> None:
    schemas = json.loads(committed_document())["components"]["schemas"]
    assert {"BatchRequest", "Features", "PredictRequest", "Error", "LlmParams"} <= set(schemas)
    assert schemas["BatchRequest"]["properties"]["feature_sets"]["items"]["enum"] == (
        REGISTRY.names()
    )


def answer(call: Any, *args: Any) -> Any:
    """What ``call(*args)`` returns, or the status, code and message the API answers."""
    try:
        return call(*args)
    except FreshlineError as exc:
        status, code = status_of(exc)
        return status, code, public_message(exc, status)


def selection(body: object, registry: Registry = REGISTRY) -> Any:
    return answer(feature_selection, body, LIMIT, registry.__getitem__)


NOT_AN_ARRAY = "must be a non-empty JSON array"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ([1, 2], (422, "invalid_request", "the body must be a JSON object")),
        ({"entities": [1]}, (422, "invalid_request", f"'feature_sets' {NOT_AN_ARRAY}")),
        (
            {"feature_sets": "geo", "entities": [1]},
            (422, "invalid_request", f"'feature_sets' {NOT_AN_ARRAY}"),
        ),
        (
            {"feature_sets": [], "entities": [1]},
            (422, "invalid_request", f"'feature_sets' {NOT_AN_ARRAY}"),
        ),
        (
            {"feature_sets": ["geo"], "entities": []},
            (422, "invalid_request", f"'entities' {NOT_AN_ARRAY}"),
        ),
        (
            {"feature_sets": ["geo"], "entities": {}},
            (422, "invalid_request", f"'entities' {NOT_AN_ARRAY}"),
        ),
        # The shapes come first, then the size, then each name in order.
        ({"feature_sets": [7]}, (422, "invalid_request", f"'entities' {NOT_AN_ARRAY}")),
        (
            {"feature_sets": ["geo", 7], "entities": list(range(13))},
            (
                422,
                "batch_too_large",
                "13 entities x 2 feature sets is over the limit of 12 per request",
            ),
        ),
        (
            {"feature_sets": [7], "entities": [1]},
            (400, "invalid_id", "invalid feature set id 7: must be a string"),
        ),
        ({"feature_sets": ["nope", 7], "entities": [1]}, (404, "unknown_feature_set", None)),
        (
            {"feature_sets": ["geo", 7], "entities": [1]},
            (400, "invalid_id", "invalid feature set id 7: must be a string"),
        ),
        ({"feature_sets": ["geo", "nope"], "entities": [1]}, (404, "unknown_feature_set", None)),
        (
            {"feature_sets": ["geo", "geo"], "entities": [1]},
            (422, "invalid_request", "'feature_sets' names a feature set twice"),
        ),
        (
            {"feature_sets": ["geo"], "entities": [1, "2", 3.0, None]},
            (["geo"], [1, "2", 3.0, None]),
        ),
        (
            {"feature_sets": ["geo", "txn_90d"], "entities": ["1"], "x": 1},
            (["geo", "txn_90d"], ["1"]),
        ),
    ],
)
def test_a_batch_selection_answers_as_it_always_has(body: object, expected: Any) -> None:
    got = selection(body)
    if expected[0] == 404:  # the message lists the known feature sets
        got = (*got[:2], None)
    assert got == expected


@pytest.mark.parametrize(
    "body",
    [
        {"feature_sets": ["geo"], "entities": ["1", "2"]},
        {"feature_sets": ["geo", "txn_90d"], "entities": [1, 2.5, "x", None, [1]]},
        {"feature_sets": ["geo"], "entities": ["1"], "after": None, "other": {}},
    ],
)
def test_the_fast_path_takes_only_what_the_model_takes_alike(body: dict[str, Any]) -> None:
    model = FeatureSelection.model_validate(body)
    assert selection(body) == (model.feature_sets, model.entities)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"max_staleness_ms": "0"},
            (422, "invalid_request", "'max_staleness_ms' must be an integer or null"),
        ),
        (
            {"max_staleness_ms": True},
            (422, "invalid_request", "'max_staleness_ms' must be an integer or null"),
        ),
        (
            {"max_staleness_ms": 1.5},
            (422, "invalid_request", "'max_staleness_ms' must be an integer or null"),
        ),
        (
            {"max_staleness_ms": -1},
            (422, "invalid_request", f"max_staleness_ms must be an integer from 0 to {MAX_MS}"),
        ),
        (
            {"wait_ms": 1e13},
            (422, "invalid_request", f"wait_ms must be an integer from 0 to {MAX_MS}"),
        ),
        (
            {"max_staleness_ms": -1, "wait_ms": "x", "after": 1},
            (422, "invalid_request", f"max_staleness_ms must be an integer from 0 to {MAX_MS}"),
        ),
        (
            {"wait_ms": "x", "after": 1},
            (422, "invalid_request", "'wait_ms' must be an integer or null"),
        ),
        (
            {"after": 1},
            (400, "invalid_token", "'after' must be a freshness token (a string) or null"),
        ),
    ],
)
def test_freshness_fields_answer_as_they_always_have(body: dict[str, Any], expected: Any) -> None:
    assert answer(freshness_fields, body) == expected


def test_freshness_fields_take_integral_numbers() -> None:
    staleness, wait, after = freshness_fields(
        {"max_staleness_ms": 7.0, "wait_ms": None, "after": "t"}
    )
    assert (staleness, wait, after) == (7, None, "t")
    assert type(staleness) is int


ROWS = "'inputs' must be a non-empty array of rows"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("x", (422, "invalid_request", "the body must be a JSON object")),
        ({"inputs": "1"}, (422, "invalid_request", ROWS)),
        ({"inputs": []}, (422, "invalid_request", ROWS)),
        ({"arm": 1}, (422, "invalid_request", ROWS)),
        (
            {"inputs": [[1.0]] * 13, "arm": 1},
            (422, "batch_too_large", "13 inputs is over the limit of 12 per request"),
        ),
        (
            {"inputs": [[1.0]], "arm": 1},
            (422, "invalid_request", "'arm' must be a string id or null"),
        ),
        ({"inputs": [[1.0]], "arm": "a:b"}, (400, "invalid_id", None)),
        ({"inputs": [[1.0]], "arm": ""}, (400, "invalid_id", None)),
        ({"inputs": [[1.0]], "arm": "a" * 65}, (400, "invalid_id", None)),
    ],
)
def test_a_predict_body_answers_as_it_always_has(body: object, expected: Any) -> None:
    got = answer(predict_request, body, LIMIT)
    if expected[2] is None:  # the id rule's own words
        got = (*got[:2], None)
    assert got == expected


@pytest.mark.parametrize(
    "body",
    [
        {"inputs": [[1, 2.5], ["x"]], "arm": "b-1", "more": 1},
        {"inputs": [[1]], "arm": None},
        {"inputs": [1, None]},
    ],
)
def test_the_predict_fast_path_takes_only_what_the_model_takes_alike(
    body: dict[str, Any],
) -> None:
    model = PredictRequest.model_validate(body)
    assert predict_request(body, LIMIT) == (model.inputs, model.arm)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=2)
    ),
    max_leaves=6,
)
NAMES = st.sampled_from(["geo", "txn_90d", "device_risk"]) | JSON


PROPERTY = settings(
    max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


M = TypeVar("M", bound=BaseModel)


def by_model(model: type[M], body: object) -> M | None:
    try:
        return model.model_validate(body)
    except ValidationError:
        return None


@PROPERTY
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "feature_sets": st.lists(NAMES, max_size=3, unique_by=repr) | JSON,
            "entities": st.lists(JSON, max_size=3) | JSON,
        },
    )
)
def test_a_selection_is_what_the_model_says(body: dict[str, Any]) -> None:
    model = by_model(FeatureSelection, body)
    try:
        got: Any = feature_selection(body, 1000, lambda name: None)
    except FreshlineError:
        got = None
    if model is None or len(set(model.feature_sets)) < len(model.feature_sets):
        assert got is None  # a name twice: the one check after the model's
    else:
        assert got == (model.feature_sets, model.entities)


@PROPERTY
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "inputs": st.lists(JSON, max_size=3) | JSON,
            "arm": st.none() | st.sampled_from(["a", "b-1", "a:b", ""]) | JSON,
        },
    )
)
def test_a_predict_body_is_what_the_model_says(body: dict[str, Any]) -> None:
    model = by_model(PredictRequest, body)
    try:
        got: Any = predict_request(body, 1000)
    except FreshlineError:
        got = None
    assert got == (None if model is None else (model.inputs, model.arm))


MS = st.integers(min_value=-1, max_value=MAX_MS + 1) | st.floats() | JSON


@PROPERTY
@given(
    st.fixed_dictionaries(
        {}, optional={"max_staleness_ms": MS, "wait_ms": MS, "after": st.text(max_size=3) | JSON}
    )
)
def test_freshness_fields_are_what_the_model_says(body: dict[str, Any]) -> None:
    model = by_model(Freshness, body)
    try:
        got: Any = freshness_fields(body)
    except FreshlineError:
        got = None
    assert got == (None if model is None else (model.max_staleness_ms, model.wait_ms, model.after))
