"""``freshline audit``: recompute a sample of served entries and report consistency.

A thin shell over :class:`freshline.pipeline.observe.audit.Auditor`: chooses the keys (a SCAN
sample of the active schema version, or a keys file), paces the run, shows progress
on stderr and prints a summary readable at 80 columns (or JSON): its tables are
``rich`` tables. Exit status 1 when a mismatch persisted past the last grace.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import orjson
import typer
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from freshline.pipeline.cli.app import console, out, progress_bar
from freshline.pipeline.core.errors import ConfigError, InvalidId
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.observe.audit import DEFAULT_RATE
from freshline.pipeline.observe.consistency import (
    AuditReport,
    GraceResult,
    Mismatch,
    describe_watermark,
)

if TYPE_CHECKING:
    import redis

    from freshline.pipeline.core.settings import Settings

_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>ms|s|m)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}
SHOWN_MISMATCHES = 20
NAME_WIDTH = 20
VALUE_WIDTH = 27


def parse_duration(text: str, option: str, example: str) -> float:
    """``500ms``, ``10s``, ``2m`` or plain seconds, as seconds."""
    m = _DURATION.match(text.strip())
    if not m:
        raise typer.BadParameter(f"durations such as {example}", param_hint=option)
    return float(m["n"]) * _UNITS[m["unit"]]


def parse_graces(text: str) -> tuple[float, ...]:
    """``1s,10s,60s`` (also ``500ms``, ``2m``, plain seconds) as seconds."""
    return tuple(
        sorted({parse_duration(part, "--grace", "1s,10s,60s") for part in text.split(",")})
    )


def read_keys(path: Path) -> list[str]:
    """Feature keys, one a line; blank lines and ``#`` comments are skipped."""
    text = sys.stdin.read() if str(path) == "-" else path.read_text()
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def _floor_percent(fraction: float) -> str:
    # Rounded down, so 99.99995% never shows as 100%.
    return f"{math.floor(fraction * 1e6) / 1e4:.4f}%"


def _nines(result: GraceResult) -> str:
    if result.nines is None:
        return "-"
    return (">=" if result.lower_bound else "") + f"{result.nines:.2f}"


def _value(value: object) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= VALUE_WIDTH else text[: VALUE_WIDTH - 3] + "..."


def _indented(table: Table) -> Padding:
    return Padding(table, (0, 0, 0, 2))


def mismatch_block(m: Mismatch) -> Group:
    """One mismatch: its key, the two watermarks, then each differing field."""
    watermarks = Table.grid(padding=(0, 1, 0, 0))
    watermarks.add_column(width=NAME_WIDTH)
    watermarks.add_column(overflow="fold")
    watermarks.add_row("served watermark", describe_watermark(m.served_watermark))
    watermarks.add_row("recomputed watermark", describe_watermark(m.recomputed_watermark))
    fields = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    fields.add_column("field", width=NAME_WIDTH, overflow="fold")
    fields.add_column("served", width=VALUE_WIDTH, overflow="fold")
    fields.add_column("recomputed", overflow="fold")
    for name, (s, r) in m.differing.items():
        fields.add_row(Text(name), Text("-" if m.served is None else _value(s)), Text(_value(r)))
    parts: list[RenderableType] = [Text(m.key), _indented(watermarks)]
    if m.problem:
        parts.append(Padding(Text(m.problem), (0, 0, 0, 2)))
    return Group(*parts, _indented(fields))


def grace_table(report: AuditReport) -> Table:
    """Per grace: entries inconsistent, the fraction consistent and its nines."""
    table = Table(box=None, show_edge=False, pad_edge=False, padding=0)
    table.add_column("grace", min_width=8)
    table.add_column("inconsistent", justify="right", min_width=14)
    table.add_column("consistent", justify="right", min_width=14)
    table.add_column("nines", justify="right", min_width=10)
    for r in report.results():
        fraction = r.consistent_fraction
        table.add_row(
            r.label,
            f"{r.inconsistent:,}",
            "-" if fraction is None else _floor_percent(fraction),
            _nines(r),
        )
    return table


def settled_table(report: AuditReport) -> Table:
    """The entries caught up on their watermarks alone, by how their values settled."""
    table = Table(box=None, show_edge=False, pad_edge=False, padding=0)
    table.add_column("caught up on watermark", min_width=24)
    table.add_column("verified", justify="right", min_width=12)
    table.add_column("unverified", justify="right", min_width=12)
    table.add_column("mismatched", justify="right", min_width=12)
    pending = report.verified + report.unverified + report.wrong_after_catching_up
    fraction = report.unverified_fraction
    table.add_row(
        f"{pending:,}",
        f"{report.verified:,}",
        f"{report.unverified:,}",
        f"{report.wrong_after_catching_up:,}",
    )
    table.add_row(
        "per entry checked",
        "",
        "-" if fraction is None else f"{fraction:.2e}",
        "",
    )
    return table


def summary(report: AuditReport, source: str) -> Group:
    """The report at 80 columns: counts, speed, consistency per grace, mismatches."""
    by_set = ", ".join(f"{n} {c:,}" for n, c in sorted(report.checked_by_set.items()))
    limit = f"rate limit {report.rate:,.0f}/s" if report.rate else "no rate limit"
    figures = Table.grid(padding=(0, 1, 0, 0))
    figures.add_column(width=11)
    figures.add_column(overflow="fold")
    figures.add_row("checked", f"{report.checked:,} entries ({by_set or 'none'})")
    figures.add_row(
        "",
        f"{report.absent:,} absent or tombstoned, {report.suspects:,} mismatched at first check",
    )
    if report.caught_up:
        figures.add_row("", f"{report.caught_up:,} healed by catching up while they changed again")
    if report.samples > 1:
        figures.add_row("", f"in {report.samples:,} samples (a key sampled twice is checked twice)")
    if report.skipped:
        figures.add_row("", f"{report.skipped:,} sampled keys skipped (not this code's)")
    figures.add_row(
        "speed",
        f"{report.entries_per_s:,.0f} entries/s ({limit}); "
        f"{report.capacity_per_s:,.0f}/s of busy time",
    )
    figures.add_row(
        "time",
        f"{report.checking_s:,.1f} s checking, {report.elapsed_s:,.1f} s with the re-checks",
    )
    parts: list[RenderableType] = [
        Text(f"audit of schema version {report.schema_version}: {source}"),
        figures,
        Text(),
        grace_table(report),
        Text(),
    ]
    if report.verified or report.unverified or report.wrong_after_catching_up:
        parts += [settled_table(report), Text()]
    last = report.results()[-1].label
    if report.consistent:
        parts.append(Text(f"no mismatch persisted past {last}"))
        return Group(*parts)
    parts.append(Text(f"{report.persistent:,} mismatched after {last} (persistent):"))
    for m in report.mismatches[:SHOWN_MISMATCHES]:
        parts += [Text(), mismatch_block(m)]
    hidden = report.persistent - SHOWN_MISMATCHES
    if hidden > 0:
        listed = len(report.mismatches)
        parts += [
            Text(),
            Text(
                f"... and {hidden:,} more (--json lists "
                + ("them all)" if listed == report.persistent else f"the first {listed:,})")
            ),
        ]
    return Group(*parts)


# long: the signature is the command's option table (78 lines of typer options)
def audit(
    sample: Annotated[
        int | None,
        typer.Option(
            "--sample",
            min=1,
            help="Entries to sample by SCAN from a random cursor \\[default: 1000]",
        ),
    ] = None,
    duration: Annotated[
        str | None,
        typer.Option(
            "--duration",
            help="Keep taking samples until this long has passed (10m, 600s), "
            "then wait out the re-checks",
        ),
    ] = None,
    feature_set: Annotated[
        str | None, typer.Option("--feature-set", help="Sample only this feature set")
    ] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Sample only this tenant")] = None,
    keys_file: Annotated[
        Path | None,
        typer.Option(
            "--keys-file", help="Audit the feature keys in this file, one a line ('-': stdin)"
        ),
    ] = None,
    rate: Annotated[
        float,
        typer.Option(
            "--rate", min=0, help="Entries per second at most, re-checks included (0: no limit)"
        ),
    ] = DEFAULT_RATE,
    verify_within: Annotated[
        str | None,
        typer.Option(
            "--verify-within",
            help="Re-check an entry caught up on its watermark alone until its values "
            "match, at most this long \\[default: the last grace]",
        ),
    ] = None,
    grace: Annotated[
        str,
        typer.Option(
            "--grace",
            help="Re-check a mismatch after each of these; only one that persists "
            "past the last counts",
        ),
    ] = "1s,10s,60s",
    version: Annotated[
        int | None,
        typer.Option(
            "--version",
            min=1,
            help="Schema version to audit \\[default: the keys', or the active one]",
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, max=10000)] = 500,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON, not a summary")] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=1,
            max=65535,
            help="Serve the freshline_audit_* metrics on this port while the audit runs",
        ),
    ] = None,
    metrics_host: Annotated[str, typer.Option("--metrics-host")] = "127.0.0.1",
    history: Annotated[
        bool,
        typer.Option(
            "--history",
            help="Audit history instead: the latest version of every row equals the "
            "table, both ways, at one snapshot",
        ),
    ] = False,
) -> None:
    """Recompute served entries from Postgres; report consistency in nines per grace.

    A mismatch is re-checked after each grace (a change in flight heals); one still
    there after the last is printed with both values and watermarks, and the exit
    status is 1. Absent or tombstoned entries are consistent (correct or absent). One
    that caught up on its watermark alone is re-checked until its values match
    (verified) or --verify-within passes (unverified, or a mismatch if unchanged).
    """

    if history:
        _audit_history(duration or "30s", json_out)
        return
    from freshline.pipeline.core.db import make_engine
    from freshline.pipeline.core.repository import active
    from freshline.pipeline.core.settings import load_settings
    from freshline.pipeline.observe.audit import Auditor
    from freshline.pipeline.observe.audit_metrics import audit_metrics

    graces = parse_graces(grace)
    verify_s = (
        None if verify_within is None else parse_duration(verify_within, "--verify-within", "60s")
    )
    duration_s = None if duration is None else parse_duration(duration, "--duration", "10m")
    if keys_file is not None and (sample or feature_set or tenant or duration):
        raise typer.BadParameter(
            "--keys-file audits exactly its keys; --sample, "
            "--feature-set, --tenant and --duration choose keys by SCAN"
        )
    if feature_set is not None:
        active().registry[feature_set]
    settings = load_settings()
    keys: list[str] | None = None
    if keys_file is not None:
        keys, version = _keys_of(keys_file, version)
    client = redis_client(settings)
    version = _version_to_audit(client, settings, version, feature_set)
    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=metrics_host)
    engine = make_engine(settings)
    with progress_bar() as bar:
        task = bar.add_task(f"audit v{version}", total=None)

        def progress(done: int, total: int | None, note: str) -> None:
            bar.update(task, completed=done, total=total, description=note or f"audit v{version}")

        auditor = Auditor(
            client,
            engine,
            version,
            rate=rate,
            batch_size=batch_size,
            metrics=audit_metrics(),
            progress=progress,
            verify_s=verify_s,
            registry=active().registry,
        )
        if keys is not None:
            report = auditor.audit_keys(keys, graces)
            source = f"{len(keys):,} keys from {keys_file}"
            chosen: dict[str, object] = {"keys_file": str(keys_file), "keys": len(keys)}
        else:
            chosen = {
                "sample": sample or 1000,
                "feature_set": feature_set,
                "tenant": tenant,
                "duration_s": duration_s,
            }
            report = auditor.audit_sample(
                sample or 1000,
                feature_set=feature_set,
                tenant=tenant,
                graces=graces,
                duration_s=duration_s,
            )
            source = _sampled(sample or 1000, feature_set, tenant, duration)
    engine.dispose()
    _show(report, source, chosen, json_out)


def _version_to_audit(
    client: redis.Redis, settings: Settings, version: int | None, feature_set: str | None
) -> int:
    """``version``, else the active one; refused unless this code's definitions are the
    ones the lock holds for it (the recompute would differ from what was served)."""
    from freshline.pipeline.cache.versions import state
    from freshline.pipeline.core.lock import Lock
    from freshline.pipeline.core.repository import active

    if version is None:
        version = state(client, settings).active
    lock = Lock.load()
    registry = active().registry
    if version != settings.schema_version and not lock.compatible(version, registry, feature_set):
        raise ConfigError(
            f"this code's feature definitions differ from schema version "
            f"{version}'s in the lock; audit it with the code that writes it "
            f"(this code writes version {settings.schema_version})"
        )
    return version


def _show(report: AuditReport, source: str, chosen: dict[str, object], json_out: bool) -> None:
    """Print ``report`` (JSON or the summary); exit 1 when a mismatch persisted."""
    if json_out:
        typer.echo(json.dumps({"source": chosen, **report.as_json()}, indent=2))
    else:
        out.print(summary(report, source))
    if not report.consistent:
        if not json_out:
            n = report.persistent
            console.print(f"{n:,} persistent mismatch{'' if n == 1 else 'es'}")
        raise typer.Exit(1)


def _keys_of(keys_file: Path, version: int | None) -> tuple[list[str], int | None]:
    """The keys of ``--keys-file`` and the schema version to audit: ``version``, else the
    one version the keys share (a file mixing versions is refused)."""
    from freshline.pipeline.core.keys import parse_feature_key

    keys = read_keys(keys_file)
    versions = set()
    for i, key in enumerate(keys, 1):
        try:
            versions.add(parse_feature_key(key)[0])
        except InvalidId as exc:
            raise ConfigError(f"{keys_file}, line {i}: {exc}") from exc
    if version is None and len(versions) > 1:
        raise ConfigError(
            f"{keys_file} holds keys of schema versions "
            f"{', '.join(map(str, sorted(versions)))}; audit one at a time"
        )
    return keys, version or (versions.pop() if versions else None)


def _sampled(want: int, feature_set: str | None, tenant: str | None, duration: str | None) -> str:
    """What a SCAN-sampled audit covered, for the summary's first line."""
    scope = " and ".join(
        f"{k} {v}" for k, v in (("feature set", feature_set), ("tenant", tenant)) if v
    )
    source = f"up to {want:,} keys by SCAN ({scope or 'all feature sets'})"
    if duration is not None:
        source = f"samples of {source.removeprefix('up to ')} for {duration}"
    return source


def _audit_history(within: str, json_out: bool) -> None:
    """``audit --history``: each recorded table against its history at one snapshot,
    retried for ``within`` while the recorder catches up; exit 1 on a difference."""
    from freshline.pipeline.core.db import make_engine
    from freshline.pipeline.core.settings import load_settings
    from freshline.pipeline.history.audit import audit as audit_tables

    engine = make_engine(load_settings())
    try:
        results = audit_tables(engine, parse_duration(within, "--duration", "30s"))
    finally:
        engine.dispose()
    if json_out:
        out.print_json(
            data=[
                {
                    "table": f"{r.schema}.{r.table}",
                    "snapshot": r.snapshot,
                    "rows": r.rows,
                    "missing": r.missing,
                    "extra": r.extra,
                    "broken": r.broken,
                    "samples": r.samples,
                }
                for r in results
            ]
        )
    else:
        table = Table("table", "rows", "missing", "extra", "state", title="history audit")
        for r in results:
            state = "ok" if r.ok else (f"BROKEN: {r.broken}" if r.broken else "differs")
            table.add_row(
                f"{r.schema}.{r.table}", f"{r.rows:,}", str(r.missing), str(r.extra), state
            )
        out.print(table)
        for r in results:
            for line in r.samples:
                out.print(f"  {r.table}: {line}")
        if not results:
            out.print("no history recorded: [history] enabled = true in freshline.toml, then apply")
    if not all(r.ok for r in results):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``audit`` to the ``freshline`` app."""
    app.command("audit")(audit)
