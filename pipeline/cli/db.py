"""``freshline db upgrade | summary``: freshline's schema and the repository's tables."""

from __future__ import annotations

import sqlalchemy as sa
import typer
from rich import box
from rich.table import Table

from freshline.pipeline.cli.app import console, out
from freshline.pipeline.core.db import make_engine, make_owner_engine, ping
from freshline.pipeline.core.settings import load_settings

db_app = typer.Typer(
    help="freshline's schema and the repository's own migrations.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    """Add ``freshline db ...`` to the main CLI."""
    app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def db_upgrade(
    revision: str = typer.Argument("head", help="freshline's Alembic revision"),
) -> None:
    """Apply the migrations as the owner (FRESHLINE_POSTGRES_ADMIN_URL, else _URL):
    freshline's own schema, then the repository's migrations if it has any."""
    from freshline import migrations
    from freshline.pipeline.core.repository import active

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
    """Row counts of the repository's tables, per tenant where a table has a tenant column."""
    from freshline.pipeline.core.repository import active

    repo = active()
    engine = make_engine(load_settings())
    ping(engine)
    by_tenant = {t: c for t in repo.table_names() if (c := repo.tenant_column(t))}
    with engine.connect() as conn:
        tenants = list(
            conn.execute(sa.text("SELECT id FROM freshline.tenants ORDER BY id")).scalars()
        )
        counts: dict[str, dict[str, int]] = {t: {} for t in tenants}
        for table, column in by_tenant.items():
            grouped = sa.text(
                f"SELECT {_ident(column)}, count(*) FROM {_ident(table)} "
                f"WHERE {_ident(column)} = ANY(:t) GROUP BY 1"
            )
            for tenant, n in conn.execute(grouped, {"t": tenants}):
                counts[tenant][table] = int(n)
        totals = {
            t: int(conn.execute(sa.text(f"SELECT count(*) FROM {_ident(t)}")).scalar_one())
            for t in repo.table_names()
            if t not in by_tenant
        }
    if by_tenant:
        tables = list(by_tenant)
        out.print(
            summary_table(
                tables, [(t, [counts[t].get(name, 0) for name in tables]) for t in tenants]
            )
        )
    for table, n in totals.items():
        out.print(f"{table}: {n:,} rows (no tenant column)")


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def summary_table(tables: list[str], rows: list[tuple[str, list[int]]]) -> Table:
    """Counts per tenant and table, borderless so that it reads at 80 columns: figures
    never wrap, a long tenant id folds within its column."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("tenant", overflow="fold")
    for name in tables:
        table.add_column(name, justify="right", no_wrap=True)
    for tenant, counts in rows:
        table.add_row(tenant, *(f"{n:,}" for n in counts))
    return table
