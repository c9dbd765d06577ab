"""Consistency under steady load: what ``freshline audit`` finds while changes stream in.

The load: real changes at a fixed offered rate. Every 10 ms one Postgres transaction
changes the newest transaction of each of 20 distinct users (its amount, and its IP
to another city), then a
``transaction.updated`` event per user is produced: 2,000 events/s. Two loader threads
take turns, each owning half of the users (so their transactions never wait on each
other's row locks) and drawing its 20 with 80% of draws among its 10 of the 20 hot
users: about half the events go to the hot users, each changed 50 times a second,
the rest spread over every user. ``freshline consume`` runs as
a subprocess and applies the events; the consumer group's lag is read from the broker
every second, which gives the rate it actually applied.

The audit: ``freshline audit`` itself, as a subprocess (``--tenant --sample --duration
--rate --grace --json``), auditing the run's tenant while the load runs: sample after
sample by SCAN from a random cursor, recompute from Postgres, re-check each mismatch
after 1 s, 10 s and 60 s of grace. The load goes on until the audit's last re-check,
so every check and re-check sees the system under load. The audit's rate limit is
set high enough to reach a million checks in the full run: with no inconsistent
entry the nines are only a lower bound, log10 of the checks, so six nines need a
million. Entries are sampled with replacement, so a key is checked many times, each
check at a different moment of the load. After the flip the two audits together
check at most ``rate`` + ``new_rate`` (2,000) entries a second: each check is the
defining full query, and a second audit at 1,000/s on top of a first at 2,000/s added
half again to the instrument's own load on Postgres just as the deploy added its own
(in two runs of three the consumer then fell behind for good).

Window edges. The windowed feature sets (``txn_90d``: 90 days, ``geo``: 30 days)
change with time alone, so the workload crosses their edges throughout:

* rows that age out during the run: before the warm-up, one cold user in
  ``AGEING_SHARE`` per window gets a transaction that turns 90 (or 30) days old at a
  moment spread over the whole run; their events are sent then, so the entries exist,
  and no event comes when they age out (the entry's horizon must end it);
* rows created at the edge: every ``EDGE_TICK_S`` an edge thread inserts, for cold
  users, transactions at most ``EDGE_SLACK_S`` inside each window's edge, which age out
  moments after their event is applied;
* late rows: the same thread inserts a transaction created between an hour and 89 days
  ago (a late arrival inside both windows or only the 90-day one).

Each inserted row is followed by a ``transaction.updated`` event naming its user.

A deploy. ``DEPLOY_AT_S`` into the audit, a second schema version with the same
definitions is deployed as an operator would: ``freshline deploy start``, ``freshline
warm --all`` of the run's tenant, ``freshline deploy flip``; the consumer writes both
versions from the start on (the previous one for a TTL after the flip). The first audit
checks the first version throughout (active, then previous); a second ``freshline
audit`` checks the new version from the flip to the end. The runs use a lock of their
own (a copy of the example's repository under ``FRESHLINE_REPO`` whose lock holds both
versions) and move the deploy pointer of the benchmark's Redis database
(``FRESHLINE_BENCH_REDIS_DB``: give the run a database no other process uses), which
they clear at the end.

Reported: consistency as nines at each grace (the two audits' checks and
inconsistencies added up, and each apart), the entries caught up on their watermarks
alone and how they settled (verified, unverified, mismatched), the checks, the audits'
achieved and spare (busy-time) rate, the mismatches that outlasted a grace (with keys
and watermarks), the deploy's steps and their times, the edge rows inserted, the events
offered and applied per second and the consumer's lag.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import orjson
import sqlalchemy as sa

from bench import common
from freshline.consumers.kafka import Producer
from freshline.pipeline.core.keys import (
    ACTIVE_SCHEMA_KEY,
    NEXT_SCHEMA_KEY,
    PREVIOUS_SCHEMA_KEY,
    RETIRED_SCHEMA_KEY,
)
from freshline.pipeline.core.lock import Lock, LockedSet
from freshline.pipeline.core.repository import active
from freshline.pipeline.core.topics import qualified
from freshline.pipeline.observe.staleness import GroupLag
from tests.helpers import REGISTRY

HOT_USERS = 20
HOT_SHARE = 0.8
TICK_S = 0.01
USERS_PER_TICK = 20
LOADERS = 4
"""Threads sharing the rate; loader ``i`` owns the users ``u`` with ``(u - 1) % LOADERS == i``."""
SERIES_EVERY_S = 10
"""Lag, events sent, machine load and consumer CPU are recorded this often."""
TARGET_CHECKS = 1_000_000
"""Six nines can only be shown from a million checks with none inconsistent."""
EDGE_TICK_S = 0.1
EDGE_SLACK_S = 2.0
"""Rows created at an edge are at most this far inside it: they age out moments later."""
AGEING_SHARE = 20
"""One user in this many, per window, is given a row that ages out during the run."""
WINDOWS_DAYS = (90, 30)
"""txn_90d's and geo's windows."""
FULL: dict[str, Any] = {
    "graces": "1s,10s,60s",
    "rate": 1400,
    "new_rate": 600,
    "duration_s": 700,
    "sample": 2000,
    "warm_s": 3.0,
    "deploy_at_s": 150,
    "warm_rate": 2000,
    "tick_s": TICK_S,
}
# A smoke run's figures are not read: a tenth of the audit's checks and a quarter of the
# load (the same statements, a tick every 40 ms) keep the consumer from falling behind
# on a busy machine, where catching up was most of the run.
QUICK: dict[str, Any] = {
    "graces": "1s,2s",
    "rate": 200,
    "new_rate": 100,
    "duration_s": 4,
    "sample": 200,
    "warm_s": 1.0,
    "deploy_at_s": 1,
    "warm_rate": 4000,
    "tick_s": 0.04,
}

_MOVE = sa.text("""
UPDATE transactions AS t
SET amount = t.amount + 0.01,
    ip = CASE WHEN (t.amount * 100)::bigint % 2 = 0 THEN t.ip + 65536 ELSE t.ip - 65536 END
WHERE t.tenant_id = :tenant AND t.id = ANY(ARRAY(
    SELECT DISTINCT ON (user_id) id FROM transactions
    WHERE tenant_id = :tenant AND user_id = ANY(CAST(:users AS bigint[]))
    ORDER BY user_id, created_at DESC, id DESC))
""")
"""Each user's newest transaction: its amount moves by a cent (``txn_90d``) and its IP
between two geoip ranges 16 apart (``geo``'s latest city), so both sets change."""


_INSERT = sa.text("""
INSERT INTO transactions (tenant_id, user_id, amount, currency, merchant_id, device_id, ip,
                          status, created_at, updated_at)
SELECT t.tenant_id, t.user_id, 7.77, t.currency, t.merchant_id, t.device_id, t.ip,
       'approved', now() - make_interval(secs => r.age_s), now()
FROM unnest(CAST(:users AS bigint[]), CAST(:ages AS float8[])) AS r(user_id, age_s),
LATERAL (SELECT * FROM transactions x WHERE x.tenant_id = :tenant AND x.user_id = r.user_id
         ORDER BY x.created_at DESC, x.id DESC LIMIT 1) AS t
""")
"""A transaction ``age_s`` old for each user, copied from the user's newest one (users
without transactions get none)."""


def _event(tenant: str, user: int, i: int) -> tuple[bytes, bytes]:
    return (
        f'{{"tenant":"{tenant}","user_id":{user},"transaction_id":{i}}}'.encode(),
        f"{tenant}:{user}".encode(),
    )


def _cold(rng: random.Random, users: int) -> int:
    return rng.randint(HOT_USERS + 1, users)


def _insert(
    ctx: common.Context,
    producer: Producer,
    topic: str,
    tenant: str,
    rows: list[tuple[int, float]],
    i: int,
) -> int:
    """Insert ``(user, age_s)`` rows in one transaction, then send their events."""
    with ctx.engine.begin() as conn:
        added = conn.execute(
            _INSERT,
            {"tenant": tenant, "users": [u for u, _ in rows], "ages": [a for _, a in rows]},
        ).rowcount
    for user, _ in rows:
        producer.produce(topic, *_event(tenant, user, i))
    producer.inner.poll(0)
    return int(added)


def seed_ageing(ctx: common.Context, tenant: str, users: int, span_s: float) -> dict[str, Any]:
    """Rows that age out of each window between ``span_s / 10`` and ``span_s`` from now,
    for one cold user in ``AGEING_SHARE`` per window, with their events."""
    rng = random.Random(7)
    topic = qualified(ctx.settings, "transaction.updated")
    added: dict[str, int] = {}
    with Producer(ctx.settings, **{"linger.ms": 2}) as producer:
        for days in WINDOWS_DAYS:
            rows = [
                (_cold(rng, users), days * 86400 - rng.uniform(span_s / 10, span_s))
                for _ in range(users // AGEING_SHARE)
            ]
            added[f"{days}d"] = _insert(ctx, producer, topic, tenant, rows, -days)
        producer.flush()
    return {"rows": added, "ageing_out_within_s": [round(span_s / 10), round(span_s)]}


class Edges:
    """The edge thread: rows created at each window's edge and late rows, with their
    events, every ``EDGE_TICK_S`` until :meth:`stop`."""

    def __init__(self, ctx: common.Context, tenant: str, users: int) -> None:
        self.ctx, self.tenant, self.users = ctx, tenant, users
        self.topic = qualified(ctx.settings, "transaction.updated")
        self.rows: dict[str, int] = {"90d_edge": 0, "30d_edge": 0, "late": 0}
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Edges:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(60)
        return {"rows": dict(self.rows), "failed_transactions": self.failed}

    def _run(self) -> None:
        rng = random.Random(29)
        with Producer(self.ctx.settings, **{"linger.ms": 2}) as producer:
            for i in common.paced(1 / EDGE_TICK_S, math.inf):
                if self._stop.is_set():
                    break
                kinds = {
                    "90d_edge": 90 * 86400 - rng.uniform(0, EDGE_SLACK_S),
                    "30d_edge": 30 * 86400 - rng.uniform(0, EDGE_SLACK_S),
                    "late": rng.uniform(3600, 89 * 86400),
                }
                for kind, age_s in kinds.items():
                    try:
                        added = _insert(
                            self.ctx,
                            producer,
                            self.topic,
                            self.tenant,
                            [(_cold(rng, self.users), age_s)],
                            1_000_000 + i,
                        )
                    except sa.exc.OperationalError:
                        self.failed += 1
                        continue
                    self.rows[kind] += added
            producer.flush()


def _users(rng: random.Random, users: int, loader: int) -> list[int]:
    """``USERS_PER_TICK`` distinct users of this loader's share, drawn with the skew."""

    def own(u: int) -> int:
        return u - (u - 1) % LOADERS + loader  # the loader's user nearest u

    want = USERS_PER_TICK
    picked: set[int] = set()
    while len(picked) < want:
        u = rng.randint(1, HOT_USERS) if rng.random() < HOT_SHARE else rng.randint(1, users)
        if (u := own(u)) <= users:
            picked.add(u)
    return sorted(picked)


class Load:
    """The loader threads: row changes and their events at the offered rate until
    :meth:`stop`; counts what was actually sent."""

    def __init__(self, ctx: common.Context, tenant: str, users: int, tick_s: float) -> None:
        self.ctx, self.tenant, self.users, self.tick_s = ctx, tenant, users, tick_s
        self.topic = qualified(ctx.settings, "transaction.updated")
        self.events = self.rows_changed = self.failed = 0
        self.touched: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.started = self.stopped = 0.0

    def start(self, window_s: float = math.inf) -> Load:
        self.started = time.monotonic()
        self._threads = [
            threading.Thread(target=self._loader, args=(n, window_s), daemon=True)
            for n in range(LOADERS)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        self.stopped = time.monotonic()
        seconds = self.stopped - self.started
        return {
            "events": self.events,
            "rows_changed": self.rows_changed,
            "failed_transactions": self.failed,
            "users_touched": len(self.touched),
            "seconds": round(seconds, 1),
            "offered_per_s": round(USERS_PER_TICK / self.tick_s),
            "events_per_s": round(self.events / seconds),
        }

    def wait(self) -> dict[str, Any]:
        for thread in self._threads:
            thread.join()
        return self.stop()

    def _loader(self, index: int, window_s: float) -> None:
        rng = random.Random(13 + index)
        with Producer(self.ctx.settings, **{"linger.ms": 2}) as producer:
            for i in common.paced(1 / self.tick_s / LOADERS, window_s):
                if self._stop.is_set():
                    break
                picked = _users(rng, self.users, index)
                try:
                    with self.ctx.engine.begin() as conn:
                        changed = conn.execute(
                            _MOVE, {"tenant": self.tenant, "users": picked}
                        ).rowcount
                except sa.exc.OperationalError:
                    with self._lock:
                        self.failed += 1
                    continue
                for user in picked:
                    producer.produce(
                        self.topic,
                        f'{{"tenant":"{self.tenant}","user_id":{user},'
                        f'"transaction_id":{i}}}'.encode(),
                        f"{self.tenant}:{user}".encode(),
                    )
                producer.inner.poll(0)
                with self._lock:
                    self.events += len(picked)
                    self.rows_changed += changed
                    self.touched.update(picked)
            producer.flush()


def _entries(ctx: common.Context, version: int, tenant: str) -> int:
    pattern = f"feat:{version}:*:{{{tenant}:*"
    return sum(1 for _ in ctx.redis.scan_iter(match=pattern, count=1000))


def _child_env(ctx: common.Context, version: int, repo: Path) -> dict[str, str]:
    s = ctx.settings
    return {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": s.postgres_url,
        "FRESHLINE_REDIS_URL": s.redis_url,
        "FRESHLINE_SCHEMA_VERSION": str(version),
        "FRESHLINE_TOPIC_PREFIX": s.topic_prefix,
        "FRESHLINE_AUTO_OFFSET_RESET": "earliest",
        "FRESHLINE_REPO": str(repo),
    }


def _repository(into: Path, *versions: int) -> Path:
    """A copy of the active repository whose lock holds ``versions``, all with this
    code's definitions: what its consumer, audits and deploy commands run on."""
    repo = into / "repo"
    source = active()
    shutil.copytree(
        source.path,
        repo,
        ignore=shutil.ignore_patterns(source.lock_path.name, "__pycache__", "*.egg-info"),
    )
    entry = {fs.name: LockedSet.of(fs) for fs in REGISTRY}
    Lock(dict.fromkeys(versions, entry)).save(repo / source.lock_path.name)
    return repo


def _clear_pointer(ctx: common.Context, *versions: int) -> None:
    keys = [ACTIVE_SCHEMA_KEY, NEXT_SCHEMA_KEY, PREVIOUS_SCHEMA_KEY]
    ctx.redis.delete(*keys, *(f"{RETIRED_SCHEMA_KEY}:{v}" for v in versions))


def _audit(
    env: dict[str, str], version: int, tenant: str, plan: dict[str, Any], rate: int, seconds: int
) -> list[str]:
    return [
        common.FRESHLINE,
        "audit",
        "--version",
        str(version),
        "--tenant",
        tenant,
        "--sample",
        str(plan["sample"]),
        "--duration",
        f"{seconds}s",
        "--rate",
        str(rate),
        "--grace",
        str(plan["graces"]),
        "--json",
    ]


class Deploy:
    """``DEPLOY_AT_S`` into the audit: start, warm and flip to ``new``, as subprocesses;
    then the second audit, of ``new``, until the first audit's end."""

    def __init__(
        self,
        env: dict[str, str],
        new: int,
        tenant: str,
        plan: dict[str, Any],
        audit_err: IO[bytes],
    ) -> None:
        self.env, self.new, self.tenant, self.plan = env, new, tenant, plan
        self.audit_err = audit_err
        self.steps: list[dict[str, Any]] = []
        self.audit: subprocess.Popen[bytes] | None = None
        self.error: str | None = None
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = 0.0

    def start(self, started: float) -> Deploy:
        self.started = started
        self._thread.start()
        return self

    def _step(self, name: str, args: list[str]) -> bool:
        t0 = time.monotonic()
        done = subprocess.run(
            [common.FRESHLINE, *args], check=False, env=self.env, capture_output=True, timeout=600
        )
        self.steps.append(
            {
                "step": name,
                "at_s": round(t0 - self.started, 1),
                "took_s": round(time.monotonic() - t0, 1),
                "returncode": done.returncode,
            }
        )
        if done.returncode != 0:
            self.error = f"{name}: {done.stderr.decode(errors='replace')[-1000:]}"
        return done.returncode == 0

    def _run(self) -> None:
        if self._cancel.wait(self.plan["deploy_at_s"]):  # the schedule, not a sync
            return
        new, tenant = str(self.new), self.tenant
        ok = (
            self._step("deploy start", ["deploy", "start", new])
            and self._step(
                "warm --all",
                [
                    "warm",
                    "--version",
                    new,
                    "--all",
                    "--tenant",
                    tenant,
                    "--rate",
                    str(self.plan["warm_rate"]),
                ],
            )
            and self._step("deploy flip", ["deploy", "flip", new])
        )
        if not ok or self._cancel.is_set():
            return
        left = self.plan["duration_s"] - (time.monotonic() - self.started)
        self.audit = subprocess.Popen(
            _audit(self.env, self.new, tenant, self.plan, self.plan["new_rate"], max(1, int(left))),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=self.audit_err,
            start_new_session=True,
        )

    def report(self) -> dict[str, Any] | None:
        """The second audit's JSON report (waiting for it), or None if it never ran."""
        self._thread.join(900)
        if self.audit is None:
            return None
        out, _ = self.audit.communicate(timeout=self.plan["duration_s"] + 900)
        if self.audit.returncode not in (0, 1):
            raise RuntimeError(f"the second audit failed ({self.audit.returncode})")
        report: dict[str, Any] = orjson.loads(out)
        return report

    def stop(self) -> None:
        self._cancel.set()
        self._thread.join(900)
        if self.audit is not None and self.audit.poll() is None:
            common.stop_process(self.audit)


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used so far, from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tail(log: Any) -> str:
    log.seek(0)
    return repr(log.read()[-2000:])


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    data = ctx.dataset()
    version, new_version = ctx.schema_version(), ctx.schema_version()
    ctx.kafka_topics()
    plan = QUICK if quick else FULL
    scratch = tempfile.TemporaryDirectory()
    env = _child_env(ctx, version, _repository(Path(scratch.name), version, new_version))
    _clear_pointer(ctx, version, new_version)
    group = f"{ctx.settings.consumer_group}-consistency-{version}"
    topic = qualified(ctx.settings, "transaction.updated")
    lag = GroupLag(ctx.settings_for(consumer_group=group))
    consumer_log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    audit_err = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    consumer = common.start_consumer(env, topic, group, consumer_log)
    audit: subprocess.Popen[bytes] | None = None
    load: Load | None = None
    edges: Edges | None = None
    deploy: Deploy | None = None
    lags: list[int] = []
    series: list[dict[str, Any]] = []
    load_avg = [round(os.getloadavg()[0], 2)]
    try:
        common.note(
            f"consistency: warming the consumer, then {plan['duration_s']}s of audit "
            f"under load, and its last re-checks"
        )
        ageing = seed_ageing(ctx, data.tenant, data.users, plan["duration_s"] + 60)
        warm = Load(ctx, data.tenant, data.users, plan["tick_s"]).start(plan["warm_s"]).wait()
        # Applied once the group has committed every record (entries are no measure:
        # the ageing rows' entries expire as they age out).
        deadline = time.monotonic() + 180
        while sum(lag.measure([topic]).values()) > 0:
            if consumer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the consumer did not apply the warm-up: {_tail(consumer_log)}")
            time.sleep(0.5)  # polling while the consumer joins and applies
        load = Load(ctx, data.tenant, data.users, plan["tick_s"]).start()
        edges = Edges(ctx, data.tenant, data.users).start()
        audit = subprocess.Popen(
            _audit(env, version, data.tenant, plan, plan["rate"], plan["duration_s"]),
            env=env,
            stdout=subprocess.PIPE,
            stderr=audit_err,
            start_new_session=True,
        )
        lag_at: list[tuple[float, int, int]] = []  # (time, produced, lag)
        started = time.monotonic()
        deploy = Deploy(env, new_version, data.tenant, plan, audit_err).start(started)
        consumer_cpu = _cpu_s(consumer.pid)

        def watch_lag() -> None:
            while audit is not None and audit.poll() is None:
                try:
                    behind = sum(lag.measure([topic]).values())
                except Exception:  # lag is advisory here; a failed read is a gap
                    behind = -1
                now = time.monotonic()
                if behind >= 0:
                    lags.append(behind)
                    lag_at.append((now, load.events if load else 0, behind))
                if not series or now - started >= series[-1]["t_s"] + SERIES_EVERY_S:
                    cpu = _cpu_s(consumer.pid)
                    series.append(
                        {
                            "t_s": round(now - started),
                            "lag": behind,
                            "sent": load.events if load else 0,
                            "load_1m": round(os.getloadavg()[0], 2),
                            "consumer_cpu_s": None
                            if cpu is None or consumer_cpu is None
                            else round(cpu - consumer_cpu, 1),
                        }
                    )
                time.sleep(1.0)  # one lag reading a second

        watcher = threading.Thread(target=watch_lag, daemon=True)
        watcher.start()
        out, _ = audit.communicate(timeout=plan["duration_s"] + 600)
        if audit.returncode not in (0, 1):
            raise RuntimeError(f"freshline audit failed ({audit.returncode}): {_tail(audit_err)}")
        try:
            new_report = deploy.report()
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {_tail(audit_err)}") from exc
        if deploy.error is not None or new_report is None:
            raise RuntimeError(f"the deploy failed: {deploy.error}")
        load_figures = load.stop()
        edge_figures = edges.stop()
        watcher.join(10)
        report = orjson.loads(out)
        entries = _entries(ctx, version, data.tenant)
        load_avg.append(round(os.getloadavg()[0], 2))
    finally:
        if deploy is not None:
            deploy.stop()
        if edges is not None:
            edges.stop()
        if load is not None:
            load.stop()
        if audit is not None and audit.poll() is None:
            common.stop_process(audit)
        common.stop_process(consumer)
        lag.close()
        consumer_log.close()
        audit_err.close()
        _clear_pointer(ctx, version, new_version)
        scratch.cleanup()

    flipped_s = sum(deploy.steps[-1][k] for k in ("at_s", "took_s"))
    reports = [(report, 0.0), (new_report, flipped_s)]
    for point in series:  # what the audits found inconsistent, by when each first checked it
        t = point["t_s"]
        point["inconsistent_found"] = {}
        for rep, offset in reports:
            for g, by_s in rep.get("inconsistent_at_second", {}).items():
                n = sum(c for sec, c in by_s.items() if t <= int(sec) + offset < t + SERIES_EVERY_S)
                point["inconsistent_found"][g] = point["inconsistent_found"].get(g, 0) + n
    checked = report["checked"] + new_report["checked"]
    by_grace: dict[str, Any] = {}
    for g, g_new in zip(report["graces"], new_report["graces"], strict=True):
        bad = g["inconsistent"] + g_new["inconsistent"]
        by_grace[g["grace"]] = _nines(bad, checked)
    applied = None
    if len(lag_at) >= 2:  # events applied between the first and last lag reading
        (t0, p0, l0), (t1, p1, l1) = lag_at[0], lag_at[-1]
        applied = round(((p1 - l1) - (p0 - l0)) / (t1 - t0))
    ten = by_grace.get("10s", {}).get("nines")
    added = ("caught_up", "verified", "unverified", "wrong_after_catching_up")
    totals = {k: report.get(k, 0) + new_report.get(k, 0) for k in added}
    targets = [
        common.target("audit consistency at 10 s grace under load", ten, ">=", 6, "nines"),
        common.target("audit checks (six nines need 1,000,000)", checked, ">=", TARGET_CHECKS),
    ]
    return {
        "parameters": {
            "tick_s": plan["tick_s"],
            "users_per_tick": USERS_PER_TICK,
            "hot_users": HOT_USERS,
            "hot_share": HOT_SHARE,
            "loaders": LOADERS,
            "users": data.users,
            "audit_rate": plan["rate"],
            "new_version_audit_rate": plan["new_rate"],
            "audit_sample": plan["sample"],
            "audit_duration_s": plan["duration_s"],
            "graces": plan["graces"],
            "deploy_at_s": plan["deploy_at_s"],
            "warm_rate": plan["warm_rate"],
            "edge_tick_s": EDGE_TICK_S,
            "edge_slack_s": EDGE_SLACK_S,
            "ageing_users_per_window": data.users // AGEING_SHARE,
        },
        "command": (
            f"freshline audit --tenant T --sample {plan['sample']} --duration "
            f"{plan['duration_s']}s --rate {plan['rate']} --grace "
            f"{plan['graces']} --json"
        ),
        "machine_load_1m": {
            "start": load_avg[0],
            "end": load_avg[-1],
            "max": max([*load_avg, *(p["load_1m"] for p in series)]),
        },
        "series": series,
        "warm_load": warm,
        "edges": {"ageing": ageing, **edge_figures},
        "deploy": {"versions": [version, new_version], "steps": deploy.steps},
        "load": {
            **load_figures,
            "consumer_applied_per_s": applied,
            "lag_records": {
                "max": max(lags, default=None),
                "median": (statistics.median(lags) if lags else None),
            },
        },
        "audit": {
            "checked": checked,
            "samples": report["samples"] + new_report["samples"],
            "absent": report["absent"] + new_report["absent"],
            "suspects": report["suspects"] + new_report["suspects"],
            "rechecks": report["rechecks"] + new_report["rechecks"],
            **totals,
            "entries_in_namespace": entries,
            "checks_per_entry": round(report["checked"] / max(entries, 1), 1),
            "checking_s": round(report["checking_s"], 1),
            "elapsed_s": round(report["elapsed_s"], 1),
            "entries_per_s": round(report["entries_per_s"] + new_report["entries_per_s"]),
            "capacity_per_s": round(report["capacity_per_s"]),
            "by_grace": by_grace,
            "by_version": {
                "old": _one(version, report),
                "new": _one(new_version, new_report),
            },
            "persistent": report["persistent"] + new_report["persistent"],
            "persisting_mismatches": (report["mismatches"] + new_report["mismatches"])[:10],
            "late_after_10s": (
                report.get("late", {}).get("10s", []) + new_report.get("late", {}).get("10s", [])
            )[:20],
            "unverified_entries": (
                report.get("unverified_entries", []) + new_report.get("unverified_entries", [])
            )[:10],
        },
        "targets": targets,
    }


def _nines(bad: int, checked: int) -> dict[str, Any]:
    nines = -math.log10(bad / checked) if bad else math.log10(max(checked, 1))
    return {"inconsistent": bad, "nines": round(nines, 2), "lower_bound": not bad}


def _one(version: int, report: dict[str, Any]) -> dict[str, Any]:
    """One audit's own figures."""
    return {
        "schema_version": version,
        "checked": report["checked"],
        "checking_s": round(report["checking_s"], 1),
        "entries_per_s": round(report["entries_per_s"]),
        "capacity_per_s": round(report["capacity_per_s"]),
        "caught_up": report.get("caught_up", 0),
        "verified": report.get("verified", 0),
        "unverified": report.get("unverified", 0),
        "wrong_after_catching_up": report.get("wrong_after_catching_up", 0),
        "by_grace": {
            g["grace"]: _nines(g["inconsistent"], report["checked"]) for g in report["graces"]
        },
    }


_ENTRY_LISTS = ("late_after_10s", "persisting_mismatches", "unverified_entries")


def _consumer_share(res: dict[str, Any]) -> str:
    points = [p for p in res.get("series", []) if p.get("consumer_cpu_s") is not None]
    if len(points) < 2 or points[-1]["t_s"] <= points[0]["t_s"]:
        return "-"
    cpu = points[-1]["consumer_cpu_s"] - points[0]["consumer_cpu_s"]
    return f"{cpu / (points[-1]['t_s'] - points[0]['t_s']):.0%}"


def _found_table(res: dict[str, Any]) -> list[str]:
    """The stretches of the run in which entries later found inconsistent were first
    checked, beside the consumer's lag and the machine's load then."""
    graces = list(res["audit"]["by_grace"])
    rows = [
        (
            p["t_s"],
            common.fmt(p["lag"]),
            p["load_1m"],
            *(p["inconsistent_found"].get(g, 0) for g in graces),
        )
        for p in res.get("series", [])
        if any(p.get("inconsistent_found", {}).get(g) for g in graces)
    ]
    if not rows:
        return []
    return [
        f"When the inconsistent entries were first checked ({SERIES_EVERY_S} s "
        "stretches with any; seconds since the audit started), with the consumer "
        "group's lag (records) and the machine's load average at the stretch's start:",
        "",
        common.table(["s", "lag", "load", *(f"inconsistent at {g}" for g in graces)], rows),
        "",
    ]


def _edges_and_deploy(res: dict[str, Any]) -> list[str]:
    edges, deploy = res.get("edges"), res.get("deploy")
    if not edges or not deploy:
        return []
    rows = edges["rows"]
    ageing = edges["ageing"]
    steps = ", ".join(
        f"`{s['step']}` at {s['at_s']:g} s ({s['took_s']:g} s)" for s in deploy["steps"]
    )
    old, new = deploy["versions"]
    return [
        "Window edges: "
        + ", ".join(f"{n:,} rows ageing out of the {w} window" for w, n in ageing["rows"].items())
        + f" between {ageing['ageing_out_within_s'][0]} and {ageing['ageing_out_within_s'][1]} s "
        f"after they were inserted (before the warm-up; no event when they age out); "
        f"during the run {rows['90d_edge']:,} and {rows['30d_edge']:,} rows created at most "
        f"{res['parameters']['edge_slack_s']:g} s inside the 90- and 30-day edges and "
        f"{rows['late']:,} late rows (1 h to 89 days old), each with its event. "
        f"The deploy from version {old} to {new}, seconds into the audit: {steps}.",
        "",
    ]


def _by_version(audit: dict[str, Any]) -> list[str]:
    versions = audit.get("by_version")
    if not versions:
        return []
    graces = list(audit["by_grace"])
    rows = [
        (
            f"{label} (v{v['schema_version']})",
            f"{v['checked']:,}",
            *(
                f"{v['by_grace'][g]['inconsistent']:,} ("
                + ("≥ " if v["by_grace"][g]["lower_bound"] else "")
                + f"{v['by_grace'][g]['nines']:.2f})"
                for g in graces
            ),
            f"{v['caught_up']:,}",
            f"{v['verified']:,}",
            f"{v['unverified']:,}",
            f"{v['wrong_after_catching_up']:,}",
        )
        for label, v in (
            ("old, whole run", versions["old"]),
            ("new, after the flip", versions["new"]),
        )
    ]
    return [
        "Per audit, and the entries caught up on their watermarks alone by how they "
        "settled ([audit](../docs/audit.md)):",
        "",
        common.table(
            [
                "audit",
                "checks",
                *(f"inconsistent at {g} (nines)" for g in graces),
                "caught up",
                "verified",
                "unverified",
                "mismatched",
            ],
            rows,
        ),
        "",
    ]


def markdown(res: dict[str, Any]) -> str:
    audit, p, load = res["audit"], res["parameters"], res["load"]
    applied = load.get("consumer_applied_per_s")
    lag = load.get("lag_records", {})
    lines = [
        "## consistency: `freshline audit` under load, across window edges and a deploy",
        "",
        f"{load['offered_per_s']:,} events/s offered, {load['events_per_s']:,} sent for "
        f"{load['seconds']:.0f} s, each a change to a user's newest transaction "
        f"({p['users_per_tick']} distinct users per Postgres transaction every "
        f"{p['tick_s'] * 1000:.0f} ms, drawn {p['hot_share']:.0%} from {p['hot_users']} hot "
        f"users of {p['users']:,}; {load['rows_changed']:,} rows changed, the rest were "
        "users without transactions), applied by `freshline consume` at "
        f"{'-' if applied is None else f'{applied:,}'} events/s (lag: median "
        f"{common.fmt(lag.get('median'))}, max {common.fmt(lag.get('max'))} records). "
        f"Meanwhile `{res['command']}` checked {audit['checked']:,} served entries "
        f"({audit['entries_in_namespace']:,} in the namespace, so about "
        f"{audit['checks_per_entry']:g} checks each) at {audit['entries_per_s']:,}/s "
        f"({audit['capacity_per_s']:,}/s of busy time), re-checking every mismatch after "
        "each grace while the load went on. Machine load average (1 min, 2 shared "
        f"cores): {res['machine_load_1m']['start']} at the start, "
        f"{res['machine_load_1m']['end']} at the end, {res['machine_load_1m']['max']} at "
        f"most; the consumer used {_consumer_share(res)} of a core.",
        "",
        common.table(
            ["grace", "inconsistent", "nines"],
            [
                (g, v["inconsistent"], ("≥ " if v["lower_bound"] else "") + f"{v['nines']:.2f}")
                for g, v in audit["by_grace"].items()
            ],
        ),
        "",
        *_edges_and_deploy(res),
        *_by_version(audit),
        *_found_table(res),
        "The audits' figures (the entries late after 10 s, persisting and unverified, "
        "with both values and watermarks, are in `results.json`):",
        "",
        "```json",
        orjson.dumps(
            {k: v for k, v in audit.items() if k not in _ENTRY_LISTS},
            option=orjson.OPT_INDENT_2,
        ).decode(),
        "```",
        "",
        common.targets_table(res["targets"]),
    ]
    return "\n".join(lines) + "\n"
