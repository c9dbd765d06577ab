"""``freshline served sink`` (the served log, from Kafka into Parquet) and ``freshline
skew`` (logged reads checked against history).

Thin shells over :mod:`freshline.consumers.served` and :mod:`freshline.pipeline.observe.skew`; see
``docs/observability.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from freshline.pipeline.cli.app import console, out

if TYPE_CHECKING:
    from freshline.pipeline.observe.skew import SkewReport

served_app = typer.Typer(
    help="The served log: what the read API answered, kept.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    """Add ``freshline served ...`` and ``freshline skew`` to the main CLI."""
    app.add_typer(served_app, name="served")
    app.command("skew")(skew)


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

    from freshline.consumers.served import ServedSink
    from freshline.pipeline.core.repository import active
    from freshline.pipeline.core.settings import load_settings

    settings = load_settings()
    served = ServedSink(settings, active().registry, directory)

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


def skew(
    since: Annotated[
        str, typer.Option(help="The window's length: reads logged since, e.g. 1h")
    ] = "1h",
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="The served log's files [default: FRESHLINE_SERVED_LOG_DIR]"),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON, not a table")] = False,
    duration: Annotated[
        float | None,
        typer.Option(min=0, help="Check again every --interval for this many seconds"),
    ] = None,
    interval: Annotated[float, typer.Option(min=1, help="Seconds between checks")] = 60.0,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve the figures as Prometheus gauges on this port")
    ] = None,
) -> None:
    """Check logged reads against history: exact mismatches (must be 0), missing, stale.

    Each read is evaluated at its entry's snapshot (a difference is a mismatch: a bug)
    and at its request's moment (a difference is staleness). Exits 1 on a mismatch.
    """
    import time
    from datetime import UTC, datetime, timedelta

    from freshline.pipeline.core.db import make_engine
    from freshline.pipeline.core.features import seconds
    from freshline.pipeline.core.repository import active
    from freshline.pipeline.core.settings import load_settings
    from freshline.pipeline.observe.served_files import ParquetLog
    from freshline.pipeline.observe.skew import check, skew_metrics

    settings = load_settings()
    window = timedelta(seconds=seconds(since, "--since"))
    log = ParquetLog(directory or settings.served_log_dir, settings.served_log_retention_days)
    engine = make_engine(settings).execution_options(isolation_level="REPEATABLE READ")
    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port)
    deadline = None if duration is None else time.monotonic() + duration
    while True:
        now = datetime.now(UTC)
        rows = log.read(since=now - window, until=now).to_pylist()
        with engine.connect() as conn, conn.begin():
            report = check(conn, active().registry, rows)
        if metrics_port is not None:
            skew_metrics().update(report)
        _show(report, json_out)
        if deadline is None or time.monotonic() + interval > deadline:
            break
        time.sleep(interval)  # the check's period, not a wait on anything
    engine.dispose()
    if report.mismatched:
        raise typer.Exit(1)


def _show(report: SkewReport, json_out: bool) -> None:
    from rich.table import Table

    if json_out:
        out.print_json(data=report.as_json())
        return
    table = Table(
        "feature set / field",
        "reads",
        "checked",
        "wrong",
        "missing",
        "stale",
        "age p50/p99 ms",
        "SMAPE",
        "nines",
        "unchecked",
        title="skew: wrong (exact mismatches, must be 0) and old (stale)",
        box=None,
    )
    for s in report.sets.values():
        ages = s.ages()
        unchecked = ", ".join(f"{n} {why}" for why, n in s.unchecked.items()) or "0"
        table.add_row(
            s.feature_set,
            f"{s.reads:,}",
            f"{s.checked:,}",
            f"[red]{s.mismatched:,}[/]" if s.mismatched else "0",
            f"{s.missing:,}",
            f"{s.stale:,}",
            f"{ages['p50']:,}/{ages['p99']:,}" if ages else "",
            "",
            "" if s.nines is None else f"{s.nines:.1f}{'+' if not s.mismatched else ''}",
            unchecked,
        )
        for name, f in s.fields.items():
            if f.mismatched or f.stale:
                table.add_row(
                    f"  {name}",
                    "",
                    "",
                    f"[red]{f.mismatched:,}[/]" if f.mismatched else "0",
                    "",
                    f"{f.stale:,}",
                    "",
                    "" if f.smape is None else f"{f.smape:.4f}",
                    "",
                    "",
                )
    out.print(table)
