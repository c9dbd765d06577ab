"""The CLI's help, as a pipe or a log sees it: defaults shown, nothing of an example's
words in freshline's own commands, no line folded at 80 columns."""

from __future__ import annotations

from typer.testing import CliRunner

from freshline.pipeline.cli import app


def help_of(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    return result.output


def test_defaults_in_option_texts_are_shown() -> None:
    text = help_of("consume")
    assert "[default: FRESHLINE_CONSUMER_GROUP]" in text
    assert "[default: domain events, CDC topics]" in text


def test_warm_all_is_described_in_freshline_words() -> None:
    text = help_of("warm")
    assert "transaction" not in text and "90 days" not in text
    assert "active=" in text


def test_help_in_a_pipe_is_wider_than_80_columns() -> None:
    lines = help_of("consume").splitlines()
    assert max(len(line) for line in lines) > 80
    assert any(
        "Prometheus port [default: FRESHLINE_CONSUMER_METRICS_PORT; 0 turns it off]" in line
        for line in lines
    )
