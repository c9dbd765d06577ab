"""``freshline apply``: deploy a repository, all or nothing for the user's tables.

The steps run in this order, so that whatever can fail for want of a permission or a
service fails before the user's tables change:

1. the Kafka topics (invalidations, dead letters, domain events, CDC topics);
2. the ACLs the topic prefix needs (the consumers' and Connect's logins);
3. Kafka Connect answers (with the connector to register);
4. freshline's own schema (migrations; never the user's tables);
5. the user's tables, in one transaction: replica identity, grants, derived paths,
   the publication (only with ``--alter-tables`` where the plan lists DDL);
6. the lock file;
7. the connector.

A step that fails stops apply with one message: the step, the cause, the steps that
ran, whether the user's tables changed (and how to undo it), and that running apply
again once the cause is fixed finishes the job: every step is idempotent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import typer

from freshline.pipeline.cli.app import console
from freshline.pipeline.cli.repo import show_plan
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.maintenance import DerivedPath

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from freshline.pipeline.core.lock import Lock
    from freshline.pipeline.core.settings import Settings
    from freshline.pipeline.deploy.plan import Plan
    from freshline.store import FeatureStore


class ApplyStopped(FreshlineError):
    """A step of ``freshline apply`` failed; the message says what ran and what next."""


@dataclass
class Steps:
    """The steps apply has run, and the DDL it ran on the user's tables."""

    done: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)

    @contextmanager
    def step(self, name: str, refused: str = "") -> Iterator[None]:
        """Run one step; a failure becomes :class:`ApplyStopped` naming it, and
        ``refused`` is added to a refusal for want of authorization."""
        import sqlalchemy as sa
        from confluent_kafka import KafkaException

        from freshline.pipeline.core.services import translate_errors

        try:
            with translate_errors():
                yield
        except (FreshlineError, KafkaException, sa.exc.SQLAlchemyError) as exc:
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            if refused and "AUTHORIZATION_FAILED" in cause:
                cause = f"{cause} ({refused})"
            raise ApplyStopped(self.stopped(name, cause)) from exc
        except typer.Exit as exc:  # the step printed its error already
            raise ApplyStopped(self.stopped(name, "see the error above")) from exc
        self.done.append(name)

    def stopped(self, name: str, cause: str) -> str:
        ran = f"done: {', '.join(self.done)}" if self.done else "nothing done"
        if self.ran:
            tables = (
                f"your tables were changed ({'; '.join(self.ran)}); to undo that: "
                f"{'; '.join(undo(d) for d in reversed(self.ran))}"
            )
        else:
            tables = "your tables are unchanged"
        return (
            f"apply stopped at {name}: {cause.rstrip('.')}. {ran}; {tables}. Once that is fixed, "
            "run freshline apply again: it finishes the job"
        )


def undo(ddl: str) -> str:
    """The statement that takes ``ddl`` (one apply ran on the user's tables) back."""
    if ddl.endswith("REPLICA IDENTITY FULL"):
        return ddl.removesuffix("FULL") + "DEFAULT"
    if ddl.startswith("GRANT "):
        return "REVOKE " + ddl.removeprefix("GRANT ").replace(" TO ", " FROM ")
    if ddl.startswith("CREATE PUBLICATION "):
        return "DROP PUBLICATION " + ddl.split()[2]
    if ddl.startswith("installed triggers "):
        triggers, _, table = ddl.removeprefix("installed triggers ").partition(" on ")
        return f"drop the triggers {triggers} on {table.split()[0]}"
    return f"revert: {ddl}"


# long: its steps in the order they must run (topics, ACLs, schema, tables, lock, CDC)
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
    """Deploy the repository: topics, ACLs and freshline's own schema first, then the
    publication, the lock and the CDC connector. Your tables are changed only with
    --alter-tables, and only once everything else is in place."""
    from freshline.store import FeatureStore

    FeatureStore.from_env().apply(
        alter_tables=alter_tables, cdc=cdc, database_host=database_host, publication=publication
    )


# long: apply's steps in order, each a few lines, read top to bottom
def apply_plan(
    store: FeatureStore,
    *,
    alter_tables: bool,
    cdc: bool,
    database_host: str | None,
    publication: str,
) -> None:
    """What ``apply`` does for ``store`` (:meth:`freshline.FeatureStore.apply`),
    printing each step; raises ``typer.Exit(1)`` where a step fails."""
    from freshline import migrations
    from freshline.consumers.kafka import admin_client
    from freshline.consumers.topics import (
        allow_consumer,
        allow_writer,
        ensure,
        managed_topics,
    )
    from freshline.pipeline.cdc.connect import ConnectClient, captured_tables, names
    from freshline.pipeline.cli.connector import register_connector
    from freshline.pipeline.core.db import make_owner_engine
    from freshline.pipeline.core.lock import Lock, update

    result = store.plan(publication)
    show_plan(result)
    if not result.ok:
        console.print("[red]error:[/red] the plan has problems; nothing applied")
        raise typer.Exit(1)
    if (result.replica_identity or result.derived) and not alter_tables:
        console.print(
            "[red]error:[/red] your tables need the DDL above; run it yourself or pass "
            "--alter-tables; nothing applied"
        )
        raise typer.Exit(1)
    repo, settings = result.repository, store.settings
    owned = names(settings)
    cdc_topics = [owned.topic(t) for t in captured_tables(repo.registry)] if cdc else []
    steps = Steps()
    operator = (
        f"the Kafka login {settings.kafka_sasl_username or '(none)'!r}, "
        "FRESHLINE_KAFKA_SASL_USERNAME, may not; apply runs as the operator, a login "
        "that may create topics and manage ACLs"
    )

    with steps.step("topics", operator):
        admin = admin_client(settings)
        report = ensure(
            admin, settings.topic_partitions, topics=[*managed_topics(settings, repo), *cdc_topics]
        )
        console.print(f"topics: {len(report.created)} created, {len(report.existing)} existing")
    with steps.step("ACLs", operator):
        if settings.kafka_consumer_user:
            for grant in allow_consumer(admin, settings.kafka_consumer_user, settings, repo):
                console.print(f"acls: User:{settings.kafka_consumer_user} may {grant}")
        if settings.kafka_connect_user and cdc_topics:
            allow_writer(admin, settings.kafka_connect_user, cdc_topics)
            console.print(f"acls: User:{settings.kafka_connect_user} may write {owned.topic('*')}")
    if cdc:
        with steps.step("Kafka Connect"):
            ConnectClient(settings.connect_url).ping()
    with steps.step("freshline schema"):
        if result.own_schema != "ok":
            migrations.upgrade(settings.migration_url)
            console.print(f"freshline schema at revision {migrations.head()}")
    with steps.step("your tables"):
        engine = make_owner_engine(settings)
        try:
            with engine.begin() as conn:
                ran = change_tables(conn, result, alter_tables, publication)
        finally:
            engine.dispose()
        steps.ran = ran  # committed together, or not at all
        for ddl in ran:
            console.print(f"ran: {ddl}")
    with steps.step("the lock"):
        lock = Lock.load(repo.lock_path)
        if update(lock, result.schema_version, repo.registry):
            lock.save(repo.lock_path)
            console.print(f"recorded schema version {result.schema_version} in {repo.lock_path}")
    publish_fields(settings, lock)
    if not cdc:
        console.print("change data capture not registered (--no-cdc): freshline cdc register")
    else:
        with steps.step("the connector"):
            register_connector(database_host=database_host, tables=captured_tables(repo.registry))
    if repo.history.enabled:
        with steps.step("history"):
            enable_history(result.tables, repo.history.retention_s)


def change_tables(
    conn: Connection, result: Plan, alter_tables: bool, publication: str
) -> list[str]:
    """What apply does to the user's tables, in ``conn``'s transaction: the replica
    identity and grants (with ``alter_tables``), the derived paths, the publication.
    Returns what ran, one line each."""
    import sqlalchemy as sa

    from freshline.pipeline.deploy.plan import missing_grants

    ran = list(result.replica_identity.values())
    grants = missing_grants(conn, result.tables)  # the roles exist now
    if alter_tables:
        ran += grants
    elif grants:
        console.print(
            "[yellow]warning:[/yellow] freshline's roles cannot read your tables; "
            f"run (or pass --alter-tables): {'; '.join(grants)}"
        )
    for ddl in ran:
        conn.execute(sa.text(ddl))
    for name in result.derived:
        path = result.repository.registry[name].maintenance
        assert isinstance(path, DerivedPath)
        path.install(conn)
        ran.append(
            f"installed triggers {path.trigger}_* on {path.decl.table} (the derived "
            f"incremental path of {name})"
        )
        ran += path.grants(conn)
    for name in result.security:  # no user table changes: no --alter-tables needed
        path = result.repository.registry[name].maintenance
        assert isinstance(path, DerivedPath)
        path.secure(conn)
        console.print(
            f"fixed the derived incremental path of {name} in place: functions replaced, "
            "partials kept"
        )
        ran += path.grants(conn)
    if result.publication_missing:
        exists = conn.execute(
            sa.text("SELECT 1 FROM pg_publication WHERE pubname = :p"), {"p": publication}
        ).first()
        verb = "ALTER PUBLICATION {p} SET TABLE" if exists else "CREATE PUBLICATION {p} FOR TABLE"
        ran.append(f"{verb.format(p=publication)} {', '.join(result.tables)}")
        conn.execute(sa.text(ran[-1]))
    return ran


def enable_history(tables: list[str], retention_s: int | None) -> None:
    """Create and register a history table per captured table, then backfill the new
    ones from one snapshot S0, once the connector's slot exists (every change S0 does
    not see is then streamed: ``freshline.pipeline.history.backfill``)."""
    import sqlalchemy as sa

    from freshline.pipeline.cdc.connect import SCHEMA, names
    from freshline.pipeline.core.db import make_owner_engine
    from freshline.pipeline.core.settings import load_settings
    from freshline.pipeline.history.backfill import backfill
    from freshline.pipeline.history.tables import create, follow, layout, registered

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


def register(app: typer.Typer) -> None:
    """Add apply to the ``freshline`` app."""
    app.command("apply")(apply)


def publish_fields(settings: Settings, lock: Lock) -> None:
    """Publish the lock's field lists for readers whose lock lacks a version
    (:func:`freshline.pipeline.cache.versions.publish_fields`); the deploy commands do it too, so a
    login that may not write them gets a warning, not a failure."""
    import redis

    from freshline.pipeline.cache.versions import publish_fields as publish
    from freshline.pipeline.core.services import redis_client

    try:
        client = redis_client(settings)
        try:
            done = publish(client, lock)
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        console.print(
            f"[yellow]warning:[/yellow] could not publish the lock's field lists in Redis "
            f"({exc}); `freshline deploy start` and `flip` publish them"
        )
        return
    console.print(f"published the field lists of schema versions {', '.join(map(str, done))}")
