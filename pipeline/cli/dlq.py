"""``freshline dlq list | replay``: the dead-letter topic, read back.

Thin shells over :mod:`freshline.consumers.replay`; see ``docs/events.md``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from freshline.pipeline.cli.app import console, out, progress_bar

dlq_app = typer.Typer(
    help="The dead-letter topic: what is in it, and replaying it.", no_args_is_help=True
)

_AGO = re.compile(r"(\d+)([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def register(app: typer.Typer) -> None:
    """Add ``freshline dlq ...`` to the main CLI."""
    app.add_typer(dlq_app, name="dlq")


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``2h``, ``30m``, ``7d``, ``45s`` ago, or an ISO 8601 time (UTC unless it says)."""
    if match := _AGO.fullmatch(text.strip()):
        ago = timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
        return (now or datetime.now(UTC)) - ago
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is neither a time like 2026-12-05T10:00Z nor a duration like 2h",
            param_hint="--since",
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


@dlq_app.command("list")
def dlq_list() -> None:
    """Count the dead letters by reason and source topic, oldest and newest (UTC)."""
    from freshline.consumers.replay import DeadLetterLog, Ledger, summarise
    from freshline.pipeline.core.services import redis_client
    from freshline.pipeline.core.settings import load_settings

    settings = load_settings()
    client = redis_client(settings)
    try:
        with DeadLetterLog(settings) as log:
            groups = summarise(log, Ledger(client, log.topic))
    finally:
        client.close()
    if not groups:
        console.print(f"{escape(log.topic)} is empty")
        return
    table = Table(title=escape(log.topic), title_justify="left")
    table.add_column("reason")
    table.add_column("source topic", overflow="fold")
    table.add_column("records", justify="right")
    table.add_column("replayed", justify="right")
    table.add_column("oldest")
    table.add_column("newest")
    for g in groups:
        table.add_row(
            escape(g.reason),
            escape(g.source_topic),
            str(g.count),
            str(g.replayed),
            _when(g.oldest_ms),
            _when(g.newest_ms),
        )
    out.print(table)


@dlq_app.command("replay")
def dlq_replay(
    reason: Annotated[
        str | None,
        typer.Option(
            "--reason", help="Only this reason: a kind (unknown_table) or a class (DataError)"
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            metavar="TIME",
            help="Only dead letters from TIME on: 2h (ago), or 2026-12-05T10:00Z",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would be replayed; send nothing")
    ] = False,
) -> None:
    """Send dead letters back to their source topics, once their cause is fixed.

    Each goes back with its key, value and headers, for the consumers to apply as
    usual; a record replayed before is not sent again.
    """
    from freshline.consumers.replay import replay
    from freshline.pipeline.core.services import redis_client
    from freshline.pipeline.core.settings import load_settings

    since_ms = None if since is None else int(parse_since(since).timestamp() * 1000)
    settings = load_settings()
    client = redis_client(settings)
    try:
        with progress_bar() as bar:
            task = bar.add_task("reading dead letters", total=None)
            report = replay(
                settings,
                client,
                reason=reason,
                since_ms=since_ms,
                dry_run=dry_run,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
    finally:
        client.close()
    verb = "would replay" if dry_run else "replayed"
    sent = sum(report.replayed.values())
    for topic, count in sorted(report.replayed.items()):
        out.print(f"{verb} {count} to {escape(topic)}")
    skipped = []
    if report.already:
        skipped.append(f"{report.already} replayed before")
    if report.not_replayable:
        skipped.append(f"{report.not_replayable} cut to fit the topic or naming no source")
    tail = f"; skipped {', '.join(skipped)}" if skipped else ""
    out.print(f"{verb} {sent} dead letter(s){tail}")
