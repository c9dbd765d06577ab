"""Registering the Debezium connector: what ``freshline cdc register`` and ``freshline
apply`` both do, in one place (the command modules never import each other)."""

from __future__ import annotations

import time

import typer

from freshline.pipeline.cdc.connect import SnapshotMode
from freshline.pipeline.cli.app import console


def register_connector(
    *,
    name: str | None = None,
    snapshot_mode: SnapshotMode = "no_data",
    database_host: str | None = None,
    tables: list[str] | None = None,
    wait: float = 60.0,
) -> None:
    """Create or update the connector for the active repository's tables, and its topics;
    then wait up to ``wait`` seconds (0: not at all) for its task to run."""
    from freshline.consumers.topics import ensure_cdc_topics
    from freshline.pipeline.cdc.connect import (
        ConnectClient,
        captured_tables,
        check_publication,
        connector_config,
        connector_state,
        names,
    )
    from freshline.pipeline.core.db import make_engine, ping
    from freshline.pipeline.core.settings import load_settings

    settings = load_settings()
    owned = names(settings, name)
    if tables is None:
        from freshline.pipeline.core.repository import active

        tables = captured_tables(active().registry)
    engine = make_engine(settings)
    ping(engine)
    check_publication(engine, tables, owned.publication)
    engine.dispose()
    client = ConnectClient(settings.connect_url)
    config = connector_config(
        settings,
        owned,
        snapshot_mode=snapshot_mode,
        database_host=database_host,
        tables=tables,
    )
    client.ping()
    created_topics = ensure_cdc_topics(settings, [owned.topic(t) for t in tables])
    created = client.put_config(owned.connector, config)
    console.print(
        f"{'created' if created else 'updated'} connector {owned.connector}: "
        f"slot {owned.slot}, publication {owned.publication}, "
        f"snapshot {snapshot_mode}, topics {owned.topic('<table>')} "
        f"({len(created_topics)} created) for {', '.join(tables)}"
    )
    if not wait:
        return
    deadline = time.monotonic() + wait
    while True:
        connector, tasks = connector_state(client, owned.connector)
        states = [t.state for t in ([connector] if connector else []) + tasks]
        failed = next(
            (t for t in ([connector] if connector else []) + tasks if t.state == "FAILED"), None
        )
        if failed is not None:
            console.print(f"[red]error:[/red] connector {owned.connector} FAILED: {failed.error}")
            raise typer.Exit(1)
        if tasks and all(s == "RUNNING" for s in states):
            console.print(f"connector {owned.connector} RUNNING")
            return
        if time.monotonic() > deadline:
            console.print(
                f"[yellow]warning:[/yellow] connector {owned.connector} not running "
                f"after {wait:.0f}s ({', '.join(states) or 'no tasks yet'}); "
                "see: freshline cdc status"
            )
            return
        time.sleep(0.25)
