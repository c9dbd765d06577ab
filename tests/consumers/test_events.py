"""Decoding: Debezium envelopes captured from the real connector, domain events, bad input.

The fixtures under ``fixtures/`` were captured from Debezium 3.6.1.Final (pgoutput,
JSON converter with schemas enabled) on our migrated schema; see fixtures/README.md.
The bare form (``schemas.enable=false``) of each is its ``value["payload"]``.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from freshline.consumers.events import EventRejected, decode
from freshline.pipeline.core.types import ChangeEvent, Op

FIXTURES = Path(__file__).parent / "fixtures"
TOPIC = "freshline.public.transactions"


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def encode(obj: Any) -> bytes:
    return orjson.dumps(obj)


def decode_fixture(name: str, *, wrapped: bool) -> ChangeEvent | None:
    data = fixture(name)
    value = data["value"]
    if value is not None and not wrapped:
        value = value["payload"]
    key = encode(data["key"]) if data["key"] is not None else None
    return decode(data["topic"], key, encode(value) if value is not None else None)


def decoded(name: str, *, wrapped: bool) -> ChangeEvent:
    event = decode_fixture(name, wrapped=wrapped)
    assert event is not None
    return event


def rejected(topic: str, value: bytes | None, **kwargs: Any) -> EventRejected:
    with pytest.raises(EventRejected) as info:
        decode(topic, None, value, **kwargs)
    return info.value


both_forms = pytest.mark.parametrize("wrapped", [True, False], ids=["schema-wrapper", "bare"])


# -- Debezium envelopes -------------------------------------------------------------


@both_forms
def test_snapshot_read(wrapped: bool) -> None:
    event = decoded("transactions_snapshot_r", wrapped=wrapped)
    assert event.op == "r"
    assert event.table == "transactions"
    assert event.tenant == "acme"
    assert event.row["user_id"] == 42 and event.row["id"] == 1001
    assert event.before is None
    payload = fixture("transactions_snapshot_r")["value"]["payload"]
    assert event.watermark == payload["source"]["lsn"]
    assert event.committed_at_ms == payload["source"]["ts_ms"]


@both_forms
def test_insert(wrapped: bool) -> None:
    event = decoded("transactions_insert_c", wrapped=wrapped)
    assert (event.op, event.table, event.tenant) == ("c", "transactions", "acme")
    assert event.row["id"] == 1002 and event.row["user_id"] == 42
    assert event.row["device_id"] is None
    assert event.row["amount"] == "18.50"  # decimal.handling.mode=string
    assert event.watermark > 0


@both_forms
def test_insert_with_precise_decimals_is_accepted(wrapped: bool) -> None:
    event = decoded("transactions_insert_c_decimal_precise", wrapped=wrapped)
    # precise mode: the unscaled value as big-endian two's complement, base64
    unscaled = int.from_bytes(base64.b64decode(event.row["amount"]), "big", signed=True)
    assert unscaled == 1850
    assert event.row["user_id"] == 42


def test_double_decimals_are_accepted() -> None:
    payload = fixture("transactions_insert_c")["value"]["payload"]
    payload["after"]["amount"] = 18.5  # decimal.handling.mode=double
    event = decode(TOPIC, None, encode(payload))
    assert event is not None and event.row["amount"] == 18.5


@both_forms
def test_update_with_replica_identity_default(wrapped: bool) -> None:
    event = decoded("transactions_update_default_u", wrapped=wrapped)
    assert event.op == "u"
    assert event.before is None  # DEFAULT: no old row unless the key changed
    assert event.row["status"] == "refunded"
    assert event.tenant == "acme"


@both_forms
def test_update_moving_a_transaction_with_replica_identity_default(wrapped: bool) -> None:
    event = decoded("transactions_update_default_moves_user_u", wrapped=wrapped)
    # Under DEFAULT the old user is not in the envelope at all: only FULL shows it.
    assert event.before is None
    assert event.row["user_id"] == 43


@both_forms
def test_update_with_replica_identity_full_keeps_the_old_row(wrapped: bool) -> None:
    event = decoded("transactions_update_full_moves_user_u", wrapped=wrapped)
    assert event.op == "u"
    assert event.before is not None
    assert event.before["user_id"] == 42  # routing refreshes the old user...
    assert event.row["user_id"] == 43  # ...and the new one
    assert event.row["status"] == "chargeback"


def test_update_merges_after_over_a_key_only_before() -> None:
    payload = fixture("transactions_update_default_u")["value"]["payload"]
    payload["before"] = {"tenant_id": "acme", "id": 1002}
    event = decode(TOPIC, None, encode(payload))
    assert event is not None
    assert event.before == {"tenant_id": "acme", "id": 1002}
    assert event.row == payload["after"]


@both_forms
def test_delete_with_replica_identity_default(wrapped: bool) -> None:
    event = decoded("transactions_delete_default_d", wrapped=wrapped)
    assert event.op == "d"
    assert event.row == event.before
    assert (event.row["tenant_id"], event.row["id"]) == ("acme", 1002)
    # Debezium fills the non-key NOT NULL columns with placeholders under DEFAULT:
    # the real user_id is unknown. Tables whose non-key columns route need FULL.
    assert event.row["user_id"] == 0


@both_forms
def test_delete_with_replica_identity_full(wrapped: bool) -> None:
    event = decoded("transactions_delete_full_d", wrapped=wrapped)
    assert event.op == "d"
    assert event.row["user_id"] == 43 and event.row["status"] == "chargeback"
    assert event.tenant == "acme"


def test_tombstone_is_none() -> None:
    data = fixture("transactions_tombstone")
    assert data["value"] is None
    assert decode(data["topic"], encode(data["key"]), None) is None
    assert decode("transaction.updated", b"acme:42", None) is None
    assert decode(TOPIC, None, b'{"schema": null, "payload": null}') is None


@both_forms
def test_truncate(wrapped: bool) -> None:
    event = decoded("user_devices_truncate_t", wrapped=wrapped)
    assert event.op == "t"
    assert event.table == "user_devices"
    assert event.tenant is None and event.row == {} and event.before is None
    assert event.watermark > 0


@both_forms
@pytest.mark.parametrize(
    ("name", "table", "tenant", "columns"),
    [
        ("users_snapshot_r", "users", "acme", {"id": 42}),
        ("devices_insert_c", "devices", "acme", {"id": "dev-9f3a"}),
        ("devices_update_default_u", "devices", "acme", {"risk_score": 0.87}),
        ("user_devices_insert_c", "user_devices", "acme", {"user_id": 42, "device_id": "dev-9f3a"}),
        ("geoip_insert_c", "geoip", None, {"ip_from": "203.0.113.0", "asn": 64500}),
    ],
)
def test_every_source_table(
    wrapped: bool, name: str, table: str, tenant: str | None, columns: dict[str, Any]
) -> None:
    event = decoded(name, wrapped=wrapped)
    assert event.table == table
    assert event.tenant == tenant
    assert {k: event.row[k] for k in columns} == columns


@both_forms
def test_a_table_no_feature_reads_is_unknown(wrapped: bool) -> None:
    # The fraud repository's tenants table is the tenant entity's table, but no feature
    # set reads it, so the connector does not capture it: if one arrives, it is
    # dead-lettered as unknown rather than silently dropped.
    data = fixture("tenants_snapshot_r")
    value = data["value"] if wrapped else data["value"]["payload"]
    with pytest.raises(EventRejected) as caught:
        decode(data["topic"], None, encode(value))
    assert caught.value.kind == "unknown_table"


def test_lsn_absent_gives_watermark_zero() -> None:
    payload = fixture("transactions_insert_c")["value"]["payload"]
    del payload["source"]["lsn"], payload["source"]["ts_ms"]
    event = decode(TOPIC, None, encode(payload))
    assert event is not None
    assert event.watermark == 0 and event.committed_at_ms is None


def test_table_comes_from_source_when_the_topic_was_renamed() -> None:
    payload = fixture("devices_insert_c")["value"]["payload"]
    event = decode("routed.public.anything", None, encode(payload))
    assert event is not None and event.table == "devices"


# -- domain events ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topic", "body", "table", "op", "row"),
    [
        (
            "transaction.created",
            {"tenant": "acme", "user_id": 42, "transaction_id": 1001},
            "transactions",
            "c",
            {"tenant_id": "acme", "user_id": 42, "id": 1001},
        ),
        (
            "transaction.updated",
            {"tenant": "acme", "user_id": "42", "transaction_id": "1001", "version": 7},
            "transactions",
            "u",
            {"tenant_id": "acme", "user_id": 42, "id": 1001, "_version": 7},
        ),
        (
            "device.updated",
            {"tenant": "acme", "device_id": "dev-9f3a", "risk_score": 0.9},
            "devices",
            "u",
            {"tenant_id": "acme", "id": "dev-9f3a"},
        ),
        (
            "user.updated",
            {"tenant": "acme", "user_id": 42, "source": "kyc-service"},
            "users",
            "u",
            {"tenant_id": "acme", "id": 42},
        ),
    ],
)
def test_domain_events(
    topic: str, body: dict[str, Any], table: str, op: Op, row: dict[str, Any]
) -> None:
    event = decode(topic, b"acme:42", encode(body))
    assert event == ChangeEvent(
        table=table,
        op=op,
        tenant="acme",
        row=row,
        watermark=0,
        committed_at_ms=None,
    )


def test_domain_event_occurred_at_is_the_commit_time() -> None:
    body = {"tenant": "acme", "user_id": 42, "occurred_at": "2026-11-30T12:00:00.250+01:00"}
    event = decode("user.updated", None, encode(body))
    assert event is not None
    assert event.committed_at_ms == 1796036400250


def test_domain_event_key_does_not_matter() -> None:
    body = encode({"tenant": "acme", "device_id": "d1"})
    events = [decode("device.updated", key, body) for key in (None, b"", b"acme:d1", b"x")]
    assert all(e == events[0] for e in events)


# -- bad input ----------------------------------------------------------------------


def test_oversized() -> None:
    body = encode({"tenant": "acme", "user_id": 1, "pad": "x" * 5000})
    assert rejected("user.updated", body, max_bytes=4096).kind == "oversized"
    assert decode("user.updated", None, body, max_bytes=len(body)) is not None


@pytest.mark.parametrize("value", [b"{", b"", b"\xff\xfe", b'{"tenant": "acme",}', b"nope"])
def test_malformed_json(value: bytes) -> None:
    assert rejected("user.updated", value).kind == "malformed_json"
    assert rejected(TOPIC, value).kind == "malformed_json"


@pytest.mark.parametrize(
    ("topic", "body"),
    [
        ("user.updated", [1, 2]),
        ("user.updated", "acme"),
        ("user.updated", None),
        ("user.updated", {"user_id": 42}),
        ("user.updated", {"tenant": "acme"}),
        ("transaction.updated", {"tenant": "acme", "user_id": 42}),
        ("transaction.created", {"tenant": None, "user_id": 42, "transaction_id": 1}),
        ("device.updated", {"tenant": "acme", "id": "d1"}),
        (TOPIC, {"before": None, "after": {"tenant_id": "acme", "id": 1}}),
        (TOPIC, {"op": "c", "before": None, "after": None, "source": {}}),
        (TOPIC, {"op": "d", "before": None, "after": None, "source": {}}),
        (TOPIC, {"op": "c", "after": {"id": 1, "user_id": 42}, "source": {}}),
        (TOPIC, {"schema": {}, "payload": [1]}),
        (TOPIC, 42),
    ],
)
def test_missing_field(topic: str, body: Any) -> None:
    assert rejected(topic, encode(body)).kind == "missing_field"


@pytest.mark.parametrize(
    ("topic", "body"),
    [
        ("user.updated", {"tenant": "ac:me", "user_id": 42}),
        ("user.updated", {"tenant": "acme*", "user_id": 42}),
        ("user.updated", {"tenant": "x" * 65, "user_id": 42}),
        ("user.updated", {"tenant": 7, "user_id": 42}),
        ("user.updated", {"tenant": "acme", "user_id": "4 2"}),
        ("user.updated", {"tenant": "acme", "user_id": -1}),
        ("user.updated", {"tenant": "acme", "user_id": True}),
        ("user.updated", {"tenant": "acme", "user_id": 4.5}),
        ("user.updated", {"tenant": "acme", "user_id": 2**63}),
        ("device.updated", {"tenant": "acme", "device_id": "{d1}"}),
        ("device.updated", {"tenant": "acme", "device_id": "d1\n"}),
        ("transaction.updated", {"tenant": "acme", "user_id": 1, "transaction_id": "1e3"}),
        (TOPIC, {"op": "c", "after": {"tenant_id": "a:b", "id": 1, "user_id": 2}}),
        (TOPIC, {"op": "c", "after": {"tenant_id": "acme", "id": 1, "user_id": "*"}}),
        (TOPIC, {"op": "c", "after": {"tenant_id": 5, "id": 1, "user_id": 2}}),
        (
            TOPIC,
            {
                "op": "u",
                "before": {"tenant_id": "acme", "id": 1, "user_id": "a b"},
                "after": {"tenant_id": "acme", "id": 1, "user_id": 2},
            },
        ),
    ],
)
def test_invalid_id(topic: str, body: Any) -> None:
    assert rejected(topic, encode(body)).kind == "invalid_id"


@pytest.mark.parametrize(
    ("topic", "body"),
    [
        ("user.updated", {"tenant": "acme", "user_id": 1, "occurred_at": "yesterday"}),
        ("user.updated", {"tenant": "acme", "user_id": 1, "occurred_at": "2026-11-30T12:00"}),
        ("user.updated", {"tenant": "acme", "user_id": 1, "occurred_at": 1796036400}),
        ("user.updated", {"tenant": "acme", "user_id": 1, "version": "7"}),
        (TOPIC, {"op": "x", "after": {"tenant_id": "acme", "id": 1, "user_id": 2}}),
        (TOPIC, {"op": ["c"], "after": {"tenant_id": "acme", "id": 1, "user_id": 2}}),
        (TOPIC, {"op": "c", "after": [1], "source": {}}),
        (TOPIC, {"op": "c", "after": {"tenant_id": "acme", "id": 1}, "source": {"lsn": "1"}}),
        (TOPIC, {"op": "c", "after": {"tenant_id": "acme", "id": 1}, "source": {"lsn": -1}}),
        (TOPIC, {"op": "c", "after": {"tenant_id": "acme", "id": 1}, "source": 3}),
    ],
)
def test_invalid_field(topic: str, body: Any) -> None:
    assert rejected(topic, encode(body)).kind == "invalid_field"


@pytest.mark.parametrize(
    "topic",
    ["freshline.public.api_keys", "freshline.public.orders", "freshline.audit.users_archive"],
)
def test_unknown_table(topic: str) -> None:
    body = {"op": "c", "after": {"tenant_id": "acme", "id": 1}, "source": {}}
    assert rejected(topic, encode(body)).kind == "unknown_table"
    body["source"] = {"table": ["users"]}
    assert rejected(TOPIC, encode(body)).kind == "unknown_table"


@pytest.mark.parametrize(
    "topic",
    ["transaction.deleted", "freshline.dlq", "orders", "freshline.invalidations", "a.b.c.d", ""],
)
def test_unknown_event_type(topic: str) -> None:
    body = encode({"tenant": "acme", "user_id": 1, "transaction_id": 1})
    assert rejected(topic, body).kind == "unknown_event_type"


def test_rejection_carries_reason_and_kind() -> None:
    err = rejected("user.updated", encode({"tenant": "acme"}))
    assert err.reason == "user_id: required"
    assert str(err) == "missing_field: user_id: required"


# -- fuzz: only an event, None, or EventRejected ever comes out ----------------------


def _samples() -> list[tuple[str, bytes]]:
    out = []
    for path in sorted(FIXTURES.glob("*.json")):
        data = json.loads(path.read_text())
        if data["value"] is not None:
            out.append((data["topic"], encode(data["value"])))
            out.append((data["topic"], encode(data["value"]["payload"])))
    out += [
        (
            "transaction.updated",
            encode(
                {
                    "tenant": "acme",
                    "user_id": 42,
                    "transaction_id": 9,
                    "occurred_at": "2026-11-30T12:00:00Z",
                    "version": 3,
                }
            ),
        ),
        ("device.updated", encode({"tenant": "acme", "device_id": "dev-9f3a"})),
        ("user.updated", encode({"tenant": "acme", "user_id": "42"})),
    ]
    return out


JUNK: list[Any] = [
    None,
    True,
    0,
    -1,
    2**63 - 1,
    1.5,
    "",
    "a:b",
    "*",
    "x" * 70,
    [],
    {},
    [1],
    {"a": None},
    "\x00",
    "2026-13-45T99:99:99Z",
]


def _mutate(obj: Any, rng: random.Random) -> Any:
    """Replace, drop or retype one value somewhere in ``obj``."""
    if isinstance(obj, dict) and obj:
        key = rng.choice(sorted(obj))
        roll = rng.random()
        copy = dict(obj)
        if roll < 0.2:
            del copy[key]
        elif roll < 0.6:
            copy[key] = rng.choice(JUNK)
        else:
            copy[key] = _mutate(obj[key], rng)
        return copy
    if isinstance(obj, list) and obj:
        i = rng.randrange(len(obj))
        return [*obj[:i], _mutate(obj[i], rng), *obj[i + 1 :]]
    return rng.choice(JUNK)


def _check(topic: str, value: bytes) -> str:
    try:
        event = decode(topic, None, value)
    except EventRejected as exc:
        return exc.kind
    if event is None:
        return "none"
    assert isinstance(event, ChangeEvent)
    return "event"


def test_fuzz_only_events_none_or_rejections() -> None:
    rng = random.Random(20261130)
    samples = _samples()
    topics = [t for t, _ in samples] + ["freshline.public.nope", "junk", "device.updated"]
    outcomes: dict[str, int] = {}
    for _ in range(3000):
        topic, value = rng.choice(samples)
        roll = rng.random()
        if roll < 0.25:
            value = value[: rng.randrange(len(value))]
        elif roll < 0.4:
            value = rng.randbytes(rng.randrange(64))
        elif roll < 0.5:
            pos = rng.randrange(len(value))
            value = value[:pos] + bytes([rng.randrange(256)]) + value[pos + 1 :]
        else:
            value = encode(_mutate(orjson.loads(value), rng))
        if rng.random() < 0.1:
            topic = rng.choice(topics)
        result = _check(topic, value)
        outcomes[result] = outcomes.get(result, 0) + 1
    # the loop reached both sides of the decoder
    assert outcomes.get("event", 0) > 100
    assert outcomes.get("malformed_json", 0) > 100
    assert len(outcomes) >= 6, outcomes
