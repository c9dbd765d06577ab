"""The read path: latency and throughput from the floor (raw redis-py) up to HTTP.

Every candidate reads the same ``txn_90d`` entries (pre-filled for 1,000 users of the
run's data set, in a schema version of its own), cycling through them, at concurrency
1 and 16 (threads sharing one process, as a scoring service's request threads would):

* ``raw GET`` / ``raw MGET 100``: redis-py on the same keys, the floor; ``+ decode``
  adds :func:`freshline.pipeline.core.codec.decode_entry` of each value, the Python client's
  reference;
* ``client get`` / ``client get_many 100``: :class:`freshline.pipeline.cache.client.FeatureClient`
  (MGET with the truncate floors, decode, age);
* ``in-process hit``: the same client with a started
:class:`freshline.pipeline.cache.local.LocalTier`
  (every read a local hit);
* ``HTTP GET`` / ``HTTP batch 100``: a real ``freshline serve`` subprocess (granian,
  2 workers, in-process tier off) over keep-alive httpx connections, one client per
  thread, beside the same requests to the minimal reference app
  (:mod:`bench.reference_app`, same granian launch): ``HTTP ... (minimal)``.

The full run then loads the servers with ``wrk`` (:func:`bench.reference_app.compare`)
and reports each HTTP figure as a ratio to the minimal app's in the same run.
Candidates of one group run interleaved, round by round.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

import httpx
import orjson

from bench import common, reference_app
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.codec import decode_entry
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.dev.tools import require
from tests.helpers import REGISTRY

FEATURE_SET = "txn_90d"
ENTITIES = 1000
BATCH = 100
MINIMAL = " (minimal)"


def _cycler(items: list[Any]) -> Callable[[], Any]:
    """A thread-safe enough round-robin (itertools.count is atomic under the GIL)."""
    import itertools

    counter = itertools.count()
    n = len(items)
    return lambda: items[next(counter) % n]


def _http_candidates(
    url: str, key: str, users: list[int], suffix: str = ""
) -> dict[str, Callable[[], Any]]:
    local = threading.local()
    headers = {"Authorization": f"Bearer {key}"}

    def client() -> httpx.Client:
        c = getattr(local, url, None)
        if c is None:
            c = httpx.Client(base_url=url, headers=headers, timeout=10)
            setattr(local, url, c)
        return c

    next_user = _cycler(users)
    batches = [users[i : i + BATCH] for i in range(0, len(users), BATCH)]
    next_batch = _cycler(
        [
            orjson.dumps({"feature_sets": [FEATURE_SET], "entities": [str(u) for u in b]})
            for b in batches
        ]
    )

    def get() -> None:
        r = client().get(f"/v1/features/{FEATURE_SET}/{next_user()}", params={"mode": "cache-only"})
        if r.status_code != 200:
            raise RuntimeError(f"HTTP GET answered {r.status_code}: {r.text[:200]}")

    def batch() -> None:
        r = client().post(
            "/v1/features/batch",
            params={"mode": "cache-only"},
            content=next_batch(),
            headers={"Content-Type": "application/json"},
        )
        if r.status_code != 200:
            raise RuntimeError(f"HTTP batch answered {r.status_code}: {r.text[:200]}")

    return {f"HTTP GET{suffix}": get, f"HTTP batch 100{suffix}": batch}


def run(quick: bool) -> dict[str, Any]:
    require("wrk")  # before minutes of measuring, not after
    ctx = common.context(quick)
    version, tenant, api_key, users = reference_app.prepared(ctx)
    store = EntryStore(ctx.redis, version, registry=REGISTRY)
    keys = [store.key(EntityRef(FEATURE_SET, tenant, str(u))) for u in users]
    payload_bytes = sum(len(ctx.redis.get(k) or b"") for k in keys[:100]) / 100
    fields = REGISTRY[FEATURE_SET].field_names

    r = ctx.new_redis()
    client = FeatureClient(r, version, registry=REGISTRY)
    tier = LocalTier(ctx.new_redis(), max_entries=10 * ENTITIES, registry=REGISTRY).start()
    if not tier.wait_live(10):
        raise RuntimeError("the local tier's invalidation subscription did not come up")
    local_client = FeatureClient(r, version, local=tier, registry=REGISTRY)
    items = [(FEATURE_SET, tenant, str(u)) for u in users]
    batches = [items[i : i + BATCH] for i in range(0, len(items), BATCH)]
    key_batches = [keys[i : i + BATCH] for i in range(0, len(keys), BATCH)]
    next_key, next_item = _cycler(keys), _cycler(items)
    next_keys, next_items = _cycler(key_batches), _cycler(batches)
    next_key_d, next_keys_d = _cycler(keys), _cycler(key_batches)
    next_local = _cycler(items)
    for it in items:  # fill the tier
        local_client.get(*it)

    def missed(item: tuple[str, str, str]) -> RuntimeError:
        key = store.key(EntityRef(*item))
        return RuntimeError(f"unexpected miss: {key} (PTTL {ctx.redis.pttl(key)} ms)")

    def client_get() -> None:
        item = next_item()
        if client.get(*item) is None:
            raise missed(item)

    def local_get() -> None:
        item = next_local()
        if local_client.get(*item) is None:
            raise missed(item)

    # Every key is present and the client does not decode responses: bytes, as cast.
    def raw_get_decode() -> Any:
        return decode_entry(cast(bytes, r.get(next_key_d())), fields, version)

    def raw_mget_decode() -> Any:
        raws = cast(list[bytes], r.mget(next_keys_d()))
        return [decode_entry(raw, fields, version) for raw in raws]

    single: dict[str, Callable[[], Any]] = {
        "raw GET": lambda: r.get(next_key()),
        "raw GET + decode": raw_get_decode,
        "client get": client_get,
        "in-process hit": local_get,
    }
    many: dict[str, Callable[[], Any]] = {
        "raw MGET 100": lambda: r.mget(next_keys()),
        "raw MGET 100 + decode": raw_mget_decode,
        "client get_many 100": lambda: client.get_many(next_items()),
    }
    rounds, calls = (1, 50) if quick else (5, 2000)
    results: dict[str, Any] = {}
    wrk: dict[str, Any] = {}
    try:
        # One start of the servers for the Python candidates and wrk alike.
        w_rounds, w_seconds = (1, 1) if quick else (3, 5)
        with reference_app.servers(ctx, version, tenant, api_key, users) as urls:
            for http in (
                _http_candidates(urls["freshline"], api_key, users),
                _http_candidates(urls["minimal"], api_key, users, MINIMAL),
            ):
                get_name, batch_name = list(http)
                single[get_name] = http[get_name]
                many[batch_name] = http[batch_name]
            for concurrency in (1, 16):
                common.note(f"Python candidates at concurrency {concurrency}")
                c_calls = calls if concurrency == 1 else calls * 2
                one = common.measure(single, rounds=rounds, calls=c_calls, concurrency=concurrency)
                hundred = common.measure(
                    many,
                    rounds=rounds,
                    calls=max(50, c_calls // 5),
                    concurrency=concurrency,
                    items=dict.fromkeys(many, BATCH),
                )
                results[f"c{concurrency}"] = {**one, **hundred}
            common.note("wrk against the minimal app and freshline (tier off, tier warm)")
            wrk = reference_app.compare(
                urls,
                api_key,
                users,
                rounds=w_rounds,
                seconds=w_seconds,
                levels=reference_app.levels(quick),
            )
        wrk["parameters"] = {
            "rounds": w_rounds,
            "seconds": w_seconds,
            "server_workers": reference_app.server_workers(quick),
        }
    finally:
        tier.close()
    tier_stats = {
        "hits": tier.stats.hits,
        "misses": tier.stats.misses,
        "invalidations_seen": tier.stats.invalidations,
    }
    ratios = {f"c{c}": _ratios(results[f"c{c}"]) for c in (1, 16)}
    c1 = results["c1"]
    targets = [
        common.target(
            "client get p50 - raw GET + decode p50 (c=1)",
            round(c1["client get"]["p50_us"] - c1["raw GET + decode"]["p50_us"], 1),
            "<=",
            25,
            "µs",
        ),
        common.target(
            "client get_many(100) / raw MGET 100 + decode, p50 (c=1)",
            ratios["c1"]["client_get_many_vs_raw_mget_decode_p50"],
            "<=",
            1.2,
            "x",
        ),
        common.target("in-process hit p50 (c=1)", c1["in-process hit"]["p50_us"], "<", 20, "µs"),
    ]
    if wrk:
        targets += reference_app.targets(wrk["ratios"], wrk["figures"])
    for conc in ("c1", "c16"):
        common.note(f"{conc}: " + ", ".join(f"{k} {v}x" for k, v in ratios[conc].items()))
    if wrk:
        reference_app.print_ratios(wrk)
    plots = _plot(results)
    return {
        "parameters": {
            "feature_set": FEATURE_SET,
            "entities": len(users),
            "batch": BATCH,
            "rounds": rounds,
            "calls_per_round_c1": calls,
            "server_workers": reference_app.server_workers(quick),
            "payload_bytes_mean": payload_bytes,
            "http_mode": "cache-only",
        },
        "results": results,
        "ratios": ratios,
        "wrk": wrk,
        "local_tier": tier_stats,
        "plots": plots,
        "targets": targets,
    }


def _ratios(res: dict[str, Any]) -> dict[str, float | None]:
    """p50 ratios: the client to raw redis-py, HTTP to the minimal app."""

    def p50(a: str, b: str) -> float | None:
        return common.ratio(res[a]["p50_us"], res[b]["p50_us"])

    return {
        "client_get_vs_raw_get_decode_p50": p50("client get", "raw GET + decode"),
        "client_get_many_vs_raw_mget_decode_p50": p50(
            "client get_many 100", "raw MGET 100 + decode"
        ),
        "http_get_vs_minimal_p50": p50("HTTP GET", f"HTTP GET{MINIMAL}"),
        "http_batch_vs_minimal_p50": p50("HTTP batch 100", f"HTTP batch 100{MINIMAL}"),
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
        f"granian, {p['server_workers']} workers, in-process tier off, `mode=cache-only` "
        "(every read a hit), and the minimal reference app (Starlette + redis.asyncio, "
        "same granian launch), with keep-alive httpx clients in the same process as the "
        "other candidates, so their latency includes the Python client's own cost.",
        "",
    ]
    for conc in ("c1", "c16"):
        rows = [
            (name, r["p50_us"], r["p90_us"], r["p99_us"], r["ops_per_s"], r["items_per_s"])
            for name, r in res["results"][conc].items()
        ]
        lines += [
            f"Concurrency {conc[1:]}:",
            "",
            common.table(
                ["candidate", "p50 µs", "p90 µs", "p99 µs", "calls/s", "entities/s"], rows
            ),
            "",
        ]
        rr = res["ratios"][conc]
        lines += [
            f"Ratios at c={conc[1:]} (p50): client get / raw GET + decode "
            f"**{rr['client_get_vs_raw_get_decode_p50']}x**; client get_many(100) / "
            f"raw MGET(100) + decode **{rr['client_get_many_vs_raw_mget_decode_p50']}x**;"
            f" HTTP GET / minimal app {rr['http_get_vs_minimal_p50']}x; HTTP batch / "
            f"minimal app {rr['http_batch_vs_minimal_p50']}x.",
            "",
        ]
    if res["wrk"]:
        lines += [
            "The servers measured with `wrk` (a C load generator; no Python client cost):",
            "",
        ]
        lines += reference_app.section(res["wrk"])
    for plot in res.get("plots", []):
        lines += [f"![read path latency]({plot})", ""]
    lines += [common.targets_table(res["targets"])]
    return "\n".join(lines)
