# The demo's harness, not code a user's repository needs (it may use freshline's internals).
"""The fraud example's own commands, mounted by freshline as ``freshline fraud ...``.

A repository may name a Typer app in its ``freshline.toml`` (``commands =
"fraud.cli:app"``); ``freshline`` adds it under the repository's name. These are the
chores of this example, not of freshline: load synthetic data, make changes and emit
their domain events, train the example model.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import TaskID

from freshline.pipeline.cli.app import console, progress_bar
from freshline.pipeline.core.db import make_engine, make_owner_engine, ping
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import load_settings

app = typer.Typer(help="The fraud example: seed, simulate, train.", no_args_is_help=True)


@app.command("seed")
def seed_cmd(
    users: Annotated[int, typer.Option(min=1, help="Users, split across tenants")] = 1000,
    transactions: Annotated[int, typer.Option(min=0, help="Transactions in all")] = 20000,
    tenants: Annotated[int, typer.Option(min=1, max=64, help="How many tenants")] = 1,
    seed: Annotated[int, typer.Option(help="Random seed: the same seed, the same rows")] = 42,
    tenant_prefix: Annotated[str, typer.Option(help="Prefix for tenant ids")] = "",
    anchor: Annotated[datetime | None, typer.Option(help="Time the history ends at")] = None,
) -> None:
    """Load deterministic synthetic tenants, users, devices and transactions."""
    from fraud.seed import seed as run_seed

    engine = make_owner_engine(load_settings())
    try:
        ping(engine)
        started = time.perf_counter()
        with progress_bar() as bar:
            tasks: dict[str, TaskID] = {}

            def report(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total)
                bar.update(tasks[stage], completed=done)

            # Refuses tenants that exist (TenantsExist, one line from main()), unwritten.
            summary = run_seed(
                engine,
                users=users,
                transactions=transactions,
                tenants=tenants,
                seed=seed,
                tenant_prefix=tenant_prefix,
                anchor=anchor,
                progress=report,
            )
    finally:
        engine.dispose()
    elapsed = time.perf_counter() - started
    rate = summary.transactions / elapsed if elapsed else 0.0
    console.print(
        f"seeded {len(summary.tenants)} tenant(s) ({', '.join(summary.tenants)}): "
        f"{summary.users:,} users, {summary.devices:,} devices, "
        f"{summary.transactions:,} transactions in {elapsed:.1f}s ({rate:,.0f} rows/s)"
    )


@app.command("simulate")
def simulate(
    rate: Annotated[float, typer.Option(min=0.1, help="Changes per second")] = 20.0,
    count: Annotated[int | None, typer.Option(min=1, help="Stop after this many")] = None,
    duration: Annotated[float | None, typer.Option(min=0.1, help="Stop after seconds")] = None,
) -> None:
    """Write realistic changes to Postgres and emit the matching domain events."""
    from fraud.simulator import Simulator
    from freshline.consumers.kafka import Producer
    from freshline.pipeline.core.topics import qualified

    settings = load_settings()
    with Producer(settings) as producer:
        sim = Simulator(
            make_owner_engine(settings), producer, topic=lambda t: qualified(settings, t)
        )
        totals = sim.run(rate, count=count, duration=duration)
    console.print(
        f"emitted {totals.created} created, {totals.updated} updated transactions "
        f"and {totals.devices} device changes"
    )


@app.command("train")
def train_cmd(
    tenant: Annotated[str, typer.Option(help="Tenant whose users to train on")] = "acme",
    out: Annotated[Path, typer.Option(help="Where to save the model file")] = Path(
        ".freshline/models"
    ),
) -> None:
    """Train the example fraud model on the seeded features and register it."""
    from fraud.training import train
    from freshline.pipeline.inference.models import ModelRegistry

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
