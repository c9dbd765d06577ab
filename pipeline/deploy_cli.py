"""The deploy commands: ``check``, ``warm``, ``deploy start|flip|status``, ``purge``."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the deploy commands to the ``freshline`` app."""
