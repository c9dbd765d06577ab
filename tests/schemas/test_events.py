"""The committed JSON Schema files and the event declarations say the same thing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from freshline.consumers.events import EventRejected, decode, domain_events
from freshline.pipeline.cli import app
from freshline.pipeline.core.events import (
    Event,
    EventFieldError,
    event_schema,
    record_model,
    schema_file,
)
from freshline.pipeline.core.features import Entity, Table
from freshline.pipeline.core.repository import active
from freshline.schemas.ids import ID_PATTERN, MAX_ID_LENGTH
from tests.helpers import examples

ID_PROPERTIES = {"tenant", "device_id"}
NUMERIC_ID_PROPERTIES = {"user_id", "transaction_id"}
TOPICS = sorted(domain_events())


def schema_dir() -> Path:
    return active().path / "schemas"


def load(topic: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((schema_dir() / f"{topic}.schema.json").read_text())
    return schema


def event(topic: str) -> Event:
    return domain_events()[topic]


def test_the_fraud_example_declares_the_four_topics() -> None:
    assert TOPICS == [
        "device.updated",
        "transaction.created",
        "transaction.updated",
        "user.updated",
    ]


def test_one_schema_file_per_domain_topic() -> None:
    files = {p.name.removesuffix(".schema.json") for p in schema_dir().glob("*.schema.json")}
    assert files == set(TOPICS)


@pytest.mark.parametrize("topic", TOPICS)
def test_committed_files_are_the_generated_ones(topic: str) -> None:
    name, text = schema_file(event(topic))
    assert (schema_dir() / name).read_text() == text, "run: freshline events schemas"


def test_cli_writes_the_generated_files(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["events", "schemas", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    written = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert written == dict(schema_file(event(t)) for t in TOPICS)


@pytest.mark.parametrize("topic", TOPICS)
def test_required_fields_are_what_the_parser_requires(topic: str) -> None:
    schema = load(topic)
    complete = {
        name: ("1" if name in NUMERIC_ID_PROPERTIES else "a1") for name in schema["required"]
    }
    assert decode(topic, None, orjson.dumps(complete)) is not None
    for name in schema["required"]:
        with pytest.raises(EventRejected) as info:
            decode(topic, None, orjson.dumps({k: v for k, v in complete.items() if k != name}))
        assert (info.value.kind, info.value.reason) == ("missing_field", f"{name}: required")
    assert set(schema["properties"]) == {*schema["required"], "occurred_at", "version"}


@pytest.mark.parametrize("topic", TOPICS)
def test_schema_shape(topic: str) -> None:
    schema = load(topic)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is True  # producers may send more
    assert schema["title"] == topic
    assert schema["description"] == event(topic).description
    assert set(schema["required"]) <= set(schema["properties"])
    props = schema["properties"]
    assert props["occurred_at"] == {**props["occurred_at"], "type": "string", "format": "date-time"}
    assert props["version"]["type"] == "integer"
    assert all(p["description"] for p in props.values())


@pytest.mark.parametrize("topic", TOPICS)
def test_id_rules_match_the_key_scheme(topic: str) -> None:
    props = load(topic)["properties"]
    assert set(props) - {"occurred_at", "version"} <= ID_PROPERTIES | NUMERIC_ID_PROPERTIES
    for name, prop in props.items():
        if name in ID_PROPERTIES:
            assert prop["pattern"] == f"^{ID_PATTERN.pattern}$"
            assert prop["maxLength"] == MAX_ID_LENGTH
        elif name in NUMERIC_ID_PROPERTIES:
            integer, digits = prop["anyOf"]
            assert integer["type"] == "integer" and integer["minimum"] == 0
            assert integer["maximum"] == 2**63 - 1
            assert re.fullmatch(digits["pattern"].strip("^$"), "9" * 19)


def test_a_uuid_key_is_checked_as_cdc_rows_are() -> None:
    order = Entity("order", key="order_id", type="uuid")
    orders = Event("order.updated", table=Table("orders", entities={order: "order_id"}))
    key = "0b9d1c3e-6f0a-4c1e-9a43-3f1f5c2b7d10"
    change = orders.change({"order_id": key})
    assert (change.table, change.op, change.tenant, change.row) == (
        "orders",
        "u",
        None,
        {"order_id": key},
    )
    # Upper case, as many systems write uuids, is read as the lower-case key.
    assert orders.change({"order_id": key.upper()}).row == {"order_id": key}
    for bad in (key[:-1], 7, "{" + key[1:]):
        with pytest.raises(EventFieldError) as info:
            orders.change({"order_id": bad})
        assert info.value.kind == "invalid_id"
    pattern = event_schema(orders)["properties"]["order_id"]["pattern"]
    assert re.fullmatch(pattern.strip("^$"), key)
    assert re.fullmatch(pattern.strip("^$"), key.upper())
    assert not re.fullmatch(pattern.strip("^$"), key[:-1])


ID_VALUES = (
    st.none()
    | st.integers(min_value=-2, max_value=2**63)
    | st.sampled_from(
        [
            "1",
            "007",
            "9" * 19,
            "9" * 20,
            "a1",
            "",
            "a:b",
            "A.b-c_d",
            "x" * 65,
            "é",
            "a\n",
            True,
            2.0,
        ]
    )
)
WHEN = st.none() | st.sampled_from(
    ["2026-01-01T00:00:00Z", "2026-01-01T00:00:00.5+02:00", "2026-01-01T00:00:00", "soon", 5]
)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topic=st.sampled_from(TOPICS), data=st.data())
def test_the_parser_takes_the_records_the_model_takes(topic: str, data: st.DataObject) -> None:
    declared = event(topic)
    fields = dict.fromkeys(declared.required, ID_VALUES)
    more = {"occurred_at": WHEN, "version": st.none() | st.sampled_from([3, "3", True, 1.5])}
    record = data.draw(st.fixed_dictionaries({}, optional={**fields, **more}))
    raw = orjson.dumps(record)
    try:
        record_model(declared).model_validate_json(raw)
        taken = True
    except ValidationError:
        taken = False
    try:
        declared.change(orjson.loads(raw))
        parsed = True
    except EventFieldError:
        parsed = False
    assert parsed == taken, record
