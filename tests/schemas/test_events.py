"""The JSON Schema files and the typed models say the same thing."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest

from consumers.events import DOMAIN_MODELS
from pipeline.core.topics import DOMAIN_TOPICS
from schemas.events import SCHEMA_DIR, DomainEvent, schema_path
from schemas.ids import ID_PATTERN, MAX_ID_LENGTH

ID_PROPERTIES = {"tenant", "device_id"}
NUMERIC_ID_PROPERTIES = {"user_id", "transaction_id"}


def load(topic: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(schema_path(topic).read_text())
    return schema


def required_fields(model: type[DomainEvent]) -> set[str]:
    return {
        f.name
        for f in dataclasses.fields(model)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }


def test_one_schema_file_per_domain_topic() -> None:
    files = {p.name.removesuffix(".schema.json") for p in SCHEMA_DIR.glob("*.schema.json")}
    assert files == set(DOMAIN_TOPICS)


@pytest.mark.parametrize("topic", sorted(DOMAIN_TOPICS))
def test_required_fields_agree(topic: str) -> None:
    schema = load(topic)
    model = DOMAIN_MODELS[topic]
    assert set(schema["required"]) == required_fields(model)
    model_fields = {f.name for f in dataclasses.fields(model)}
    assert set(schema["properties"]) == model_fields


@pytest.mark.parametrize("topic", sorted(DOMAIN_TOPICS))
def test_schema_shape(topic: str) -> None:
    schema = load(topic)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is True  # producers may send more
    assert schema["title"] == topic
    assert set(schema["required"]) <= set(schema["properties"])
    props = schema["properties"]
    assert props["occurred_at"] == {**props["occurred_at"], "type": "string", "format": "date-time"}
    assert props["version"]["type"] == "integer"


@pytest.mark.parametrize("topic", sorted(DOMAIN_TOPICS))
def test_id_rules_match_the_key_scheme(topic: str) -> None:
    for name, prop in load(topic)["properties"].items():
        if name in ID_PROPERTIES:
            assert prop["pattern"] == f"^{ID_PATTERN.pattern}$"
            assert prop["maxLength"] == MAX_ID_LENGTH
        elif name in NUMERIC_ID_PROPERTIES:
            integer, digits = prop["oneOf"]
            assert integer["type"] == "integer" and integer["minimum"] == 0
            assert integer["maximum"] == 2**63 - 1
            assert re.fullmatch(digits["pattern"].strip("^$"), "9" * 19)
