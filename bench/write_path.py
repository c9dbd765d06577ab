"""The write path: events/s through the real consumer against a naive one, and freshness.

The stream: ``transaction.updated`` domain events for the run's data set, skewed (80% of
events name one of 20 hot users, the rest any user), keyed ``<tenant>:<user>`` as the
README asks producers to key. Each event routes to two feature sets (``txn_90d`` and
``geo``).

**Throughput.** N events are produced first; then the real consumer
(:class:`freshline.consumers.worker.Worker`: batches, coalescing, one set-based query per feature
set, pipelined conditional writes, invalidations, a commit per batch) drains them in a
fresh consumer group, and so does a naive consumer written here, which takes one event
at a time: decode, route, recompute each feature set for that one entity, write,
publish, commit. Both use the same library functions and run in this process, one
after the other, in alternating rounds. Each is timed from its first record to its
last, so joining the group is not counted. The naive consumer drains a prefix of the
same stream (it would take minutes to drain all of it).

**Freshness.** ``freshline consume`` runs as a subprocess; events are offered at a fixed
2,000/s for a window. An event counts as fresh for a feature set when an invalidation
for its entity arrives on the Redis channel ``freshline:invalidations`` whose
watermark's clock (Postgres ``clock_timestamp()`` read before the recompute's
snapshot) is at or after the event's produce time: the entry was computed from a
snapshot that began after the event existed. Lag = receipt of that message minus the
produce time (also the event's ``occurred_at``), the later of its two feature sets.
The events change no rows (a single producer thread cannot commit 2,000 Postgres
transactions a second here), so the lag is the pipeline's own: consume, route,
recompute, write, publish.
"""

from __future__ import annotations

import bisect
import os
import random
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson

from bench import common
from freshline.consumers.events import decode
from freshline.consumers.kafka import Consumer, Producer
from freshline.consumers.routing import Router
from freshline.consumers.worker import Worker
from freshline.pipeline.cache.invalidation import Invalidation
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.keys import INVALIDATION_CHANNEL
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import logical, qualified
from tests.helpers import REGISTRY

HOT_USERS = 20
HOT_SHARE = 0.8
FEATURE_SETS = ("txn_90d", "geo")


def _user(rng: random.Random, users: int) -> int:
    if rng.random() < HOT_SHARE:
        return rng.randint(1, HOT_USERS)
    return rng.randint(1, users)


def _event(tenant: str, user: int, seq: int, at: float) -> bytes:
    occurred = datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
    return orjson.dumps(
        {"tenant": tenant, "user_id": user, "transaction_id": seq, "occurred_at": occurred}
    )


def _produce(settings: Settings, tenant: str, users: int, n: int, seed: int) -> None:
    rng = random.Random(seed)
    topic = qualified(settings, "transaction.updated")
    with Producer(settings, **{"linger.ms": 20}) as producer:
        for i in range(n):
            user = _user(rng, users)
            producer.produce(
                topic, _event(tenant, user, i, time.time()), f"{tenant}:{user}".encode()
            )
            if i % 10_000 == 0:
                producer.inner.poll(0)
        producer.flush()


class TimedWorker(Worker):
    """The real worker, noting when its first non-empty batch began."""

    first_ns: int | None = None
    last_ns: int = 0

    def _iteration(self) -> int:
        started = common.now_ns()
        n = super()._iteration()
        if n:
            if self.first_ns is None:
                self.first_ns = started
            self.last_ns = common.now_ns()
        return n


def _real(settings: Settings, versions: list[int], n: int) -> dict[str, Any]:
    """The real worker writing ``versions`` (two: a consumer during a deploy)."""
    worker = TimedWorker(
        settings,
        topics=[qualified(settings, "transaction.updated")],
        group=f"{settings.consumer_group}-real-{common.Context.new_schema_version()}",
        versions=lambda: versions,
    )
    totals = worker.run(max_messages=n, timeout=300)
    if totals.consumed < n or worker.first_ns is None:
        raise RuntimeError(f"the worker consumed {totals.consumed} of {n} events")
    seconds = (worker.last_ns - worker.first_ns) / 1e9
    return {
        "events": totals.consumed,
        "seconds": round(seconds, 3),
        "events_per_s": round(totals.consumed / seconds),
        "batches": totals.batches,
        "applied": totals.applied,
        "dead_lettered": totals.dead_lettered,
    }


def _naive(ctx: common.Context, settings: Settings, version: int, n: int) -> dict[str, Any]:
    """One event at a time: decode, route, recompute, write, publish, commit."""
    store = EntryStore(ctx.redis, version, registry=REGISTRY)
    router = Router(REGISTRY)
    consumer = Consumer(
        settings,
        **{"group.id": f"{settings.consumer_group}-naive-{common.Context.new_schema_version()}"},
    )
    consumer.subscribe([qualified(settings, "transaction.updated")])
    done = 0
    first_ns: int | None = None
    last_ns = 0
    deadline = time.monotonic() + 300
    try:
        while done < n and time.monotonic() < deadline:
            msgs = consumer.consume(1, timeout=0.1)
            if not msgs:
                continue
            msg = msgs[0]
            if first_ns is None:
                first_ns = common.now_ns()
            event = decode(logical(settings, msg.topic() or ""), msg.key(), msg.value())
            if event is not None:
                with ctx.engine.connect() as conn:
                    targets = router.route(conn, [event])
                    for name, pairs in targets.items():
                        batch = compute(conn, REGISTRY[name], sorted(pairs))
                        store.write(batch)
                        for tenant, entity in pairs:
                            ctx.redis.publish(
                                INVALIDATION_CHANNEL,
                                Invalidation(
                                    tenant, name, entity, batch.watermark, version
                                ).encode(),
                            )
                    conn.rollback()
            consumer.commit([msg])
            done += 1
            last_ns = common.now_ns()
    finally:
        consumer.close()
    if first_ns is None or done < n:
        raise RuntimeError(f"the naive consumer consumed {done} of {n} events")
    seconds = (last_ns - first_ns) / 1e9
    return {"events": done, "seconds": round(seconds, 3), "events_per_s": round(done / seconds)}


def _throughput(ctx: common.Context, quick: bool) -> dict[str, Any]:
    data = ctx.dataset()
    n, naive_n, rounds = (1_000, 50, 1) if quick else (60_000, 1_000, 2)
    # Topics of its own: the naive consumer reads from the start of the topic, where
    # another benchmark's events (of other forms) would be bad input to it.
    settings = ctx.settings_with_own_topics("write_path")
    _, produce_s = common.timed(lambda: _produce(settings, data.tenant, data.users, n, seed=5))
    runs: dict[str, list[dict[str, Any]]] = {"real": [], "deploy": [], "naive": []}
    for r in range(rounds):
        order = ["real", "deploy", "naive"] if r % 2 == 0 else ["naive", "deploy", "real"]
        for how in order:
            common.note(f"write_path: round {r + 1}, {how} consumer")
            version = ctx.schema_version()
            if how == "naive":
                runs[how].append(_naive(ctx, settings, version, naive_n))
            else:
                both = [version] if how == "real" else [version, ctx.schema_version()]
                runs[how].append(_real(settings, both, n))
    real_runs, naive_runs = runs["real"], runs["naive"]
    real_rate = float(np.median([x["events_per_s"] for x in real_runs]))
    deploy_rate = float(np.median([x["events_per_s"] for x in runs["deploy"]]))
    naive_rate = float(np.median([x["events_per_s"] for x in naive_runs]))
    return {
        "events": n,
        "naive_events": naive_n,
        "rounds": rounds,
        "produce_s": round(produce_s, 2),
        "real": real_runs,
        "naive": naive_runs,
        "deploy": runs["deploy"],
        "real_events_per_s": round(real_rate),
        "deploy_events_per_s": round(deploy_rate),
        "deploy_ratio": common.ratio(deploy_rate, real_rate),
        "naive_events_per_s": round(naive_rate),
        "ratio": common.ratio(real_rate, naive_rate),
    }


def _freshness(ctx: common.Context, quick: bool) -> dict[str, Any]:
    data = ctx.dataset()
    rate, window = (2000, 1.0) if quick else (2000, 20.0)
    version = ctx.schema_version()
    settings = ctx.settings
    ctx.kafka_topics()
    group = f"{settings.consumer_group}-fresh-{version}"
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_SCHEMA_VERSION": str(version),
        "FRESHLINE_TOPIC_PREFIX": settings.topic_prefix,
        "FRESHLINE_AUTO_OFFSET_RESET": "latest",
    }
    common.note(f"write_path: freshness at {rate}/s for {window:.0f}s")
    watcher = common.InvalidationWatcher(ctx.new_redis(), version, data.tenant)
    topic = qualified(settings, "transaction.updated")
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    proc = common.start_consumer(env, topic, group, log)
    rng = random.Random(9)
    sent: list[tuple[float, int]] = []
    try:
        with Producer(settings, **{"linger.ms": 1}) as producer:
            # Wait until the consumer has joined and applies events: probe until one lands.
            deadline = time.monotonic() + 60
            probe = 0
            while not watcher.seen:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"freshline consume did not start: {log.read()[-2000:]!r}")
                producer.produce(
                    topic, _event(data.tenant, 1, probe, time.time()), f"{data.tenant}:1".encode()
                )
                producer.flush()
                probe += 1
                time.sleep(0.5)  # pacing the probes while the group forms
            time.sleep(1.0)  # let the probes drain before the window opens
            started = time.monotonic()
            for i in common.paced(rate, window):
                user = _user(rng, data.users)
                at = time.time()
                producer.produce(
                    topic, _event(data.tenant, user, i, at), f"{data.tenant}:{user}".encode()
                )
                sent.append((at, user))
                if i % 200 == 199:
                    producer.inner.poll(0)
            producer.flush()
            offered = len(sent) / (time.monotonic() - started)
        # Drain: wait until the last events are fresh (or give up after 15 s).
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            at, user = sent[-1]
            if all(watcher.fresh_at(fs, str(user), at) for fs in FEATURE_SETS):
                break
            time.sleep(0.1)  # polling for the drain
    finally:
        common.stop_process(proc)
        log.close()
        watcher.close()
    for rows in watcher.seen.values():
        rows.sort()
    lags: list[float] = []
    unseen = 0
    for at, user in sent:
        worst = 0.0
        for fs in FEATURE_SETS:
            rows = watcher.seen.get((fs, str(user)), [])
            j = bisect.bisect_left(rows, (int(at * 1e6), 0.0))
            fresh = min((t for _, t in rows[j:]), default=None)
            if fresh is None:
                worst = float("nan")
                break
            worst = max(worst, fresh - at)
        if worst != worst:  # NaN: never fresh within the drain
            unseen += 1
        else:
            lags.append(worst)
    arr = np.array(lags) * 1000
    p50, p90, p99 = np.percentile(arr, [50, 90, 99]) if arr.size else (None, None, None)
    return {
        "offered_per_s": round(offered),
        "window_s": window,
        "events": len(sent),
        "fresh_events": len(lags),
        "never_fresh": unseen,
        "subscription_reconnects": watcher.reconnects,
        "lag_ms": {
            "p50": _r(p50),
            "p90": _r(p90),
            "p99": _r(p99),
            "max": _r(arr.max()) if arr.size else None,
        },
        "lags_ms_sample": [round(float(x), 1) for x in arr[:: max(1, arr.size // 2000)]],
    }


def _r(x: Any) -> float | None:
    return None if x is None else round(float(x), 1)


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    throughput = _throughput(ctx, quick)
    fresh = _freshness(ctx, quick)
    plots = _plot(fresh)
    fresh.pop("lags_ms_sample")
    targets = [
        common.target("real consumer events/s vs naive", throughput["ratio"], ">=", 10, "x"),
        common.target(
            "real consumer events/s", throughput["real_events_per_s"], ">=", 10_000, "events/s"
        ),
        common.target(
            f"freshness lag p99 at {fresh['offered_per_s']:,} events/s offered",
            fresh["lag_ms"]["p99"],
            "<",
            150,
            "ms",
        ),
    ]
    return {
        "parameters": {
            "hot_users": HOT_USERS,
            "hot_share": HOT_SHARE,
            "feature_sets": list(FEATURE_SETS),
            "batch_max_events": ctx.settings.batch_max_events,
            "batch_max_wait_ms": ctx.settings.batch_max_wait_ms,
            "batches_as_fetched": True,
            "partitions": ctx.settings.topic_partitions,
        },
        "throughput": throughput,
        "freshness": fresh,
        "plots": plots,
        "targets": targets,
    }


def _plot(fresh: dict[str, Any]) -> list[str]:
    plt = common.pyplot()
    lags = fresh.get("lags_ms_sample") or []
    if plt is None or not lags:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = np.sort(np.array(lags))
    ax.plot(xs, np.arange(1, xs.size + 1) / xs.size)
    ax.axvline(150, color="red", linestyle="--", label="target p99 150 ms")
    ax.set_xlabel("freshness lag (ms)")
    ax.set_ylabel("fraction of events")
    ax.set_title(f"freshness at {fresh['offered_per_s']:,} events/s offered")
    ax.legend()
    return [common.save_plot(fig, "write_path_freshness")]


def markdown(res: dict[str, Any]) -> str:
    p, t, f = res["parameters"], res["throughput"], res["freshness"]
    lines = [
        "## write_path: the consumer against a naive one, and freshness",
        "",
        f"A skewed stream of `transaction.updated` events ({p['hot_share']:.0%} on "
        f"{p['hot_users']} hot users), each routed to {', '.join(p['feature_sets'])}. "
        f"Batches of up to {p['batch_max_events']:,} events ({common.batching(p)}); "
        f"{p['partitions']} partitions.",
        "",
        f"Throughput: {t['events']:,} events pre-produced, drained by the real consumer "
        f"(`Worker`, in process); the naive per-event consumer drained the first "
        f"{t['naive_events']:,} of the same stream; {t['rounds']} alternating round(s), "
        "timed from first to last record.",
        "",
        common.table(
            ["consumer", "events/s (median)", "runs"],
            [
                (
                    "real (batched, coalesced)",
                    t["real_events_per_s"],
                    ", ".join(f"{x['events_per_s']:,}" for x in t["real"]),
                ),
                (
                    "real, during a deploy (two schema versions written)",
                    t.get("deploy_events_per_s"),
                    ", ".join(f"{x['events_per_s']:,}" for x in t.get("deploy", [])),
                ),
                (
                    "naive (one event at a time)",
                    t["naive_events_per_s"],
                    ", ".join(f"{x['events_per_s']:,}" for x in t["naive"]),
                ),
            ],
        ),
        "",
        f"Ratio: **{t['ratio']}x**. During a deploy (every batch written into two schema "
        f"versions, one round trip) the real consumer drains {t.get('deploy_ratio')}x "
        "its rate with one.",
        "",
        f"Freshness: `freshline consume` (subprocess), {f['offered_per_s']:,} events/s offered "
        f"for {f['window_s']:.0f} s ({f['events']:,} events; {f['never_fresh']} not fresh "
        f"within the drain): lag p50 **{f['lag_ms']['p50']} ms**, p90 {f['lag_ms']['p90']} ms, "
        f"p99 **{f['lag_ms']['p99']} ms**, max {f['lag_ms']['max']} ms.",
        "",
    ]
    for plot in res.get("plots", []):
        lines += [f"![freshness lag]({plot})", ""]
    lines.append(common.targets_table(res["targets"]))
    return "\n".join(lines)
