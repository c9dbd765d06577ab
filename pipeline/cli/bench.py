"""``freshline bench``: run the benchmarks from the source checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

from freshline.pipeline.core.errors import FreshlineError


def register(app: typer.Typer) -> None:
    """Add ``freshline bench`` to the main CLI."""
    app.command(
        "bench",
        add_help_option=False,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(bench_cmd)


def bench_cmd(ctx: typer.Context) -> None:
    """Run the benchmarks: `python -m bench [--quick] [--only NAME ...] [--out DIR]`."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "bench" / "__main__.py").exists():
        raise FreshlineError("the benchmarks live in the source checkout (bench/); run from it")
    raise typer.Exit(subprocess.call([sys.executable, "-m", "bench", *ctx.args], cwd=root))
