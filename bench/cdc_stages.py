"""The CDC path's stages, per change: commit, Debezium's event, the Kafka record, a
consumer's receipt, the recompute's start, the entry's invalidation on Redis.

:class:`Pipeline` holds a benchmark's connector (reconfigured per window) and its
``freshline consume``; :func:`cdc` runs :data:`RATES` with the connector settings before
issue 26 and with the current ones (see :mod:`bench.freshness`)."""

from __future__ import annotations

import bisect
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from confluent_kafka import Message

from bench import common
from bench.cdc_freshness import TenantChanges, _delete_topics, _remove_connector, _wait
from bench.sql_load import background
from freshline.consumers.topics import ensure_cdc_topics
from freshline.pipeline.cdc.connect import (
    LATENCY_SETTINGS,
    ConnectClient,
    captured_tables,
    connector_config,
    names,
    streaming,
)
from tests.helpers import REGISTRY

RATES = (500, 2000)
SETTLE_S = 10.0
WARMUP_S = 3.0
"""Writes at a window's rate before its changes count: each window starts a consumer
(and may reconfigure the connector, which restarts its task), and their first batches
are not the steady state the window measures. Without it, in four windows at 500
writes/s after one reconfiguration (2026-12-07), the first window's 60 slowest changes
all came in its first 0.3 s: commit to Debezium event took 100-170 ms, the new
consumer's first batch 288 ms."""
"""A pause after each CDC window, so work it left in Postgres does not land on the next."""
FEATURE_SETS = ("txn_90d", "geo")
FRESHLINE = str(Path(sys.executable).with_name("freshline"))
BEFORE_CONNECTOR = {"poll.interval.ms": "50"}
"""The connector's latency settings before issue 26 (the rest were Debezium's and
Connect's defaults): the "before" windows run with these instead of
:data:`freshline.pipeline.cdc.connect.LATENCY_SETTINGS`."""
STAGES = (
    ("commit -> Debezium event", "commit", "debezium"),
    ("Debezium -> Kafka record", "debezium", "kafka"),
    ("Kafka -> consumer receive", "kafka", "received"),
    ("receive -> recompute start", "received", "recompute"),
    ("recompute start -> Redis", "recompute", "redis"),
    ("commit -> Redis", "commit", "redis"),
)


@dataclass
class Change:
    user: str
    commit_us: int
    debezium_us: int
    kafka_ms: int
    received: float


class Changes(TenantChanges):
    """The CDC topic of ``transactions`` as a consumer with the consumer's own settings
    sees it: per change of ``tenant``, its commit, Debezium's and Kafka's timestamps,
    and when it was received (one record per poll, so nothing waits for a batch)."""

    def __init__(self, settings: Any, topic: str, tenant: str) -> None:
        self.seen: list[Change] = []
        self._at = 0.0
        super().__init__(settings, topic, tenant, group="stages", reset="latest")

    def receive(self) -> list[Message]:
        msg = self.consumer.poll(0.1)
        self._at = time.time()  # received: before the record is decoded
        return [] if msg is None else [msg]

    def take(self, msg: Message, env: dict[str, Any], row: dict[str, Any]) -> None:
        source = env["source"]
        self.seen.append(
            Change(
                str(row["user_id"]),
                int(source.get("ts_us") or source["ts_ms"] * 1000),
                int(env.get("ts_us") or env["ts_ms"] * 1000),
                int(msg.timestamp()[1]),
                self._at,
            )
        )

    def since(self, start_us: int) -> list[Change]:
        return [c for c in self.seen if c.commit_us >= start_us]


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
        "stages_ms": {name: pcts(xs) for name, xs in times.items()},
    }


def pcts(xs: list[float]) -> dict[str, float | None]:
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
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log: Any = None
    registered: bool = False
    cdc_topics: list[str] = field(default_factory=list)
    running: tuple[bool | None, dict[str, str] | None, list[str] | None] = (None, None, None)
    """The connector's configuration (tuned or not) and the consumer's environment and
    topics, as last set: what :meth:`reuse` compares."""

    def __post_init__(self) -> None:
        self.settings = self.ctx.settings_for(schema_version=self.version)
        self.ctx.kafka_topics()
        self.owned = names(self.settings)
        self.client = ConnectClient(self.settings.connect_url)
        self.client.ping()
        self.cdc_topics = [self.owned.topic(t) for t in captured_tables(REGISTRY)]
        ensure_cdc_topics(self.settings, self.cdc_topics)
        self.watcher = common.InvalidationWatcher(self.ctx.new_redis(), self.version, self.tenant)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()

    def connector(self, tuned: bool) -> dict[str, str]:
        """(Re)configure the connector, tuned or as before issue 26; wait until it runs."""
        client = self.client
        assert client is not None
        config = connector_config(self.settings, self.owned)
        if not tuned:
            for key in LATENCY_SETTINGS:
                config.pop(key, None)
            config.update(BEFORE_CONNECTOR)
        client.put_config(self.owned.connector, config)
        self.registered = True
        self.running = (tuned, None, None)
        # The config change restarts the task: let it begin. A smoke run goes on at once:
        # its probe (:meth:`probe`) waits for a write to come through all the same.
        if not self.ctx.quick:
            time.sleep(2.0)
        _wait(lambda: streaming(client, self.ctx.engine, self.owned), "the connector to run", 60)
        return {k: config[k] for k in sorted(config) if k in {*LATENCY_SETTINGS, *BEFORE_CONNECTOR}}

    def consume(self, env: dict[str, str], topics: list[str] | None = None) -> None:
        """(Re)start ``freshline consume`` with ``env``; on ``topics`` or its default.
        ``env["MEMBERS"]`` (not passed on) starts that many processes in one group."""
        self.stop_consumer()
        self.running = (self.running[0], dict(env), list(topics or []))
        env = dict(env)
        members = int(env.pop("MEMBERS", "1"))
        group = f"{self.settings.consumer_group}-{self.version}-{time.monotonic_ns()}"
        argv = [FRESHLINE, "consume", "--metrics-port", "0", "--group", group]
        for t in topics or []:
            argv += ["--topics", t]
        for _ in range(members):
            self.procs.append(
                subprocess.Popen(
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
            )

    def reuse(self, tuned: bool, env: dict[str, str], topics: list[str] | None = None) -> bool:
        """Whether the connector runs as ``tuned`` says and the consumer with ``env`` on
        ``topics``, all its processes alive: a smoke run then keeps them rather than
        starting them again."""
        return (
            self.running == (tuned, env, list(topics or []))
            and bool(self.procs)
            and all(proc.poll() is None for proc in self.procs)
        )

    def probe(self, poke: Callable[[], None]) -> None:
        """``poke`` (a write) until one comes out the far end: the consumer has joined."""
        assert self.watcher is not None and self.procs
        before = sum(len(v) for v in self.watcher.seen.values())
        end = time.monotonic() + 90
        while sum(len(v) for v in self.watcher.seen.values()) == before:
            if any(proc.poll() is not None for proc in self.procs):
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

    def pause_connector(self) -> None:
        """Pause the connector, as where domain events alone feed freshline; wait
        until it is paused."""
        client, name = self.client, self.owned.connector
        assert client is not None
        client.request("PUT", f"/connectors/{name}/pause")
        self.running = (None, *self.running[1:])

        def paused() -> bool:
            state = (client.status(name) or {}).get("connector", {}).get("state")
            return bool(state == "PAUSED")

        _wait(paused, "the connector to pause", 60)

    def stop_consumer(self) -> None:
        for proc in self.procs:
            common.stop_process(proc)
        self.procs.clear()

    def close(self) -> None:
        self.stop_consumer()
        if self.watcher is not None:
            self.watcher.close()
        if self.log is not None:
            self.log.close()
        if self.registered and self.client is not None:
            _remove_connector(self.ctx, self.client, self.owned)
        _delete_topics(self.ctx, [*self.cdc_topics, self.owned.heartbeat_topic])


def sql_poke(conninfo: str, tenant: str, user: int) -> Callable[[], None]:
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
) -> tuple[dict[str, Any], list[Change]]:
    """One window of writes at ``rate``: its figures, and its changes. The writes run
    :data:`WARMUP_S` longer, first: the changes committed then are not counted."""
    assert pipe.watcher is not None
    load = os.getloadavg()[0]
    begun_us = int(time.time() * 1e6)
    warmup = min(WARMUP_S, window / 4)
    with background(conninfo, pipe.tenant, writers, rate, warmup + window) as finish:
        start_us = int((time.time() + warmup) * 1e6)  # the writers are connected
        writes, took = finish(False)
    # Drain: every write on the topic, then its entry in Redis (or 30 s).
    _wait(lambda: len(changes.since(begun_us)) >= writes, "every write on the CDC topic", 60)
    mine = [c for c in changes.since(begun_us)[:writes] if c.commit_us >= start_us]
    end = time.monotonic() + 30
    while time.monotonic() < end:
        pipe.watcher.sort()
        if _covering(pipe.watcher, mine[-1]) is not None:
            break
        time.sleep(0.1)  # polling for the drain
    time.sleep(0.5)  # stragglers of the last batch
    pipe.watcher.sort()
    res = {
        "offered_per_s": rate,
        "achieved_per_s": round(writes / took, 1),
        "writes": len(mine),
        "warmup_s": warmup,
        "load_at_start": round(load, 2),
        **_stages(pipe.watcher, mine),
    }
    return res, mine


def _pooled(
    watcher: common.InvalidationWatcher, windows: list[tuple[dict[str, Any], list[Change]]]
) -> dict[str, Any]:
    """The windows of one configuration as one: their changes' stages taken together."""
    figures = [f for f, _ in windows]
    return {
        "offered_per_s": figures[0]["offered_per_s"],
        "achieved_per_s": round(statistics.mean(f["achieved_per_s"] for f in figures), 1),
        "writes": sum(f["writes"] for f in figures),
        "load_at_start": max(f["load_at_start"] for f in figures),
        **_stages(watcher, [c for _, mine in windows for c in mine]),
        "windows": figures,
    }


ORDER = (("before", False), ("after", True), ("after", True), ("before", False))
"""The connector's configurations at each rate, in run order: each window adds rows to
the busy users' current day, which makes the next one slower, so both run first and
last once (ABBA) and each configuration's two windows are taken together."""


def cdc(pipe: Pipeline, conninfo: str, writers: list[int], quick: bool) -> dict[str, Any]:
    """Each rate with the settings before issue 26 and with the current ones, in the
    order :data:`ORDER` (a new consumer for each window: a backlog left by one is not
    the next's)."""
    # Quick: one rate, each configuration once, to see that it runs.
    rates, order, window = (RATES[:1], ORDER[:2], 1.0) if quick else (RATES, ORDER, 20.0)
    changes = Changes(pipe.settings, pipe.owned.topic("transactions"), pipe.tenant)
    poke = sql_poke(conninfo, pipe.tenant, writers[0])
    out: dict[str, Any] = {"window_s": window, "order": "abba", "configs": {}, "windows": {}}
    assert pipe.watcher is not None
    try:
        for rate in rates:
            runs: dict[str, list[tuple[dict[str, Any], list[Change]]]] = {}
            for label, tuned in order:
                out["configs"][label] = {"connector": pipe.connector(tuned)}
                pipe.consume({})
                pipe.probe(poke)
                common.note(
                    f"freshness: CDC stages, {label}, {rate} SQL writes/s for {window:.0f} s"
                )
                res, mine = _cdc_window(pipe, changes, conninfo, writers, rate, window)
                runs.setdefault(label, []).append((res, mine))
                e2e = res["stages_ms"]["commit -> Redis"]
                common.note(f"freshness:   commit -> Redis p50 {e2e['p50']} p99 {e2e['p99']} ms")
                if not quick:  # a smoke run's figures are not read
                    time.sleep(SETTLE_S)  # what the window left behind settles
            for label, windows in runs.items():
                out["windows"][f"{label}@{rate}"] = _pooled(pipe.watcher, windows)
    finally:
        changes.close()
    return out


def consumers(
    pipe: Pipeline,
    conninfo: str,
    writers: list[int],
    builds: dict[str, dict[str, str]],
    *,
    rates: tuple[int, ...] = RATES,
    window: float = 20.0,
) -> dict[str, Any]:
    """Each rate with each consumer build, the connector tuned: ``builds`` maps a name to
    the environment of its ``freshline consume`` (another checkout's ``PYTHONPATH`` and
    ``FRESHLINE_REPO``; ``{}``: this one). The order of the builds alternates from one
    rate to the next, so neither always runs on the table the other has just grown."""
    changes = Changes(pipe.settings, pipe.owned.topic("transactions"), pipe.tenant)
    poke = sql_poke(conninfo, pipe.tenant, writers[0])
    out: dict[str, Any] = {"window_s": window, "windows": {}}
    try:
        pipe.connector(True)
        names = list(builds)
        for i, rate in enumerate(rates):
            for name in names if i % 2 == 0 else names[::-1]:
                pipe.consume(builds[name])
                pipe.probe(poke)
                common.note(f"cdc_stages: consumer {name}, {rate} SQL writes/s for {window:.0f} s")
                res, _ = _cdc_window(pipe, changes, conninfo, writers, rate, window)
                out["windows"][f"{name}@{rate}"] = res
                e2e = res["stages_ms"]["commit -> Redis"]
                common.note(f"cdc_stages:   commit -> Redis p50 {e2e['p50']} p99 {e2e['p99']} ms")
                time.sleep(SETTLE_S)  # what the window left behind settles
    finally:
        changes.close()
    return out


INSTALL = """
import sys
import sqlalchemy as sa
from freshline.pipeline.core.maintenance import install_missing
from freshline.pipeline.core.repository import active
with sa.create_engine(sys.argv[1]).begin() as conn:
    install_missing(conn, active().registry.maintenances())
"""
"""Install a checkout's derived paths in the run's database (a checkout of another
layout needs its own tables; both layouts' triggers then log every write, in every
window alike)."""


def main() -> int:
    """``python -m bench.cdc_stages NAME=TREE ...``: the CDC stages with the consumer of
    each checkout (``this`` is added, as this one), one run, printed as a table.
    ``NAME:VAR=VALUE`` is this checkout's consumer with an environment variable set
    (``everyfold:FRESHLINE_BUCKET_FOLD_ALL_INTERVAL_MS=0``); ``NAME:MEMBERS=N`` runs N
    of this checkout's consumers in one group."""
    import argparse

    from bench.cdc_freshness import _connstr, _writers

    parser = argparse.ArgumentParser(prog="python -m bench.cdc_stages", description=main.__doc__)
    parser.add_argument("builds", nargs="+", metavar="NAME=TREE")
    parser.add_argument("--rates", nargs="+", type=int, default=list(RATES))
    parser.add_argument("--window", type=float, default=20.0)
    args = parser.parse_args()
    builds: dict[str, dict[str, str]] = {}
    for spec in args.builds:
        name, tree = spec.split("=", 1)
        if ":" in name:  # this checkout, with a variable of its own
            name, variable = name.split(":", 1)
            builds[name] = {variable: tree}
            continue
        root = Path(tree).resolve()
        builds[name] = {"PYTHONPATH": str(root), "FRESHLINE_REPO": str(root / "examples/fraud")}
    builds["this"] = {}

    def run(quick: bool) -> dict[str, Any]:
        ctx = common.context(quick)
        for name, env in builds.items():  # each checkout's derived paths (its layout's)
            if "PYTHONPATH" in env:
                common.note(f"cdc_stages: installing the derived paths of {name}")
                subprocess.run(
                    [sys.executable, "-c", INSTALL, ctx.settings.postgres_admin_url],
                    env=os.environ | env,
                    cwd=env["PYTHONPATH"],  # (-c puts the working directory first)
                    check=True,
                )
        data = ctx.dataset()
        conninfo = _connstr(ctx.settings.postgres_url)
        pipe = Pipeline(ctx, ctx.schema_version(), data.tenant)
        try:
            writers = _writers(conninfo, data.tenant)
            return consumers(
                pipe, conninfo, writers, builds, rates=tuple(args.rates), window=args.window
            )
        finally:
            pipe.close()

    res = common.run_standalone(run, False)
    windows = res["windows"]
    rows: list[tuple[Any, ...]] = [
        (
            name,
            *(
                f"{w['stages_ms'][name]['p50']} / {w['stages_ms'][name]['p99']}"
                for w in windows.values()
            ),
        )
        for name, _, _ in STAGES
    ]
    rows.append(("writes/s achieved", *(w["achieved_per_s"] for w in windows.values())))
    rows.append(
        (
            "changes (never fresh)",
            *(f"{w['changes']} ({w['never_fresh']})" for w in windows.values()),
        )
    )
    rows.append(("load average at start", *(w["load_at_start"] for w in windows.values())))
    print(common.table(["stage", *windows], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
