"""The ``freshline`` command line. Every command is a thin shell over the library."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated

import sqlalchemy as sa
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from consumers.cli import consume, produce_demo, topics_app
from pipeline.advisor_cli import register as register_advisor_commands
from pipeline.api_cli import register as register_api_commands
from pipeline.cdc_cli import register as register_cdc_commands
from pipeline.deploy_cli import register as register_deploy_commands
from pipeline.errors import FreshlineError
from pipeline.models_cli import models_app
from pipeline.settings import get_settings

app = typer.Typer(
    name="freshline",
    help="Fresh, versioned ML features in Redis, driven by change events.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="The source Postgres schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")
register_deploy_commands(app)
register_api_commands(app)
register_advisor_commands(app)
register_cdc_commands(app)
app.add_typer(topics_app, name="topics")
app.command("consume")(consume)
app.command("produce-demo")(produce_demo)
app.add_typer(models_app, name="models")

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


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="Alembic revision")) -> None:
    """Apply the migrations to the Postgres in FRESHLINE_POSTGRES_URL."""
    import migrations
    from pipeline.db import make_engine, ping

    settings = get_settings()
    engine = make_engine(settings)
    ping(engine)
    migrations.upgrade(settings.postgres_url, revision)
    console.print(f"database at revision {revision}")


@db_app.command("summary")
def db_summary() -> None:
    """Row counts per tenant and table."""
    from pipeline.db import make_engine, ping

    engine = make_engine(get_settings())
    ping(engine)
    table = Table("tenant", "users", "devices", "transactions", "last 90 days", "newest")
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            """
            SELECT t.id,
                   (SELECT count(*) FROM users u WHERE u.tenant_id = t.id),
                   (SELECT count(*) FROM devices d WHERE d.tenant_id = t.id),
                   (SELECT count(*) FROM transactions x WHERE x.tenant_id = t.id),
                   (SELECT count(*) FROM transactions x WHERE x.tenant_id = t.id
                      AND x.created_at > now() - interval '90 days'),
                   (SELECT max(created_at) FROM transactions x WHERE x.tenant_id = t.id)
            FROM tenants t ORDER BY t.id
            """
        )).all()
        geo = conn.execute(sa.text("SELECT count(*) FROM geoip")).scalar_one()
    for tenant, n_users, n_dev, n_tx, n_recent, newest in rows:
        table.add_row(tenant, f"{n_users:,}", f"{n_dev:,}", f"{n_tx:,}", f"{n_recent:,}",
                      newest.strftime("%Y-%m-%d %H:%M") if newest else "-")
    out.print(table)
    out.print(f"geoip ranges: {geo:,}")


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
    import time

    from pipeline.db import make_engine, ping
    from pipeline.seed import seed as run_seed

    engine = make_engine(get_settings())
    ping(engine)
    started = time.perf_counter()
    with progress_bar() as bar:
        tasks: dict[str, TaskID] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        summary = run_seed(engine, users=users, transactions=transactions, tenants=tenants,
                           seed=seed, tenant_prefix=tenant_prefix, anchor=anchor,
                           progress=report)
    elapsed = time.perf_counter() - started
    rate = summary.transactions / elapsed if elapsed else 0.0
    console.print(
        f"seeded {len(summary.tenants)} tenant(s) ({', '.join(summary.tenants)}): "
        f"{summary.users:,} users, {summary.devices:,} devices, "
        f"{summary.transactions:,} transactions in {elapsed:.1f}s ({rate:,.0f} rows/s)"
    )


@app.command("bench", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_cmd(ctx: typer.Context) -> None:
    """Run the benchmarks: `python -m bench [--quick] [--only NAME ...] [--out DIR]`."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "__main__.py").exists():
        raise FreshlineError("the benchmarks live in the source checkout (bench/); run from it")
    raise typer.Exit(subprocess.call([sys.executable, "-m", "bench", *ctx.args], cwd=root))


def main() -> None:
    """Entry point: one clear line for expected failures, never a traceback."""
    from pipeline.services import translate_errors

    try:
        with translate_errors():
            app()
    except FreshlineError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
