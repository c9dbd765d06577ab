"""Feature values as Arrow columns (:mod:`freshline.pipeline.core.frames`): the names and
types training sets and batch reads share, and one line when pyarrow is missing."""

from __future__ import annotations

import datetime as dt
import sys
from typing import Any, NamedTuple

import pytest

from freshline.pipeline.core import frames
from freshline.pipeline.core.frames import FrameError, requested
from tests.helpers import REGISTRY

pa = pytest.importorskip("pyarrow")


class Read(NamedTuple):
    values: dict[str, Any]
    age_ms: int
    schema_version: int


def test_a_feature_set_asks_for_every_field_and_set_field_for_one() -> None:
    got = requested(REGISTRY, ["geo", "txn_90d:txn_count", "geo:distinct_countries_30d"])
    assert [r.column for r in got] == [
        *(f"geo__{f}" for f in REGISTRY["geo"].field_names),
        "txn_90d__txn_count",
    ]


@pytest.mark.parametrize(
    ("features", "message"),
    [
        ([], "no features asked for"),
        ("txn_90d", "features are a list of names, not one string: ['txn_90d']"),
        (["txn_9d"], "unknown feature set 'txn_9d'"),
        (["geo:countries"], "feature set 'geo' has no field 'countries'; its fields: "),
    ],
)
def test_features_it_cannot_use_are_one_line(features: Any, message: str) -> None:
    with pytest.raises(FrameError) as caught:
        requested(REGISTRY, features)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_columns_are_typed_as_declared_with_timestamps_from_epoch_ms() -> None:
    at = dt.datetime(2026, 12, 1, 10, 0, 0, 123000, tzinfo=dt.UTC)
    ms = int(at.timestamp() * 1000)
    assert frames.arrow_column("int", [1, None]).type == pa.int64()
    assert frames.arrow_column("float", [1.5]).type == pa.float64()
    assert frames.arrow_column("bool", [True]).type == pa.bool_()
    assert frames.arrow_column("str", ["a"]).type == pa.string()
    column = frames.arrow_column("timestamp", [ms, None])
    assert column.type == pa.timestamp("ms", tz="UTC")
    assert column.to_pylist() == [at, None]


def test_an_entity_frame_is_keys_then_fields_with_misses_null() -> None:
    wanted = requested(REGISTRY, ["txn_90d:txn_count", "geo:distinct_countries_30d"])
    user = REGISTRY["txn_90d"].entity
    got = frames.entity_frame(
        user,
        wanted,
        "acme",
        ["7", "8"],
        {
            "txn_90d": [Read({"txn_count": 3}, 5, 1), None],
            "geo": [None, Read({"distinct_countries_30d": 2}, 5, 1)],
        },
    )
    assert got.column_names == [
        "tenant_id",
        "user_id",
        "txn_90d__txn_count",
        "geo__distinct_countries_30d",
    ]
    assert got.schema.field("user_id").type == pa.int64()
    assert got.to_pylist() == [
        {
            "tenant_id": "acme",
            "user_id": 7,
            "txn_90d__txn_count": 3,
            "geo__distinct_countries_30d": None,
        },
        {
            "tenant_id": "acme",
            "user_id": 8,
            "txn_90d__txn_count": None,
            "geo__distinct_countries_30d": 2,
        },
    ]


def test_without_pyarrow_a_frame_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake: uninstalling pyarrow under a running suite is not a fault to cause for real.
    # None in sys.modules makes `import pyarrow` raise ImportError, as when it is absent.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(FrameError, match=r"need pyarrow: pip install 'freshline\[training\]'"):
        frames.arrow_column("int", [1])
