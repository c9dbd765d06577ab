"""``/healthz`` with 2,000 idle connections open: a server that silent clients cannot starve.

``freshline serve`` (granian, one worker, its default limits) runs on loopback. Each
round measures ``/healthz`` over one keep-alive connection twice, in alternating
order: with no other connection open (the reference) and with ``IDLE`` TCP
connections open that never send a byte. Figures are latencies (µs) over all rounds;
the ratio is the median of the rounds' p99 ratios. Bounded: loopback only, ``IDLE``
connections at most, a few seconds per round, each request with a 5 s timeout (a
timed-out request is counted, never waited on for ever).

The test suite checks the behaviour (``/healthz`` answers with more idle connections
open than granian's default limit of 1,024 per worker); this file measures it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench import common
from freshline.pipeline.dev import processes

IDLE = 2000
FRESHLINE = str(Path(sys.executable).with_name("freshline"))


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed <= hard or (hard == resource.RLIM_INFINITY and soft < needed):
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    elif soft < needed:
        raise RuntimeError(
            f"{IDLE} idle connections need {needed} file descriptors; the hard limit is {hard}"
        )


@contextlib.contextmanager
def _serve(settings: Any) -> Iterator[int]:
    port = processes.free_port()
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [FRESHLINE, "serve", "--port", str(port), "--workers", "1"]
    with processes.serving(argv, port, env=env):
        yield port


def _sample(port: int, calls: int) -> tuple[list[int], int]:
    """``calls`` sequential /healthz requests on one connection: (latencies ns, timeouts)."""
    samples: list[int] = []
    timeouts = 0
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        client.get("/healthz")  # open the connection outside the figures
        for _ in range(calls):
            started = common.now_ns()
            try:
                client.get("/healthz")
            except httpx.TimeoutException:
                timeouts += 1
                continue
            samples.append(common.now_ns() - started)
    return samples, timeouts


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    rounds, calls = (1, 50) if quick else (8, 500)
    _raise_fd_limit(2 * IDLE + 256)
    series: dict[str, list[int]] = {"no idle connections": [], f"{IDLE} idle": []}
    timeouts = {name: 0 for name in series}
    round_ratios: list[float] = []
    with _serve(ctx.settings) as port:
        for r in range(rounds):
            order = list(series) if r % 2 == 0 else list(reversed(series))
            p99: dict[str, float] = {}
            for name in order:
                idle: list[socket.socket] = []
                try:
                    if name != "no idle connections":
                        idle = [
                            socket.create_connection(("127.0.0.1", port), timeout=5)
                            for _ in range(IDLE)
                        ]
                    samples, missed = _sample(port, calls)
                finally:
                    for s in idle:
                        s.close()
                series[name].extend(samples)
                timeouts[name] += missed
                p99[name] = common.stats_ns(samples).get("p99_us", 0.0)
            ref = p99["no idle connections"]
            if ref:
                round_ratios.append(p99[f"{IDLE} idle"] / ref)
    results = {
        name: {**common.stats_ns(samples), "timeouts": timeouts[name]}
        for name, samples in series.items()
    }
    busy = results[f"{IDLE} idle"]
    return {
        "parameters": {
            "idle": IDLE,
            "rounds": rounds,
            "calls_per_round": calls,
            "workers": 1,
            "server": "granian (freshline serve defaults)",
        },
        "results": results,
        "p99_ratio_median": round(statistics.median(round_ratios), 3) if round_ratios else None,
        "targets": [
            common.target(
                f"/healthz p99 with {IDLE} idle connections open",
                (busy.get("p99_us", 0) / 1000) if busy.get("n") else None,
                "<",
                50,
                "ms",
            )
        ],
    }


def markdown(res: dict[str, Any]) -> str:
    p = res["parameters"]
    rows = [
        (
            name,
            r.get("n", 0),
            r.get("timeouts", 0),
            r.get("p50_us"),
            r.get("p90_us"),
            r.get("p99_us"),
            r.get("max_us"),
        )
        for name, r in res["results"].items()
    ]
    return "\n".join(
        [
            f"## idle_connections: /healthz with {p['idle']} idle connections open",
            "",
            f"`freshline serve` ({p['server']}, {p['workers']} worker) on loopback; each of "
            f"{p['rounds']} rounds makes {p['calls_per_round']} sequential /healthz requests "
            "with no other connection open and with the idle ones open (order alternating). "
            "Times in µs; a request has a 5 s timeout.",
            "",
            common.table(["case", "requests", "timeouts", "p50", "p90", "p99", "max"], rows),
            "",
            f"p99 with idle connections / without (median of rounds): "
            f"{common.fmt(res['p99_ratio_median'], 3)}x.",
            "",
            common.targets_table(res["targets"]),
        ]
    )
