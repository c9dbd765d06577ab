"""Read-your-writes trials: commit with plain SQL, take ``freshline.token()``, read the
feature over HTTP ``after`` it; count answers older than the commit and time commit to
answer (see :mod:`bench.freshness`).

``python -m bench.read_your_writes NAME=TREE ... [--rounds N] [--trials N]`` runs the
trials against the API of each checkout in turn (``this`` is added, as this one), under
one steady background load and consumer: see :func:`builds`."""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psycopg

from bench import common, reference_app
from bench.cdc_freshness import _connstr
from bench.cdc_stages import Pipeline, pcts, sql_poke
from bench.sql_load import background
from freshline.consumers.kafka import Producer
from freshline.pipeline.core.repository import active
from freshline.pipeline.core.topics import qualified

LOAD_RATE = 500
RYW_SET = "txn_90d"
TRIAL_THREADS = 8
TRIAL_USERS_PER_THREAD = 25
TRIAL_RATE = 50.0
"""Trials a second, in all, each thread on a schedule of its own: a scoring service's
commits and reads beside the :data:`LOAD_RATE` writes/s of everyone else's. Threads
that ran trials as fast as answers came (about 90 a second) took the two CPUs the
background load needed: it reached 381-443 of its 500 writes/s, and the p99 measured
the trials' own queue rather than the target's conditions."""
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
SETTLE_DEADLINE_S = 180.0
_VACUUMING = "SELECT count(*) FROM pg_stat_progress_vacuum WHERE datname = current_database()"


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
    period_s: float,
) -> None:
    """``count`` trials, the i-th at ``period_s`` times i after the start (at once when
    the one before ran late)."""
    extra = {} if wait_ms is None else {"wait_ms": str(wait_ms)}
    start = time.perf_counter()
    with (
        psycopg.connect(conninfo, autocommit=True) as conn,
        httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30
        ) as http,
    ):
        for i in range(count):
            late = start + i * period_s - time.perf_counter()
            if late > 0:
                time.sleep(late)  # pacing to the schedule, not waiting on anything
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


def _run_trials(
    target: tuple[str, str, str, str],
    groups: list[list[int]],
    per_thread: int,
    out: Trials,
    producer: Producer | None,
    topic: str,
    wait_ms: int | None,
) -> None:
    """:data:`TRIAL_THREADS` threads of :func:`_trial_thread`, one per group of users,
    each on its schedule; returns when all are done. ``target``: the database's
    conninfo, the API's URL, the key and the tenant."""
    conninfo, url, api_key, tenant = target
    threads = [
        threading.Thread(
            target=_trial_thread,
            args=(
                conninfo,
                url,
                api_key,
                tenant,
                group,
                per_thread,
                out,
                producer,
                topic,
                wait_ms,
                TRIAL_THREADS / TRIAL_RATE,
            ),
        )
        for group in groups
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def settle(ctx: common.Context) -> dict[str, float]:
    """Finish the work earlier writes left before the trials begin: fold every pending
    change of the derived paths (the current UTC day's too), then wait for autovacuum's
    workers on this database to end (up to :data:`SETTLE_DEADLINE_S`). Without it the
    trials that follow the CDC windows' 2,000 writes/s ran at a load average of 8-10:
    the consumer's recomputes of the busy users read the day's unfolded rows until its
    first whole fold, a minute in, and autovacuum worked on the tables those windows
    grew. Returns the seconds each took."""
    started = time.monotonic()
    for path in active().registry.maintenances():
        path.fold_all(ctx.engine)
    folded = time.monotonic()
    end = folded + (0 if ctx.quick else SETTLE_DEADLINE_S)  # a smoke run's figures are not read
    with psycopg.connect(_connstr(ctx.settings.postgres_admin_url), autocommit=True) as conn:
        while time.monotonic() < end:
            row = conn.execute(_VACUUMING).fetchone()
            if row is None or row[0] == 0:
                break
            time.sleep(0.5)  # polling autovacuum's progress view
    return {"fold_s": round(folded - started, 1), "vacuum_s": round(time.monotonic() - folded, 1)}


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
    """``trials`` read-your-writes trials over :data:`TRIAL_THREADS` threads at
    :data:`TRIAL_RATE` a second, with :data:`LOAD_RATE` background writes/s (and their
    domain events, with ``events``),
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
    settled = settle(pipe.ctx)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    try:
        with background(
            conninfo, pipe.tenant, writers, LOAD_RATE, 3600, seed=11, events=load_events
        ) as finish:
            time.sleep(1.0)  # the load is on before the first trial
            _run_trials(
                (conninfo, url, api_key, pipe.tenant),
                groups,
                per_thread,
                out,
                producer,
                topics["transaction.created"],
                wait_ms,
            )
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
        "latency_ms": pcts(out.latencies_ms),
        "latency_ms_by_token": {form: pcts(xs) for form, xs in out.by_form.items()},
        "trials_per_s": round(lat.size / elapsed, 1),
        "elapsed_s": round(elapsed, 1),
        "load_per_s": round(writes / took, 1),
        "load_at_start": round(load, 2),
        "settled_s": settled,
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


def both(
    ctx: common.Context,
    pipe: Pipeline,
    conninfo: str,
    writers: list[int],
    quick: bool,
    trials: int | None = None,
) -> dict[str, Any]:
    """Read-your-writes through Debezium (with the server's default ``wait_ms``, then
    a fifth as many trials with ``wait_ms=0``: straight to the recompute), then through
    domain events. The issue's 10,000 trials per path; 40 with ``quick``."""
    from freshline.pipeline.api.accounts import create_api_key

    trials = trials or (40 if quick else 10_000)
    busy = set(writers)
    spare = [u for u in range(ctx.dataset().users, 0, -1) if u not in busy]
    # A smoke run's few trials take a user each (the entries of the rest, cached before
    # each path, would go unread).
    per_thread = min(TRIAL_USERS_PER_THREAD, -(-trials // TRIAL_THREADS)) if quick else None
    trial_users = spare[: TRIAL_THREADS * (per_thread or TRIAL_USERS_PER_THREAD)]
    api_key = create_api_key(ctx.engine, pipe.tenant)
    out: dict[str, Any] = {"trials_asked": trials}
    with reference_app.serve_freshline(ctx, pipe.version) as url:
        # A smoke run keeps the tuned connector and the consumer the CDC part left.
        if not (quick and pipe.reuse(True, {})):
            pipe.connector(tuned=True)
            pipe.consume({})
            pipe.probe(sql_poke(conninfo, pipe.tenant, writers[0]))
        common.note(f"freshness: read-your-writes through Debezium, {trials} trials")
        out["sql"] = ryw(pipe, conninfo, url, api_key, writers, trial_users, trials, events=False)
        _note_ryw(out["sql"])
        common.note(f"freshness: the same with wait_ms=0, {trials // 5} trials")
        out["sql_wait0"] = ryw(
            pipe, conninfo, url, api_key, writers, trial_users, trials // 5, events=False, wait_ms=0
        )
        _note_ryw(out["sql_wait0"])
        try:
            domain = [
                qualified(pipe.settings, t) for t in ("transaction.created", "transaction.updated")
            ]
            pipe.pause_connector()
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


def builds(trees: dict[str, str], rounds: int, trials: int) -> dict[str, Any]:
    """Read-your-writes with ``wait_ms=0`` (each read recomputes) against ``freshline
    serve`` of each checkout in turn, ``trees`` mapping a name to a checkout's root
    (``""``: this one), the order reversed every round so neither always runs on the
    table the other has just grown; :data:`LOAD_RATE` background writes/s, the tuned
    connector and this checkout's consumer throughout. Per round, each build's p50 and
    p99; the medians of each round's ratio to the first build."""
    from bench.cdc_freshness import _writers

    ctx = common.context(False)
    data = ctx.dataset()
    conninfo = _connstr(ctx.settings.postgres_url)
    pipe = Pipeline(ctx, ctx.schema_version(), data.tenant)
    writers = _writers(conninfo, data.tenant)
    busy = set(writers)
    spare = [u for u in range(data.users, 0, -1) if u not in busy]
    trial_users = spare[: TRIAL_THREADS * TRIAL_USERS_PER_THREAD]
    groups = [trial_users[k::TRIAL_THREADS] for k in range(TRIAL_THREADS)]
    api_key = _api_key(ctx, pipe.tenant)
    names = list(trees)
    out: dict[str, Any] = {"rounds": [], "trials_per_round": trials, "load_rate": LOAD_RATE}
    try:
        pipe.connector(tuned=True)
        pipe.consume({})
        pipe.probe(sql_poke(conninfo, pipe.tenant, writers[0]))
        settle(ctx)
        with background(conninfo, pipe.tenant, writers, LOAD_RATE, 24 * 3600, seed=11) as done:
            for n in range(rounds):
                figures: dict[str, dict[str, float | None]] = {}
                for name in names if n % 2 == 0 else names[::-1]:
                    root = trees[name]
                    env = {"PYTHONPATH": f"{root}:{root}/examples/fraud"} if root else {}
                    with reference_app.serve_freshline(ctx, pipe.version, env=env) as url:
                        got = Trials()
                        per_thread = -(-trials // TRIAL_THREADS)
                        target = (conninfo, url, api_key, pipe.tenant)
                        _run_trials(target, groups, per_thread, got, None, "", 0)
                    if got.predates or got.errors:
                        raise RuntimeError(f"{name}: {got.predates} predate, {dict(got.errors)}")
                    figures[name] = pcts(got.latencies_ms)
                    common.note(
                        f"read_your_writes: round {n + 1}/{rounds}, {name}: p50 "
                        f"{figures[name]['p50']} p99 {figures[name]['p99']} ms"
                    )
                out["rounds"].append(figures)
            done(True)
    finally:
        pipe.close()
    first = names[0]
    for name in names[1:]:
        for q in ("p50", "p99"):
            ratios = [r[name][q] / r[first][q] for r in out["rounds"]]
            out[f"{q}_ratio_{name}_to_{first}"] = {
                "rounds": [round(x, 3) for x in ratios],
                "median": round(statistics.median(ratios), 3),
            }
    return out


def _api_key(ctx: common.Context, tenant: str) -> str:
    from freshline.pipeline.api.accounts import create_api_key

    return create_api_key(ctx.engine, tenant)


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m bench.read_your_writes", description=builds.__doc__
    )
    parser.add_argument("builds", nargs="+", metavar="NAME=TREE")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--trials", type=int, default=800)
    args = parser.parse_args()
    trees = dict(spec.split("=", 1) for spec in args.builds)
    trees = {name: str(Path(root).resolve()) for name, root in trees.items()}
    trees["this"] = ""
    res = common.run_standalone(lambda _quick: builds(trees, args.rounds, args.trials), False)
    print(orjson.dumps(res, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
