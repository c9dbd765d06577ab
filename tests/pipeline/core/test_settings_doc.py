from __future__ import annotations

from pathlib import Path

import pytest

from freshline.pipeline.core import settings_doc
from freshline.pipeline.core.settings import Settings, SettingsGroup

PAGE = Path(__file__).resolve().parents[3] / "docs" / "settings.md"


def test_the_committed_page_is_the_generated_one() -> None:
    page = PAGE.read_text()
    assert settings_doc.splice(page, settings_doc.render()) == page, (
        "docs/settings.md is stale: run python -m freshline.pipeline.core.settings_doc"
    )


def test_every_setting_is_in_one_group_with_a_description() -> None:
    """A field declared on ``Settings`` itself would be missing from the page; one
    without a docstring would have an empty meaning."""
    names = [name for group in settings_doc.groups() for name in group.model_fields]
    assert sorted(names) == sorted(Settings.model_fields)
    assert [b for b in Settings.__bases__ if issubclass(b, SettingsGroup)] == list(
        reversed(settings_doc.groups())
    )
    assert [n for n, f in Settings.model_fields.items() if not f.description] == []


def test_a_group_is_a_section_with_its_title() -> None:
    generated = settings_doc.render()
    for group in settings_doc.groups():
        assert f"\n## {group.model_config['title']}\n" in generated
    assert "| `FRESHLINE_REDIS_URL` | `redis://127.0.0.1:6379/0` | text |" in generated
    assert "| `FRESHLINE_REDIS_CLUSTER` | `false` | `true` or `false` |" in generated
    assert "| integer ≥ 1, ≤ 1000 |" in generated


def test_check_reports_a_stale_page_and_writing_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "settings.md"
    page.write_text(f"# Settings\n\n{settings_doc.BEGIN}\nSTALE\n{settings_doc.END}\n\n## Errors\n")
    assert settings_doc.main(["--check", str(page)]) == 1
    assert "stale" in capsys.readouterr().err
    assert settings_doc.main([str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Settings\n\n") and text.endswith("\n\n## Errors\n")
    assert "STALE" not in text
    assert settings_doc.main(["--check", str(page)]) == 0


def test_a_page_without_markers_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "settings.md"
    page.write_text("# Settings\n")
    with pytest.raises(SystemExit) as exc:
        settings_doc.main(["--check", str(page)])
    assert exc.value.code == 1
