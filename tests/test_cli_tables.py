"""Listings (``freshline.pipeline.cli.app.print_rows``): fitted on a terminal, whole rows in a
pipe."""

from __future__ import annotations

import importlib
import io
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console

from freshline.pipeline.api.accounts import KeyInfo
from freshline.pipeline.cli.apikey import key_table

app = importlib.import_module(
    "freshline.pipeline.cli.app"
)  # the module: freshline.pipeline.cli.app is the Typer app

NOW = datetime(2026, 12, 6, 0, 30, tzinfo=UTC)
KEYS = [
    KeyInfo("35e8875b394b", "acme", "batch scorer", NOW, NOW + timedelta(days=90), NOW, None),
    KeyInfo(
        "45e8875b394b",
        "a-tenant-with-a-very-long-name-of-forty-chars",
        "the [bold]nightly[/bold] scorer of the fraud team, for backfills",
        NOW - timedelta(days=400),
        None,
        None,
        NOW,
    ),
]
HEADER = ["id", "tenant", "state", "created", "expires", "last", "used", "label"]
"""The header line split at spaces ("last used" is one column)."""


def test_in_a_pipe_a_row_is_one_whole_line(capsys: pytest.CaptureFixture[str]) -> None:
    app.print_rows(key_table(KEYS, NOW))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == HEADER
    assert len(lines) == 3 and all(line == line.rstrip() for line in lines)
    first, second = (line.split() for line in lines[1:])
    assert first[:3] == ["35e8875b394b", "acme", "active"] and first[-2:] == ["batch", "scorer"]
    assert second[1] == KEYS[1].tenant and second[2] == "revoked"
    assert lines[2].endswith("the [bold]nightly[/bold] scorer of the fraud team, for backfills")


def test_on_a_terminal_the_table_fits_and_cuts_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    app.print_rows(key_table(KEYS, NOW))
    piped = capsys.readouterr().out
    shown = io.StringIO()
    terminal = Console(file=shown, width=80, force_terminal=True, color_system=None)
    monkeypatch.setattr(app, "out", terminal)
    app.print_rows(key_table(KEYS, NOW))
    lines = shown.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in shown.getvalue()
    assert lines[0].split() == HEADER
    assert set(lines[1]) == {"─"}
    # Folded, not cut: every character the pipe shows is there (cells wrap at spaces).
    folded = Counter("".join(lines[:1] + lines[2:]).replace(" ", ""))
    assert folded == Counter(piped.replace(" ", "").replace("\n", ""))
