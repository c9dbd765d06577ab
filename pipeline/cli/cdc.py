"""``freshline cdc register | status | remove``: the Debezium connector and its slot.

Thin shells over :mod:`freshline.pipeline.cdc.connect`; see ``docs/cdc.md``.
"""

from __future__ import annotations

from typing import Annotated, cast, get_args

import typer
from rich.markup import escape
from rich.table import Table

from freshline.pipeline.cdc.connect import WAL_WARN_BYTES, CdcStatus, SnapshotMode
from freshline.pipeline.cli.app import console, out

cdc_app = typer.Typer(help="Postgres change data capture through Debezium.", no_args_is_help=True)

NameOption = Annotated[
    str | None,
    typer.Option(
        "--name", help="Connector name \\[default: <FRESHLINE_TOPIC_PREFIX>freshline-postgres]"
    ),
]


def register(app: typer.Typer) -> None:
    """Add ``freshline cdc ...`` to the main CLI."""
    app.add_typer(cdc_app, name="cdc")


@cdc_app.command("register")
def cdc_register(
    name: NameOption = None,
    snapshot_mode: Annotated[
        str,
        typer.Option(
            "--snapshot-mode",
            help=f"Debezium snapshot.mode: {', '.join(get_args(SnapshotMode))}",
        ),
    ] = "no_data",
    database_host: Annotated[
        str | None,
        typer.Option(
            "--database-host",
            help="Postgres host as Connect sees it \\[default: from the URL]",
        ),
    ] = None,
    wait: Annotated[
        float,
        typer.Option("--wait", min=0, help="Seconds to wait for the task to run (0: do not wait)"),
    ] = 60.0,
) -> None:
    """Create or update the Debezium connector (idempotent), and its topics."""
    from freshline.pipeline.cli.connector import register_connector

    if snapshot_mode not in get_args(SnapshotMode):
        raise typer.BadParameter(
            f"choose one of {', '.join(get_args(SnapshotMode))}", param_hint="--snapshot-mode"
        )
    register_connector(
        name=name,
        snapshot_mode=cast(SnapshotMode, snapshot_mode),
        database_host=database_host,
        wait=wait,
    )


@cdc_app.command("status")
def cdc_status(
    name: NameOption = None,
    wal_warn_mib: Annotated[
        int,
        typer.Option("--wal-warn-mib", min=1, help="Warn when the slot retains more WAL than this"),
    ] = WAL_WARN_BYTES >> 20,
) -> None:
    """The connector's and its tasks' state, and the replication slot's WAL retention.

    Exits 1 when the connector or a task FAILED, or the connector is not registered;
    2 when the slot retains more WAL than --wal-warn-mib.
    """
    from freshline.pipeline.cdc.connect import status
    from freshline.pipeline.core.db import make_engine, ping
    from freshline.pipeline.core.settings import load_settings

    settings = load_settings()
    engine = make_engine(settings)
    ping(engine)
    state = status(settings, engine, name)
    engine.dispose()
    report, code = status_report(state, wal_warn_mib << 20)
    out.print(report)
    raise typer.Exit(code)


def status_report(state: CdcStatus, wal_warn_bytes: int) -> tuple[Table, int]:
    """``freshline cdc status``'s report and exit code.

    One short line per thing (connector, task, topics, slot) under a 10-column label,
    details on the lines below it; anything long (a Java trace, an LSN) wraps under
    its label, so the report reads at 80 columns and in a pipe.
    """
    from freshline.pipeline.cdc.connect import format_bytes

    report = Table.grid(padding=(0, 1, 0, 0))
    report.add_column(width=10, no_wrap=True)
    report.add_column(overflow="fold")

    def say(label: str, text: str) -> None:
        report.add_row(label, text)

    owned = state.names
    code = 0
    if state.connector is None:
        say(
            "connector",
            f"{escape(owned.connector)}: [red]not registered[/red] (run: freshline cdc register)",
        )
        code = 1
    else:
        say("connector", f"{escape(owned.connector)}: {_state(state.connector.state)}")
        say("", f"worker {escape(state.connector.worker)}")
        if state.connector.error:
            say("", escape(state.connector.error))
        for task in state.tasks:
            say(f"task {task.id}", f"{_state(task.state)}  worker {escape(task.worker)}")
            if task.error:
                say("", escape(task.error))
        if not state.tasks:
            say("tasks", "none yet")
        if state.failed:
            code = 1
    say("topics", escape(owned.topic("<table>")))
    say(
        "",
        f"publication {escape(owned.publication)}: "
        f"{escape(', '.join(state.publication_tables)) or '[red]missing[/red]'}",
    )
    slot = state.slot
    if slot is None:
        say("slot", f"{escape(owned.slot)}: [yellow]none[/yellow]")
    else:
        retained = format_bytes(slot.retained_bytes)
        say(
            "slot",
            f"{escape(slot.name)}: {'active' if slot.active else 'inactive'}, "
            f"retains {retained} of WAL",
        )
        say("", f"confirmed_flush_lsn {slot.confirmed_flush_lsn}")
        say("", f"restart_lsn {slot.restart_lsn}")
        if slot.retained_bytes > wal_warn_bytes:
            say(
                "[yellow]warning[/yellow]",
                f"slot {escape(slot.name)} retains {retained} of WAL (over "
                f"{wal_warn_bytes >> 20} MiB): the server cannot recycle it until the "
                "connector catches up. Fix the connector, or drop the slot with "
                "`freshline cdc remove` before the disk fills.",
            )
            code = code or 2
    return report, code


@cdc_app.command("remove")
def cdc_remove(name: NameOption = None) -> None:
    """Delete the connector (and its stored offsets), drop its replication slot, then
    delete the ACLs register gave Connect's login on its topics (idempotent)."""
    from freshline.consumers.topics import remove_cdc_acls
    from freshline.pipeline.cdc.connect import ConnectClient, drop_slot, names
    from freshline.pipeline.core.db import make_engine
    from freshline.pipeline.core.settings import load_settings

    settings = load_settings()
    owned = names(settings, name)
    deleted = ConnectClient(settings.connect_url).delete(owned.connector)
    console.print(f"connector {owned.connector}: {'deleted' if deleted else 'not registered'}")
    engine = make_engine(settings)
    dropped = drop_slot(engine, owned.slot)
    engine.dispose()
    console.print(f"slot {owned.slot}: {'dropped' if dropped else 'none'}")
    prefix = owned.topic("")
    if not settings.kafka_connect_user:
        console.print("acls: none made (FRESHLINE_KAFKA_CONNECT_USER is empty)")
        return
    revoked = remove_cdc_acls(settings, prefix)
    console.print(
        f"acls User:{settings.kafka_connect_user} on {prefix}*: "
        + (f"WRITE and DESCRIBE deleted on {len(revoked)} topics" if revoked else "none")
    )


def _state(state: str) -> str:
    color = {"RUNNING": "green", "FAILED": "red"}.get(state, "yellow")
    return f"[{color}]{state}[/{color}]"
