"""Scaling on the cluster topology: store reads and writes with 1 and with 3 Redis
masters, from 1, 2 and 3 processes, as throughput ratios.

Needs ``scripts/stack up --topology cluster`` (its settings in .stack/cluster/env);
without it the benchmark says so and measures nothing. The reference, measured in
the same run: a private single Redis (no cluster, same configuration) that this
benchmark starts on a free port and stops. Each process loops, for a fixed time:

* ``write``: :meth:`EntryStore.write` of a 500-entity ``txn_90d`` batch, each batch a
  newer watermark (every entry is replaced): what a consumer does after its recompute,
  without Kafka and Postgres, so the figure is Redis's and the client's share;
* ``read``: :meth:`EntryStore.read` of 500 entities (``get_many``'s Redis part: one
  MGET on one node, one per slot pipelined per node on the cluster).

Figures are entries per second, the median over rounds. This machine has 2 cores,
shared by the Redis nodes, the client processes and the rest of the stack: past two
busy processes the figures measure the cores, not Redis Cluster.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from freshline.pipeline.dev import processes

ROOT = Path(__file__).resolve().parents[1]
ENV = Path(os.environ.get("FRESHLINE_STACK_DIR", ROOT / ".stack")) / "cluster" / "env"
BATCH = 500
PROCESSES = (1, 2, 3)


def _cluster_login() -> tuple[str, str, str] | None:
    """The cluster's Redis URL and the writers' login (a consumer's: it writes entries
    and may read them), or None when the topology is not up."""
    if not ENV.exists():
        return None
    env = {}
    for line in ENV.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = shlex.split(value)[0] if value else ""
    url = env.get("FRESHLINE_REDIS_URL")
    if not url:
        return None
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.socket() as sock:
        sock.settimeout(0.5)
        if sock.connect_ex((host, int(port))) != 0:
            return None
    return (
        url,
        env.get("FRESHLINE_STACK_REDIS_WRITER_USER", ""),
        env.get("FRESHLINE_STACK_REDIS_WRITER_PASSWORD", ""),
    )


def _worker(
    url: str,
    login: tuple[str, str],
    cluster: bool,
    kind: str,
    version: int,
    offset: int,
    seconds: float,
    start_at: float,
    out: Any,
) -> None:
    from pydantic import SecretStr

    from freshline.pipeline.cache.recompute import Batch
    from freshline.pipeline.cache.store import EntryStore
    from freshline.pipeline.core.services import redis_client
    from freshline.pipeline.core.settings import Settings
    from freshline.pipeline.core.types import EntityRef
    from tests.helpers import REGISTRY

    fs = REGISTRY["txn_90d"]
    user, password = login
    client = redis_client(
        Settings(
            redis_url=url,
            redis_cluster=cluster,
            redis_username=user,
            redis_password=SecretStr(password),
        )
    )
    store = EntryStore(client, version, registry=REGISTRY)
    values = {
        "txn_count": 3,
        "txn_sum": 30.0,
        "txn_mean": 10.0,
        "txn_max": 12.0,
        "txn_std": 1.5,
        "distinct_merchants": 2,
        "distinct_devices": 1,
        "last_txn_at": 1_700_000_000_000,
    }
    ids = [str(offset + i) for i in range(BATCH)]
    rows = {("bench", e): values for e in ids}
    refs = [EntityRef(fs.name, "bench", e) for e in ids]
    watermark = 1
    store.write(Batch(fs, rows, watermark, 0))
    while time.time() < start_at:
        time.sleep(0.001)  # a common start line for every process, not synchronisation
    done = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if kind == "write":
            watermark += 1
            store.write(Batch(fs, rows, watermark, 0))
        else:
            store.read(refs)
        done += BATCH
    out.put(done / seconds)


def _throughput(
    url: str, login: tuple[str, str], cluster: bool, kind: str, procs: int, seconds: float
) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    version = 700_000 + os.getpid() % 1000
    start_at = time.time() + 3.0  # after every process has imported and connected
    workers = [
        ctx.Process(
            target=_worker,
            args=(url, login, cluster, kind, version, i * BATCH, seconds, start_at, out),
        )
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    total = sum(out.get(timeout=120) for _ in workers)
    for w in workers:
        w.join(30)
    return float(total)


def _listens(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _private_redis() -> tuple[subprocess.Popen[bytes], str, str]:
    port = processes.free_port()
    tmp = tempfile.mkdtemp(prefix="freshline-bench-redis-")
    proc = subprocess.Popen(
        [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            tmp,
            "--maxmemory-policy",
            "noeviction",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    processes.wait_until(lambda: _listens(port), timeout=10, interval=0.05)
    return proc, f"redis://127.0.0.1:{port}/0", tmp


def run(quick: bool) -> dict[str, Any]:
    found = _cluster_login()
    if found is None:
        common.note("cluster_scaling: the cluster topology is not up; nothing measured")
        return {"skipped": "scripts/stack up --topology cluster is not running"}
    url, user, password = found
    rounds, seconds = (1, 0.5) if quick else (3, 2.0)
    proc, single, tmp = _private_redis()
    figures: dict[str, dict[str, list[float]]] = {}
    try:
        for r in range(rounds):
            for kind in ("write", "read"):
                for procs in PROCESSES:
                    for masters, target, login, cluster in (
                        (1, single, ("", ""), False),
                        (3, url, (user, password), True),
                    ):
                        name = f"{kind}/{masters}m/{procs}p"
                        common.note(f"cluster_scaling round {r + 1}/{rounds}: {name}")
                        figures.setdefault(kind, {}).setdefault(f"{masters}m/{procs}p", []).append(
                            _throughput(target, login, cluster, kind, procs, seconds)
                        )
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    medians = {
        kind: {k: statistics.median(v) for k, v in cells.items()} for kind, cells in figures.items()
    }
    ratios = {
        kind: {k: common.ratio(v, cells["1m/1p"]) for k, v in cells.items()}
        for kind, cells in medians.items()
    }
    return {
        "cpus": os.cpu_count(),
        "rounds": rounds,
        "seconds": seconds,
        "batch": BATCH,
        "entries_per_s": medians,
        "ratio_to_1_master_1_process": ratios,
    }


def markdown(results: dict[str, Any]) -> str:
    head = "## Cluster scaling (1 vs 3 Redis masters, 1-3 processes)\n\n"
    if "skipped" in results:
        return head + f"Not measured: {results['skipped']}.\n"
    rows = []
    for kind in ("write", "read"):
        for procs in PROCESSES:
            one = f"1m/{procs}p"
            three = f"3m/{procs}p"
            rows.append(
                [
                    kind,
                    procs,
                    results["entries_per_s"][kind][one],
                    results["entries_per_s"][kind][three],
                    results["ratio_to_1_master_1_process"][kind][one],
                    results["ratio_to_1_master_1_process"][kind][three],
                ]
            )
    return head + (
        f"Entries per second, median of {results['rounds']} rounds of "
        f"{results['seconds']} s, batches of {results['batch']}; ratios against one "
        "master and one process, measured in the same run. **This machine has "
        f"{results['cpus']} cores**, shared by every Redis node, every client process "
        "and the rest of the stack: the ratios show what 2 cores allow, not what "
        "three masters on three machines would.\n\n"
        + common.table(
            ["op", "processes", "1 master /s", "3 masters /s", "1 master x", "3 masters x"], rows
        )
        + "\n"
    )
