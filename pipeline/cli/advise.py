"""``freshline advise``: measure over a window, then a verdict per feature set and model.

Figures come from the API's (and any other process's) ``/metrics``, scraped twice a
window apart, or from a Prometheus server's HTTP API as increases over the window.
The verdicts are :func:`freshline.pipeline.observe.advisor.advise`'s.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from typing import Annotated, Any

import orjson
import typer
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.text import Text

from freshline.pipeline.cli.app import console, out
from freshline.pipeline.core.errors import ConfigError, FreshlineError
from freshline.pipeline.core.http import fetch
from freshline.pipeline.observe.advisor import (
    Advice,
    Samples,
    advise_all,
    difference,
    figures_from_samples,
    format_ms,
    parse_exposition,
)

_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}

COUNTERS = (
    "freshline_api_feature_hits_total",
    "freshline_api_feature_misses_total",
    "freshline_api_predictions_total",
    "freshline_semantic_lookups_total",
    "freshline_cache_read_seconds_sum",
    "freshline_cache_read_seconds_count",
    "freshline_cache_miss_seconds_sum",
    "freshline_cache_miss_seconds_count",
    "freshline_compute_seconds_sum",
    "freshline_compute_seconds_count",
)
GAUGES = (
    "freshline_feature_ttl_seconds",
    "freshline_staleness_oldest_age_seconds",
    "freshline_staleness_mean_age_seconds",
    "freshline_model_deterministic",
)
API_HINT = "the API is not running: start it with `freshline serve`, or pass `--from-metrics URL`"
METRICS_HINT = (
    "nothing serves metrics there: start the process (`freshline serve` for "
    "the API), or check the --from-metrics URL"
)
PROMETHEUS_HINT = "is Prometheus running there? check the --from-prometheus URL"
_STYLE = {
    "keep": "green",
    "kill": "red",
    "refuse": "magenta",
    "shorten-ttl": "yellow",
    "lengthen-ttl": "cyan",
}


def parse_window(text: str) -> float:
    """``5m``, ``30s``, ``1h``, ``500ms`` or plain seconds."""
    m = _DURATION.match(text.strip())
    if not m or float(m["n"]) <= 0:
        raise typer.BadParameter("a duration such as 30s, 5m or 1h", param_hint="--window")
    return float(m["n"]) * _UNITS[m["unit"]]


def _scrape_one(url: str, service: str, hint: str) -> str:
    response = fetch(url, service=service, hint=hint)
    if response.status != 200:
        raise FreshlineError(
            f"{url} answered HTTP {response.status}, not metrics: is it a /metrics URL?"
        )
    return response.text()


def scrape(urls: list[str], *, api: bool = True) -> Samples:
    """Every URL's metrics, merged (:func:`parse_exposition`).

    One that does not answer is :class:`ServiceUnavailable` with the remedy: start the
    API (``api``: the URL is the local API's) or check the ``--from-metrics`` URL.
    """
    service, hint = ("the API", API_HINT) if api else ("the metrics endpoint", METRICS_HINT)
    return parse_exposition([_scrape_one(u, service, hint) for u in urls])


def measure_scrapes(
    urls: list[str], window_s: float, *, api: bool = True
) -> tuple[Samples, Samples]:
    """Two scrapes ``window_s`` apart: ``(increase, latest)``."""
    before = scrape(urls, api=api)
    console.print(f"measuring {', '.join(urls)} for {window_s:g}s ...")
    threading.Event().wait(window_s)  # the measurement window itself
    after = scrape(urls, api=api)
    return difference(after, before), after


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    response = fetch(url, service="Prometheus", hint=PROMETHEUS_HINT)
    try:
        body = response.json()
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else f"HTTP {response.status}"
        raise FreshlineError(f"Prometheus at {base} refused {expr!r}: {error}")
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


def _line(text: str | Text, indent: int = 2) -> Padding:
    """One ``key: value`` line of a block, wrapped under its indent at the console width."""
    return Padding(text if isinstance(text, Text) else Text(text), (0, 0, 0, indent), expand=False)


def block(a: Advice) -> Group:
    """One cache's verdict, its reason, and the figures behind it, as short lines."""
    f = a.figures
    verdict = a.verdict + (f" to {a.suggested_ttl_s:,.0f}s" if a.suggested_ttl_s else "")
    lines: list[RenderableType] = [
        _line(
            Text.assemble(
                (f.name, "bold"), f" ({f.kind.replace('_', ' ')}): ", (verdict, _STYLE[a.verdict])
            ),
            indent=0,
        ),
        _line(a.reason),
        _line(f"traffic: {f.qps:,.1f} requests/s, hit rate {f.hit_rate:.1%}"),
        _line(
            f"cost: lookup {format_ms(f.lookup_s)}, compute {format_ms(f.compute_s)}, "
            f"miss overhead {format_ms(f.miss_overhead_s)}"
        ),
    ]
    ratio = f", read/compute {f.lookup_s / f.compute_s:.2g}" if f.compute_s > 0 else ""
    lines.append(
        _line(
            f"expected latency: {format_ms(a.cached_s)} cached, "
            f"{format_ms(a.uncached_s)} uncached{ratio}"
        )
    )
    if f.ttl_s:
        oldest = "-" if f.oldest_age_s is None else f"{f.oldest_age_s:,.0f}s"
        mean = "-" if f.mean_age_s is None else f"{f.mean_age_s:,.0f}s"
        lines.append(_line(f"staleness: oldest {oldest}, mean {mean}, of a {f.ttl_s:,.0f}s TTL"))
    if a.slots_cached is not None and a.slots_uncached is not None:
        lines.append(
            _line(
                f"serving slots: {a.slots_uncached:,.2f} uncached, "
                f"{a.slots_cached:,.2f} cached, "
                f"{a.slots_uncached - a.slots_cached:,.2f} saved"
            )
        )
    lines += [_line(Text.assemble(("warning: ", "yellow"), w)) for w in a.warnings]
    return Group(*lines)


def report(advice: list[Advice]) -> Group:
    """Every block, under a legend for the figures; reads at 80 columns and in a pipe."""
    legend = Text(
        "Per feature set, model and semantic cache, over the window. Expected latency: "
        "cached = lookup + (1 - hit rate) x (compute + miss overhead), uncached = "
        "compute. Serving slots "
        "(models, Little's law): requests/s x (1 - hit rate) x compute.",
        style="dim",
    )
    parts: list[RenderableType] = [legend]
    for a in advice:
        parts += ["", block(a)]
    return Group(*parts)


def as_json(advice: list[Advice]) -> list[dict[str, Any]]:
    return [
        {
            "name": a.figures.name,
            "kind": a.figures.kind,
            "verdict": a.verdict,
            "reason": a.reason,
            "suggested_ttl_s": a.suggested_ttl_s,
            "qps": a.figures.qps,
            "hit_rate": a.figures.hit_rate,
            "lookup_s": a.figures.lookup_s,
            "compute_s": a.figures.compute_s,
            "miss_overhead_s": a.figures.miss_overhead_s,
            "cached_s": a.cached_s,
            "uncached_s": a.uncached_s,
            "ttl_s": a.figures.ttl_s,
            "oldest_age_s": a.figures.oldest_age_s,
            "mean_age_s": a.figures.mean_age_s,
            "slots_cached": a.slots_cached,
            "slots_uncached": a.slots_uncached,
            "warnings": list(a.warnings),
        }
        for a in advice
    ]


def advise(
    window: Annotated[str, typer.Option(help="Measurement window: 30s, 5m, 1h")] = "5m",
    from_metrics: Annotated[
        list[str] | None,
        typer.Option(
            "--from-metrics",
            help="A /metrics URL to scrape twice, a window apart (repeatable) "
            "\\[default: the local API's ops port, FRESHLINE_OPS_PORT]",
        ),
    ] = None,
    from_prometheus: Annotated[
        str | None,
        typer.Option("--from-prometheus", help="A Prometheus base URL: increases over the window"),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON, not tables")] = False,
) -> None:
    """Keep, kill, re-TTL or refuse each cache, from figures measured over a window.

    With a cache: E = lookup + (1-h)(compute + miss overhead); without: E = compute.
    Kept only if cheaper, at 5 requests/s or more and a hit rate of 30% or more; a
    non-deterministic computation is refused. See pipeline/observe/advisor.py.
    """
    from freshline.pipeline.core.settings import load_settings

    window_s = parse_window(window)
    if from_metrics and from_prometheus:
        raise ConfigError("choose --from-metrics or --from-prometheus, not both")
    if from_prometheus:
        delta, latest = measure_prometheus(from_prometheus, window_s)
    else:
        settings = load_settings()
        urls = from_metrics or [f"http://{settings.ops_host}:{settings.ops_port}/metrics"]
        delta, latest = measure_scrapes(urls, window_s, api=not from_metrics)
    advice = advise_all(figures_from_samples(delta, latest, window_s))
    if json_out:
        typer.echo(json.dumps(as_json(advice), indent=2))
        return
    if not advice:
        console.print(
            "no feature set, model or semantic cache has been read yet: nothing to advise on"
        )
        return
    out.print(report(advice))


def register(app: typer.Typer) -> None:
    """Add ``advise`` to the ``freshline`` app."""
    app.command("advise")(advise)
