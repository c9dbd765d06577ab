"""The semantic response cache: lookup latency by size, ANN recall, embeddings, the labelled set.

* **Lookup** (embedding excluded) at each size in ``FRESHLINE_BENCH_SEMANTIC_SIZES``
  (10,000 and 100,000 prompts per tenant by default; ``--quick`` 2,000):
  :meth:`SemanticCache.lookup_vector` from a worker whose index was built from Redis,
  half the queries near a stored prompt (a hit), half far from all (a miss), against
  a plain Redis ``GET`` of one entry; every size and the reference interleaved in the
  same rounds (the sizes are loaded and indexed first, side by side), so a burst of
  load from elsewhere lands on all alike; p50 and p99 are the medians over rounds of
  each round's.
* **The build**: a worker that has never seen the namespace looks up once (that
  lookup must not wait: a miss, ``warming``), then its index builds in the
  background; the time until it is ready is reported.
  The vectors are synthetic (384-d, in clusters of 20, unit length), so the sizes
  cost no embedding time; lookups do not care where a vector came from.
* **Recall at the threshold**: for queries whose exact nearest entry (numpy, over
  every stored vector) is at or above the threshold, the share for which the index's
  candidates contain that entry, i.e. the share of true hits the ANN index finds.
* **Tenants and determinism**: every near query again from another tenant (hits must
  be 0), and stores at temperature 0.7 (entries stored must be 0).
* **Embedding throughput**: the local model, batches of 32 against one prompt a call.
* **The labelled sets**: hit rate and false-hit rate at the default threshold, on the
  shipped pairs (the prior is fitted on them) and on the holdout pairs (written apart,
  never used for calibration).
* **Static against learned** (:mod:`bench.paraphrases`), on each set: a stream made
  from the labelled set, in which each cached question recurs with fresh paraphrases among
  near misses (a warm-up, then a measured stream), played as a caller plays it (a
  miss stores the right answer) against the fixed threshold and against the learned
  decision (``max_error`` 0.02, three exploration seeds summed; with a caller that
  flags wrong hits, and with one that never does): paraphrase hit rate and the error
  rate of hits, side by side.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import numpy as np

from bench import common, paraphrases
from bench.common import _unlink_matching
from freshline.pipeline.core.keys import semantic_entry_key, semantic_pattern, semantic_registry_key
from freshline.pipeline.semantic import prior
from freshline.pipeline.semantic.cache import (
    CANDIDATES,
    Limits,
    NonDeterministicParams,
    Scope,
    SemanticCache,
)
from freshline.pipeline.semantic.decision import Learned
from freshline.pipeline.semantic.embed import MiniLM, local_model, normalise
from freshline.pipeline.semantic.entry import entry_id
from freshline.pipeline.semantic.index import FLAT_MAX, NPROBE, TRAIN_PER_LIST
from freshline.pipeline.semantic.pool import MAX_VECTORS
from freshline.pipeline.semantic.tune import HOLDOUT, PAIRS, load_pairs, similarities, sweep

DIM = 384
THRESHOLD = 0.93
SETS = {"shipped": PAIRS, "holdout": HOLDOUT}
"""The labelled sets: the one the prior is fitted on, and one written apart from it."""
MAX_ERROR = 0.02
ZERO = {"temperature": 0}
CLUSTER = 20
LOAD_CHUNK = 2000


class _Fixed:
    """An embedder that is never called: lookups and stores here take vectors."""

    name = "synthetic"
    dim = DIM

    def embed(self, texts: Any, /) -> np.ndarray:
        raise AssertionError("the lookup benchmark passes vectors")


def _vectors(rng: np.random.Generator, n: int) -> np.ndarray:
    centers = rng.normal(size=(max(1, n // CLUSTER), DIM))
    members = centers[rng.integers(0, len(centers), n)] + 0.6 * rng.normal(size=(n, DIM))
    return normalise(members)


def _near(rng: np.random.Generator, base: np.ndarray) -> np.ndarray:
    """Queries at cosine about 0.94-0.99 from ``base`` (random directions)."""
    noise = normalise(rng.normal(size=base.shape))
    angle = rng.uniform(0.14, 0.34, size=(len(base), 1))  # cos 0.99 .. 0.94
    return normalise(np.cos(angle) * base + np.sin(angle) * noise)


def _sizes(quick: bool) -> list[int]:
    raw = os.environ.get("FRESHLINE_BENCH_SEMANTIC_SIZES")
    if raw:
        return [int(x) for x in raw.split(",") if x.strip()]
    return [2_000] if quick else [10_000, 100_000]


def _interleaved(
    candidates: dict[str, Callable[[], Any]], *, rounds: int, calls: int, warmup: int
) -> dict[str, dict[str, Any]]:
    """Each candidate ``calls`` times per round, in an order rotating round by round;
    per candidate the median over rounds of each round's p50 and p99 (µs)."""
    names = list(candidates)
    per_round: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = candidates[name]
            samples = np.empty(calls, dtype=np.int64)
            for i in range(calls):
                t0 = time.perf_counter_ns()
                fn()
                samples[i] = time.perf_counter_ns() - t0
            per_round[name].append(common.stats_ns(samples))
    return {
        name: {
            "p50_us": round(float(np.median([x["p50_us"] for x in rs])), 2),
            "p99_us": round(float(np.median([x["p99_us"] for x in rs])), 2),
            "rounds": len(rs),
            "calls_per_round": calls,
            "round_p50s_us": [x["p50_us"] for x in rs],
        }
        for name, rs in per_round.items()
    }


@dataclasses.dataclass
class Prepared:
    """One size, loaded and indexed: its figures so far, a lookup to time, a key of
    its namespace for the reference GET, and its clean-up."""

    result: dict[str, Any]
    lookup: Callable[[], None]
    key: str
    close: Callable[[], None]
    learned: Callable[[], None]
    """The same lookups with the learned decision (its outcomes read, its estimates)."""


def _size(ctx: common.Context, n: int, quick: bool) -> Prepared:
    rng = np.random.default_rng(n)
    tenant = f"{ctx.tenant_prefix()}sem"
    scope = Scope(tenant, "bench-bot", f"v{ctx.tag}", "t1")
    writer = SemanticCache(ctx.redis, _Fixed(), ttl_s=3600, limits=Limits(max_entries=n))
    vectors = _vectors(rng, n)
    prompts = [f"bench prompt {i}" for i in range(n)]
    t0 = time.perf_counter()
    for start in range(0, n, LOAD_CHUNK):
        chunk = range(start, min(n, start + LOAD_CHUNK))
        writer.store_many(
            scope,
            [(prompts[i], f"response {i}") for i in chunk],
            ZERO,
            vectors[start : start + len(chunk)],
        )
    load_s = time.perf_counter() - t0

    # A worker that has never seen the namespace: its first lookup must not wait for
    # the build (a miss, "warming"), and the build runs in the background.
    worker = SemanticCache(
        ctx.new_redis(), _Fixed(), threshold=THRESHOLD, max_index_vectors=max(n, MAX_VECTORS)
    )
    t0 = time.perf_counter()
    first = worker.lookup_vector(scope, prompts[0], ZERO, vectors[0])
    first_ms = (time.perf_counter() - t0) * 1000
    idx = worker.pool.get(scope.namespace)
    deadline = time.monotonic() + 3600
    while not idx.ready and time.monotonic() < deadline:
        time.sleep(0.05)  # a benchmark polling a background build, not a test
    build_s = time.perf_counter() - t0
    if not idx.ready:
        raise TimeoutError(f"the index of {n:,} entries was not built within an hour")

    queries = 50 if quick else 1000
    picks = rng.integers(0, n, queries)
    near = _near(rng, vectors[picks])
    far = normalise(rng.normal(size=(queries, DIM)))

    # Recall at the threshold: exact search over every stored vector.
    best = np.zeros(queries, dtype=np.int64)
    top = np.full(queries, -2.0, dtype=np.float32)
    for start in range(0, n, 100_000):  # in slices: 1,000 x 1M floats would be 4 GB
        sims = near @ vectors[start : start + 100_000].T
        arg = sims.argmax(axis=1)
        val = sims[np.arange(queries), arg]
        better = val > top
        best[better], top[better] = arg[better] + start, val[better]
    true_hits = top >= THRESHOLD
    ids = np.array([entry_id(p) for p in prompts], dtype=np.int64)
    found = 0
    with idx.lock:
        candidates = idx.search(near, CANDIDATES)
    for row in np.flatnonzero(true_hits):
        found += int(ids[best[row]] in {e for e, _ in candidates[row]})
    recall = found / max(1, int(true_hits.sum()))

    served = 0
    for q in range(queries):
        served += worker.lookup_vector(scope, prompts[picks[q]], ZERO, near[q]).hit
    other = Scope(f"{tenant}x", scope.model, scope.model_version, scope.template_version)
    cross = sum(
        worker.lookup_vector(other, prompts[picks[q]], ZERO, near[q]).hit
        for q in range(min(queries, 200))
    )

    asked = [prompts[i] for i in picks]
    del vectors, prompts  # 1.5 GB at 1M; the measurement needs only the queries
    state = {"i": 0}
    learned = Learned(prior.for_model(MiniLM.name), MAX_ERROR)

    def lookups(decision: Learned | None) -> Callable[[], None]:
        """Lookups alternating a near query and a far one, served under ``decision``."""

        def lookup() -> None:
            worker.decision = decision
            i = state["i"] = state["i"] + 1
            q = (i // 2) % queries
            if i % 2:
                worker.lookup_vector(scope, asked[q], ZERO, near[q])
            else:
                worker.lookup_vector(scope, "no such prompt", ZERO, far[q])

        return lookup

    # The same worker and index: only the decision differs.
    lookup, lookup_learned = lookups(None), lookups(learned)

    def close() -> None:
        worker.close()
        writer.close()
        for t in (tenant, other.tenant):
            _unlink_matching(ctx.redis, semantic_pattern(t))
            ctx.redis.unlink(semantic_registry_key(t))

    index = {
        "kind": idx.kind,
        "vectors": len(idx),
        "trained_for": idx.trained_for,
        "lists": int(idx.index.nlist) if idx.kind == "ivf" else None,
        "nprobe": int(idx.index.nprobe) if idx.kind == "ivf" else None,
    }
    return Prepared(
        {
            "size": n,
            "load_s": round(load_s, 2),
            "index_build_s": round(build_s, 2),
            "first_lookup_ms": round(first_ms, 2),
            "first_lookup_warming": first.warming,
            "index": index,
            "recall_at_threshold": round(recall, 4),
            "true_hit_queries": int(true_hits.sum()),
            "queries": queries,
            "served_near": served,
            "cross_tenant_hits": int(cross),
        },
        lookup,
        semantic_entry_key(scope.namespace, int(ids[0])),
        close,
        lookup_learned,
    )


def _measure(
    ctx: common.Context, prepared: dict[int, Prepared], quick: bool
) -> dict[str, dict[str, Any]]:
    """Every size's lookups and the reference GET, interleaved in the same rounds, so
    a burst of load from elsewhere lands on all of them alike."""
    ref_name = "redis GET of one entry (reference)"
    key = next(iter(prepared.values())).key
    candidates: dict[str, Callable[[], Any]] = {}
    for n, p in prepared.items():
        candidates[f"lookup ({n:,} cached)"] = p.lookup
        candidates[f"learned lookup ({n:,} cached)"] = p.learned
    candidates[ref_name] = lambda: ctx.redis.get(key)
    res = _interleaved(candidates, rounds=1 if quick else 5, calls=50 if quick else 2000, warmup=50)
    out = {}
    for n, p in prepared.items():
        look, ref = res[f"lookup ({n:,} cached)"], res[ref_name]
        learned = res[f"learned lookup ({n:,} cached)"]
        out[str(n)] = {
            **p.result,
            "lookup": look,
            "lookup_learned": learned,
            "reference": ref,
            "p50_vs_get": common.ratio(look["p50_us"], ref["p50_us"]),
            "learned_vs_static": common.ratio(learned["p50_us"], look["p50_us"]),
        }
    return out


def _non_deterministic(ctx: common.Context) -> dict[str, int]:
    tenant = f"{ctx.tenant_prefix()}nd"
    cache = SemanticCache(ctx.redis, _Fixed())
    scope = Scope(tenant, "bench-bot", "v1", "t1")
    refused = 0
    vector = normalise(np.ones((1, DIM)))
    for i in range(100):
        try:
            cache.store_many(scope, [(f"prompt {i}", "sampled")], {"temperature": 0.7}, vector)
        except NonDeterministicParams:
            refused += 1
    cache.close()
    stored = sum(1 for _ in ctx.redis.scan_iter(match=semantic_pattern(tenant, kind="e")))
    _unlink_matching(ctx.redis, semantic_pattern(tenant))
    return {"attempts": 100, "refused": refused, "stored": stored}


def _embedding(model: MiniLM, quick: bool) -> dict[str, Any]:
    texts = sorted({p.a for p in load_pairs(PAIRS)})
    batch = 32
    state = {"b": 0, "s": 0}

    def batched() -> None:
        i = state["b"] = (state["b"] + batch) % (len(texts) - batch)
        model.embed(texts[i : i + batch])

    def single() -> None:
        i = state["s"] = (state["s"] + 1) % len(texts)
        model.embed([texts[i]])

    res = common.measure(
        {f"batches of {batch}": batched, "one at a time": single},
        rounds=3,
        calls=1 if quick else 6,
        warmup=1,
        items={f"batches of {batch}": batch},
    )
    return {
        "results": res,
        "ratio": common.ratio(
            res[f"batches of {batch}"]["items_per_s"], res["one at a time"]["items_per_s"]
        ),
    }


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    prepared: dict[int, Prepared] = {}
    try:
        for n in _sizes(quick):
            print(
                f"bench: semantic: {n:,} cached prompts: load, build, recall ...",
                file=sys.stderr,
                flush=True,
            )
            prepared[n] = _size(ctx, n, quick)
        print(
            "bench: semantic: lookups at every size, interleaved ...", file=sys.stderr, flush=True
        )
        sizes = _measure(ctx, prepared, quick)
    finally:
        for p in prepared.values():
            p.close()
    model = local_model()
    labelled: dict[str, Any] = {}
    streams: dict[str, Any] = {}
    for name, path in SETS.items():
        # Quick: the first 40 pairs, one exploration seed; embedding is the cost.
        pairs = load_pairs(path)[: 40 if quick else None]
        sims = similarities(model, pairs)
        [row] = [r for r in sweep(pairs, sims) if abs(r.threshold - THRESHOLD) < 1e-9]
        labelled[name] = {
            "file": f"pipeline/semantic/data/{path.name}",
            "pairs": len(pairs),
            "threshold": THRESHOLD,
            "hit_rate": row.hit_rate,
            "false_hit_rate": row.false_hit_rate,
            "unguarded_false_hit_rate": row.unguarded_false_hit_rate,
            "sweep": [dataclasses.asdict(r) for r in sweep(pairs, sims)],
        }
        print(
            f"bench: semantic: static against learned, on the {name} set's stream ...",
            file=sys.stderr,
        )
        streams[name] = paraphrases.compare(
            ctx.redis,
            model,
            pairs,
            f"{ctx.tenant_prefix()}stream",
            f"{ctx.tag}{name[0]}",
            threshold=THRESHOLD,
            seeds=paraphrases.SEEDS[:1] if quick else paraphrases.SEEDS,
        )
    embedding = _embedding(model, quick)
    nondet = _non_deterministic(ctx)

    def p50_ms(n: int) -> float | None:
        s = sizes.get(str(n))
        return round(s["lookup"]["p50_us"] / 1000, 3) if s else None

    targets = [
        common.target(
            "lookup p50 at 100k prompts (embedding excluded)", p50_ms(100_000), "<=", 2, "ms"
        ),
        common.target(
            "lookup p50 at 1M prompts (embedding excluded)", p50_ms(1_000_000), "<=", 5, "ms"
        ),
        common.target(
            "learned lookup p50 over static's at 100k prompts",
            sizes.get("100000", {}).get("learned_vs_static"),
            "<=",
            1.2,
            "x",
        ),
        common.target(
            "ANN recall at the threshold (lowest size)",
            min((s["recall_at_threshold"] for s in sizes.values()), default=None),
            ">=",
            0.99,
        ),
        common.target(
            "cross-tenant hits", sum(s["cross_tenant_hits"] for s in sizes.values()), "<=", 0
        ),
        common.target("non-deterministic responses stored", nondet["stored"], "<=", 0),
    ]
    for name, stream in streams.items():
        targets += _stream_targets(name, stream)
    return {
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "parameters": {
            "dim": DIM,
            "threshold": THRESHOLD,
            "cluster": CLUSTER,
            "candidates": CANDIDATES,
            "flat_max": FLAT_MAX,
            "nprobe": NPROBE,
            "train_per_list": TRAIN_PER_LIST,
        },
        "sizes": sizes,
        "embedding": embedding,
        "labelled": labelled,
        "streams": streams,
        "non_deterministic": nondet,
        "targets": targets,
    }


def _stream_targets(name: str, stream: dict[str, Any]) -> list[dict[str, Any]]:
    runs = stream["runs"]
    learned, static, unflagged = (
        runs[k]["measured"] for k in ("learned", "static", "learned, no flags")
    )

    def worse(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a - b, 4)

    return [
        common.target(
            f"{name} set: paraphrase hit rate, learned over static (measured stream)",
            stream["hit_ratio"],
            ">=",
            3,
            "x",
        ),
        common.target(
            f"{name} set: error rate of learned hits (measured stream)",
            learned["error_rate"],
            "<=",
            stream["max_error"],
        ),
        common.target(
            f"{name} set: error rate of learned hits against static's",
            worse(learned["error_rate"], static["error_rate"]),
            "<=",
            0,
        ),
        common.target(
            f"{name} set: error rate of learned hits, a caller that never flags",
            unflagged["error_rate"],
            "<=",
            stream["max_error"],
        ),
    ]


def _index_name(index: dict[str, Any]) -> str:
    if index["kind"] == "ivf":
        return f"IVF {index['lists']:,} lists, nprobe {index['nprobe']}"
    return "exact (flat)"


def markdown(res: dict[str, Any]) -> str:
    lines = ["## semantic: the semantic response cache", ""]
    if "measured_at" in res:
        lines += [f"Measured {res['measured_at']} (`python -m bench --only semantic`).", ""]
    rows = [
        (
            f"{s['size']:,}",
            s["lookup"]["p50_us"] / 1000,
            s["lookup"]["p99_us"] / 1000,
            s["reference"]["p50_us"] / 1000,
            f"{s['p50_vs_get']}x",
            s["recall_at_threshold"],
            s["cross_tenant_hits"],
            _index_name(s["index"]),
            s["first_lookup_ms"],
            s["index_build_s"],
            s["load_s"],
        )
        for s in res["sizes"].values()
    ]
    p = res["parameters"]
    lines += [
        "Lookups with the embedding excluded (half hits, half misses); reference: one "
        "Redis GET; every size and the reference interleaved in the same rounds; p50 and "
        "p99 are medians over rounds of each round's. "
        f"Synthetic {p['dim']}-d vectors in clusters of {p['cluster']}. The index is "
        f"exact up to {p['flat_max']:,} vectors, above it IVF with 8-bit scalar "
        f"quantization, {p['nprobe']} lists probed. A worker that has never seen the "
        "namespace looks up once (first lookup: a miss, without waiting), then its "
        "index builds in the background (build s: until it is ready).",
        "",
        common.table(
            [
                "cached per tenant",
                "lookup p50 ms",
                "lookup p99 ms",
                "GET p50 ms",
                "p50 vs GET",
                "recall at 0.93",
                "cross-tenant hits",
                "index",
                "first lookup ms",
                "build s",
                "load s",
            ],
            rows,
        ),
        "",
    ]
    learned_rows = [
        (
            f"{s['size']:,}",
            s["lookup"]["p50_us"] / 1000,
            s["lookup_learned"]["p50_us"] / 1000,
            s["lookup_learned"]["p99_us"] / 1000,
            f"{s['learned_vs_static']}x",
        )
        for s in res["sizes"].values()
        if "lookup_learned" in s
    ]
    if learned_rows:
        lines += [
            "The same lookups with the learned decision (the same worker and index; the "
            "entries' outcomes read in the same round trip, each candidate's error "
            "estimated), in the same rounds:",
            "",
            common.table(
                [
                    "cached per tenant",
                    "static p50 ms",
                    "learned p50 ms",
                    "learned p99 ms",
                    "learned vs static",
                ],
                learned_rows,
            ),
            "",
        ]
    if not any(s["size"] >= 1_000_000 for s in res["sizes"].values()):
        lines += [
            "1M prompts per tenant was not run here (about 3.5 GB in Redis with the "
            "stream): `FRESHLINE_BENCH_SEMANTIC_SIZES=1000000 .venv/bin/python -m bench "
            "--only semantic`.",
            "",
        ]
    e = res["embedding"]["results"]
    lines += [
        "Embedding (all-MiniLM-L6-v2 in numpy, local):",
        "",
        common.table(
            ["mode", "prompts/s", "p50 ms per call"],
            [(k, v["items_per_s"], v["p50_us"] / 1000) for k, v in e.items()],
        ),
        "",
        f"Batched vs one at a time: {res['embedding']['ratio']}x.",
        "",
    ]
    labelled = res["labelled"]
    if "sweep" in labelled:  # a result from before the second set
        labelled = {"shipped": labelled}
    for name, lab in labelled.items():
        lines += [
            f"The {name} labelled set ({lab['pairs']} pairs) at {lab['threshold']}: hit rate "
            f"{lab['hit_rate']:.1%}, false-hit rate {lab['false_hit_rate']:.1%} "
            f"({lab['unguarded_false_hit_rate']:.1%} on similarity alone, without the "
            "numbers and names checks).",
            "",
        ]
        sweep_rows = [
            (
                f"{r['threshold']:.2f}",
                f"{r['hit_rate']:.1%}",
                f"{r['false_hit_rate']:.1%}",
                f"{r['unguarded_false_hit_rate']:.1%}",
            )
            for r in lab["sweep"]
        ]
        lines += [
            common.table(
                ["threshold", "hit rate", "false hits", "false hits, similarity alone"],
                sweep_rows,
            ),
            "",
        ]
    streams = res.get("streams") or ({"shipped": res["stream"]} if "stream" in res else {})
    for name, st in streams.items():
        lines += _stream_markdown(name, st)
    nd = res["non_deterministic"]
    lines += [
        f"Stores at temperature 0.7: {nd['refused']} of {nd['attempts']} refused, "
        f"{nd['stored']} stored.",
        "",
        common.targets_table(res["targets"]),
    ]
    return "\n".join(lines)


def _stream_markdown(name: str, st: dict[str, Any]) -> list[str]:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def decision(run: str) -> str:
        if run == "static":
            return f"fixed threshold {st['threshold']}"
        flags = "caller flags wrong hits" if run == "learned" else "caller never flags"
        return f"learned, max error {st['max_error']:.0%} (start {st['start']}), {flags}"

    rows = [
        (
            decision(run_name),
            phase,
            r["lookups"],
            f"{pct(r['paraphrase_hit_rate'])} of {r['paraphrases']:,}",
            f"{pct(r['error_rate'])} ({r['wrong_hits']} of {r['hits']})",
            pct(r["exploration_rate"]),
        )
        for run_name, run in st["runs"].items()
        for phase, r in run.items()
    ]
    return [
        f"Static against learned, on a stream made from the {name} labelled set "
        f"(`bench/paraphrases.py`): {st['questions']} cached questions, each recurring "
        f"with fresh paraphrases among near misses; {st['lookups']['warmup']} warm-up "
        f"lookups, then {st['lookups']['measured']} measured. A miss stores the right "
        f"answer, as a caller would. Learned: exploration seeds {st['seeds']}, summed. "
        f"Paraphrase hit rate, learned over static: {st['hit_ratio']}x "
        f"({st.get('hit_ratio_no_flags')}x with a caller that never flags).",
        "",
        common.table(
            ["decision", "phase", "lookups", "paraphrase hit rate", "error of hits", "explored"],
            rows,
        ),
        "",
    ]
