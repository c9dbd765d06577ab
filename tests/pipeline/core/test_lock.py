"""The feature-definition lock: the shipped lock matches the code, and drift is caught."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from freshline.pipeline.core.errors import LockMismatch
from freshline.pipeline.core.features import Field, Registry
from freshline.pipeline.core.lock import Lock, check, lock_path, update
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY

TXN_90D = REGISTRY["txn_90d"]


def test_shipped_lock_matches_the_registry() -> None:
    """CI's guard: a definition changed without a SCHEMA_VERSION bump fails here."""
    version = Settings().schema_version
    assert check(Lock.load(lock_path()), version, REGISTRY) == "ok", (
        f"schema version {version} is not locked: run `freshline check --update-lock`"
    )


def test_the_lock_documents_every_field_in_order() -> None:
    locked = Lock.load(lock_path()).entry(Settings().schema_version)
    for fs in REGISTRY:
        assert locked[fs.name].fields == fs.fields


def drifted(change: dict[str, object]) -> Registry:
    others = [fs for fs in REGISTRY if fs.name != TXN_90D.name]
    return Registry([dataclasses.replace(TXN_90D, **change), *others])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"fields": (*TXN_90D.fields, Field("txn_min", "float"))},
        {"fields": (Field("txn_count", "float"), *TXN_90D.fields[1:])},
        {"ttl_s": TXN_90D.ttl_s + 1},
        {"query": TXN_90D.query.replace("7776000 seconds", "5184000 seconds")},  # 90d -> 60d
    ],
)
def test_a_changed_definition_without_a_bump_is_caught(change: dict[str, object]) -> None:
    lock = Lock.load(lock_path())
    version = Settings().schema_version
    with pytest.raises(LockMismatch) as caught:
        check(lock, version, drifted(change))
    message = str(caught.value)
    assert "'txn_90d' changed" in message
    assert "FRESHLINE_SCHEMA_VERSION" in message and "--update-lock" in message
    assert "device_risk" not in message


def test_whitespace_in_a_query_is_not_a_change() -> None:
    lock = Lock.load(lock_path())
    same = drifted({"query": "\n  " + TXN_90D.query.replace(" ", "  ")})
    assert check(lock, Settings().schema_version, same) == "ok"


def test_added_and_removed_sets_are_changes() -> None:
    lock = Lock.load(lock_path())
    version = Settings().schema_version
    extra = dataclasses.replace(TXN_90D, name="txn_30d")
    with pytest.raises(LockMismatch, match="'txn_30d' is new"):
        check(lock, version, Registry([*REGISTRY, extra]))
    with pytest.raises(LockMismatch, match="'geo' was removed"):
        check(lock, version, Registry(fs for fs in REGISTRY if fs.name != "geo"))


def test_update_adds_a_new_version_and_never_rewrites_one(tmp_path: Path) -> None:
    path = tmp_path / "features.lock.json"
    lock = Lock()
    assert update(lock, 1, REGISTRY) is True
    lock.save(path)
    changed = drifted({"ttl_s": 7})
    with pytest.raises(LockMismatch):
        update(lock, 1, changed)
    assert update(lock, 2, changed) is True
    assert update(lock, 2, changed) is False
    lock.save(path)
    again = Lock.load(path)
    assert sorted(again.versions) == [1, 2]
    assert again.entry(1)["txn_90d"].ttl_s == TXN_90D.ttl_s
    assert again.entry(2)["txn_90d"].ttl_s == 7
    assert again.compatible(1, REGISTRY) and not again.compatible(2, REGISTRY)
    assert again.compatible(2, REGISTRY, feature_set="geo")
    assert again.decoders(2)["txn_90d"].field_names == TXN_90D.field_names


def test_check_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from freshline.pipeline.cli import app

    path = tmp_path / "features.lock.json"
    Lock({1: {fs.name: Lock.load(lock_path()).entry(1)[fs.name] for fs in REGISTRY}}).save(path)
    runner = CliRunner()
    monkeypatch.setenv("FRESHLINE_SCHEMA_VERSION", "2")
    result = runner.invoke(app, ["check", "--lock", str(path)])
    assert result.exit_code == 1
    assert "--update-lock" in result.output
    result = runner.invoke(app, ["check", "--lock", str(path), "--update-lock"])
    assert result.exit_code == 0, result.output
    assert sorted(Lock.load(path).versions) == [1, 2]
    assert runner.invoke(app, ["check", "--lock", str(path)]).exit_code == 0
