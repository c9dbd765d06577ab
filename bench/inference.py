"""The inference cache: predictions/s at 0%, 40% and 90% hit rates against the model alone.

The model is a logistic regression over 8 inputs wrapped in
:class:`freshline.pipeline.dev.models.SlowModel`, which adds the cost of a real model
(``time.sleep``
standing for its compute). Two shapes of that cost, both "about 10 ms a call":

* ``per_request``: a scoring service asks for one prediction at a time and the model
  costs 10 ms per call. The cache helps by skipping calls.
* ``batched``: a batch of 20 inputs per call and a model that costs 10 ms per row (no
  batching gains inside the model). The cache sends only the misses, in one call.

For each, the direct call and
:meth:`freshline.pipeline.inference.predictions.InferenceCache.predict` at
each hit rate run interleaved, round by round, on pre-built inputs: a hit is a row
taken from a pool predicted beforehand, a miss a fresh random row never seen before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from bench import common
from freshline.pipeline.dev.models import SlowModel
from freshline.pipeline.inference.models import LogisticModel
from freshline.pipeline.inference.predictions import InferenceCache

D = 8
HIT_RATES = (0.0, 0.4, 0.9)
POOL = 2000


def _model(tag: str) -> LogisticModel:
    rng = np.random.default_rng(3)
    return LogisticModel(
        name=f"bench{tag}",
        version="v1",
        feature_names=tuple(f"x{i}" for i in range(D)),
        weights=rng.normal(size=D),
        bias=0.1,
        mean=np.zeros(D),
        scale=np.ones(D),
    )


def _batches(
    rng: np.random.Generator, pool: np.ndarray, size: int, hit_rate: float, count: int
) -> list[np.ndarray]:
    """``count`` batches of ``size`` rows, a ``hit_rate`` share of them from ``pool``.

    With batches of one row, the share holds over the sequence (row i is a hit when
    ``i % 10 < 10 * hit_rate``).
    """
    out: list[np.ndarray] = []
    for i in range(count):
        per_ten = round(10 * hit_rate)
        hits = (1 if i % 10 < per_ten else 0) if size == 1 else round(size * hit_rate)
        rows = [pool[rng.integers(0, len(pool), hits)], rng.normal(size=(size - hits, D))]
        batch = np.concatenate(rows)
        rng.shuffle(batch)
        out.append(batch)
    return out


def _scenario(
    ctx: common.Context,
    name: str,
    *,
    size: int,
    cost_s: float,
    per_row_s: float,
    rounds: int,
    calls: int,
) -> dict[str, Any]:
    version = f"{name}-{ctx.schema_version()}"
    model = SlowModel(_model(ctx.tag), cost_s=cost_s, per_row_s=per_row_s, version=version)
    free = SlowModel(model.inner, version=version)  # the same key space, at no cost
    cache = InferenceCache(ctx.redis)
    rng = np.random.default_rng(17)
    pool = rng.normal(size=(POOL, D))
    for chunk in common.chunks(pool, 500):
        cache.predict(free, chunk)  # warm the pool without paying the model's cost
    total = rounds * calls + 50
    queues: dict[str, list[np.ndarray]] = {"direct": _batches(rng, pool, size, 0.0, total)}
    for h in HIT_RATES:
        queues[f"cache {h:.0%} hits"] = _batches(rng, pool, size, h, total)
    hits_seen: dict[str, list[int]] = {k: [] for k in queues}

    def make(label: str) -> Callable[[], Any]:
        it = iter(queues[label])
        if label == "direct":
            return lambda: model.predict(next(it))

        def call() -> None:
            out = cache.predict(model, next(it))
            hits_seen[label].append(int(out.hit.sum()))

        return call

    res = common.measure(
        {label: make(label) for label in queues},
        rounds=rounds,
        calls=calls,
        warmup=5,
        items=dict.fromkeys(queues, size),
    )
    direct = res["direct"]["items_per_s"]
    for label in queues:
        if label != "direct":
            seen = hits_seen[label]
            res[label]["observed_hit_rate"] = round(sum(seen) / (len(seen) * size), 3)
            res[label]["vs_direct"] = common.ratio(res[label]["items_per_s"], direct)
    return {
        "batch": size,
        "cost_per_call_ms": cost_s * 1000,
        "cost_per_row_ms": per_row_s * 1000,
        "results": res,
        "model_calls": model.calls,
    }


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    rounds = 1 if quick else 3
    scenarios = {
        "per_request": _scenario(
            ctx,
            "per_request",
            size=1,
            cost_s=0.010,
            per_row_s=0.0,
            rounds=rounds,
            calls=10 if quick else 200,
        ),
        "batched": _scenario(
            ctx,
            "batched",
            size=20,
            cost_s=0.0,
            per_row_s=0.010,
            rounds=rounds,
            calls=2 if quick else 15,
        ),
    }
    targets = [
        common.target(
            f"{name}: throughput at 90% hits vs the model alone",
            s["results"]["cache 90% hits"]["vs_direct"],
            ">=",
            5,
            "x",
        )
        for name, s in scenarios.items()
    ]
    return {
        "parameters": {"inputs": D, "rounds": rounds, "pool": POOL},
        "scenarios": scenarios,
        "targets": targets,
    }


def markdown(res: dict[str, Any]) -> str:
    lines = ["## inference: the model-side cache against calling the model", ""]
    for name, s in res["scenarios"].items():
        cost = (
            f"{s['cost_per_call_ms']:.0f} ms per call"
            if s["cost_per_call_ms"]
            else f"{s['cost_per_row_ms']:.0f} ms per row"
        )
        rows = [
            (
                label,
                r.get("observed_hit_rate", "-"),
                r["items_per_s"],
                r["p50_us"] / 1000,
                r["p99_us"] / 1000,
                f"{r['vs_direct']}x" if "vs_direct" in r else "1x",
            )
            for label, r in s["results"].items()
        ]
        lines += [
            f"`{name}`: batches of {s['batch']}, model cost {cost}, "
            f"{res['parameters']['rounds']} interleaved rounds.",
            "",
            common.table(
                [
                    "candidate",
                    "hit rate",
                    "predictions/s",
                    "p50 ms per call",
                    "p99 ms per call",
                    "vs direct",
                ],
                rows,
            ),
            "",
        ]
    lines.append(common.targets_table(res["targets"]))
    return "\n".join(lines)
