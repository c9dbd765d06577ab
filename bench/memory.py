"""Redis memory per cached entry, against the raw values and a Feast-like layout.

Entries of each feature set are written for the run's data set by the real path
(set-based compute, :meth:`freshline.pipeline.cache.store.EntryStore.write`), then ``MEMORY USAGE
key SAMPLES 0`` is read for a sample of them. "Raw" is what the values are worth
without any store: the orjson of the values dict (names and values), and, tighter,
the orjson of the positional list of values (what freshline's entry body holds).

The Feast-like layout, written in the same run for the same entities and values:
one Redis HASH per entity and feature view, one field per feature (Feast names
fields by a 4-byte murmur hash of ``view:feature``; 4-byte BLAKE2 digests here) with
the value serialised on its own, plus a ``_ts:<view>`` timestamp field, and a TTL.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import orjson
from redis.typing import EncodableT, FieldT

from bench import common
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY


def _field(view: str, name: str) -> bytes:
    return hashlib.blake2b(f"{view}:{name}".encode(), digest_size=4).digest()


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    data = ctx.dataset()
    n = 100 if quick else 5000
    sample = 50 if quick else 1000
    version = ctx.schema_version()
    store = EntryStore(ctx.redis, version, registry=REGISTRY)
    users = random.Random(3).sample(range(1, data.users + 1), min(n, data.users))
    feast_prefix = f"feastlike:{ctx.tag}"
    out: dict[str, Any] = {}
    for fs in REGISTRY:
        refs = [(data.tenant, str(u)) for u in users]
        batches = [compute(ctx.engine, fs, list(chunk)) for chunk in common.chunks(refs, 500)]
        for batch in batches:
            store.write(batch)
        values = {k: v for b in batches for k, v in b.values.items()}
        pipe = ctx.redis.pipeline(transaction=False)
        for (tenant, entity), vals in values.items():
            key = f"{feast_prefix}:{tenant}:{entity}:{fs.name}"
            mapping: dict[FieldT, EncodableT] = {
                _field(fs.name, name): orjson.dumps(vals[name]) for name in fs.field_names
            }
            mapping[f"_ts:{fs.name}"] = orjson.dumps(batches[0].computed_at_ms)
            pipe.hset(key, mapping=mapping)
            pipe.expire(key, fs.ttl_s)
        pipe.execute()
        picked = random.Random(5).sample(sorted(values), min(sample, len(values)))
        pipe = ctx.redis.pipeline(transaction=False)
        for tenant, entity in picked:
            pipe.memory_usage(store.key(EntityRef(fs.name, tenant, entity)), samples=0)
            pipe.memory_usage(f"{feast_prefix}:{tenant}:{entity}:{fs.name}", samples=0)
        usage = pipe.execute()
        ours = np.array(usage[0::2], dtype=float)
        feast = np.array(usage[1::2], dtype=float)
        raw = np.array([len(orjson.dumps(values[k])) for k in picked], dtype=float)
        positional = np.array(
            [len(orjson.dumps([values[k][f] for f in fs.field_names])) for k in picked], dtype=float
        )
        stored = np.array(
            [len(ctx.redis.get(store.key(EntityRef(fs.name, *k))) or b"") for k in picked[:100]],
            dtype=float,
        )
        out[fs.name] = {
            "fields": len(fs.field_names),
            "entries": len(values),
            "sampled": len(picked),
            "freshline_bytes": round(float(ours.mean()), 1),
            "feast_like_bytes": round(float(feast.mean()), 1),
            "raw_dict_bytes": round(float(raw.mean()), 1),
            "raw_positional_bytes": round(float(positional.mean()), 1),
            "stored_value_bytes": round(float(stored.mean()), 1),
            "limit_bytes": round(float(2 * raw.mean() + 100), 1),
            "vs_raw": common.ratio(float(ours.mean()), float(raw.mean())),
            "vs_feast_like": common.ratio(float(ours.mean()), float(feast.mean())),
        }
    common._unlink_matching(ctx.redis, f"{feast_prefix}:*")
    targets = [
        common.target(
            f"{name}: bytes per entry (limit 2x raw + 100 = {r['limit_bytes']:.0f})",
            r["freshline_bytes"],
            "<=",
            r["limit_bytes"],
            "bytes",
        )
        for name, r in out.items()
    ]
    return {
        "parameters": {
            "entries_per_set": n,
            "sampled": sample,
            "redis_version": ctx.redis.info("server")["redis_version"],
        },
        "feature_sets": out,
        "targets": targets,
    }


def markdown(res: dict[str, Any]) -> str:
    rows = [
        (
            name,
            r["fields"],
            r["raw_dict_bytes"],
            r["raw_positional_bytes"],
            r["stored_value_bytes"],
            r["freshline_bytes"],
            f"{r['vs_raw']}x",
            r["feast_like_bytes"],
            f"{r['vs_feast_like']}x",
        )
        for name, r in res["feature_sets"].items()
    ]
    return "\n".join(
        [
            "## memory: Redis bytes per cached entry",
            "",
            f"`MEMORY USAGE key SAMPLES 0`, mean over {res['parameters']['sampled']:,} sampled "
            f"entries of {res['parameters']['entries_per_set']:,} per feature set (Redis "
            f"{res['parameters']['redis_version']}). Raw: the orjson of the values dict; "
            "positional: the orjson of the list of values. Feast-like: a HASH per entity and "
            "feature view, one field per feature, with a TTL, measured in the same run.",
            "",
            common.table(
                [
                    "feature set",
                    "fields",
                    "raw dict",
                    "raw positional",
                    "entry value",
                    "freshline in Redis",
                    "vs raw dict",
                    "Feast-like in Redis",
                    "freshline / Feast-like",
                ],
                rows,
            ),
            "",
            common.targets_table(res["targets"]),
        ]
    )
