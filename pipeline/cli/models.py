"""``freshline models register | list``: the models the inference cache serves."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Group
from rich.padding import Padding
from rich.text import Text

from freshline.pipeline.cli.app import console, out
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import load_settings

if TYPE_CHECKING:
    from freshline.pipeline.inference.models import ModelRecord

models_app = typer.Typer(help="Models served through the inference cache.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add ``freshline models ...`` to the main CLI."""
    app.add_typer(models_app, name="models")


@models_app.command("register")
def models_register(
    path: Annotated[Path, typer.Argument(help="A saved model file", exists=True)],
) -> None:
    """Register a saved model file (its name and version are in the file) as current."""
    from freshline.pipeline.inference.models import ModelRegistry

    record = ModelRegistry(redis_client(load_settings())).register(path)
    console.print(
        f"registered {record.name} version {record.version} ({len(record.feature_names)}"
        f" inputs) from {path}"
    )


@models_app.command("list")
def models_list() -> None:
    """The registered models and their versions."""

    from freshline.pipeline.inference.models import ModelRegistry

    registry = ModelRegistry(redis_client(load_settings()))
    records = [registry.record(name) for name in registry.names()]
    if not records:
        console.print("no model registered: register one with `freshline models register FILE`")
    for record in records:
        out.print(model_block(record))


def model_block(record: ModelRecord) -> Group:
    """One model: its name, version and inputs on a line, its file on the next (a long
    path folds at the console width instead of widening a table)."""
    kind = "deterministic" if record.deterministic else "non-deterministic"
    return Group(
        Text.assemble(
            (record.name, "bold"),
            f"  version {record.version}, {len(record.feature_names)} inputs, {kind}",
        ),
        Padding(Text(f"file: {record.path}", overflow="fold"), (0, 0, 0, 2), expand=False),
    )
