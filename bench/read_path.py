"""The read path: latency and throughput from the floor (raw redis-py) up to HTTP.

Every candidate reads the same ``txn_90d`` entries (pre-filled for 1,000 users of the
run's data set, in a schema version of its own), cycling through them, at concurrency
1 and 16 (threads sharing one process, as a scoring service's request threads would):

* ``raw GET`` / ``raw MGET 100``: redis-py on the same keys, the floor;
* ``client get`` / ``client get_many 100``: :class:`pipeline.cache.client.FeatureClient`
  (MGET, decode, age);
* ``in-process hit``: the same client with a started :class:`pipeline.cache.local.LocalTier`
  (every read a local hit);
* ``HTTP GET`` / ``HTTP batch 100``: a real ``freshline serve`` subprocess (granian,
  2 workers) over keep-alive connections with httpx, one client per thread. The
  latency includes the Python client's own cost; with ``wrk`` installed (``apt-get
  install wrk``) the full run also measures the server with a C load generator.

Candidates of one group run interleaved, round by round.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import common
from pipeline.api.auth import create_api_key
from pipeline.cache.client import FeatureClient
from pipeline.cache.local import LocalTier
from pipeline.cache.recompute import compute
from pipeline.cache.store import FeatureStore
from pipeline.core.features import REGISTRY
from pipeline.core.types import EntityRef

FEATURE_SET = "txn_90d"
ENTITIES = 1000
BATCH = 100
SERVER_WORKERS = 2
FRESHLINE = str(Path(sys.executable).with_name("freshline"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(ctx: common.Context, version: int) -> Iterator[str]:
    """``freshline serve`` on a free port, in a process group of its own; yields its URL."""
    port = _free_port()
    env = {**os.environ, "FRESHLINE_POSTGRES_URL": ctx.settings.postgres_url,
           "FRESHLINE_REDIS_URL": ctx.settings.redis_url,
           "FRESHLINE_SCHEMA_VERSION": str(version)}
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen([FRESHLINE, "serve", "--port", str(port), "--workers",
                             str(SERVER_WORKERS)], env=env, stdout=log, stderr=log,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"freshline serve did not start: {log.read()[-2000:]!r}")
            time.sleep(0.1)  # polling for readiness
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        log.close()


def _cycler(items: list[Any]) -> Callable[[], Any]:
    """A thread-safe enough round-robin (itertools.count is atomic under the GIL)."""
    import itertools

    counter = itertools.count()
    n = len(items)
    return lambda: items[next(counter) % n]


def _http_candidates(url: str, key: str, users: list[int]) -> dict[str, Callable[[], Any]]:
    local = threading.local()
    headers = {"Authorization": f"Bearer {key}"}

    def client() -> httpx.Client:
        c = getattr(local, "client", None)
        if c is None:
            c = local.client = httpx.Client(base_url=url, headers=headers, timeout=10)
        return c

    next_user = _cycler(users)
    batches = [users[i:i + BATCH] for i in range(0, len(users), BATCH)]
    next_batch = _cycler([orjson.dumps({"feature_sets": [FEATURE_SET],
                                        "entities": [str(u) for u in b]}) for b in batches])

    def get() -> None:
        r = client().get(f"/v1/features/{FEATURE_SET}/{next_user()}", params={"mode": "cache-only"})
        if r.status_code != 200:
            raise RuntimeError(f"HTTP GET answered {r.status_code}: {r.text[:200]}")

    def batch() -> None:
        r = client().post("/v1/features/batch", params={"mode": "cache-only"},
                          content=next_batch(), headers={"Content-Type": "application/json"})
        if r.status_code != 200:
            raise RuntimeError(f"HTTP batch answered {r.status_code}: {r.text[:200]}")

    return {"HTTP GET": get, "HTTP batch 100": batch}


_WRK_LATENCY = re.compile(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_WRK_RATE = re.compile(r"Requests/sec:\s+([\d.]+)")


def _wrk(url: str, key: str, users: list[int], *, batch: bool, concurrency: int,
         seconds: int) -> dict[str, Any] | None:
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    if batch:
        bodies = [orjson.dumps({"feature_sets": [FEATURE_SET],
                                "entities": [str(u) for u in users[i:i + BATCH]]}).decode()
                  for i in range(0, len(users), BATCH)]
        items = ", ".join(f"'{b}'" for b in bodies)
        script = (f"local bodies = {{{items}}}\nlocal i = 0\n"
                  "request = function()\n  i = i % #bodies + 1\n"
                  "  return wrk.format('POST', '/v1/features/batch?mode=cache-only', "
                  f"{{['Authorization'] = 'Bearer {key}', ['Content-Type'] = 'application/json'}}, "
                  "bodies[i])\nend\n")
    else:
        ids = ", ".join(str(u) for u in users)
        script = (f"local ids = {{{ids}}}\nlocal i = 0\n"
                  "request = function()\n  i = i % #ids + 1\n"
                  f"  return wrk.format('GET', '/v1/features/{FEATURE_SET}/' .. ids[i] .. "
                  f"'?mode=cache-only', {{['Authorization'] = 'Bearer {key}'}})\nend\n")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        threads = 1 if concurrency == 1 else 2
        out = subprocess.run([wrk, f"-t{threads}", f"-c{concurrency}", f"-d{seconds}s",
                              "--latency", "-s", f.name, url], capture_output=True, text=True,
                             timeout=seconds + 30, check=False).stdout
    finally:
        os.unlink(f.name)
    scale = {"us": 1.0, "ms": 1000.0, "s": 1e6}
    lat = {f"p{p}_us": round(float(v) * scale[u], 1) for p, v, u in _WRK_LATENCY.findall(out)}
    rate = _WRK_RATE.search(out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {**lat, "ops_per_s": float(rate.group(1)) if rate else None,
            "errors": int(non2xx.group(1)) if non2xx else 0}


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    data = ctx.dataset()
    version = ctx.schema_version()
    fs = REGISTRY[FEATURE_SET]
    users = list(range(1, min(ENTITIES, data.users) + 1))
    store = FeatureStore(ctx.redis, version)
    for chunk in common.chunks(users, 500):
        store.write(compute(ctx.engine, fs, [(data.tenant, str(u)) for u in chunk]))
    keys = [store.key(EntityRef(FEATURE_SET, data.tenant, str(u))) for u in users]
    payload_bytes = sum(len(ctx.redis.get(k) or b"") for k in keys[:100]) / 100

    r = ctx.new_redis()
    client = FeatureClient(r, version)
    tier = LocalTier(ctx.new_redis(), max_entries=10 * ENTITIES).start()
    if not tier.wait_live(10):
        raise RuntimeError("the local tier's invalidation subscription did not come up")
    local_client = FeatureClient(r, version, local=tier)
    items = [(FEATURE_SET, data.tenant, str(u)) for u in users]
    batches = [items[i:i + BATCH] for i in range(0, len(items), BATCH)]
    key_batches = [keys[i:i + BATCH] for i in range(0, len(keys), BATCH)]
    next_key, next_item = _cycler(keys), _cycler(items)
    next_keys, next_items = _cycler(key_batches), _cycler(batches)
    next_local = _cycler(items)
    for it in items:  # fill the tier
        local_client.get(*it)

    def client_get() -> None:
        if client.get(*next_item()) is None:
            raise RuntimeError("unexpected miss")

    def local_get() -> None:
        if local_client.get(*next_local()) is None:
            raise RuntimeError("unexpected miss")

    single: dict[str, Callable[[], Any]] = {
        "raw GET": lambda: r.get(next_key()),
        "client get": client_get,
        "in-process hit": local_get,
    }
    many: dict[str, Callable[[], Any]] = {
        "raw MGET 100": lambda: r.mget(next_keys()),
        "client get_many 100": lambda: client.get_many(next_items()),
    }
    api_key = create_api_key(ctx.engine, data.tenant)
    rounds, calls = (2, 200) if quick else (5, 2000)
    results: dict[str, Any] = {}
    wrk_results: dict[str, Any] = {}
    try:
        with serve(ctx, version) as url:
            http = _http_candidates(url, api_key, users)
            single["HTTP GET"] = http["HTTP GET"]
            many["HTTP batch 100"] = http["HTTP batch 100"]
            for concurrency in (1, 16):
                c_calls = calls if concurrency == 1 else calls * 2
                one = common.measure(single, rounds=rounds, calls=c_calls,
                                     concurrency=concurrency)
                hundred = common.measure(many, rounds=rounds, calls=max(50, c_calls // 5),
                                         concurrency=concurrency,
                                         items=dict.fromkeys(many, BATCH))
                results[f"c{concurrency}"] = {**one, **hundred}
            if not quick:
                for concurrency in (1, 16):
                    for name, is_batch in (("HTTP GET", False), ("HTTP batch 100", True)):
                        res = _wrk(url, api_key, users, batch=is_batch, concurrency=concurrency,
                                   seconds=5)
                        if res is not None:
                            wrk_results[f"c{concurrency}:{name}"] = res
    finally:
        tier.close()
    tier_stats = {"hits": tier.stats.hits, "misses": tier.stats.misses,
                  "invalidations_seen": tier.stats.invalidations}
    c1, c16 = results["c1"], results["c16"]
    wrk16 = wrk_results.get("c16:HTTP GET"), wrk_results.get("c16:HTTP batch 100")
    targets = [
        common.target("client get p50 / raw GET p50 (c=1)",
                      common.ratio(c1["client get"]["p50_us"], c1["raw GET"]["p50_us"]),
                      "<=", 1.5, "x"),
        common.target("in-process hit p50 (c=1)", c1["in-process hit"]["p50_us"], "<", 20, "µs"),
        common.target("HTTP GET p99 at c=16 (httpx client)", c16["HTTP GET"]["p99_us"] / 1000,
                      "<", 2, "ms"),
        common.target("HTTP batch-100 p99 at c=16 (httpx client)",
                      c16["HTTP batch 100"]["p99_us"] / 1000, "<", 6, "ms"),
    ]
    if wrk16[0] and "p99_us" in wrk16[0]:
        targets.append(common.target("HTTP GET p99 at c=16 (wrk)", wrk16[0]["p99_us"] / 1000,
                                     "<", 2, "ms"))
    if wrk16[1] and "p99_us" in wrk16[1]:
        targets.append(common.target("HTTP batch-100 p99 at c=16 (wrk)",
                                     wrk16[1]["p99_us"] / 1000, "<", 6, "ms"))
    ratios = {
        f"c{c}": {
            "client_get_vs_raw_get_p50": common.ratio(results[f"c{c}"]["client get"]["p50_us"],
                                                      results[f"c{c}"]["raw GET"]["p50_us"]),
            "client_get_many_vs_raw_mget_p50": common.ratio(
                results[f"c{c}"]["client get_many 100"]["p50_us"],
                results[f"c{c}"]["raw MGET 100"]["p50_us"]),
            "http_get_vs_raw_get_p50": common.ratio(results[f"c{c}"]["HTTP GET"]["p50_us"],
                                                    results[f"c{c}"]["raw GET"]["p50_us"]),
            "http_batch_vs_raw_mget_p50": common.ratio(
                results[f"c{c}"]["HTTP batch 100"]["p50_us"],
                results[f"c{c}"]["raw MGET 100"]["p50_us"]),
        } for c in (1, 16)
    }
    plots = _plot(results)
    return {
        "parameters": {"feature_set": FEATURE_SET, "entities": len(users), "batch": BATCH,
                       "rounds": rounds, "calls_per_round_c1": calls,
                       "server_workers": SERVER_WORKERS, "payload_bytes_mean": payload_bytes,
                       "http_mode": "cache-only", "wrk": shutil.which("wrk") is not None},
        "results": results,
        "ratios": ratios,
        "wrk": wrk_results,
        "local_tier": tier_stats,
        "plots": plots,
        "targets": targets,
    }


def _plot(results: dict[str, Any]) -> list[str]:
    plt = common.pyplot()
    if plt is None:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, conc in zip(axes, ("c1", "c16"), strict=True):
        names = list(results[conc])
        p50 = [results[conc][n]["p50_us"] for n in names]
        p99 = [results[conc][n]["p99_us"] for n in names]
        y = range(len(names))
        ax.barh([i + 0.2 for i in y], p50, height=0.4, label="p50")
        ax.barh([i - 0.2 for i in y], p99, height=0.4, label="p99")
        ax.set_yticks(list(y), names)
        ax.set_xscale("log")
        ax.set_xlabel("latency per call (µs, log scale)")
        ax.set_title(f"concurrency {conc[1:]}")
        ax.legend()
    return [common.save_plot(fig, "read_path_latency")]


def markdown(res: dict[str, Any]) -> str:
    p = res["parameters"]
    lines = [
        "## read_path: from raw redis-py to HTTP",
        "",
        f"`{p['feature_set']}` entries of {p['entities']:,} users (~{p['payload_bytes_mean']:.0f} "
        f"bytes each), {p['rounds']} interleaved rounds, {p['calls_per_round_c1']:,} calls per "
        "candidate per round at c=1 (twice that at c=16; a fifth for batches). Latency per "
        f"call in µs; ops/s is calls per second of wall time. HTTP: `freshline serve` with "
        f"granian, {p['server_workers']} workers, `mode=cache-only` (every read a hit), "
        "keep-alive httpx clients in the same process as the other candidates, so their "
        "latency includes the Python client's own cost.",
        "",
    ]
    for conc in ("c1", "c16"):
        rows = [(name, r["p50_us"], r["p90_us"], r["p99_us"], r["ops_per_s"], r["items_per_s"])
                for name, r in res["results"][conc].items()]
        lines += [f"Concurrency {conc[1:]}:", "",
                  common.table(["candidate", "p50 µs", "p90 µs", "p99 µs", "calls/s",
                                "entities/s"], rows), ""]
        rr = res["ratios"][conc]
        lines += [f"Ratios at c={conc[1:]} (p50): client get / raw GET "
                  f"**{rr['client_get_vs_raw_get_p50']}x**; client get_many(100) / raw MGET(100) "
                  f"**{rr['client_get_many_vs_raw_mget_p50']}x**; HTTP GET / raw GET "
                  f"{rr['http_get_vs_raw_get_p50']}x; HTTP batch / raw MGET "
                  f"{rr['http_batch_vs_raw_mget_p50']}x.", ""]
    if res["wrk"]:
        rows = [(name, r.get("p50_us"), r.get("p90_us"), r.get("p99_us"), r.get("ops_per_s"),
                 r.get("errors"))
                for name, r in res["wrk"].items()]
        lines += ["The server measured with `wrk` (C load generator, 5 s each; no Python "
                  "client cost):", "",
                  common.table(["concurrency:endpoint", "p50 µs", "p90 µs", "p99 µs", "req/s",
                                "non-2xx"], rows), ""]
    for plot in res.get("plots", []):
        lines += [f"![read path latency]({plot})", ""]
    lines += [_why_http(res), "", common.targets_table(res["targets"])]
    return "\n".join(lines)


def _why_http(res: dict[str, Any]) -> str:
    """What bounds the HTTP latency at concurrency 16, from this run's own figures."""
    wrk = res.get("wrk") or {}
    single = wrk.get("c16:HTTP GET") or {}
    one = wrk.get("c1:HTTP GET") or {}
    rate = single.get("ops_per_s") or res["results"]["c16"]["HTTP GET"]["ops_per_s"]
    if not rate:
        return ""
    mean_ms = 16 / rate * 1000
    text = (f"On HTTP at concurrency 16: with 16 requests always in flight, Little's law "
            f"makes the mean latency 16 / throughput; this server answered {rate:,.0f} "
            f"single GETs/s, so the mean is {mean_ms:.1f} ms and p99 under 2 ms would need "
            f"over 8,000 requests/s from {res['parameters']['server_workers']} Python "
            "workers on a machine whose CPUs the load generator (and, here, other "
            "engineers' runs) share.")
    if one.get("p50_us"):
        text += (f" Alone (concurrency 1) a cache-only GET costs {one['p50_us'] / 1000:.2f} ms "
                 f"at p50 on the server, against {res['results']['c1']['raw GET']['p50_us']:.0f}"
                 " µs for the raw Redis GET it wraps: the per-request cost of the app "
                 "(auth, thread-pool hop, version resolution, metrics, JSON) is "
                 "what a faster server would have to cut.")
    return text
