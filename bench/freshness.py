"""Freshness on request (issue 26): read-your-writes, token reads, the CDC path's stages.

Three parts, each on the real stack, nothing simulated:

**Token reads** (``token``). A read ``after`` a token that the entry already covers
against the same read without it, on one ``freshline serve`` (granian, 2 workers,
tier off), loaded by ``wrk`` at 16 connections in interleaved rounds; the figure is
the median over rounds of the p50 ratio. Two tokens: one taken right after commit (a
snapshot token, checked with no query) and one taken inside the transaction (resolved
once per process, then remembered). Both are taken before the entries are computed,
so every entry covers them. The Python client (``FeatureClient.get``) likewise, 16
threads, :func:`bench.common.measure`.

**The CDC path's stages** (``cdc``). Plain SQL writes (the workload of
:mod:`bench.cdc_freshness`: 70% INSERT, 30% UPDATE, users in proportion to their
history, ``synchronous_commit=on``) at 500 and then 2,000 writes/s, once with the
connector and consumer settings before issue 26 and once with the current ones, each
window with its own connector configuration and ``freshline consume``. For every
change: its commit (``source.ts_us``, from the WAL), when Debezium made the event
(the envelope's ``ts_us``), the Kafka record's timestamp (set when Connect's producer
took it), when a consumer of our own with the consumer's settings received it, when
the real consumer began the recompute that covers it (the entry's watermark clock,
``clock_timestamp()`` read before the snapshot) and when that entry's invalidation
reached a Redis subscriber. Commit-to-Redis is the last minus the first, the later of
``txn_90d`` and ``geo``, as in :mod:`bench.cdc_freshness` (the same definition of fresh).

**Read-your-writes** (``ryw``). With the current settings, 500 SQL writes/s of
background load on other users, trial threads each commit an INSERT for a user of their
own with ``SELECT freshline.token()`` (inside the transaction for even trials, right
after commit for odd ones), then read ``GET /v1/features/txn_90d/{user}?after=<token>``
(the server's default ``wait_ms``; then half as many trials with ``wait_ms=0``, which
go straight to the recompute). An answer predates the commit when its ``last_txn_at`` is before
the inserted row's ``created_at`` (the trial users get no other writes); there must be
none. Commit-to-answer runs from the COMMIT's return to the answer. Then the same with
domain events: the writer also publishes ``transaction.created`` after commit, the
background load publishes one per write, and the consumer reads the domain topics only.

Run alone: ``.venv/bin/python -m bench.freshness [--quick] [--parts token cdc ryw]
[--json]``; or as part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psycopg

from bench import common, reference_app
from bench.cdc_freshness import UPDATE_SHARE, _connstr, _delete_topics, _writers
from consumers.kafka import Consumer, Producer
from consumers.topics import ensure_cdc_topics
from pipeline.cdc.connect import (
    LATENCY_SETTINGS,
    ConnectClient,
    captured_tables,
    connector_config,
    connector_state,
    drop_slot,
    names,
    slot_state,
)
from pipeline.core.topics import qualified

PARTS = ("token", "cdc", "ryw")
RATES = (500, 2000)
LOAD_RATE = 500
SETTLE_S = 10.0
"""A pause after each CDC window, so work it left in Postgres does not land on the next."""
PER_WRITER = 500
"""Writes/s one background writer thread is asked for; more writers for more."""
FEATURE_SETS = ("txn_90d", "geo")
RYW_SET = "txn_90d"
TRIAL_THREADS = 8
TRIAL_USERS_PER_THREAD = 25
FRESHLINE = str(Path(sys.executable).with_name("freshline"))
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
BEFORE_CONNECTOR = {"poll.interval.ms": "50"}
"""The connector's latency settings before issue 26 (the rest were Debezium's and
Connect's defaults): the "before" windows run with these instead of
:data:`pipeline.cdc.connect.LATENCY_SETTINGS`."""
STAGES = (
    ("commit -> Debezium event", "commit", "debezium"),
    ("Debezium -> Kafka record", "debezium", "kafka"),
    ("Kafka -> consumer receive", "kafka", "received"),
    ("receive -> recompute start", "received", "recompute"),
    ("recompute start -> Redis", "recompute", "redis"),
    ("commit -> Redis", "commit", "redis"),
)


# -- background load ---------------------------------------------------------------------


def _load_main(
    conninfo: str,
    tenant: str,
    users: list[int],
    rate: int,
    seconds: float,
    seed: int,
    events: dict[str, str] | None,
    stop: MpEvent,
    ready: MpEvent,
    done: Any,
) -> None:
    """A process of writer threads offering ``rate`` SQL writes/s in all (the workload of
    :mod:`bench.cdc_freshness`) for ``seconds`` or until ``stop``; with ``events`` (the
    domain topics by event name), each write also publishes its domain event, on the
    broker the environment's settings name. Sets ``ready`` once every writer has its
    connection; puts the writes made in ``done``."""
    writers = max(1, -(-rate // PER_WRITER))
    producer = None
    if events is not None:
        from pipeline.core.settings import Settings

        producer = Producer(Settings(), **{"linger.ms": 1})
    counts = [0] * writers
    connected = threading.Barrier(writers, action=ready.set)

    def writer(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        mine: list[int] = []
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = on")
            connected.wait()
            for _ in common.paced(rate / writers, seconds):
                if stop.is_set():
                    break
                if mine and rng.random() < UPDATE_SHARE:
                    txn = rng.choice(mine)
                    row = conn.execute(
                        "UPDATE transactions SET amount = amount + 1 WHERE tenant_id = %s "
                        "AND id = %s RETURNING user_id",
                        (tenant, txn),
                        prepare=True,
                    ).fetchone()
                    user, topic = (int(row[0]) if row else 0), "transaction.updated"
                else:
                    user = rng.choice(users)
                    ip = f"11.{rng.randint(0, 127)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
                    row = conn.execute(
                        "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
                        "VALUES (%s, %s, %s, %s, %s) RETURNING id",
                        (
                            tenant,
                            user,
                            round(rng.uniform(1, 500), 2),
                            f"m{rng.randint(1, 300)}",
                            ip,
                        ),
                        prepare=True,
                    ).fetchone()
                    txn, topic = (int(row[0]) if row else 0), "transaction.created"
                    mine.append(txn)
                if producer is not None and events is not None and user:
                    producer.produce(
                        events[topic],
                        orjson.dumps({"tenant": tenant, "user_id": user, "transaction_id": txn}),
                        f"{tenant}:{user}".encode(),
                    )
                    producer.inner.poll(0)
                counts[k] += 1

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if producer is not None:
        producer.flush()
        producer.close()
    done.put(sum(counts))


@contextlib.contextmanager
def background(
    conninfo: str,
    tenant: str,
    users: list[int],
    rate: int,
    seconds: float,
    *,
    seed: int = 7,
    events: dict[str, str] | None = None,
) -> Iterator[Callable[[bool], tuple[int, float]]]:
    """Run :func:`_load_main` in a process of its own (its pacing is not slowed by this
    process's GIL); yields, once its writers are connected, a function that stops it
    (``now``, or else at the end of ``seconds``) and returns (writes, seconds)."""
    mp = multiprocessing.get_context("spawn")
    stop, ready, done = mp.Event(), mp.Event(), mp.Queue()
    proc = mp.Process(
        target=_load_main,
        args=(conninfo, tenant, users, rate, seconds, seed, events, stop, ready, done),
        daemon=True,
    )
    proc.start()
    if not ready.wait(60):
        proc.kill()
        raise RuntimeError("the background writers did not connect within 60 s")
    started = time.monotonic()
    result: list[tuple[int, float]] = []

    def finish(now: bool) -> tuple[int, float]:
        if not result:
            if now:
                stop.set()
            writes = int(done.get(timeout=seconds + 60))
            result.append((writes, time.monotonic() - started))
            proc.join(10)
        return result[0]

    try:
        yield finish
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# -- the CDC path's stages ---------------------------------------------------------------


@dataclass
class Change:
    user: str
    commit_us: int
    debezium_us: int
    kafka_ms: int
    received: float


class Changes:
    """The CDC topic of ``transactions`` as a consumer with the consumer's own settings
    sees it: per change of ``tenant``, its commit, Debezium's and Kafka's timestamps,
    and when it was received (one record per poll, so nothing waits for a batch)."""

    def __init__(self, settings: Any, topic: str, tenant: str) -> None:
        self.seen: list[Change] = []
        self.tenant = tenant
        self.consumer = Consumer(
            settings,
            **{"group.id": f"{settings.consumer_group}-stages", "auto.offset.reset": "latest"},
        )
        self.consumer.subscribe([topic])
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cdc-stages", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self.consumer.poll(0.1)
            if msg is None:
                continue
            at = time.time()
            value = msg.value()
            if not value:
                continue  # a tombstone
            env = orjson.loads(value)
            env = env.get("payload", env)
            row = env.get("after") or env.get("before") or {}
            if row.get("tenant_id") != self.tenant:
                continue
            source = env["source"]
            self.seen.append(
                Change(
                    str(row["user_id"]),
                    int(source.get("ts_us") or source["ts_ms"] * 1000),
                    int(env.get("ts_us") or env["ts_ms"] * 1000),
                    int(msg.timestamp()[1]),
                    at,
                )
            )

    def since(self, start_us: int) -> list[Change]:
        return [c for c in self.seen if c.commit_us >= start_us]

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.consumer.close()


def _covering(watcher: common.InvalidationWatcher, change: Change) -> tuple[float, float] | None:
    """(recompute start, Redis receipt) in seconds of the later feature set's first entry
    whose watermark clock is at least 1 ms after the commit (cdc_freshness's rule)."""
    worst: tuple[float, float] | None = None
    bar = (change.commit_us // 1000 + 1) * 1000
    for fs in FEATURE_SETS:
        rows = watcher.seen.get((fs, change.user), [])
        j = bisect.bisect_left(rows, (bar, 0.0))
        if j >= len(rows):
            return None
        clock_us, at = rows[j]
        if worst is None or at > worst[1]:
            worst = (clock_us / 1e6, at)
    return worst


def _stages(watcher: common.InvalidationWatcher, changes: list[Change]) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    never = 0
    for c in changes:
        fresh = _covering(watcher, c)
        if fresh is None:
            never += 1
            continue
        at = {
            "commit": c.commit_us / 1e6,
            "debezium": c.debezium_us / 1e6,
            "kafka": c.kafka_ms / 1e3,
            "received": c.received,
            "recompute": fresh[0],
            "redis": fresh[1],
        }
        for name, a, b in STAGES:
            times[name].append((at[b] - at[a]) * 1000)
    return {
        "changes": len(changes),
        "never_fresh": never,
        "stages_ms": {name: _pcts(xs) for name, xs in times.items()},
    }


def _pcts(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(np.array(xs), [50, 90, 99])
    return {
        "p50": round(float(p50), 1),
        "p90": round(float(p90), 1),
        "p99": round(float(p99), 1),
        "max": round(float(max(xs)), 1),
    }


@dataclass
class Pipeline:
    """The run's connector (its config changed per window) and consumer process."""

    ctx: common.Context
    version: int
    tenant: str
    settings: Any = None
    client: ConnectClient | None = None
    owned: Any = None
    watcher: common.InvalidationWatcher | None = None
    proc: subprocess.Popen[bytes] | None = None
    log: Any = None
    registered: bool = False
    cdc_topics: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.settings = self.ctx.settings_for(schema_version=self.version)
        self.ctx.kafka_topics()
        self.owned = names(self.settings)
        self.client = ConnectClient(self.settings.connect_url)
        self.client.ping()
        self.cdc_topics = [self.owned.topic(t) for t in captured_tables()]
        ensure_cdc_topics(self.settings, self.cdc_topics)
        self.watcher = common.InvalidationWatcher(self.ctx.new_redis(), self.version, self.tenant)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()

    def connector(self, tuned: bool) -> dict[str, str]:
        """(Re)configure the connector, tuned or as before issue 26; wait until it runs."""
        assert self.client is not None
        config = connector_config(self.settings, self.owned)
        if not tuned:
            for key in LATENCY_SETTINGS:
                config.pop(key, None)
            config.update(BEFORE_CONNECTOR)
        self.client.put_config(self.owned.connector, config)
        self.registered = True
        time.sleep(2.0)  # the config change restarts the task: let it begin

        def running() -> bool:
            assert self.client is not None
            connector, tasks = connector_state(self.client, self.owned.connector)
            return (
                connector is not None
                and connector.state == "RUNNING"
                and bool(tasks)
                and all(t.state == "RUNNING" for t in tasks)
                and slot_state(self.ctx.engine, self.owned.slot) is not None
            )

        _wait(running, "the connector to run", 60)
        return {k: config[k] for k in sorted(config) if k in {*LATENCY_SETTINGS, *BEFORE_CONNECTOR}}

    def consume(self, env: dict[str, str], topics: list[str] | None = None) -> None:
        """(Re)start ``freshline consume`` with ``env``; on ``topics`` or its default."""
        self.stop_consumer()
        group = f"{self.settings.consumer_group}-{self.version}-{time.monotonic_ns()}"
        argv = [FRESHLINE, "consume", "--metrics-port", "0", "--group", group]
        for t in topics or []:
            argv += ["--topics", t]
        self.proc = subprocess.Popen(
            argv,
            env={
                **os.environ,
                "FRESHLINE_POSTGRES_URL": self.settings.postgres_url,
                "FRESHLINE_REDIS_URL": self.settings.redis_url,
                "FRESHLINE_SCHEMA_VERSION": str(self.version),
                "FRESHLINE_TOPIC_PREFIX": self.settings.topic_prefix,
                "FRESHLINE_AUTO_OFFSET_RESET": "latest",
                **env,
            },
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,
        )

    def probe(self, poke: Callable[[], None]) -> None:
        """``poke`` (a write) until one comes out the far end: the consumer has joined."""
        assert self.watcher is not None and self.proc is not None
        before = sum(len(v) for v in self.watcher.seen.values())
        end = time.monotonic() + 90
        while sum(len(v) for v in self.watcher.seen.values()) == before:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"freshline consume exited: {self.log.read()[-2000:]!r}")
            if time.monotonic() > end:
                self.log.seek(0)
                raise RuntimeError(
                    f"no probe write reached Redis within 90 s: {self.log.read()[-3000:]!r}"
                )
            poke()
            time.sleep(0.5)  # pacing the probes while the group forms
        time.sleep(1.0)  # let the probes drain

    def stop_consumer(self) -> None:
        if self.proc is not None:
            common.stop_process(self.proc)
            self.proc = None

    def close(self) -> None:
        self.stop_consumer()
        if self.watcher is not None:
            self.watcher.close()
        if self.log is not None:
            self.log.close()
        if self.registered and self.client is not None:
            with contextlib.suppress(Exception):
                self.client.delete(self.owned.connector)
            drop_slot(self.ctx.engine, self.owned.slot)
        _delete_topics(
            self.ctx,
            [*self.cdc_topics, f"__debezium-heartbeat.{self.owned.topic_prefix}"],
        )


def _wait(condition: Callable[[], bool], what: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)  # polling interval


def _sql_poke(conninfo: str, tenant: str, user: int) -> Callable[[], None]:
    def poke() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id) "
                "VALUES (%s, %s, 1, 'probe')",
                (tenant, user),
            )

    return poke


def _cdc_window(
    pipe: Pipeline, changes: Changes, conninfo: str, writers: list[int], rate: int, window: float
) -> dict[str, Any]:
    assert pipe.watcher is not None
    load = os.getloadavg()[0]
    start_us = int(time.time() * 1e6)
    with background(conninfo, pipe.tenant, writers, rate, window) as finish:
        writes, took = finish(False)
    # Drain: every write on the topic, then its entry in Redis (or 30 s).
    _wait(lambda: len(changes.since(start_us)) >= writes, "every write on the CDC topic", 60)
    mine = changes.since(start_us)[:writes]
    end = time.monotonic() + 30
    while time.monotonic() < end:
        pipe.watcher.sort()
        if _covering(pipe.watcher, mine[-1]) is not None:
            break
        time.sleep(0.1)  # polling for the drain
    time.sleep(0.5)  # stragglers of the last batch
    pipe.watcher.sort()
    return {
        "offered_per_s": rate,
        "achieved_per_s": round(writes / took, 1),
        "writes": writes,
        "load_at_start": round(load, 2),
        **_stages(pipe.watcher, mine),
    }


def cdc(pipe: Pipeline, conninfo: str, writers: list[int], quick: bool) -> dict[str, Any]:
    """Each rate with the settings before issue 26, then with the current ones, in that
    order (a new consumer for each window: a backlog left by one is not the next's)."""
    window = 4.0 if quick else 20.0
    changes = Changes(pipe.settings, pipe.owned.topic("transactions"), pipe.tenant)
    poke = _sql_poke(conninfo, pipe.tenant, writers[0])
    out: dict[str, Any] = {"window_s": window, "configs": {}, "windows": {}}
    try:
        for rate in RATES:
            for label, tuned in (("before", False), ("after", True)):
                out["configs"][label] = {"connector": pipe.connector(tuned)}
                pipe.consume({})
                pipe.probe(poke)
                common.note(
                    f"freshness: CDC stages, {label}, {rate} SQL writes/s for {window:.0f} s"
                )
                res = _cdc_window(pipe, changes, conninfo, writers, rate, window)
                out["windows"][f"{label}@{rate}"] = res
                e2e = res["stages_ms"]["commit -> Redis"]
                common.note(f"freshness:   commit -> Redis p50 {e2e['p50']} p99 {e2e['p99']} ms")
                time.sleep(1.0 if quick else SETTLE_S)  # what the window left behind settles
    finally:
        changes.close()
    return out


# -- read-your-writes --------------------------------------------------------------------


@dataclass
class Trials:
    latencies_ms: list[float] = field(default_factory=list)
    by_form: dict[str, list[float]] = field(default_factory=lambda: {"in txn": [], "after": []})
    sources: Counter[str] = field(default_factory=Counter)
    predates: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _epoch_ms(value: Any) -> int | None:
    """An answer's timestamp (epoch ms, as the API sends them; or ISO text) in epoch ms."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return int(value)
    return int(datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp() * 1000)


def _trial_thread(
    conninfo: str,
    url: str,
    api_key: str,
    tenant: str,
    users: list[int],
    count: int,
    out: Trials,
    producer: Producer | None,
    topic: str,
    wait_ms: int | None,
) -> None:
    extra = {} if wait_ms is None else {"wait_ms": str(wait_ms)}
    with (
        psycopg.connect(conninfo, autocommit=True) as conn,
        httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30
        ) as http,
    ):
        for i in range(count):
            user = users[i % len(users)]
            in_txn = i % 2 == 0
            with conn.transaction():
                row = conn.execute(
                    "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id) "
                    "VALUES (%s, %s, %s, 'ryw') RETURNING id, created_at",
                    (tenant, user, 1 + i % 400),
                    prepare=True,
                ).fetchone()
                assert row is not None
                token = conn.execute("SELECT freshline.token()").fetchone() if in_txn else None
            committed = time.perf_counter()
            if token is None:
                token = conn.execute("SELECT freshline.token()").fetchone()
            assert token is not None
            if producer is not None:
                producer.produce(
                    topic,
                    orjson.dumps({"tenant": tenant, "user_id": user, "transaction_id": row[0]}),
                    f"{tenant}:{user}".encode(),
                )
                producer.inner.poll(0)
            r = http.get(f"/v1/features/{RYW_SET}/{user}", params={"after": token[0], **extra})
            took = (time.perf_counter() - committed) * 1000
            with out.lock:
                if r.status_code != 200:
                    out.errors[f"{r.status_code} {r.text[:80]}"] += 1
                    continue
                body = r.json()
                last = _epoch_ms((body.get("values") or {}).get("last_txn_at"))
                # Entries keep milliseconds: compare the row's created_at truncated alike.
                if last is None or last < (row[1] - EPOCH) // timedelta(milliseconds=1):
                    out.predates += 1
                out.sources[str(body.get("source"))] += 1
                out.latencies_ms.append(took)
                out.by_form["in txn" if in_txn else "after"].append(took)


def ryw(
    pipe: Pipeline,
    conninfo: str,
    url: str,
    api_key: str,
    writers: list[int],
    trial_users: list[int],
    trials: int,
    *,
    events: bool,
    wait_ms: int | None = None,
) -> dict[str, Any]:
    """``trials`` read-your-writes trials over :data:`TRIAL_THREADS` threads, with
    :data:`LOAD_RATE` background writes/s (and their domain events, with ``events``),
    reading with ``wait_ms`` (the server's default when None)."""
    settings = pipe.settings
    topics = {t: qualified(settings, t) for t in ("transaction.created", "transaction.updated")}
    out = Trials()
    per_thread = -(-trials // TRIAL_THREADS)
    groups = [trial_users[k::TRIAL_THREADS] for k in range(TRIAL_THREADS)]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}) as http:
        for u in trial_users:  # their entries are cached before the trials begin
            http.get(f"/v1/features/{RYW_SET}/{u}")
    producer = Producer(settings, **{"linger.ms": 1}) if events else None
    load_events = topics if events else None
    load = os.getloadavg()[0]
    started = time.perf_counter()
    try:
        with background(
            conninfo, pipe.tenant, writers, LOAD_RATE, 3600, seed=11, events=load_events
        ) as finish:
            time.sleep(1.0)  # the load is on before the first trial
            threads = [
                threading.Thread(
                    target=_trial_thread,
                    args=(
                        conninfo,
                        url,
                        api_key,
                        pipe.tenant,
                        groups[k],
                        per_thread,
                        out,
                        producer,
                        topics["transaction.created"],
                        wait_ms,
                    ),
                )
                for k in range(TRIAL_THREADS)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - started
            writes, took = finish(True)
    finally:
        if producer is not None:
            producer.close()
    lat = np.array(out.latencies_ms)
    return {
        "trials": int(lat.size) + sum(out.errors.values()),
        "answered": int(lat.size),
        "predates_commit": out.predates,
        "errors": dict(out.errors),
        "sources": dict(out.sources),
        "latency_ms": _pcts(out.latencies_ms),
        "latency_ms_by_token": {form: _pcts(xs) for form, xs in out.by_form.items()},
        "trials_per_s": round(lat.size / elapsed, 1),
        "elapsed_s": round(elapsed, 1),
        "load_per_s": round(writes / took, 1),
        "load_at_start": round(load, 2),
    }


def _events_poke(settings: Any, tenant: str, user: int) -> Callable[[], None]:
    topic = qualified(settings, "transaction.updated")

    def poke() -> None:
        with Producer(settings) as producer:
            producer.produce(
                topic,
                orjson.dumps({"tenant": tenant, "user_id": user, "transaction_id": 0}),
                f"{tenant}:{user}".encode(),
            )
            producer.flush()

    return poke


# -- token reads against plain reads -------------------------------------------------------


def _token(conninfo: str, tenant: str, *, in_txn: bool) -> str:
    """A token of a write of ours: taken inside the transaction, or right after it."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        with conn.transaction():
            conn.execute(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id) "
                "VALUES (%s, 1, 1, 'token')",
                (tenant,),
            )
            token = conn.execute("SELECT freshline.token()").fetchone() if in_txn else None
        if token is None:
            token = conn.execute("SELECT freshline.token()").fetchone()
    assert token is not None
    return str(token[0])


def _covered(ctx: common.Context, conninfo: str, tokens: list[str]) -> None:
    """Make entries computed from now on cover ``tokens``: rank each (a transaction
    token's rank is then shared through Redis, so the API's workers rank it alike;
    ranked later, its bar would pass entries computed before), then issue one
    transaction id, which every later snapshot's xmax passes."""
    from pipeline.cache.tokens import Tokens

    ranks = Tokens(ctx.engine, ctx.redis)
    for text in tokens:
        token = ranks.parse(text)
        if ranks.rank(token) is None and ranks.resolve(token) is None:
            raise RuntimeError("a committed transaction's token did not rank")
    with psycopg.connect(conninfo, autocommit=True) as conn, conn.transaction():
        conn.execute("SELECT pg_current_xact_id()")


def _wrk_get(key: str, users: list[int], query: str) -> str:
    ids = ", ".join(str(u) for u in users)
    return (
        f"local ids = {{{ids}}}\nlocal i = 0\n"
        "request = function()\n  i = i % #ids + 1\n"
        f"  return wrk.format('GET', '/v1/features/{RYW_SET}/' .. ids[i] .. '{query}', "
        f"{{['Authorization'] = 'Bearer {key}'}})\nend\n"
    )


def token_reads(ctx: common.Context, quick: bool) -> dict[str, Any]:
    """p50 at c=16 of token reads whose entries cover the token, against plain reads."""
    from pipeline.cache.client import FeatureClient
    from pipeline.cache.readthrough import ReadThrough
    from pipeline.cache.store import FeatureStore

    data = ctx.dataset()
    conninfo = _connstr(ctx.settings.postgres_url)
    tokens = {
        "after commit": _token(conninfo, data.tenant, in_txn=False),
        "in txn": _token(conninfo, data.tenant, in_txn=True),
    }
    _covered(ctx, conninfo, list(tokens.values()))
    version, tenant, key, users = reference_app.prepared(ctx)  # computed after the tokens
    scripts = {"plain": _wrk_get(key, users, "")} | {
        f"after ({form})": _wrk_get(key, users, f"?after={tok}") for form, tok in tokens.items()
    }
    rounds, seconds = (1, 2) if quick else (5, 5)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in scripts}
    with reference_app.serve_freshline(ctx, version) as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
            for tok in tokens.values():  # every worker resolves and remembers them
                for _ in range(8):
                    got = http.get(f"/v1/features/{RYW_SET}/1", params={"after": tok}).json()
                    if got.get("source") != "hit":
                        raise RuntimeError(
                            f"a covered token read answered {got.get('source')}: {got!r:.300}"
                        )
        for r in range(rounds):
            order = list(scripts)[r % len(scripts) :] + list(scripts)[: r % len(scripts)]
            for name in order:
                runs[name].append(
                    reference_app.wrk(url, scripts[name], concurrency=16, seconds=seconds)
                )
    http_figures = {
        name: {m: statistics.median(x[m] for x in rs) for m in ("p50_us", "p99_us", "ops_per_s")}
        for name, rs in runs.items()
    }
    http_ratios = {
        name: round(
            statistics.median(
                a["p50_us"] / b["p50_us"] for a, b in zip(rs, runs["plain"], strict=True)
            ),
            3,
        )
        for name, rs in runs.items()
        if name != "plain"
    }
    # The Python client, 16 threads.
    r = ctx.new_redis()
    client = FeatureClient(
        r, version, readthrough=ReadThrough(FeatureStore(r, version), ctx.engine)
    )
    counter = iter(range(10**9))

    def reader(after: str | None) -> Callable[[], Any]:
        def read() -> Any:
            u = users[next(counter) % len(users)]
            if after is None:
                return client.get(RYW_SET, tenant, u)
            return client.get(RYW_SET, tenant, u, after=after)

        return read

    py = common.measure(
        {"plain": reader(None), "after (after commit)": reader(tokens["after commit"])},
        rounds=3 if quick else 7,
        calls=800 if quick else 4000,
        concurrency=16,
    )
    r.close()
    return {
        "rounds": rounds,
        "seconds": seconds,
        "http": http_figures,
        "http_p50_ratio": http_ratios,
        "client": py,
        "client_p50_ratio": common.ratio(
            py["after (after commit)"]["p50_us"], py["plain"]["p50_us"]
        ),
    }


# -- the run -----------------------------------------------------------------------------


def _part(res: dict[str, Any], name: str, measure: Callable[[], Any]) -> None:
    """``res[name] = measure()``; a part that fails is reported and the others kept."""
    try:
        res[name] = measure()
    except Exception as exc:  # one part's failure must not lose the others' figures
        common.note(f"freshness: {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
        res.setdefault("failed", {})[name] = f"{type(exc).__name__}: {str(exc)[:2000]}"


def run(quick: bool, parts: tuple[str, ...] = PARTS, trials: int | None = None) -> dict[str, Any]:
    ctx = common.context(quick)
    data = ctx.dataset()
    res: dict[str, Any] = {"parts": list(parts)}
    if "token" in parts:
        common.note("freshness: token reads against plain reads (wrk, c=16)")
        _part(res, "token", lambda: token_reads(ctx, quick))
    if "cdc" in parts or "ryw" in parts:
        conninfo = _connstr(ctx.settings.postgres_url)
        writers = _writers(conninfo, data.tenant)
        version = ctx.schema_version()
        pipe = Pipeline(ctx, version, data.tenant)
        try:
            if "cdc" in parts:
                _part(res, "cdc", lambda: cdc(pipe, conninfo, writers, quick))
            if "ryw" in parts:
                _part(res, "ryw", lambda: _ryw_both(ctx, pipe, conninfo, writers, quick, trials))
        finally:
            pipe.close()
    res["targets"] = _targets(res)
    res["parameters"] = {
        "rates": list(RATES),
        "load_rate": LOAD_RATE,
        "trial_threads": TRIAL_THREADS,
        "feature_sets": list(FEATURE_SETS),
        "before_connector": BEFORE_CONNECTOR,
        "after_connector": LATENCY_SETTINGS,
        "batch_max_wait_ms": ctx.settings.batch_max_wait_ms,
        "token_wait_ms": ctx.settings.token_wait_ms,
        "dataset": {"users": data.users, "transactions": data.transactions},
    }
    return res


def _ryw_both(
    ctx: common.Context,
    pipe: Pipeline,
    conninfo: str,
    writers: list[int],
    quick: bool,
    trials: int | None = None,
) -> dict[str, Any]:
    """Read-your-writes through Debezium (with the server's default ``wait_ms``, then
    half as many trials with ``wait_ms=0``: straight to the recompute), then through
    domain events."""
    from pipeline.api.auth import create_api_key

    trials = trials or (200 if quick else 2000)
    busy = set(writers)
    spare = [u for u in range(ctx.dataset().users, 0, -1) if u not in busy]
    trial_users = spare[: TRIAL_THREADS * TRIAL_USERS_PER_THREAD]
    api_key = create_api_key(ctx.engine, pipe.tenant)
    out: dict[str, Any] = {"trials_asked": trials}
    with reference_app.serve_freshline(ctx, pipe.version) as url:
        pipe.connector(tuned=True)
        pipe.consume({})
        pipe.probe(_sql_poke(conninfo, pipe.tenant, writers[0]))
        common.note(f"freshness: read-your-writes through Debezium, {trials} trials")
        out["sql"] = ryw(pipe, conninfo, url, api_key, writers, trial_users, trials, events=False)
        _note_ryw(out["sql"])
        common.note(f"freshness: the same with wait_ms=0, {trials // 2} trials")
        out["sql_wait0"] = ryw(
            pipe, conninfo, url, api_key, writers, trial_users, trials // 2, events=False, wait_ms=0
        )
        _note_ryw(out["sql_wait0"])
        try:
            domain = [
                qualified(pipe.settings, t) for t in ("transaction.created", "transaction.updated")
            ]
            pipe.consume({}, topics=domain)
            pipe.probe(_events_poke(pipe.settings, pipe.tenant, writers[0]))
            common.note(f"freshness: read-your-writes through domain events, {trials} trials")
            out["events"] = ryw(
                pipe, conninfo, url, api_key, writers, trial_users, trials, events=True
            )
            _note_ryw(out["events"])
        except Exception as exc:  # keep the Debezium half's figures
            out["events_failed"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    return out


def _note_ryw(r: dict[str, Any]) -> None:
    common.note(
        f"freshness:   {r['answered']} answered, {r['predates_commit']} predate the commit, "
        f"p50 {r['latency_ms']['p50']} p99 {r['latency_ms']['p99']} ms, sources {r['sources']}, "
        f"errors {r['errors']}"
    )


def _targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path, label in (("sql", "plain SQL via Debezium"), ("events", "domain events")):
        r = res.get("ryw", {}).get(path)
        if r is None:
            continue
        share = r["answered"] / r["trials"] if r["trials"] else None
        out += [
            common.target(
                f"read-your-writes ({label}): answers after the commit",
                None
                if share is None
                else round(100 * share * (1 - r["predates_commit"] / max(1, r["answered"])), 3),
                ">=",
                100,
                "%",
            ),
            common.target(
                f"read-your-writes ({label}): commit to answer p99",
                r["latency_ms"]["p99"],
                "<=",
                250,
                "ms",
            ),
        ]
    tok = res.get("token")
    if tok is not None:
        out.append(
            common.target(
                "covered token read vs plain read, HTTP p50 at c=16",
                tok["http_p50_ratio"].get("after (after commit)"),
                "<=",
                1.1,
                "x",
            )
        )
    windows = res.get("cdc", {}).get("windows", {})
    for rate, limit in zip(RATES, (250, 400), strict=True):
        w = windows.get(f"after@{rate}")
        if w is not None:
            out.append(
                common.target(
                    f"CDC commit-to-Redis p99 at {rate:,} SQL writes/s",
                    w["stages_ms"]["commit -> Redis"]["p99"],
                    "<=",
                    limit,
                    "ms",
                )
            )
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "## freshness: read-your-writes, token reads and the CDC path's stages",
        "",
        "Issue 26. See `bench/freshness.py` for what each part measures.",
        "",
    ]
    tok = res.get("token")
    if tok is not None:
        rows = [
            (
                name,
                f["p50_us"],
                f["p99_us"],
                f["ops_per_s"],
                f"{tok['http_p50_ratio'].get(name, 1.0):.2f}x",
            )
            for name, f in tok["http"].items()
        ]
        c = tok["client"]
        lines += [
            "### Token reads whose entry covers the token, against plain reads",
            "",
            f"`GET /v1/features/txn_90d/{{id}}` on `freshline serve` (2 workers, tier off) "
            f"over 1,000 cached users, `wrk` at 16 connections, {tok['rounds']} interleaved "
            f"rounds of {tok['seconds']} s; medians over rounds, the ratio is the median of "
            "each round's p50 ratio to the plain read.",
            "",
            common.table(["read", "p50 µs", "p99 µs", "req/s", "p50 vs plain"], rows),
            "",
            "The Python client (`FeatureClient.get`, 16 threads): p50 "
            f"{c['plain']['p50_us']:.0f} µs plain, {c['after (after commit)']['p50_us']:.0f} µs "
            f"with `after=` ({tok['client_p50_ratio']}x).",
            "",
        ]
    cdc_res = res.get("cdc")
    if cdc_res is not None:
        cfg = cdc_res["configs"]
        lines += [
            "### The CDC path, stage by stage, before and after tuning",
            "",
            f"Plain SQL writes (the `cdc_freshness` workload) for {cdc_res['window_s']:.0f} s "
            "per window, each rate once per configuration, in the order of the columns. "
            "Before: connector "
            + ", ".join(f"`{k}={v}`" for k, v in cfg["before"]["connector"].items())
            + " (the rest Debezium's and Connect's defaults). After: "
            + ", ".join(f"`{k}={v}`" for k, v in cfg["after"]["connector"].items())
            + " (`pipeline/cdc/connect.py`, `LATENCY_SETTINGS`). The consumer is the same in "
            f"both (`freshline consume`, batches wait at most "
            f"{res['parameters']['batch_max_wait_ms']} ms). "
            "Each stage is the p50 / p99 in ms of the time between two stamps of a change "
            "(clocks of one machine); the last row is commit to the entry in Redis.",
            "",
        ]
        windows = cdc_res["windows"]
        header = ["stage", *windows]
        stage_rows: list[tuple[Any, ...]] = [
            (name, *(_pp(w["stages_ms"][name]) for w in windows.values())) for name, _, _ in STAGES
        ]
        stage_rows.append(("writes/s achieved", *(w["achieved_per_s"] for w in windows.values())))
        stage_rows.append(
            (
                "changes (never fresh)",
                *(f"{w['changes']:,} ({w['never_fresh']})" for w in windows.values()),
            )
        )
        stage_rows.append(
            ("load average at start", *(w["load_at_start"] for w in windows.values()))
        )
        lines += [common.table(header, stage_rows), ""]
    ryw_res = res.get("ryw")
    if ryw_res is not None:
        ryw_rows: list[tuple[Any, ...]] = []
        for path, label in (
            ("sql", "plain SQL via Debezium"),
            ("sql_wait0", "plain SQL via Debezium, `wait_ms=0`"),
            ("events", "domain events"),
        ):
            r = ryw_res.get(path)
            if r is None:
                continue
            ryw_rows.append(
                (
                    label,
                    r["trials"],
                    r["predates_commit"],
                    sum(r["errors"].values()),
                    _pp(r["latency_ms"]),
                    _pp(r["latency_ms_by_token"]["in txn"]),
                    _pp(r["latency_ms_by_token"]["after"]),
                    ", ".join(f"{k} {v:,}" for k, v in sorted(r["sources"].items())),
                    r["load_per_s"],
                )
            )
        lines += [
            "### Read-your-writes",
            "",
            f"{TRIAL_THREADS} threads, each committing an INSERT for users of its own and "
            "then reading `txn_90d` with `after=` its token (the server's default `wait_ms`, "
            f"{res['parameters'].get('token_wait_ms', 100)} ms, unless the row says), beside "
            f"{LOAD_RATE} SQL writes/s of background load on other users. Half the tokens "
            "come from inside the transaction, half from right after commit. Latency runs "
            "from the COMMIT's return to the answer.",
            "",
            common.table(
                [
                    "path",
                    "trials",
                    "predate commit",
                    "errors",
                    "p50 / p99 ms",
                    "token in txn",
                    "token after",
                    "answered from",
                    "load/s",
                ],
                ryw_rows,
            ),
            "",
        ]
    failed = {**res.get("failed", {})}
    if ryw_res is not None and "events_failed" in ryw_res:
        failed["ryw (domain events)"] = ryw_res["events_failed"]
    for name, error in failed.items():
        lines += [f"**{name} failed**: `{error[:300]}`", ""]
    if res.get("targets"):
        lines += [common.targets_table(res["targets"]), ""]
    return "\n".join(lines)


def _pp(p: dict[str, Any]) -> str:
    return f"{common.fmt(p['p50'])} / {common.fmt(p['p99'])}"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.freshness", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="smoke sizes")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--trials", type=int, help="read-your-writes trials per path")
    args = parser.parse_args()
    res = common.run_standalone(lambda q: run(q, tuple(args.parts), args.trials), args.quick)
    print(orjson.dumps(res, option=orjson.OPT_INDENT_2).decode() if args.json else markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
