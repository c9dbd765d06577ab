from __future__ import annotations

import pytest

from pipeline.core.errors import InvalidId
from pipeline.core.keys import feature_key, inference_key, lease_key, validate_id
from pipeline.core.types import EntityRef


def test_feature_key_format_is_the_documented_one() -> None:
    ref = EntityRef("txn_90d", "acme", "42")
    assert feature_key(3, ref) == "feat:3:txn_90d:{acme:42}"
    assert lease_key(3, ref) == "lease:3:txn_90d:{acme:42}"


def test_keys_of_one_entity_share_a_hash_tag() -> None:
    a = feature_key(1, EntityRef("txn_90d", "acme", "42"))
    b = feature_key(1, EntityRef("geo", "acme", "42"))
    assert a[a.index("{"):] == b[b.index("{"):]


@pytest.mark.parametrize(
    "bad",
    ["", "a:b", "a*", "a?", "a[1]", "{x}", "a b", "a\nb", "a\x00", "é", "-lead", "x" * 65,
     None, 1.5, True],
)
def test_unsafe_ids_never_reach_a_key(bad: object) -> None:
    with pytest.raises(InvalidId):
        validate_id("entity", bad)
    with pytest.raises(InvalidId):
        feature_key(1, EntityRef("txn_90d", "acme", bad))  # type: ignore[arg-type]
    with pytest.raises(InvalidId):
        feature_key(1, EntityRef("txn_90d", bad, "1"))  # type: ignore[arg-type]


def test_integer_and_plain_ids_are_accepted() -> None:
    assert validate_id("entity", 42) == "42"
    assert validate_id("tenant", "acme-eu_1.x") == "acme-eu_1.x"


def test_inference_key_keeps_tenant_and_arm_apart() -> None:
    plain = inference_key("fraud", "3", "abc")
    with_arm = inference_key("fraud", "3", "abc", arm="b")
    with_tenant = inference_key("fraud", "3", "abc", tenant="b")
    assert plain == "infer:fraud:3:::{abc}"
    assert len({plain, with_arm, with_tenant}) == 3
