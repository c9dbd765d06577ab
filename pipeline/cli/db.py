"""``freshline db upgrade | summary`` and ``freshline seed``: the source schema and data."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import sqlalchemy as sa
import typer
from rich import box
from rich.progress import TaskID
from rich.table import Table

from pipeline.cli.app import console, out, progress_bar
from pipeline.core.db import make_engine, make_owner_engine, ping
from pipeline.core.settings import load_settings

db_app = typer.Typer(help="The source Postgres schema.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add ``freshline db ...`` and ``freshline seed`` to the main CLI."""
    app.add_typer(db_app, name="db")
    app.command("seed")(seed_cmd)


@db_app.command("upgrade")
def db_upgrade(
    revision: str = typer.Argument("head", help="freshline's Alembic revision"),
) -> None:
    """Apply the migrations as the owner (FRESHLINE_POSTGRES_ADMIN_URL, else _URL):
    freshline's own schema, then the repository's migrations if it has any."""
    import migrations
    from pipeline.core.repository import active

    settings = load_settings()
    engine = make_owner_engine(settings)
    ping(engine)
    repo = active()
    chain = migrations.Chain.of_repository(repo)
    migrations.upgrade(settings.migration_url, revision, repo=chain)
    console.print(
        f"freshline schema at revision {revision}"
        + (f"; {repo.name}'s migrations at head" if chain else "")
    )


@db_app.command("summary")
def db_summary() -> None:
    """Row counts per tenant and table."""
    engine = make_engine(load_settings())
    ping(engine)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                """
            SELECT t.id,
                   (SELECT count(*) FROM users u WHERE u.tenant_id = t.id),
                   (SELECT count(*) FROM devices d WHERE d.tenant_id = t.id),
                   (SELECT count(*) FROM transactions x WHERE x.tenant_id = t.id),
                   (SELECT count(*) FROM transactions x WHERE x.tenant_id = t.id
                      AND x.created_at > now() - interval '90 days'),
                   (SELECT max(created_at) FROM transactions x WHERE x.tenant_id = t.id)
            FROM freshline.tenants t ORDER BY t.id
            """
            )
        ).all()
        geo = conn.execute(sa.text("SELECT count(*) FROM geoip")).scalar_one()
    out.print(
        summary_table(
            [
                (
                    tenant,
                    n_users,
                    n_dev,
                    n_tx,
                    n_recent,
                    newest.strftime("%Y-%m-%d %H:%M") if newest else "-",
                )
                for tenant, n_users, n_dev, n_tx, n_recent, newest in rows
            ]
        )
    )
    out.print(f"geoip ranges: {geo:,}")


def summary_table(rows: list[tuple[str, int, int, int, int, str]]) -> Table:
    """Counts per tenant, borderless so that it reads at 80 columns: figures never wrap,
    a long tenant id folds within its column."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("tenant", overflow="fold")
    for name in ("users", "devices", "transactions", "last 90 days"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("newest", no_wrap=True)
    for tenant, *counts, newest in rows:
        table.add_row(tenant, *(f"{n:,}" for n in counts), newest)
    return table


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

    from pipeline.dev.seed import seed as run_seed

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
