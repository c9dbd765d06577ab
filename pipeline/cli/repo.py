"""``freshline init``, ``plan`` and ``apply``: a feature repository, made and deployed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pipeline.cli.app import console, out
from pipeline.core.declarations import Declaration, window_text
from pipeline.core.maintenance import DerivedPath

if TYPE_CHECKING:
    from pipeline.deploy.plan import Plan

CONFIG_TEMPLATE = """\
# A freshline feature repository. Keep it in your own git.
[project]
name = "{name}"
schema_version = 1               # bump it when a feature set changes (freshline plan says when)
definitions = "features.py"      # your entities, tables and feature sets
lock = "features.lock.json"      # written by freshline apply; commit it
"""

DEFINITIONS_TEMPLATE = '''\
"""Feature definitions: `freshline plan` checks them against your Postgres, `freshline
apply` deploys them. This example is a sketch of a lending library; replace it with your
own tables and queries."""

from freshline import Entity, FeatureSet, Field, Table

# What features are about: its key column and type (bigint, text or uuid) and, for a
# multi-tenant database, the column holding the tenant. `table` is where its rows are.
member = Entity("member", key="member_id", type="bigint", tenant="library_id",
                table="members")

# How a changed row reaches members: a column holding the member's key (old and new
# values both), or a query returning the affected members' keys (tenant first).
members = Table("members", entities={member: "member_id"})
loans = Table("loans", entities={member: "member_id"})
books = Table(
    "books",
    reverse={member: "SELECT library_id, member_id FROM loans "
                     "WHERE library_id = :library_id AND book_id = :book_id"},
    tenant="library_id",
)

# One set-based query for a whole batch of keys: read them from `keys` (columns: the
# tenant column, then the key) and the moment from `t(as_of)`; return the key columns,
# then the fields in declared order.
loans_30d = FeatureSet(
    "loans_30d",
    entity=member,
    ttl="1h",
    sources=[members, loans, books],
    fields=[Field("open_loans", "int"), Field("overdue", "int"),
            Field("last_loan_at", "timestamp")],
    query="""
SELECT k.library_id, k.member_id,
       count(l.book_id) FILTER (WHERE l.returned_at IS NULL) AS open_loans,
       count(l.book_id) FILTER (WHERE l.returned_at IS NULL AND l.due_at < t.as_of) AS overdue,
       max(l.loaned_at) AS last_loan_at
FROM keys k CROSS JOIN t
LEFT JOIN loans l ON l.library_id = k.library_id AND l.member_id = k.member_id
               AND l.loaned_at > t.as_of - interval '30 days' AND l.loaned_at <= t.as_of
GROUP BY k.library_id, k.member_id
""",
)
'''


def init(
    directory: Annotated[Path, typer.Argument(help="Where to make the repository")],
    name: Annotated[
        str | None, typer.Option(help="Project name (default: the directory's)")
    ] = None,
) -> None:
    """Make a feature repository: freshline.toml and a commented example of definitions."""
    import re

    project = name or re.sub(r"[^a-z0-9_]", "_", directory.resolve().name.lower()).strip("_")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", project):
        raise typer.BadParameter(f"{project!r} is not a lower-case identifier", param_hint="--name")
    config, definitions = directory / "freshline.toml", directory / "features.py"
    existing = [p for p in (config, definitions) if p.exists()]
    if existing:
        raise typer.BadParameter(
            f"{', '.join(map(str, existing))} already exist(s); nothing written",
            param_hint="DIRECTORY",
        )
    directory.mkdir(parents=True, exist_ok=True)
    config.write_text(CONFIG_TEMPLATE.format(name=project))
    definitions.write_text(DEFINITIONS_TEMPLATE)
    console.print(
        f"made feature repository {project!r} in {directory}: edit {definitions}, then "
        f"run: freshline --repo {directory} plan"
    )


def plan(
    publication: Annotated[str, typer.Option(help="The CDC publication")] = "freshline",
) -> None:
    """Show what apply would change, checked against Postgres; change nothing."""
    result = _plan(publication)
    _print(result)
    if not result.ok:
        raise typer.Exit(1)


def apply(
    alter_tables: Annotated[
        bool,
        typer.Option(
            "--alter-tables",
            help="Also run the DDL on your tables that the plan lists (replica identity, "
            "grants to the freshline roles)",
        ),
    ] = False,
    cdc: Annotated[
        bool,
        typer.Option("--cdc/--no-cdc", help="Register the Debezium connector (Kafka Connect)"),
    ] = True,
    database_host: Annotated[
        str | None,
        typer.Option("--database-host", help="Postgres host as Connect sees it"),
    ] = None,
    publication: Annotated[str, typer.Option(help="The CDC publication")] = "freshline",
) -> None:
    """Deploy the repository: freshline's own schema, the publication, the lock, the
    topics and the CDC connector. Your tables are changed only with --alter-tables."""
    import sqlalchemy as sa

    import migrations
    from consumers.topics import ensure_from_settings
    from pipeline.cli.connector import register_connector
    from pipeline.core.db import make_owner_engine
    from pipeline.core.lock import Lock, update
    from pipeline.core.settings import load_settings
    from pipeline.deploy.plan import missing_grants

    result = _plan(publication)
    _print(result)
    if not result.ok:
        console.print("[red]error:[/red] the plan has problems; nothing applied")
        raise typer.Exit(1)
    if (result.replica_identity or result.derived) and not alter_tables:
        console.print(
            "[red]error:[/red] your tables need the DDL above; run it yourself or pass "
            "--alter-tables; nothing applied"
        )
        raise typer.Exit(1)
    repo, settings = result.repository, load_settings()
    if result.own_schema != "ok":
        migrations.upgrade(settings.migration_url)
        console.print(f"freshline schema at revision {migrations.head()}")
    engine = make_owner_engine(settings)
    with engine.begin() as conn:
        ddls = list(result.replica_identity.values())
        grants = missing_grants(conn, result.tables)  # the roles exist now
        if alter_tables:
            ddls += grants
        elif grants:
            console.print(
                "[yellow]warning:[/yellow] freshline's roles cannot read your tables; "
                f"run (or pass --alter-tables): {'; '.join(grants)}"
            )
        for ddl in ddls:
            conn.execute(sa.text(ddl))
            console.print(f"ran: {ddl}")
        for name in result.derived:
            path = repo.registry[name].maintenance
            assert isinstance(path, DerivedPath)
            path.install(conn)
            console.print(f"installed the derived incremental path of {name} ({path.days})")
        if result.publication_missing:
            exists = conn.execute(
                sa.text("SELECT 1 FROM pg_publication WHERE pubname = :p"), {"p": publication}
            ).first()
            tables = ", ".join(result.tables)
            verb = (
                "ALTER PUBLICATION {p} SET TABLE" if exists else "CREATE PUBLICATION {p} FOR TABLE"
            )
            ddl = f"{verb.format(p=publication)} {tables}"
            conn.execute(sa.text(ddl))
            console.print(f"ran: {ddl}")
    engine.dispose()
    lock = Lock.load(repo.lock_path)
    if update(lock, result.schema_version, repo.registry):
        lock.save(repo.lock_path)
        console.print(f"recorded schema version {result.schema_version} in {repo.lock_path}")
    report = ensure_from_settings(settings)
    console.print(f"topics: {len(report.created)} created, {len(report.existing)} existing")
    if cdc:
        register_connector(database_host=database_host)
    else:
        console.print("change data capture not registered (--no-cdc): freshline cdc register")
    if repo.history.enabled:
        _enable_history(result.tables, repo.history.retention_s)


def _enable_history(tables: list[str], retention_s: int | None) -> None:
    """Create and register a history table per captured table, then backfill the new
    ones from one snapshot S0, once the connector's slot exists (every change S0 does
    not see is then streamed: ``pipeline.history.backfill``)."""
    import sqlalchemy as sa

    from pipeline.cdc.connect import SCHEMA, names
    from pipeline.core.db import make_owner_engine
    from pipeline.core.settings import load_settings
    from pipeline.history.backfill import backfill
    from pipeline.history.tables import create, follow, layout, registered

    settings = load_settings()
    engine = make_owner_engine(settings)
    try:
        with engine.begin() as conn:
            layouts = [layout(conn, SCHEMA, t) for t in tables]
            for found in layouts:
                if create(conn, found, retention_s):
                    console.print(f"history: created {found.history} for {SCHEMA}.{found.table}")
                for statement in follow(conn, found):
                    console.print(f"history: ran {statement}")
            known = registered(conn)
            slot = conn.execute(
                sa.text("SELECT 1 FROM pg_replication_slots WHERE slot_name = :s"),
                {"s": names(settings).slot},
            ).first()
        pending = [f for f in layouts if known[(f.schema, f.table)].s0_snapshot is None]
        if pending and slot is None:
            console.print(
                "[yellow]warning:[/yellow] history waits for the connector's replication "
                "slot before its backfill: run apply with --cdc (or freshline cdc register), "
                "then apply again"
            )
        elif pending:
            s0 = backfill(engine, pending)
            copied = ", ".join(f"{t} {n}" for t, n in s0.rows.items())
            console.print(f"history: backfilled from snapshot {s0.snapshot} ({copied} rows)")
    finally:
        engine.dispose()


def _plan(publication: str) -> Plan:
    from pipeline.core.db import make_engine, ping
    from pipeline.core.repository import active
    from pipeline.core.settings import load_settings
    from pipeline.deploy.plan import plan as make_plan
    from pipeline.history.status import describe

    repo = active()
    settings = load_settings()
    engine = make_engine(settings)
    ping(engine)
    try:
        result = make_plan(repo, engine, settings.schema_version, publication)
        result.history = describe(engine, repo.history, result.tables)
        return result
    finally:
        engine.dispose()


def _print(result: Plan) -> None:
    repo = result.repository
    out.print(f"repository {repo.name} at {repo.path}, schema version {result.schema_version}")
    for fs in repo.registry:
        out.print(
            f"  feature set {fs.name}: entity {fs.entity.name} ({fs.entity.type}), "
            f"{len(fs.fields)} fields, ttl {fs.ttl_s} s, {fs.mode}, from "
            f"{', '.join(s.table for s in fs.sources)}"
        )
        if isinstance(fs.declared, Declaration):
            windows = ", ".join(window_text(w) for w in sorted(set(fs.declared.windows_s)))
            out.print(
                f"    declared: {len(fs.declared.aggs)} aggregations over "
                f"{fs.declared.table}.{fs.declared.time}, windows {windows}; query and "
                "horizon generated"
            )
    if result.lock == "ok":
        out.print(f"lock: schema version {result.schema_version} is locked and unchanged")
    elif result.lock == "new":
        out.print(f"lock: apply records schema version {result.schema_version} (new)")
    else:
        out.print(f"lock: {result.lock}")
    out.print(f"freshline schema: {result.own_schema}")
    for line in result.history:
        out.print(line)
    out.print(f"change data capture must cover: {', '.join(result.tables)}")
    if result.publication_missing:
        out.print(
            f"  the publication lacks: {', '.join(result.publication_missing)} (apply adds them)"
        )
    for ddl in result.replica_identity.values():
        out.print(f"  your table needs: {ddl} (apply runs it only with --alter-tables)")
    for grant in result.grants:
        out.print(f"  freshline's roles need: {grant} (apply runs it only with --alter-tables)")
    for name, what in result.derived.items():
        out.print(f"  {name}'s incremental path: {what} (apply does it only with --alter-tables)")
    for problem in result.problems:
        console.print(f"[red]problem:[/red] {problem}")
    if result.ok:
        out.print("plan: ok")


def register(app: typer.Typer) -> None:
    """Add init, plan and apply to the ``freshline`` app."""
    app.command("init")(init)
    app.command("plan")(plan)
    app.command("apply")(apply)
