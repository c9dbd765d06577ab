"""``freshline events schemas``: the domain events' JSON Schemas, from their declarations."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from freshline.pipeline.cli.app import console

events_app = typer.Typer(help="The domain events the repository declares.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add ``freshline events ...`` to the main CLI."""
    app.add_typer(events_app, name="events")


@events_app.command("schemas")
def schemas(
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            metavar="DIRECTORY",
            help="Where to write them \\[default: the repository's schemas/ folder]",
        ),
    ] = None,
) -> None:
    """Write ``<topic>.schema.json`` (JSON Schema 2020-12) for each declared domain event."""
    from freshline.pipeline.core.events import schema_file
    from freshline.pipeline.core.repository import active

    repo = active()
    folder = out or repo.path / "schemas"
    if not repo.events:
        console.print(f"{repo.name} declares no domain events")
        return
    folder.mkdir(parents=True, exist_ok=True)
    for event in repo.events:
        name, text = schema_file(event)
        (folder / name).write_text(text)
        console.print(f"wrote {folder / name}")
