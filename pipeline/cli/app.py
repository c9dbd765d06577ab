"""The ``freshline`` Typer app and what every command shares: consoles and progress.

Command modules (one per group, beside this one) import from here and never from each
other; :mod:`freshline.pipeline.cli.app` registers them all the same way, through ``register(app)``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer
import typer.rich_utils
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

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
if not sys.stdout.isatty() and not os.environ.get("TERMINAL_WIDTH"):
    # Help in a pipe: Typer boxes it at 80 columns, which folds most option texts.
    typer.rich_utils.MAX_WIDTH = 120


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


def print_rows(table: Table) -> None:
    """A listing on stdout, such as ``apikey list``. On a terminal it fits the width
    (cells fold) with a rule under the header; in a pipe it is plain: the header, then a
    line a row at its natural width, never folded, so that grep, awk and cut see whole
    rows."""
    if out.is_terminal:
        table.box, table.padding = box.SIMPLE_HEAD, (0, 1, 0, 0)
        for column in table.columns:  # a header is never cut
            column.min_width = max(column.min_width or 0, len(str(column.header)))
        out.print(table)
        return
    table.box, table.padding = None, (0, 2, 0, 0)
    unbounded = Console(width=1_000_000, color_system=None, highlight=False)
    width = Measurement.get(unbounded, unbounded.options, table).maximum
    plain = Console(width=width, color_system=None, highlight=False)
    with plain.capture() as captured:
        plain.print(table)
    for line in captured.get().splitlines():
        typer.echo(line.rstrip())
