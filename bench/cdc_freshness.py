"""CDC freshness: from a Postgres commit to the fresh Redis entry, through Debezium.

The whole production path, nothing simulated: plain SQL writes (one transaction each)
at a fixed offered rate -> Postgres WAL -> the Debezium connector in Kafka Connect
(``freshline cdc register``'s configuration, its own topic prefix, slot and connector
name) -> Kafka -> ``freshline consume`` (a subprocess) -> Redis, then an invalidation on
the Redis channel ``freshline:invalidations``.

**Commit time** is Debezium's ``source.ts_ms`` of each change, read from the CDC topic
by a consumer of our own. **Fresh** for a feature set means an invalidation for the
changed user arrived whose watermark's clock (Postgres ``clock_timestamp()``, read
before the recompute's snapshot) is at least 1 ms after the commit time: that entry
was computed from a snapshot that contains the commit. Freshness of a write = receipt
of that message minus the commit time, the later of its two feature sets
(``txn_90d``, ``geo``). Postgres and this process share the machine's clock.

The writes are 70% INSERTs and 30% UPDATEs of the amount of a row inserted earlier in
the run. An INSERT's user is the user of a row sampled from the data set, so users
write in proportion to their history, as in the fraud workloads the Zipf data set
models: the busiest user gets about one insert in seven, and nearly every consumer
batch contains it (what issue 16 measures: a change's cost on each path).

One window per recompute path (full, then incremental) of both feature sets, each
with a ``freshline consume`` started with ``FRESHLINE_RECOMPUTE_PATHS`` for it, the
writes with ``synchronous_commit=on``.

Run alone: ``.venv/bin/python -m bench.cdc_freshness [--quick] [--json] [--users N
--transactions N]``; or as part of ``python -m bench`` (after ``seed``: 100,000 users
and 1,000,000 transactions).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson
import psycopg
from confluent_kafka import Message
from sqlalchemy.engine import make_url

from bench import common
from bench.sql_load import UPDATE_SHARE
from freshline.consumers.kafka import Consumer
from freshline.consumers.topics import ensure_cdc_topics
from freshline.pipeline.cdc.connect import (
    HEARTBEAT_MS,
    ConnectClient,
    Names,
    captured_tables,
    connector_config,
    drop_slot,
    names,
    streaming,
)

RATE = 500
TARGET_P99_MS = 1000.0
FEATURE_SETS = ("txn_90d", "geo")
SAMPLE_ROWS = 20_000
"""Rows sampled for the writers' users (their users in proportion to their rows)."""
PATHS: tuple[Literal["full", "incremental"], ...] = ("full", "incremental")
"""The recompute path of both feature sets (``FRESHLINE_RECOMPUTE_PATHS``), one window
each, with a consumer started for it; the target is read on "incremental"."""
FRESHLINE = str(Path(sys.executable).with_name("freshline"))


class TenantChanges:
    """The CDC topic of ``transactions`` read on a daemon thread until :meth:`close`:
    each change of ``tenant`` is handed to :meth:`take` with its Debezium envelope and
    row (tombstones and other tenants' changes are skipped)."""

    def __init__(
        self,
        settings: Any,
        topic: str,
        tenant: str,
        *,
        group: str,
        reset: Literal["earliest", "latest"],
    ) -> None:
        self.tenant = tenant
        self.consumer = Consumer(
            settings,
            **{"group.id": f"{settings.consumer_group}-{group}", "auto.offset.reset": reset},
        )
        self.consumer.subscribe([topic])
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"cdc-{group}", daemon=True)
        self.thread.start()

    def receive(self) -> list[Message]:
        """The next records: up to 500, waiting at most 0.2 s for the first."""
        return self.consumer.consume(500, timeout=0.2)

    def take(self, msg: Message, env: dict[str, Any], row: dict[str, Any]) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            for msg in self.receive():
                value = msg.value()
                if not value:
                    continue  # a tombstone
                env = orjson.loads(value)
                env = env.get("payload", env)
                row = env.get("after") or env.get("before") or {}
                if row.get("tenant_id") == self.tenant:
                    self.take(msg, env, row)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.consumer.close()


class Commits(TenantChanges):
    """The CDC topic of ``transactions``: (user, ``source.ts_ms``) of each change of ours."""

    def __init__(self, settings: Any, topic: str, tenant: str) -> None:
        self.changes: list[tuple[str, int]] = []
        super().__init__(settings, topic, tenant, group="commits", reset="earliest")

    def take(self, msg: Message, env: dict[str, Any], row: dict[str, Any]) -> None:
        self.changes.append((str(row["user_id"]), int(env["source"]["ts_ms"])))


def _connstr(url: str) -> str:
    u = make_url(url)
    return (
        f"host={u.host} port={u.port or 5432} dbname={u.database} user={u.username} "
        f"password={u.password}"
    )


def _writers(conninfo: str, tenant: str, rows: int = SAMPLE_ROWS) -> list[int]:
    """The users of about ``rows`` rows of ``tenant`` sampled at random, in id order (so
    a seeded choice among them repeats): users in proportion to their rows."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        total = conn.execute(
            "SELECT count(*) FROM transactions WHERE tenant_id = %s", (tenant,)
        ).fetchone()
        share = min(100.0, 100.0 * rows / max(1, int(total[0]) if total else 1))
        found = conn.execute(
            f"SELECT user_id FROM transactions TABLESAMPLE BERNOULLI ({share:.6f}) "
            "REPEATABLE (7) WHERE tenant_id = %s ORDER BY id",
            (tenant,),
        ).fetchall()
    return [int(r[0]) for r in found] or [1]


def _write(
    conninfo: str,
    tenant: str,
    users: list[int],
    rate: int,
    window: float,
    seed: int,
    synchronous_commit: str = "on",
) -> tuple[int, float]:
    """Offer ``rate`` writes/s for ``window`` seconds, open loop; (writes, achieved rate).
    Each INSERT goes to a user drawn from ``users``."""
    rng = random.Random(seed)
    mine: list[int] = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        # Logical decoding only sends flushed WAL: with synchronous_commit off, a commit
        # waits for the WAL writer (wal_writer_delay, 200 ms) before Debezium sees it.
        conn.execute(f"SET synchronous_commit = {synchronous_commit}")
        insert = (
            "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
            "VALUES (%s, %s, %s, %s, %s) RETURNING id"
        )
        update = "UPDATE transactions SET amount = amount + 1 WHERE tenant_id = %s AND id = %s"
        started = time.monotonic()
        writes = 0
        for _ in common.paced(rate, window):
            if mine and rng.random() < UPDATE_SHARE:
                conn.execute(update, (tenant, rng.choice(mine)), prepare=True)
            else:
                user = rng.choice(users)
                ip = f"11.{rng.randint(0, 127)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
                row = conn.execute(
                    insert,
                    (tenant, user, round(rng.uniform(1, 500), 2), f"m{rng.randint(1, 300)}", ip),
                    prepare=True,
                ).fetchone()
                if row is not None:
                    mine.append(int(row[0]))
            writes += 1
        elapsed = time.monotonic() - started
    return writes, writes / elapsed


def _wait(
    condition: Any,
    what: str,
    deadline_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: Any = None,
) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"freshline consume exited: {log.read()[-2000:]!r}")
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)  # polling interval


def _measure(ctx: common.Context, quick: bool) -> dict[str, Any]:
    data = ctx.dataset()  # seeded before the connector exists: no snapshot events
    window = 1.0 if quick else 30.0
    version = ctx.schema_version()
    settings = ctx.settings_for(schema_version=version)
    ctx.kafka_topics()
    owned = names(settings)
    from tests.helpers import REGISTRY

    tables = captured_tables(REGISTRY)
    client = ConnectClient(settings.connect_url)
    client.ping()
    config = connector_config(settings, owned)
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_SCHEMA_VERSION": str(version),
        "FRESHLINE_TOPIC_PREFIX": settings.topic_prefix,
        "FRESHLINE_CONSUMER_GROUP": f"{settings.consumer_group}-cdc-{version}",
        "FRESHLINE_AUTO_OFFSET_RESET": "earliest",
    }
    watcher = common.InvalidationWatcher(ctx.new_redis(), version, data.tenant)
    commits: Commits | None = None
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    proc: subprocess.Popen[bytes] | None = None
    conninfo = _connstr(settings.postgres_url)
    windows: dict[str, dict[str, Any]] = {}
    try:
        ensure_cdc_topics(settings, [owned.topic(t) for t in tables])
        client.put_config(owned.connector, config)

        _wait(lambda: streaming(client, ctx.engine, owned), "the connector to run", 60)
        commits = Commits(settings, owned.topic("transactions"), data.tenant)
        writers = _writers(conninfo, data.tenant)
        head_share = max(collections.Counter(writers).values()) / len(writers)
        for path in PATHS:
            proc = _start(env, path, log)
            _probe(conninfo, data.tenant, watcher, proc, log)
            common.note(
                f"cdc_freshness: {RATE} SQL writes/s for {window:.0f} s, recompute path {path}"
            )
            seen_before = len(commits.changes)
            writes, achieved = _write(conninfo, data.tenant, writers, RATE, window, seed=7)
            _wait(
                lambda n=seen_before + writes: len(commits.changes) >= n,
                "every write on the CDC topic",
                60,
                proc,
                log,
            )
            changes = commits.changes[seen_before : seen_before + writes]
            end = time.monotonic() + 60
            while time.monotonic() < end:
                watcher.sort()
                if _fresh(watcher, *changes[-1]) is not None:
                    break
                time.sleep(0.1)  # polling for the drain
            time.sleep(0.5)  # stragglers of the last batch
            watcher.sort()
            windows[path] = _summary(watcher, changes, writes, achieved)
            _stop(proc)
            proc = None
    finally:
        if proc is not None:
            _stop(proc)
        log.close()
        watcher.close()
        if commits is not None:
            commits.close()
        _remove_connector(ctx, client, owned)
        _delete_topics(ctx, [*(owned.topic(t) for t in tables), owned.heartbeat_topic])
    return {
        "offered_per_s": RATE,
        "window_s": window,
        "windows": windows,
        "dataset": {"users": data.users, "transactions": data.transactions},
        "heaviest_user": _heaviest_user_cost(ctx, data.tenant),
        "writers": {"sampled_rows": len(writers), "head_share": round(head_share, 3)},
        "subscription_reconnects": watcher.reconnects,
        "config": {
            k: config[k]
            for k in ("snapshot.mode", "poll.interval.ms", "heartbeat.interval.ms", "plugin.name")
        },
        "batch_max_wait_ms": settings.batch_max_wait_ms,
        "batches_as_fetched": True,
        "partitions": settings.topic_partitions,
    }


def _paths(path: str) -> dict[str, str]:
    """``path`` for each feature set that has it (a plain query: full only)."""
    from tests.helpers import REGISTRY

    return {
        name: path
        for name in FEATURE_SETS
        if path == "full" or REGISTRY[name].incremental is not None
    }


def _start(env: dict[str, str], path: str, log: Any) -> subprocess.Popen[bytes]:
    """``freshline consume`` recomputing the feature sets on ``path`` where they can."""
    paths = orjson.dumps(_paths(path)).decode()
    return subprocess.Popen(
        [FRESHLINE, "consume", "--metrics-port", "0"],
        env={**env, "FRESHLINE_RECOMPUTE_PATHS": paths},
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _probe(
    conninfo: str,
    tenant: str,
    watcher: common.InvalidationWatcher,
    proc: subprocess.Popen[bytes],
    log: Any,
) -> None:
    """Write until a write comes out the far end: the consumer has joined the group."""
    common.note("cdc_freshness: waiting for the consumer to apply a probe write")
    before = sum(len(v) for v in watcher.seen.values())
    probes = 0
    end = time.monotonic() + 90
    while sum(len(v) for v in watcher.seen.values()) == before:
        if time.monotonic() > end:
            raise RuntimeError("no probe write reached Redis within 90 s")
        _write(conninfo, tenant, [1], 10, 0.1, seed=probes)
        probes += 1
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"freshline consume exited: {log.read()[-2000:]!r}")
        time.sleep(0.5)  # pacing the probes while the group forms
    time.sleep(1.0)  # let the probes drain before the window opens


def _heaviest_user_cost(ctx: common.Context, tenant: str) -> dict[str, Any]:
    """What one recompute of the busiest user costs: a batch waits for its slowest entity.

    The writes pick users uniformly, but the seeded activity is Zipf-skewed, so the
    head users own a large share of all transactions and each change to one of them
    recomputes an aggregate over all of its recent rows.
    """
    import sqlalchemy as sa

    from freshline.pipeline.cache.recompute import compute
    from tests.helpers import REGISTRY

    with ctx.engine.connect() as conn:
        user, count = conn.execute(
            sa.text(
                "SELECT user_id, count(*) FROM transactions WHERE tenant_id = :t "
                "GROUP BY user_id ORDER BY 2 DESC LIMIT 1"
            ),
            {"t": tenant},
        ).one()
    cost: dict[str, float] = {}
    for name in FEATURE_SETS:
        for path in PATHS:
            if name not in _paths(path):
                continue
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                compute(ctx.engine, REGISTRY[name], [(tenant, str(user))], path=path)
                runs.append((time.perf_counter() - t0) * 1000)
            cost[f"{name} {path}"] = round(float(np.median(runs)), 1)
    return {"user": str(user), "transactions": int(count), "recompute_ms": cost}


def _fresh(watcher: common.InvalidationWatcher, user: str, ts_ms: int) -> float | None:
    """Seconds from commit to the first invalidation reflecting it, the later of the sets."""
    worst = 0.0
    for fs in FEATURE_SETS:
        rows = watcher.seen.get((fs, user), [])
        j = bisect.bisect_left(rows, ((ts_ms + 1) * 1000, 0.0))
        if j >= len(rows):
            return None
        worst = max(worst, rows[j][1] - ts_ms / 1000)
    return worst


def _summary(
    watcher: common.InvalidationWatcher,
    changes: list[tuple[str, int]],
    writes: int,
    achieved: float,
) -> dict[str, Any]:
    lags = [_fresh(watcher, user, ts) for user, ts in changes]
    got = np.array([x for x in lags if x is not None]) * 1000
    p50, p90, p99 = np.percentile(got, [50, 90, 99]) if got.size else (None, None, None)
    return {
        "achieved_per_s": round(achieved, 1),
        "writes": writes,
        "changes_on_topic": len(changes),
        "fresh": int(got.size),
        "never_fresh": sum(1 for x in lags if x is None),
        "lag_ms": {
            "p50": _r(p50),
            "p90": _r(p90),
            "p99": _r(p99),
            "max": _r(got.max()) if got.size else None,
        },
        "lags_ms_sample": [round(float(x), 1) for x in np.sort(got)[:: max(1, got.size // 2000)]],
    }


def _remove_connector(ctx: common.Context, client: ConnectClient, owned: Names) -> None:
    """Delete the connector (if it was ever made), then its replication slot."""
    with contextlib.suppress(Exception):
        client.delete(owned.connector)
    drop_slot(ctx.engine, owned.slot)


def _delete_topics(ctx: common.Context, topics: list[str]) -> None:
    from freshline.consumers.kafka import admin_client

    admin = admin_client(ctx.settings)
    for future in admin.delete_topics(topics, operation_timeout=10).values():
        with contextlib.suppress(Exception):  # best effort clean-up
            future.result(timeout=30)


def _r(x: Any) -> float | None:
    return None if x is None else round(float(x), 1)


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    res = _measure(ctx, quick)
    res["plots"] = _plot(res)
    for window in res["windows"].values():
        window.pop("lags_ms_sample")
    lag = {path: w["lag_ms"] for path, w in res["windows"].items()}
    res["incremental_vs_full"] = {
        q: common.ratio(lag["incremental"][q], lag["full"][q]) if lag["full"][q] else None
        for q in ("p50", "p99")
    }
    res["targets"] = [
        common.target(
            f"commit-to-Redis p99 at {RATE} SQL writes/s, incremental",
            lag["incremental"]["p99"],
            "<",
            TARGET_P99_MS,
            "ms",
        )
    ]
    res["parameters"] = {
        "rate": RATE,
        "window_s": res["window_s"],
        "update_share": UPDATE_SHARE,
        "feature_sets": list(FEATURE_SETS),
        "paths": list(PATHS),
        "synchronous_commit": "on",
        "heartbeat_ms": HEARTBEAT_MS,
    }
    return res


def _plot(res: dict[str, Any]) -> list[str]:
    plt = common.pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for mode, window in res["windows"].items():
        xs = np.array(window.get("lags_ms_sample") or [])
        if xs.size:
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=f"recompute path {mode}")
    ax.axvline(TARGET_P99_MS, color="red", linestyle="--", label="target p99 1 s")
    ax.set_xlabel("commit to fresh Redis entry (ms)")
    ax.set_ylabel("fraction of writes")
    ax.set_title(f"CDC freshness at {res['offered_per_s']} SQL writes/s offered")
    ax.legend()
    return [common.save_plot(fig, "cdc_freshness")]


def _heaviest_note(res: dict[str, Any]) -> str:
    """What was measured about the data set's busiest user, and nothing more."""
    heavy = res.get("heaviest_user")
    if not heavy:
        return ""
    data = res.get("dataset", {})
    costs = ", ".join(f"{k} {v:,.0f} ms" for k, v in heavy["recompute_ms"].items())
    return (
        f"The dataset: {data.get('users', 0):,} users, {data.get('transactions', 0):,} "
        f"transactions. Its busiest user has {heavy['transactions']:,} of them; one "
        f"recompute of that user took {costs} (median of 3, measured after the "
        "windows)."
    )


def _writers_note(res: dict[str, Any]) -> str:
    writers = res.get("writers")
    if writers is None:  # results from before writers followed the users' activity
        return "Each INSERT went to a user drawn uniformly from the data set."
    return (
        "Each INSERT goes to the user of a row sampled from the data set "
        f"({writers['sampled_rows']:,} rows): users write in proportion to their "
        f"history, and the busiest user gets {writers['head_share']:.1%} of the inserts, "
        "so nearly every consumer batch recomputes it."
    )


def markdown(res: dict[str, Any]) -> str:
    rows = [
        (
            mode,
            w["achieved_per_s"],
            w["writes"],
            w["fresh"],
            w["never_fresh"],
            w["lag_ms"]["p50"],
            w["lag_ms"]["p90"],
            w["lag_ms"]["p99"],
            w["lag_ms"]["max"],
        )
        for mode, w in res["windows"].items()
    ]
    lines = [
        "## cdc_freshness: Postgres commit to fresh Redis entry, through Debezium",
        "",
        f"Plain SQL writes ({1 - UPDATE_SHARE:.0%} INSERT, {UPDATE_SHARE:.0%} UPDATE, one "
        f"transaction each) offered at {res['offered_per_s']}/s for {res['window_s']:.0f} s "
        "per window -> Debezium (pgoutput, Kafka Connect) -> `freshline consume` -> Redis. "
        "Commit time is the change's `source.ts_ms`; a write is fresh when an invalidation "
        "for its user arrives whose watermark clock is after the commit, for both `txn_90d` "
        f"and `geo`. Connector: {', '.join(f'`{k}={v}`' for k, v in res['config'].items())}; "
        f"consumer: {common.batching(res)}; "
        f"{res['partitions']} partitions.",
        "",
        _writers_note(res),
        "",
        "One window per recompute path of both feature sets (`FRESHLINE_RECOMPUTE_PATHS`), "
        "each with a consumer started for it, `synchronous_commit=on` (what applications "
        "get by default). Incremental against full: p50 "
        f"{res['incremental_vs_full']['p50']}x, p99 {res['incremental_vs_full']['p99']}x.",
        "",
        _heaviest_note(res),
        "",
        common.table(
            [
                "recompute path",
                "achieved/s",
                "writes",
                "fresh",
                "never fresh",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
            ],
            rows,
        ),
        "",
        common.targets_table(res["targets"]),
    ]
    for plot in res.get("plots", []):
        lines += ["", f"![CDC freshness]({plot})"]
    return "\n".join(lines) + "\n"


def main() -> int:
    return common.seeded_main(
        "cdc_freshness",
        __doc__,
        run,
        markdown,
        quick_help="a 5 s window instead of 30 s",
        users_help="seed this many users (with --transactions; "
        "the full benchmark's data set is 100000 and 1000000)",
    )


if __name__ == "__main__":
    sys.exit(main())
