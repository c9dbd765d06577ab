"""The ``freshline`` command line: one module per command group, each a thin shell.

Every group module has ``register(app)``; this package registers them all on the one
Typer app of :mod:`pipeline.cli.app`. Nothing in the library imports this package.
"""

from __future__ import annotations

import sys

from pipeline.cli import (
    advise,
    apikey,
    audit,
    bench,
    buckets,
    cdc,
    chaos,
    consume,
    db,
    deploy,
    events,
    models,
    repo,
    semantic,
    serve,
)
from pipeline.cli.app import app, console
from pipeline.core.errors import FreshlineError
from pipeline.core.services import translate_errors

for _group in (
    repo,
    db,
    consume,
    events,
    deploy,
    serve,
    apikey,
    advise,
    audit,
    cdc,
    models,
    bench,
    chaos,
    semantic,
    buckets,
):
    _group.register(app)


def main() -> None:
    """Entry point: one clear line for expected failures, never a traceback."""
    try:
        with translate_errors():
            app()
    except FreshlineError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


__all__ = ["app", "main"]
