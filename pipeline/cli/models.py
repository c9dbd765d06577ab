"""``freshline models train | list``: the example model and the registry."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Group
from rich.padding import Padding
from rich.text import Text

from pipeline.cli.app import console, out, progress_bar
from pipeline.core.services import redis_client
from pipeline.core.settings import load_settings

if TYPE_CHECKING:
    from pipeline.inference.models import ModelRecord

models_app = typer.Typer(help="Models served through the inference cache.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add ``freshline models ...`` to the main CLI."""
    app.add_typer(models_app, name="models")


@models_app.command("train")
def models_train(
    tenant: Annotated[str, typer.Option(help="Tenant whose users to train on")] = "acme",
    out: Annotated[Path, typer.Option(help="Where to save the model file")] = Path(
        ".freshline/models"
    ),
) -> None:
    """Train the example fraud model on the seeded features and register it."""

    from pipeline.core.db import make_engine, ping
    from pipeline.inference.models import ModelRegistry
    from pipeline.inference.training import train

    settings = load_settings()
    engine = make_engine(settings)
    ping(engine)
    out.mkdir(parents=True, exist_ok=True)
    with progress_bar() as bar:
        task = bar.add_task("features", total=None)
        _, path = train(
            engine,
            tenant,
            out,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    record = ModelRegistry(redis_client(settings)).register(path)
    console.print(
        f"registered {record.name} version {record.version} ({len(record.feature_names)}"
        f" inputs) from {path}"
    )


@models_app.command("list")
def models_list() -> None:
    """The registered models and their versions."""

    from pipeline.inference.models import ModelRegistry

    registry = ModelRegistry(redis_client(load_settings()))
    records = [registry.record(name) for name in registry.names()]
    if not records:
        console.print("no model registered: train one with `freshline models train`")
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
