"""``freshline topics ensure`` and ``consume``: the Kafka side."""

from __future__ import annotations

from typing import Annotated

import typer

from freshline.pipeline.cli.app import console

topics_app = typer.Typer(help="The Kafka topics freshline owns.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add ``freshline topics ...`` and ``consume`` to the main CLI."""
    app.add_typer(topics_app, name="topics")
    app.command("consume")(consume)
    app.command("record")(record)


@topics_app.command("ensure")
def topics_ensure(
    partitions: Annotated[
        int | None,
        typer.Option(min=1, help="Partitions per topic \\[default: FRESHLINE_TOPIC_PARTITIONS]"),
    ] = None,
    replication_factor: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Replicas per partition \\[default: 3 (min.insync.replicas 2) from "
            "3 brokers on, else one per broker]",
        ),
    ] = None,
) -> None:
    """Create the domain-event, invalidation and dead-letter topics if they are missing."""
    from freshline.consumers.kafka import admin_client
    from freshline.consumers.topics import ensure, managed_topics
    from freshline.pipeline.core.settings import load_settings

    settings = load_settings()
    wanted = partitions or settings.topic_partitions
    report = ensure(
        admin_client(settings),
        wanted,
        replication_factor=replication_factor,
        topics=managed_topics(settings),
    )
    for name in report.created:
        console.print(f"created  {name} ({wanted} partitions)")
    for name, count in report.existing.items():
        note = "" if count == wanted else f", configured {wanted}: not changed"
        console.print(f"existing {name} ({count} partitions{note})")


def consume(
    topics: Annotated[
        list[str] | None,
        typer.Option(
            "--topics",
            help="Topics or ^regex patterns \\[default: domain events, CDC topics]",
        ),
    ] = None,
    group: Annotated[
        str | None, typer.Option(help="Consumer group \\[default: FRESHLINE_CONSUMER_GROUP]")
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Prometheus port \\[default: FRESHLINE_CONSUMER_METRICS_PORT; 0 turns it off]"
        ),
    ] = None,
    max_messages: Annotated[int | None, typer.Option(min=1, help="Stop after this many")] = None,
) -> None:
    """Run one consumer-group member: change events in, fresh features out.

    Start several (on one machine or many) with the same --group to share the
    partitions. SIGTERM or Ctrl-C finishes the batch, commits and exits; a second
    signal exits at once.
    """
    import logging
    import os
    import signal

    from freshline.store import FeatureStore

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    store = FeatureStore.from_env()
    settings = store.settings
    worker = store.worker(topics=topics, group=group)
    port = settings.consumer_metrics_port if metrics_port is None else metrics_port
    if port:
        from prometheus_client import start_http_server

        try:
            start_http_server(port, addr=settings.consumer_metrics_host)
        except OSError as exc:
            console.print(f"metrics port {port} unavailable ({exc}); running without /metrics")
    signals = 0

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            os._exit(128 + signum)
        console.print("stopping after this batch (signal again to exit now)")
        worker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    console.print(f"consuming {', '.join(worker.topics)} as group {worker.consumer.group_id}")
    totals = worker.run(max_messages=max_messages)
    console.print(
        f"consumed {totals.consumed:,}: applied {totals.applied:,}, "
        f"dead-lettered {totals.dead_lettered:,}, skipped {totals.skipped:,}"
    )
    if not worker.closed_cleanly:
        # The interpreter's teardown would wait on the stuck Kafka client again.
        console.file.flush()
        logging.shutdown()
        os._exit(0)


def record(
    max_messages: Annotated[int | None, typer.Option(min=1, help="Stop after this many")] = None,
    metrics_port: Annotated[
        int, typer.Option(help="Prometheus port for the recorder's metrics (0: none)")
    ] = 0,
) -> None:
    """Record history: every version of every row of the captured tables, from the CDC
    topics, in a consumer group of its own (FRESHLINE_CONSUMER_GROUP + "-history").

    Turn history on in freshline.toml ([history] enabled = true) and run apply first.
    SIGTERM or Ctrl-C finishes the batch, commits and exits.
    """
    import logging
    import signal

    from freshline.consumers.history import HistoryWorker, group, topics
    from freshline.pipeline.core.settings import load_settings

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = load_settings()
    worker = HistoryWorker(settings)
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=settings.consumer_metrics_host)

    def on_signal(_signum: int, _frame: object) -> None:
        console.print("stopping after this batch")
        worker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    console.print(
        f"recording history from {', '.join(topics(settings))} as group {group(settings)}"
    )
    totals = worker.run(max_messages=max_messages)
    console.print(
        f"consumed {totals.consumed:,}: {totals.versions:,} versions, "
        f"{totals.duplicates:,} duplicates, {totals.skipped_s0:,} before S0, "
        f"{totals.malformed:,} malformed"
    )
