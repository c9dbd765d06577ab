"""One rule for entity ids: the read API, the Python client and domain events take and
refuse the same ids, with the same message (:func:`freshline.pipeline.core.features.validate_key`).

Upper-case uuids, which many systems write, are the lower-case key everywhere. Run on
the library repository (tests/repos/library: uuid keys, one tenant).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.recompute import Batch
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.clock import now_ms
from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.events import Event, EventFieldError
from freshline.pipeline.core.features import IMPLICIT_TENANT, Registry, Table, validate_key
from freshline.pipeline.core.repository import load
from freshline.pipeline.core.settings import Settings
from tests.helpers import api_for, fresh_version

LIBRARY = Path(__file__).resolve().parents[2] / "repos" / "library"
MEMBER = "0b9d1c3e-6f0a-4c1e-9a43-3f1f5c2b7d10"
WRONG: list[object] = ["42", 42, True, 1.5, MEMBER[:-1], "{" + MEMBER[1:], MEMBER + " "]
"""Not a uuid key, each for its own reason: digits, a number, a boolean, a float, one
hex digit short, a brace, a trailing space."""


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load(LIBRARY).registry


def refusal(value: object) -> str:
    with pytest.raises(InvalidId) as info:
        validate_key("uuid", value)
    return str(info.value)


def test_an_upper_case_uuid_reads_the_lower_case_key(
    redis_client: redis.Redis, registry: Registry
) -> None:
    assert validate_key("uuid", MEMBER.upper()) == MEMBER
    version = fresh_version()
    values = {"open_loans": 1, "lost_books": 0, "last_loan_at": None}
    batch = Batch(registry["loans_now"], {(IMPLICIT_TENANT, MEMBER): values}, 5, now_ms())
    EntryStore(redis_client, version, registry=registry).write(batch)
    client = FeatureClient(redis_client, version, registry=registry)
    got = client.get("loans_now", IMPLICIT_TENANT, MEMBER.upper())
    assert got is not None and (got.entity, got.values["open_loans"]) == (MEMBER, 1)


@pytest.mark.parametrize("value", WRONG, ids=repr)
def test_the_client_refuses_what_http_refuses_with_the_same_message(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    registry: Registry,
    tenant_factory: Callable[..., SeedSummary],
    value: object,
) -> None:
    message = refusal(value)
    client = FeatureClient(redis_client, fresh_version(), registry=registry)
    with pytest.raises(InvalidId) as info:
        client.get("loans_now", IMPLICIT_TENANT, value)  # type: ignore[arg-type]
    assert str(info.value) == message
    tenant = tenant_factory(users=1, transactions=1).tenants[0]
    with api_for(settings, engine, redis_client, tenant, registry=registry) as api:
        body = {"feature_sets": ["loans_now"], "entities": [value], "mode": "cache-only"}
        answer = api.post("/v1/features/batch", json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == {"code": "invalid_id", "message": message}
        if isinstance(value, str):
            answer = api.get(f"/v1/features/loans_now/{value}?mode=cache-only")
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["message"] == message
    with pytest.raises(EventFieldError) as refused:
        member_event(registry).change({"member_id": value})
    assert refused.value.reason == info.value.reason


def member_event(registry: Registry) -> Event:
    """A domain event changing a member, as the library could declare one."""
    member = registry["loans_now"].entity
    return Event("member.updated", table=Table("lib_members", entities={member: "member_id"}))


def test_an_upper_case_uuid_in_an_event_is_the_lower_case_key(registry: Registry) -> None:
    change = member_event(registry).change({"member_id": MEMBER.upper()})
    assert change.row == {"member_id": MEMBER}
