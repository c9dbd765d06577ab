"""``freshline advise``: measure over a window, then a verdict per feature set and model.

Figures come from the API's (and any other process's) ``/metrics``, scraped twice a
window apart, or from a Prometheus server's HTTP API as increases over the window.
The verdicts are :func:`pipeline.observe.advisor.advise`'s.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
import urllib.request
from typing import Annotated, Any

import typer
from rich.table import Table

from pipeline.cli.app import console, out
from pipeline.core.errors import ConfigError, ServiceUnavailable
from pipeline.observe.advisor import (
    Advice,
    Samples,
    advise_all,
    difference,
    figures_from_samples,
    parse_exposition,
)

_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}

COUNTERS = (
    "freshline_api_feature_hits_total", "freshline_api_feature_misses_total",
    "freshline_api_predictions_total",
    "freshline_cache_read_seconds_sum", "freshline_cache_read_seconds_count",
    "freshline_cache_miss_seconds_sum", "freshline_cache_miss_seconds_count",
    "freshline_compute_seconds_sum", "freshline_compute_seconds_count",
)
GAUGES = (
    "freshline_feature_ttl_seconds", "freshline_staleness_oldest_age_seconds",
    "freshline_staleness_mean_age_seconds", "freshline_model_deterministic",
)
_STYLE = {"keep": "green", "kill": "red", "refuse": "magenta", "shorten-ttl": "yellow",
          "lengthen-ttl": "cyan"}


def parse_window(text: str) -> float:
    """``5m``, ``30s``, ``1h``, ``500ms`` or plain seconds."""
    m = _DURATION.match(text.strip())
    if not m or float(m["n"]) <= 0:
        raise typer.BadParameter("a duration such as 30s, 5m or 1h", param_hint="--window")
    return float(m["n"]) * _UNITS[m["unit"]]


def _get(url: str, timeout_s: float = 10.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            return str(response.read().decode())
    except OSError as exc:
        raise ServiceUnavailable("metrics", url, str(exc)) from exc


def scrape(urls: list[str]) -> Samples:
    return parse_exposition(_get(u) for u in urls)


def measure_scrapes(urls: list[str], window_s: float) -> tuple[Samples, Samples]:
    """Two scrapes ``window_s`` apart: ``(increase, latest)``."""
    before = scrape(urls)
    console.print(f"measuring {', '.join(urls)} for {window_s:g}s ...")
    threading.Event().wait(window_s)  # the measurement window itself
    after = scrape(urls)
    return difference(after, before), after


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    body = json.loads(_get(url))
    if body.get("status") != "success":
        raise ServiceUnavailable("Prometheus", base, f"refused {expr!r}: {body.get('error')}")
    return list(body["data"]["result"])


def measure_prometheus(base: str, window_s: float) -> tuple[Samples, Samples]:
    """Increases over the window and latest values, from Prometheus's HTTP API."""
    window = f"{max(1, round(window_s))}s"
    delta: Samples = {}
    latest: Samples = {}
    for name in COUNTERS:
        for r in _query(base, f"increase({name}[{window}])"):
            labels = frozenset((k, v) for k, v in r["metric"].items() if k != "__name__")
            delta[(name, labels)] = delta.get((name, labels), 0.0) + float(r["value"][1])
        for r in _query(base, name):
            labels = frozenset((k, v) for k, v in r["metric"].items() if k != "__name__")
            latest[(name, labels)] = float(r["value"][1])
    for name in GAUGES:
        for r in _query(base, name):
            labels = frozenset((k, v) for k, v in r["metric"].items() if k != "__name__")
            latest[(name, labels)] = float(r["value"][1])
    return delta, latest


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.2f}"


def table(advice: list[Advice]) -> Table:
    t = Table(title="Cache verdicts", title_justify="left")
    for col in ("cache", "verdict", "req/s", "hit rate", "lookup ms", "compute ms",
                "miss overhead ms", "E(cached) ms", "E(uncached) ms", "read/compute",
                "staleness / TTL"):
        t.add_column(col, justify="left" if col in ("cache", "verdict") else "right")
    for a in advice:
        f = a.figures
        ratio = f"{f.lookup_s / f.compute_s:.2f}" if f.compute_s > 0 else "-"
        stale = "-"
        if f.ttl_s:
            oldest = "-" if f.oldest_age_s is None else f"{f.oldest_age_s:,.0f}s"
            stale = f"{oldest} / {f.ttl_s:,.0f}s"
        verdict = a.verdict + (f" → {a.suggested_ttl_s:,.0f}s" if a.suggested_ttl_s else "")
        t.add_row(f"{f.kind.replace('_', ' ')} {f.name}",
                  f"[{_STYLE[a.verdict]}]{verdict}[/]", f"{f.qps:,.1f}", f"{f.hit_rate:.1%}",
                  _ms(f.lookup_s), _ms(f.compute_s), _ms(f.miss_overhead_s), _ms(a.cached_s),
                  _ms(a.uncached_s), ratio, stale)
    return t


def slots_table(advice: list[Advice]) -> Table | None:
    models = [(a, a.slots_cached, a.slots_uncached) for a in advice
              if a.slots_cached is not None and a.slots_uncached is not None]
    if not models:
        return None
    t = Table(title="Model serving slots (Little's law: QPS x (1-h) x compute)",
              title_justify="left")
    for col in ("model", "req/s", "hit rate", "compute ms", "slots, no cache",
                "slots, cached", "slots saved"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for a, cached, uncached in models:
        f = a.figures
        t.add_row(f.name, f"{f.qps:,.1f}", f"{f.hit_rate:.1%}", _ms(f.compute_s),
                  f"{uncached:,.2f}", f"{cached:,.2f}", f"{uncached - cached:,.2f}")
    return t


def as_json(advice: list[Advice]) -> list[dict[str, Any]]:
    return [{
        "name": a.figures.name, "kind": a.figures.kind, "verdict": a.verdict,
        "reason": a.reason, "suggested_ttl_s": a.suggested_ttl_s,
        "qps": a.figures.qps, "hit_rate": a.figures.hit_rate,
        "lookup_s": a.figures.lookup_s, "compute_s": a.figures.compute_s,
        "miss_overhead_s": a.figures.miss_overhead_s, "cached_s": a.cached_s,
        "uncached_s": a.uncached_s, "ttl_s": a.figures.ttl_s,
        "oldest_age_s": a.figures.oldest_age_s, "mean_age_s": a.figures.mean_age_s,
        "slots_cached": a.slots_cached, "slots_uncached": a.slots_uncached,
        "warnings": list(a.warnings),
    } for a in advice]


def advise(
    window: Annotated[str, typer.Option(help="Measurement window: 30s, 5m, 1h")] = "5m",
    from_metrics: Annotated[list[str] | None, typer.Option(
        "--from-metrics", help="A /metrics URL to scrape twice, a window apart (repeatable) "
                               "[default: the local API's]")] = None,
    from_prometheus: Annotated[str | None, typer.Option(
        "--from-prometheus", help="A Prometheus base URL: increases over the window")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON, not tables")] = False,
) -> None:
    """Keep, kill, re-TTL or refuse each cache, from figures measured over a window.

    With a cache: E = lookup + (1-h)(compute + miss overhead); without: E = compute.
    Kept only if cheaper, at 5 requests/s or more and a hit rate of 30% or more; a
    non-deterministic computation is refused. See pipeline/observe/advisor.py.
    """
    from pipeline.core.settings import load_settings

    window_s = parse_window(window)
    if from_metrics and from_prometheus:
        raise ConfigError("choose --from-metrics or --from-prometheus, not both")
    if from_prometheus:
        delta, latest = measure_prometheus(from_prometheus, window_s)
    else:
        settings = load_settings()
        urls = from_metrics or [f"http://{settings.api_host}:{settings.api_port}/metrics"]
        delta, latest = measure_scrapes(urls, window_s)
    advice = advise_all(figures_from_samples(delta, latest, window_s))
    if json_out:
        typer.echo(json.dumps(as_json(advice), indent=2))
        return
    if not advice:
        console.print("no feature set or model has been read yet: nothing to advise on")
        return
    out.print(table(advice))
    slots = slots_table(advice)
    if slots is not None:
        out.print(slots)
    for a in advice:
        out.print(f"[bold]{a.figures.name}[/]: [{_STYLE[a.verdict]}]{a.verdict}[/] - {a.reason}")
        for w in a.warnings:
            out.print(f"  [yellow]warning:[/] {w}")


def register(app: typer.Typer) -> None:
    """Add ``advise`` to the ``freshline`` app."""
    app.command("advise")(advise)
