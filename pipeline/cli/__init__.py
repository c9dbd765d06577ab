"""The ``freshline`` command line: one module per command group, each a thin shell.

Every group module has ``register(app)``; this package registers them all on the one
Typer app of :mod:`freshline.pipeline.cli.app`. Nothing in the library imports this package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.markup import escape

from freshline.pipeline.cli import (
    advise,
    apikey,
    apply,
    audit,
    bench,
    buckets,
    cdc,
    chaos,
    consume,
    db,
    deploy,
    dlq,
    events,
    models,
    repo,
    semantic,
    serve,
    served,
    training,
)
from freshline.pipeline.cli.app import app, console
from freshline.pipeline.core.errors import ConfigError, FreshlineError
from freshline.pipeline.core.repository import active_path, import_commands, own_commands
from freshline.pipeline.core.services import translate_errors

for _group in (
    repo,
    apply,
    db,
    consume,
    events,
    dlq,
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
    served,
    training,
):
    _group.register(app)


def _repo_argument(argv: list[str]) -> str | None:
    """``--repo DIRECTORY`` (or ``--repo=DIRECTORY``) from the command line, if given."""
    for i, arg in enumerate(argv):
        if arg == "--repo" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--repo="):
            return arg.split("=", 1)[1]
    return None


def mount_own_commands(argv: list[str]) -> None:
    """Add the active repository's own commands under its name (``freshline fraud
    seed``), if its ``freshline.toml`` names them. One that cannot be imported is an
    error only for a command line that asks for it."""
    given = _repo_argument(argv)
    root = Path(given).resolve() if given else active_path()
    found = own_commands(root)
    if found is None:
        return
    name, target = found
    try:
        group = import_commands(root, target)
    except FreshlineError:
        if name in argv:
            raise
        return
    if not isinstance(group, typer.Typer):
        if name in argv:
            raise ConfigError(f"{root / 'freshline.toml'}: commands {target!r} is not a Typer app")
        return
    if all(info.typer_instance is not group for info in app.registered_groups):
        app.add_typer(group, name=name)  # once, when main runs again in one process


def main() -> None:
    """Entry point: one clear line for expected failures, never a traceback."""
    try:
        with translate_errors():
            mount_own_commands(sys.argv[1:])
            app()
    except FreshlineError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")  # brackets are text here
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


__all__ = ["app", "main"]
