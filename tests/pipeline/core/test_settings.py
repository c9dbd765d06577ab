from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.settings import Settings, load_settings, redact


def test_environment_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRESHLINE_SCHEMA_VERSION", "7")
    monkeypatch.setenv("FRESHLINE_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
    s = Settings()
    assert s.schema_version == 7
    assert s.kafka_bootstrap == "127.0.0.1:19092"


def test_the_schema_version_defaults_to_the_repositorys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``freshline.toml``'s ``project.schema_version`` is the version every command
    uses unless ``FRESHLINE_SCHEMA_VERSION`` says otherwise; without one, 1."""
    monkeypatch.delenv("FRESHLINE_SCHEMA_VERSION", raising=False)
    monkeypatch.setenv("FRESHLINE_REPO", str(tmp_path))
    assert Settings().schema_version == 1
    (tmp_path / "freshline.toml").write_text('[project]\nname = "x"\nschema_version = 5\n')
    assert Settings().schema_version == 5
    monkeypatch.setenv("FRESHLINE_SCHEMA_VERSION", "6")
    assert Settings().schema_version == 6


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(pydantic.ValidationError):
        s.schema_version = 3


def test_passwords_are_masked_when_printed() -> None:
    s = Settings(postgres_url="postgresql+psycopg://u:s3cret@127.0.0.1:5432/db")
    assert "s3cret" not in repr(s)
    assert "u:***@" in repr(s)
    assert redact("redis://:pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"


def test_invalid_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRESHLINE_SCHEMA_VERSION", "zero")
    with pytest.raises(ConfigError, match="FRESHLINE_SCHEMA_VERSION"):
        load_settings()
