"""The ``freshline`` Typer app and what every command shares: consoles and progress.

Command modules (one per group, beside this one) import from here and never from each
other; :mod:`pipeline.cli.app` registers them all the same way, through ``register(app)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

app = typer.Typer(
    name="freshline",
    help="Fresh, versioned ML features in Redis, driven by change events.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _options(
    repo: str | None = typer.Option(
        None,
        "--repo",
        metavar="DIRECTORY",
        help="The feature repository (default: FRESHLINE_REPO, else the current directory)",
    ),
) -> None:
    """Fresh, versioned ML features in Redis, driven by change events."""
    if repo:
        os.environ["FRESHLINE_REPO"] = repo  # the processes a command starts inherit it


console = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False)


@contextmanager
def progress_bar() -> Iterator[Progress]:
    """A concise progress bar on stderr, shared by seed, warm and purge."""
    bar = Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    with bar:
        yield bar
