from __future__ import annotations

import fnmatch
import random

import pytest

from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.keys import (
    feature_key,
    inference_key,
    lease_key,
    semantic_budget_keys,
    semantic_entry_key,
    semantic_namespace,
    semantic_pattern,
    validate_id,
)
from freshline.pipeline.core.types import EntityRef
from freshline.schemas.ids import id_problem


def test_feature_key_format_is_the_documented_one() -> None:
    ref = EntityRef("txn_90d", "acme", "42")
    assert feature_key(3, ref) == "feat:3:txn_90d:{acme:42}"
    assert lease_key(3, ref) == "lease:3:txn_90d:{acme:42}"


def test_keys_of_one_entity_share_a_hash_tag() -> None:
    a = feature_key(1, EntityRef("txn_90d", "acme", "42"))
    b = feature_key(1, EntityRef("geo", "acme", "42"))
    assert a[a.index("{") :] == b[b.index("{") :]


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "a:b",
        "a*",
        "a?",
        "a[1]",
        "{x}",
        "a b",
        "a\nb",
        "a\x00",
        "é",
        "-lead",
        "x" * 65,
        None,
        1.5,
        True,
    ],
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


def test_validate_id_accepts_exactly_the_contracts_ids() -> None:
    """Its fast paths (alphanumeric, then the pattern) agree with :func:`id_problem`."""
    rng = random.Random(15)
    alphabet = "aZ09_.-:{}* \n\x00\u00e9\uff11"
    values = ["x" * 64, "x" * 65, "a-" * 32, "a-" * 32 + "b", "a\n", "\n", "1.", "_a", ".a"]
    values += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(3000)]
    for value in values:
        if id_problem(value) is None:
            assert validate_id("tenant", value) == value
        else:
            with pytest.raises(InvalidId):
                validate_id("tenant", value)


def test_inference_key_keeps_tenant_and_arm_apart() -> None:
    plain = inference_key("fraud", "3", "abc")
    with_arm = inference_key("fraud", "3", "abc", arm="b")
    with_tenant = inference_key("fraud", "3", "abc", tenant="b")
    assert plain == "infer:fraud:3:::{abc}"
    assert len({plain, with_arm, with_tenant}) == 3


def test_a_tenants_semantic_budget_shares_its_tag_and_no_namespace_pattern() -> None:
    own, size = semantic_budget_keys("acme")
    assert (own, size) == ("sem:_own:{acme}", "sem:_bytes:{acme}")  # one slot: one script
    entry = semantic_entry_key(semantic_namespace("acme", "bot", "v1", "t1"), 1)
    # A namespace's pattern, even the whole tenant's, never matches the budget: a
    # purge narrowed to a model cannot drop the count of the tenant's other entries.
    glob = semantic_pattern("acme").replace("\\", "")
    assert fnmatch.fnmatchcase(entry, glob)
    assert not fnmatch.fnmatchcase(own, glob) and not fnmatch.fnmatchcase(size, glob)
    with pytest.raises(InvalidId):
        semantic_budget_keys("a}b")
