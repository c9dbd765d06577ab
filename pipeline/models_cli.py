"""``freshline models train | list``: the example model and the registry."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pipeline.settings import get_settings

console = Console(stderr=True, highlight=False, soft_wrap=True)
models_app = typer.Typer(help="Models served through the inference cache.",
                         no_args_is_help=True)


@models_app.command("train")
def models_train(
    tenant: Annotated[str, typer.Option(help="Tenant whose users to train on")] = "acme",
    out: Annotated[Path, typer.Option(help="Where to save the model file")] = Path(
        ".freshline/models"),
) -> None:
    """Train the example fraud model on the seeded features and register it."""
    import redis

    from pipeline.cli import progress_bar
    from pipeline.db import make_engine, ping
    from pipeline.models import ModelRegistry
    from pipeline.training import train

    settings = get_settings()
    engine = make_engine(settings)
    ping(engine)
    out.mkdir(parents=True, exist_ok=True)
    with progress_bar() as bar:
        task = bar.add_task("features", total=None)
        _, path = train(engine, tenant, out,
                            progress=lambda done, total: bar.update(task, completed=done,
                                                                    total=total))
    record = ModelRegistry(redis.Redis.from_url(settings.redis_url)).register(path)
    console.print(f"registered {record.name} version {record.version} ({len(record.feature_names)}"
                  f" inputs) from {path}")


@models_app.command("list")
def models_list() -> None:
    """The registered models and their versions."""
    import redis

    from pipeline.models import ModelRegistry

    registry = ModelRegistry(redis.Redis.from_url(get_settings().redis_url))
    table = Table("model", "version", "inputs", "file")
    for name in registry.names():
        record = registry.record(name)
        table.add_row(name, record.version, str(len(record.feature_names)), record.path)
    Console().print(table)
