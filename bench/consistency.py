"""Consistency under steady load: what ``freshline audit`` finds while changes stream in.

The load: real changes at a fixed rate. Every 10 ms one Postgres transaction moves the
amount of one transaction of each of 20 users (skewed: 80% of picks among 20 hot
users), then a ``transaction.updated`` event per user is produced: 2,000 events/s for
the window. ``freshline consume`` runs as a subprocess and applies them.

The audit: a :class:`pipeline.observe.audit.Auditor`, unthrottled, audits the served
entries of the run's tenant round after round while the load runs (each round: SCAN
from a random cursor, recompute from Postgres, re-check each mismatch after 1 s and
10 s of grace, as in production). Reported: consistency as nines at each grace over
all rounds, the entries checked, and the mismatches that outlasted a grace (with keys
and watermarks). The figure the README quotes is the nines at 10 s. With no
inconsistent entry the nines are only a lower bound, log10 of the entries checked:
six nines needs a million checks.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa

from bench import common
from consumers.kafka import Producer
from pipeline.core.topics import TRANSACTION_UPDATED, qualified
from pipeline.observe.audit import Auditor
from pipeline.observe.consistency import AuditReport

FRESHLINE = str(Path(sys.executable).with_name("freshline"))
HOT_USERS = 20
HOT_SHARE = 0.8
TICK_S = 0.01
USERS_PER_TICK = 20
GRACES = (1.0, 10.0)

_MOVE = sa.text("""
UPDATE transactions AS t SET amount = t.amount + 0.01
FROM (SELECT DISTINCT ON (user_id) id FROM transactions
      WHERE tenant_id = :tenant AND user_id = ANY(CAST(:users AS bigint[]))
      ORDER BY user_id, id) AS pick
WHERE t.id = pick.id
""")


def _users(rng: random.Random, users: int) -> list[int]:
    return sorted({rng.randint(1, HOT_USERS) if rng.random() < HOT_SHARE
                   else rng.randint(1, users) for _ in range(USERS_PER_TICK)})


LOADERS = 2
"""Threads sharing the rate: one Postgres transaction at a time each."""


def _load(ctx: common.Context, tenant: str, users: int, window: float,
          stop: threading.Event) -> dict[str, Any]:
    """Change rows and send their events at the fixed rate for ``window`` seconds."""
    topic = qualified(ctx.settings, TRANSACTION_UPDATED)
    counts = {"events": 0, "rows_changed": 0}
    touched: set[int] = set()
    lock = threading.Lock()

    def loader(seed: int) -> None:
        rng = random.Random(seed)
        with Producer(ctx.settings, **{"linger.ms": 2}) as producer:
            for i in common.paced(1 / TICK_S / LOADERS, window):
                if stop.is_set():
                    break
                picked = _users(rng, users)
                try:
                    with ctx.engine.begin() as conn:
                        changed = conn.execute(_MOVE, {"tenant": tenant,
                                                       "users": picked}).rowcount
                except sa.exc.OperationalError:  # a deadlock with the other loader
                    continue
                for user in picked:
                    producer.produce(topic, f'{{"tenant":"{tenant}","user_id":{user},'
                                            f'"transaction_id":{i}}}'.encode(),
                                     f"{tenant}:{user}".encode())
                producer.inner.poll(0)
                with lock:
                    counts["events"] += len(picked)
                    counts["rows_changed"] += changed
                    touched.update(picked)
            producer.flush()

    started = time.monotonic()
    threads = [threading.Thread(target=loader, args=(13 + n,)) for n in range(LOADERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    return {**counts, "users_touched": len(touched), "seconds": round(seconds, 1),
            "events_per_s": round(counts["events"] / seconds)}


def _entries(ctx: common.Context, version: int, tenant: str) -> int:
    pattern = f"feat:{version}:*:{{{tenant}:*"
    return sum(1 for _ in ctx.redis.scan_iter(match=pattern, count=1000))


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    data = ctx.dataset()
    version = ctx.schema_version()
    ctx.kafka_topics()
    window = 8.0 if quick else 240.0
    graces = GRACES
    settings = ctx.settings
    env = {**os.environ, "FRESHLINE_POSTGRES_URL": settings.postgres_url,
           "FRESHLINE_REDIS_URL": settings.redis_url,
           "FRESHLINE_SCHEMA_VERSION": str(version),
           "FRESHLINE_TOPIC_PREFIX": settings.topic_prefix,
           "FRESHLINE_AUTO_OFFSET_RESET": "earliest"}
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    group = f"{settings.consumer_group}-consistency-{version}"
    proc = subprocess.Popen([FRESHLINE, "consume", "--topics",
                             qualified(settings, TRANSACTION_UPDATED), "--group", group,
                             "--metrics-port", "0"], env=env, stdout=log, stderr=log,
                            start_new_session=True)
    stop = threading.Event()
    report: list[AuditReport] = []
    try:
        common.note(f"consistency: warming the consumer, then {window:.0f}s of load")
        warm = _load(ctx, data.tenant, data.users, 3.0, stop)  # entries to audit
        wanted = 2 * warm["users_touched"]  # txn_90d and geo per user
        deadline = time.monotonic() + 120
        while _entries(ctx, version, data.tenant) < wanted:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"the consumer did not apply the warm-up: "
                                   f"{log.read()[-2000:]!r}")
            time.sleep(0.5)  # polling while the consumer joins and applies
        auditor = Auditor(ctx.new_redis(), ctx.engine, version, rate=None, batch_size=1000)
        loading = threading.Event()
        loading.set()

        def audit() -> None:
            while loading.is_set():
                report.append(auditor.audit_sample(10 * data.users, tenant=data.tenant,
                                                   graces=graces))

        checker = threading.Thread(target=audit, daemon=True)
        checker.start()
        load = _load(ctx, data.tenant, data.users, window, stop)
        loading.clear()
        common.note(f"consistency: load done ({load['events_per_s']:,} events/s); "
                    f"waiting for the last round's {graces[-1]:.0f}s re-checks")
        checker.join(timeout=600)
        if not report:
            raise RuntimeError("the audit did not finish")
    finally:
        stop.set()
        common.stop_process(proc)
        log.close()
    checked = sum(r.checked for r in report)
    by_grace: dict[str, Any] = {}
    for grace in graces:
        bad = sum(r.result(grace).inconsistent for r in report)
        nines = -math.log10(bad / checked) if bad else math.log10(max(checked, 1))
        by_grace[f"{grace:g}s"] = {"inconsistent": bad, "nines": round(nines, 2),
                                   "lower_bound": not bad}
    mismatches = [m for r in report for m in r.as_json()["mismatches"]][:10]
    targets = [common.target("audit consistency at 10 s grace under load",
                             by_grace["10s"]["nines"], ">=", 6, "nines")]
    return {"parameters": {"tick_s": TICK_S, "users_per_tick": USERS_PER_TICK,
                           "hot_users": HOT_USERS, "hot_share": HOT_SHARE,
                           "window_s": window, "graces_s": list(graces)},
            "warm_load": warm, "load": load,
            "audit": {"rounds": len(report), "checked": checked,
                      "absent": sum(r.absent for r in report),
                      "entries_per_s": round(checked / max(load["seconds"], 1e-9)),
                      "by_grace": by_grace, "persisting_mismatches": mismatches},
            "targets": targets}


def markdown(res: dict[str, Any]) -> str:
    audit = res["audit"]
    p, load = res["parameters"], res["load"]
    lines = [
        "## consistency: `freshline audit` under steady load",
        "",
        f"{load['events_per_s']:,} events/s for {p['window_s']:.0f} s, each event a real "
        f"row change ({p['users_per_tick']} users per Postgres transaction every "
        f"{p['tick_s'] * 1000:.0f} ms, {p['hot_share']:.0%} among {p['hot_users']} hot "
        f"users), applied by `freshline consume`. Meanwhile the auditor checked "
        f"{audit['checked']:,} served entries in {audit['rounds']} rounds, recomputing "
        "each and re-checking every mismatch after each grace.",
        "",
        common.table(["grace", "inconsistent", "nines"],
                     [(g, v["inconsistent"], ("≥ " if v["lower_bound"] else "")
                       + f"{v['nines']:.2f}") for g, v in audit["by_grace"].items()]),
        "",
        "```json",
        orjson.dumps(audit, option=orjson.OPT_INDENT_2).decode(),
        "```",
        "",
        common.targets_table(res["targets"]),
    ]
    return "\n".join(lines) + "\n"
