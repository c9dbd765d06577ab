"""``freshline topics ...``: the Kafka topics freshline owns."""

from __future__ import annotations

from typing import Annotated

import typer

topics_app = typer.Typer(help="The Kafka topics freshline owns.", no_args_is_help=True)


@topics_app.command("ensure")
def topics_ensure(
    partitions: Annotated[int | None, typer.Option(
        min=1, help="Partitions per topic [default: FRESHLINE_TOPIC_PARTITIONS]")] = None,
    replication_factor: Annotated[int, typer.Option(
        min=1, help="Replicas per partition (1 on a single local broker)")] = 1,
) -> None:
    """Create the domain-event, invalidation and dead-letter topics if they are missing."""
    from rich.console import Console

    from consumers.kafka import admin_client
    from consumers.topics import ensure
    from pipeline.settings import get_settings

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    settings = get_settings()
    wanted = partitions or settings.topic_partitions
    report = ensure(admin_client(settings), wanted, replication_factor=replication_factor)
    for name in report.created:
        console.print(f"created  {name} ({wanted} partitions)")
    for name, count in report.existing.items():
        note = "" if count == wanted else f", configured {wanted}: not changed"
        console.print(f"existing {name} ({count} partitions{note})")
