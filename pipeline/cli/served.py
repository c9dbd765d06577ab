"""``freshline served sink``: the served log, from Kafka into Parquet.

A thin shell over :mod:`consumers.served`; see ``docs/observability.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli.app import console

served_app = typer.Typer(
    help="The served log: what the read API answered, kept.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    """Add ``freshline served ...`` to the main CLI."""
    app.add_typer(served_app, name="served")


@served_app.command("sink")
def sink(
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir", help="Where the Parquet files go [default: FRESHLINE_SERVED_LOG_DIR]"
        ),
    ] = None,
    max_rows: Annotated[int | None, typer.Option(min=1, help="Stop after this many rows")] = None,
    timeout: Annotated[
        float | None, typer.Option(min=0, help="Stop after this many seconds")
    ] = None,
) -> None:
    """Write the served log (topic freshline.served) as day-partitioned Parquet files.

    A consumer group of its own (freshline-served-sink); days older than
    FRESHLINE_SERVED_LOG_RETENTION_DAYS are deleted. SIGTERM or Ctrl-C finishes the
    batch, commits and exits.
    """
    import signal

    from consumers.served import ServedSink
    from pipeline.core.repository import REGISTRY
    from pipeline.core.settings import load_settings

    settings = load_settings()
    served = ServedSink(settings, REGISTRY, directory)

    def on_signal(_signum: int, _frame: object) -> None:
        served.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    console.print(f"writing {served.topic} to {served.log.directory}")
    try:
        written = served.run(max_rows=max_rows, timeout=timeout)
    finally:
        served.close()
    console.print(f"wrote {written:,} served rows")
