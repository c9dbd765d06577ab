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
check at a different moment of the load.

Reported: consistency as nines at each grace, the checks, the audit's achieved and
spare (busy-time) rate, the mismatches that outlasted a grace (with keys and
watermarks), the events offered and applied per second and the consumer's lag.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa

from bench import common
from consumers.kafka import Producer
from pipeline.core.topics import qualified
from pipeline.observe.staleness import GroupLag

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
FULL: dict[str, Any] = {
    "graces": "1s,10s,60s",
    "rate": 3000,
    "duration_s": 600,
    "sample": 2000,
    "warm_s": 3.0,
}
QUICK: dict[str, Any] = {
    "graces": "1s,10s",
    "rate": 2000,
    "duration_s": 4,
    "sample": 1000,
    "warm_s": 2.0,
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

    def __init__(self, ctx: common.Context, tenant: str, users: int) -> None:
        self.ctx, self.tenant, self.users = ctx, tenant, users
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
            "offered_per_s": round(USERS_PER_TICK / TICK_S),
            "events_per_s": round(self.events / seconds),
        }

    def wait(self) -> dict[str, Any]:
        for thread in self._threads:
            thread.join()
        return self.stop()

    def _loader(self, index: int, window_s: float) -> None:
        rng = random.Random(13 + index)
        with Producer(self.ctx.settings, **{"linger.ms": 2}) as producer:
            for i in common.paced(1 / TICK_S / LOADERS, window_s):
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


def _child_env(ctx: common.Context, version: int) -> dict[str, str]:
    s = ctx.settings
    return {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": s.postgres_url,
        "FRESHLINE_REDIS_URL": s.redis_url,
        "FRESHLINE_SCHEMA_VERSION": str(version),
        "FRESHLINE_TOPIC_PREFIX": s.topic_prefix,
        "FRESHLINE_AUTO_OFFSET_RESET": "earliest",
    }


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
    version = ctx.schema_version()
    ctx.kafka_topics()
    plan = QUICK if quick else FULL
    env = _child_env(ctx, version)
    group = f"{ctx.settings.consumer_group}-consistency-{version}"
    topic = qualified(ctx.settings, "transaction.updated")
    lag = GroupLag(ctx.settings_for(consumer_group=group))
    consumer_log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    audit_err = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    consumer = common.start_consumer(env, topic, group, consumer_log)
    audit: subprocess.Popen[bytes] | None = None
    load: Load | None = None
    lags: list[int] = []
    series: list[dict[str, Any]] = []
    load_avg = [round(os.getloadavg()[0], 2)]
    try:
        common.note(
            f"consistency: warming the consumer, then {plan['duration_s']}s of audit "
            f"under load, and its last re-checks"
        )
        warm = Load(ctx, data.tenant, data.users).start(plan["warm_s"]).wait()
        wanted = 2 * warm["users_touched"]  # txn_90d and geo per user
        deadline = time.monotonic() + 120
        while _entries(ctx, version, data.tenant) < wanted:
            if consumer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the consumer did not apply the warm-up: {_tail(consumer_log)}")
            time.sleep(0.5)  # polling while the consumer joins and applies
        load = Load(ctx, data.tenant, data.users).start()
        audit = subprocess.Popen(
            [
                common.FRESHLINE,
                "audit",
                "--version",
                str(version),
                "--tenant",
                data.tenant,
                "--sample",
                str(plan["sample"]),
                "--duration",
                f"{plan['duration_s']}s",
                "--rate",
                str(plan["rate"]),
                "--grace",
                str(plan["graces"]),
                "--json",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=audit_err,
            start_new_session=True,
        )
        lag_at: list[tuple[float, int, int]] = []  # (time, produced, lag)
        started = time.monotonic()
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
        load_figures = load.stop()
        watcher.join(10)
        if audit.returncode not in (0, 1):
            raise RuntimeError(f"freshline audit failed ({audit.returncode}): {_tail(audit_err)}")
        report = orjson.loads(out)
        entries = _entries(ctx, version, data.tenant)
        load_avg.append(round(os.getloadavg()[0], 2))
    finally:
        if load is not None:
            load.stop()
        if audit is not None and audit.poll() is None:
            common.stop_process(audit)
        common.stop_process(consumer)
        lag.close()
        consumer_log.close()
        audit_err.close()

    found = report.get("inconsistent_at_second", {})
    for point in series:  # what the audit found inconsistent, by when it first checked it
        t = point["t_s"]
        point["inconsistent_found"] = {
            g: sum(n for second, n in by_s.items() if t <= int(second) < t + SERIES_EVERY_S)
            for g, by_s in found.items()
        }
    checked = report["checked"]
    by_grace: dict[str, Any] = {}
    for g in report["graces"]:
        bad = g["inconsistent"]
        nines = -math.log10(bad / checked) if bad else math.log10(max(checked, 1))
        by_grace[g["grace"]] = {
            "inconsistent": bad,
            "nines": round(nines, 2),
            "lower_bound": not bad,
        }
    applied = None
    if len(lag_at) >= 2:  # events applied between the first and last lag reading
        (t0, p0, l0), (t1, p1, l1) = lag_at[0], lag_at[-1]
        applied = round(((p1 - l1) - (p0 - l0)) / (t1 - t0))
    ten = by_grace.get("10s", {}).get("nines")
    targets = [
        common.target("audit consistency at 10 s grace under load", ten, ">=", 6, "nines"),
        common.target("audit checks (six nines need 1,000,000)", checked, ">=", TARGET_CHECKS),
    ]
    return {
        "parameters": {
            "tick_s": TICK_S,
            "users_per_tick": USERS_PER_TICK,
            "hot_users": HOT_USERS,
            "hot_share": HOT_SHARE,
            "loaders": LOADERS,
            "users": data.users,
            "audit_rate": plan["rate"],
            "audit_sample": plan["sample"],
            "audit_duration_s": plan["duration_s"],
            "graces": plan["graces"],
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
            "samples": report["samples"],
            "absent": report["absent"],
            "suspects": report["suspects"],
            "rechecks": report["rechecks"],
            "caught_up": report["caught_up"],
            "entries_in_namespace": entries,
            "checks_per_entry": round(checked / max(entries, 1), 1),
            "checking_s": round(report["checking_s"], 1),
            "elapsed_s": round(report["elapsed_s"], 1),
            "entries_per_s": round(report["entries_per_s"]),
            "capacity_per_s": round(report["capacity_per_s"]),
            "by_grace": by_grace,
            "persistent": report["persistent"],
            "persisting_mismatches": report["mismatches"][:10],
            "late_after_10s": report.get("late", {}).get("10s", [])[:20],
        },
        "targets": targets,
    }


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


def markdown(res: dict[str, Any]) -> str:
    audit, p, load = res["audit"], res["parameters"], res["load"]
    applied = load.get("consumer_applied_per_s")
    lag = load.get("lag_records", {})
    lines = [
        "## consistency: `freshline audit` under steady load",
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
        *_found_table(res),
        "```json",
        orjson.dumps(audit, option=orjson.OPT_INDENT_2).decode(),
        "```",
        "",
        common.targets_table(res["targets"]),
    ]
    return "\n".join(lines) + "\n"
