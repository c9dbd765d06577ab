"""``freshline training-set SPINE --features ... --out FILE``: features as of each spine
row's moment, from history (docs/training.md)."""

from __future__ import annotations

import datetime as dt
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress, TaskID

from freshline.pipeline.cli.app import console, progress_bar
from freshline.pipeline.core.features import seconds


def register(app: typer.Typer) -> None:
    """Add ``freshline training-set`` to the main CLI."""
    app.command("training-set")(training_set_command)


def training_set_command(
    spine: Annotated[Path, typer.Argument(help="The spine: a .parquet or .csv file")],
    features: Annotated[
        str,
        typer.Option("--features", help="Feature sets, or set:field, comma-separated: txn_90d,geo"),
    ],
    out: Annotated[Path, typer.Option("--out", help="Where to write it: .parquet or .csv")],
    timestamp: Annotated[
        str, typer.Option("--timestamp", help="The spine's moment column (with a zone)")
    ] = "timestamp",
    delay: Annotated[
        str | None,
        typer.Option("--delay", help="Model serving lag: values as of moment - delay (90s, 5m)"),
    ] = None,
    at: Annotated[
        str,
        typer.Option(
            "--at",
            help="commit_time (rows as committed at each moment) or snapshot (as the "
            "spine's snapshot column saw them)",
        ),
    ] = "commit_time",
) -> None:
    """Build a training set: the spine's rows with each feature as freshline would
    have served it at the row's moment."""
    from freshline.pipeline.history.training import SpineError, write
    from freshline.store import FeatureStore

    if at not in ("commit_time", "snapshot"):
        raise SpineError(f"--at {at!r}: expected commit_time or snapshot")
    lag = dt.timedelta(seconds=seconds(delay, "--delay")) if delay else None
    started = time.monotonic()
    with ExitStack() as stack:
        store = stack.enter_context(FeatureStore.from_env())
        bars: list[tuple[Progress, TaskID]] = []

        def progress(done: int, total: int) -> None:
            if not bars:  # the input is checked: from here on there is work to show
                bar = stack.enter_context(progress_bar())
                bars.append((bar, bar.add_task("training set", total=total)))
            bar, task = bars[0]
            bar.update(task, completed=done, total=total)

        table = store.training_set(
            spine,
            [f for f in features.split(",") if f.strip()],
            timestamp=timestamp,
            delay=lag,
            at="snapshot" if at == "snapshot" else "commit_time",
            progress=progress,
        )
    path = write(table, out)
    added = [c for c in table.column_names if "__" in c]
    empty = sum(table.column(c).null_count for c in added)
    console.print(
        f"wrote {path}: {table.num_rows} rows, {len(added)} feature columns "
        f"({empty} empty values), in {time.monotonic() - started:.1f}s"
    )
