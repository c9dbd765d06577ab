"""``freshline init``, ``plan`` and ``apply``: a feature repository, made and deployed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from freshline.pipeline.cli.app import console, out
from freshline.pipeline.core.declarations import Declaration, window_text

if TYPE_CHECKING:
    from freshline.pipeline.deploy.plan import Plan

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

from freshline import AS_OF, Entity, FeatureSet, Field, Table

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
# then the fields in declared order. A query that reads the moment changes with time
# alone (a loan leaves the 30 days, a due date passes): its `horizon` says when, for one
# row of the query's result (`f`), so the entry expires then instead of going stale.
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
    horizon=f"""(SELECT least(
        min(l.loaned_at) FILTER (WHERE l.loaned_at > {AS_OF} - interval '30 days')
            + interval '30 days',
        min(l.loaned_at) FILTER (WHERE l.loaned_at > {AS_OF}),
        min(l.due_at) FILTER (WHERE l.returned_at IS NULL AND l.due_at >= {AS_OF}))
    FROM loans l WHERE l.library_id = f.library_id AND l.member_id = f.member_id)""",
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
    from freshline.store import FeatureStore

    result = FeatureStore.from_env().plan(publication)
    show_plan(result)
    if not result.ok:
        raise typer.Exit(1)


def show_plan(result: Plan) -> None:
    """Print ``result`` as ``plan`` shows it."""
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
    for name, lacking in result.security.items():
        out.print(
            f"  {name}'s incremental path: security fix pending: {'; '.join(lacking)} (apply "
            "replaces its functions and grants in place; partials, log and triggers stay)"
        )
    for name, grants in result.path_grants.items():
        for grant in grants:
            out.print(f"  {name}'s incremental path: apply runs: {grant}")
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    for problem in result.problems:
        console.print(f"[red]problem:[/red] {problem}")
    if result.ok:
        out.print("plan: ok")


def register(app: typer.Typer) -> None:
    """Add init and plan to the ``freshline`` app (apply is :mod:`freshline.pipeline.cli.apply`)."""
    app.command("init")(init)
    app.command("plan")(plan)
