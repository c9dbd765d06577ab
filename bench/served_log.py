"""The read path with the served log at 0%, 1%, 10% and 100% of requests, against off.

Five ``freshline serve`` processes (granian, the read-path benchmark's workers, tier
off) on the same ``txn_90d`` entries (:func:`bench.reference_app.prepared`): one
without the log (``FRESHLINE_SERVED_LOG_BUFFER=0``, "off"), and four with
``FRESHLINE_SERVED_LOG_SAMPLE`` 0, 0.01, 0.1 and 1, logging to a topic of the run's own
(``<the run's prefix>freshline.served``, made here and deleted after; the servers
log in to Kafka as the benchmark does). ``wrk`` loads each with
HTTP GET and batch-100 (cache-only) at 16 connections, all interleaved round by
round; the ratios are the medians of each round's p50 and p99 against off.

Targets (issue 58): at 1%, p50 <= 1.10x and p99 <= 1.2x; at 100%, p50 <= 1.3x. Nothing
consumes the topic while it runs: the producer's work is what is measured.
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Any

from bench import common, reference_app
from freshline.pipeline.core.topics import SERVED
from freshline.pipeline.dev import processes

SHARES = {
    "off": {"FRESHLINE_SERVED_LOG_BUFFER": "0"},
    "0%": {"FRESHLINE_SERVED_LOG_SAMPLE": "0"},
    "1%": {"FRESHLINE_SERVED_LOG_SAMPLE": "0.01"},
    "10%": {"FRESHLINE_SERVED_LOG_SAMPLE": "0.1"},
    "100%": {"FRESHLINE_SERVED_LOG_SAMPLE": "1"},
}
"""Each server's settings: off has no log at all; 0% has one and samples nothing."""
QUICK_SHARES = ("off", "1%", "100%")
"""A smoke run's servers: those the targets read (0% and 10% run the same code as 1%)."""
CONCURRENCY = 16


def run(quick: bool) -> dict[str, Any]:
    from freshline.consumers.kafka import admin_client
    from freshline.consumers.topics import ensure

    ctx = common.context(quick)
    version, _tenant, api_key, users = reference_app.prepared(ctx)
    prefix = ctx.settings.topic_prefix
    topic = prefix + SERVED
    admin = admin_client(ctx.settings)
    ensure(admin, 1, topics=[topic])
    rounds, seconds = (1, 1) if quick else (5, 5)
    shares = {k: v for k, v in SHARES.items() if k in QUICK_SHARES} if quick else SHARES
    scripts = {
        "GET": reference_app.wrk_script(api_key, users, batch=False),
        "batch 100": reference_app.wrk_script(api_key, users, batch=True),
    }
    figures: dict[str, dict[str, list[dict[str, Any]]]] = {
        e: {s: [] for s in shares} for e in scripts
    }
    try:
        with contextlib.ExitStack() as stack:
            servers = [
                reference_app.serve_freshline(
                    ctx, version, env={**value, "FRESHLINE_TOPIC_PREFIX": prefix}
                )
                for value in shares.values()
            ]
            urls = dict(zip(shares, processes.enter_together(stack, servers), strict=True))
            for url in urls.values():  # a smoke run's figures are not read: a few users
                reference_app.warm(
                    url, api_key, users[:20] if quick else users, passes=1 if quick else 3
                )
            for r in range(rounds):
                k = r % len(shares)
                order = list(shares)[k:] + list(shares)[:k]
                for endpoint, script in scripts.items():
                    for share in order:
                        common.note(f"round {r + 1}: {endpoint}, logging {share}")
                        figures[endpoint][share].append(
                            reference_app.wrk(
                                urls[share], script, concurrency=CONCURRENCY, seconds=seconds
                            )
                        )
    finally:
        admin.delete_topics([topic])
    ratios = {
        endpoint: {
            share: {
                p: statistics.median(
                    common.ratio(a[f"{p}_us"], b[f"{p}_us"]) or 0.0
                    for a, b in zip(runs[share], runs["off"], strict=True)
                )
                for p in ("p50", "p99")
            }
            for share in shares
            if share != "off"
        }
        for endpoint, runs in figures.items()
    }
    medians = {
        endpoint: {
            share: {
                k: statistics.median(run[k] for run in runs)
                for k in ("p50_us", "p99_us", "ops_per_s", "errors")
            }
            for share, runs in by_share.items()
        }
        for endpoint, by_share in figures.items()
    }
    targets = []
    for endpoint in scripts:
        targets += [
            common.target(
                f"{endpoint} p50, 1% / off", ratios[endpoint]["1%"]["p50"], "<=", 1.10, "x"
            ),
            common.target(
                f"{endpoint} p99, 1% / off", ratios[endpoint]["1%"]["p99"], "<=", 1.2, "x"
            ),
            common.target(
                f"{endpoint} p50, 100% / off", ratios[endpoint]["100%"]["p50"], "<=", 1.3, "x"
            ),
        ]
    return {
        "parameters": {
            "rounds": rounds,
            "seconds": seconds,
            "concurrency": CONCURRENCY,
            "shares": list(shares),
            "server_workers": reference_app.server_workers(quick),
            "entities": len(users),
            "mode": "cache-only",
        },
        "results": medians,
        "ratios": ratios,
        "targets": targets,
    }


def markdown(res: dict[str, Any]) -> str:
    p = res["parameters"]
    shares = [s for s in p.get("shares", SHARES) if s != "off"]
    rows = [
        (
            endpoint,
            share,
            r["p50_us"],
            r["p99_us"],
            round(r["ops_per_s"]),
            r["errors"],
            res["ratios"][endpoint].get(share, {}).get("p50", 1.0),
            res["ratios"][endpoint].get(share, {}).get("p99", 1.0),
        )
        for endpoint, by_share in res["results"].items()
        for share, r in by_share.items()
    ]
    return "\n".join(
        [
            "## served_log: the read path with the served log at 0%, 1%, 10% and 100%",
            "",
            f"`freshline serve` ({p['server_workers']} workers, tier off, {p['mode']}) once "
            "per row's logging: without the log (`FRESHLINE_SERVED_LOG_BUFFER=0`, off), "
            f"and with `FRESHLINE_SERVED_LOG_SAMPLE` at the share ({', '.join(shares)}); `wrk` at "
            f"{p['concurrency']} connections, {p['rounds']} interleaved rounds of "
            f"{p['seconds']} s per server and endpoint, {p['entities']} entities. Medians; "
            "ratios are the median of each round's ratio to off.",
            "",
            common.table(
                (
                    "endpoint",
                    "logging",
                    "p50 µs",
                    "p99 µs",
                    "req/s",
                    "non-2xx",
                    "p50 / off",
                    "p99 / off",
                ),
                rows,
            ),
            "",
            common.targets_table(res["targets"]),
        ]
    )
