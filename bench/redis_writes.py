"""Redis writes: the conditional batched write against plain pipelined SETEX.

A batch of 500 ``txn_90d`` entries computed from the run's data set is written again
and again, each call with a newer watermark, so every conditional write really
replaces its entry (an equal watermark would be a cheaper no-op). Candidates,
interleaved round by round:

* ``conditional``: :meth:`freshline.pipeline.cache.store.EntryStore.write`, the shipped path:
encode
  each entry, one pipeline of EVALSHA of the compare-and-set Lua script;
* ``conditional, plain EVALSHA``: the same script and encoding in a bare loop, without
  the store's bookkeeping (its entity refs, result codes, NOSCRIPT handling);
* ``SETEX``: the same entries encoded the same way, written with pipelined ``SET .. PX``
  to keys of another namespace: no compare, no lease;
* ``SETEX, pre-encoded``: the same bytes, encoded beforehand: the floor.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from bench import common
from freshline.pipeline.cache.recompute import Batch, compute
from freshline.pipeline.cache.store import _WRITE_LUA, EntryStore, jittered_ttl_ms
from freshline.pipeline.core.codec import encode_entry
from freshline.pipeline.core.keys import entity_floor_key, feature_key, floor_key, lease_key
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY

BATCH = 500


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    data = ctx.dataset()
    fs = REGISTRY["txn_90d"]
    users = random.Random(8).sample(range(1, data.users + 1), min(BATCH, data.users))
    base = compute(ctx.engine, fs, [(data.tenant, str(u)) for u in users])
    cas_version, sha_version, set_version = (ctx.schema_version() for _ in range(3))
    store = EntryStore(ctx.redis, cas_version, registry=REGISTRY)
    sha = ctx.redis.script_load(_WRITE_LUA)
    counter = itertools.count(1)
    refs = [EntityRef(fs.name, t, e) for t, e in base.values]
    fields = fs.field_names

    def batch() -> Batch:
        return Batch(fs, base.values, base.watermark + next(counter), base.computed_at_ms)

    def conditional() -> None:
        result = store.write(batch())
        if result.written != len(refs):
            raise RuntimeError(f"expected {len(refs)} writes, got {result}")

    def evalsha() -> None:
        b = batch()
        pipe = ctx.redis.pipeline(transaction=False)
        for ref in refs:
            raw = encode_entry(
                [b.values[(ref.tenant, ref.entity)][f] for f in fields],
                sha_version,
                b.computed_at_ms,
                b.watermark,
            )
            pipe.evalsha(
                sha,
                4,
                feature_key(sha_version, ref),
                lease_key(sha_version, ref),
                entity_floor_key(sha_version, ref),
                floor_key(sha_version, fs.name),
                raw,
                jittered_ttl_ms(fs.ttl_s),
                "",
                "",
                store.fence_ms,
                store.max_age_ms,
            )
        pipe.execute()

    set_keys = [feature_key(set_version, r) for r in refs]

    def setex() -> None:
        b = batch()
        pipe = ctx.redis.pipeline(transaction=False)
        for ref, key in zip(refs, set_keys, strict=True):
            raw = encode_entry(
                [b.values[(ref.tenant, ref.entity)][f] for f in fields],
                set_version,
                b.computed_at_ms,
                b.watermark,
            )
            pipe.set(key, raw, px=jittered_ttl_ms(fs.ttl_s))
        pipe.execute()

    encoded = [
        encode_entry(
            [base.values[(r.tenant, r.entity)][f] for f in fields],
            set_version,
            base.computed_at_ms,
            base.watermark,
        )
        for r in refs
    ]

    def setex_raw() -> None:
        pipe = ctx.redis.pipeline(transaction=False)
        for key, raw in zip(set_keys, encoded, strict=True):
            pipe.set(key, raw, px=fs.ttl_s * 1000)
        pipe.execute()

    rounds, calls = (1, 3) if quick else (7, 30)
    res = common.measure(
        {
            "conditional (EntryStore.write)": conditional,
            "conditional, plain EVALSHA": evalsha,
            "SETEX": setex,
            "SETEX, pre-encoded": setex_raw,
        },
        rounds=rounds,
        calls=calls,
        warmup=3,
        items=dict.fromkeys(
            [
                "conditional (EntryStore.write)",
                "conditional, plain EVALSHA",
                "SETEX",
                "SETEX, pre-encoded",
            ],
            len(refs),
        ),
    )
    setex_rate = res["SETEX"]["items_per_s"]
    for r in res.values():
        r["vs_setex"] = common.ratio(r["items_per_s"], setex_rate)
        r["vs_setex_pre_encoded"] = common.ratio(
            r["items_per_s"], res["SETEX, pre-encoded"]["items_per_s"]
        )
    cas = res["conditional (EntryStore.write)"]
    targets = [
        common.target(
            "conditional writes/s vs pipelined SETEX of the same payloads",
            cas["vs_setex"],
            ">=",
            0.5,
            "x",
        )
    ]
    return {
        "parameters": {
            "batch": len(refs),
            "rounds": rounds,
            "calls_per_round": calls,
            "payload_bytes": round(sum(map(len, encoded)) / len(encoded), 1),
        },
        "results": res,
        "targets": targets,
    }


def markdown(res: dict[str, Any]) -> str:
    p = res["parameters"]
    rows = [
        (
            name,
            r["items_per_s"],
            r["p50_us"] / 1000,
            r["p99_us"] / 1000,
            f"{r['vs_setex']}x",
            f"{r['vs_setex_pre_encoded']}x",
        )
        for name, r in res["results"].items()
    ]
    return "\n".join(
        [
            "## redis_writes: conditional batched writes against pipelined SETEX",
            "",
            f"Batches of {p['batch']} `txn_90d` entries (~{p['payload_bytes']:.0f} bytes each), "
            f"{p['rounds']} interleaved rounds of {p['calls_per_round']} batches; every "
            "conditional write replaces its entry (a newer watermark each call).",
            "",
            common.table(
                [
                    "candidate",
                    "entries/s",
                    "p50 ms per batch",
                    "p99 ms per batch",
                    "vs SETEX",
                    "vs pre-encoded SETEX",
                ],
                rows,
            ),
            "",
            common.targets_table(res["targets"]),
        ]
    )
