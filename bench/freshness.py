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
background load on other users, trial threads (50 trials a second in all, each thread
on a schedule: :data:`bench.read_your_writes.TRIAL_RATE`) each commit an INSERT for a
user of their own with ``SELECT freshline.token()`` (inside the transaction for even
trials, right after commit for odd ones), then read
``GET /v1/features/txn_90d/{user}?after=<token>`` (the server's default ``wait_ms``;
then a fifth as many trials with ``wait_ms=0``, which go straight to the recompute).
An answer predates the commit when its ``last_txn_at`` is before the inserted row's
``created_at`` (the trial users get no other writes); there must be none.
Commit-to-answer runs from the COMMIT's return to the answer. Then the same with
domain events: the writer also publishes ``transaction.created`` after commit, the
background load publishes one per write, and the consumer reads the domain topics only
(the connector paused, as where domain events alone feed freshline). Before each path, the
work earlier writes left is finished (:func:`bench.read_your_writes.settle`).

The parts live in :mod:`bench.cdc_stages`, :mod:`bench.read_your_writes` (both with
the background writers of :mod:`bench.sql_load`) and here (token reads, the run, the
section).

Run alone: ``.venv/bin/python -m bench.freshness [--quick] [--parts token cdc ryw]
[--json]``; or as part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import psycopg

from bench import common, read_your_writes, reference_app
from bench.cdc_freshness import _connstr, _writers
from bench.cdc_stages import BEFORE_CONNECTOR, FEATURE_SETS, RATES, STAGES, Pipeline, cdc
from bench.read_your_writes import LOAD_RATE, RYW_SET, TRIAL_RATE, TRIAL_THREADS
from freshline.pipeline.cdc.connect import (
    LATENCY_SETTINGS,
)
from tests.helpers import REGISTRY

PARTS = ("token", "cdc", "ryw")


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
    from freshline.pipeline.cache.tokens import Tokens

    ranks = Tokens(ctx.engine, ctx.redis)
    for text in tokens:
        token = ranks.parse(text)
        if ranks.rank(token) is None and ranks.resolve(token) is None:
            raise RuntimeError("a committed transaction's token did not rank")
    with psycopg.connect(conninfo, autocommit=True) as conn, conn.transaction():
        conn.execute("SELECT pg_current_xact_id()")


def token_reads(ctx: common.Context, quick: bool) -> dict[str, Any]:
    """p50 at c=16 of token reads whose entries cover the token, against plain reads."""
    from freshline.pipeline.cache.client import FeatureClient
    from freshline.pipeline.cache.readthrough import ReadThrough
    from freshline.pipeline.cache.store import EntryStore

    data = ctx.dataset()
    conninfo = _connstr(ctx.settings.postgres_url)
    tokens = {
        "after commit": _token(conninfo, data.tenant, in_txn=False),
        "in txn": _token(conninfo, data.tenant, in_txn=True),
    }
    _covered(ctx, conninfo, list(tokens.values()))
    version, tenant, key, users = reference_app.prepared(ctx)  # computed after the tokens
    scripts = {"plain": reference_app.wrk_get_script(key, users, RYW_SET, "")} | {
        f"after ({form})": reference_app.wrk_get_script(key, users, RYW_SET, f"?after={tok}")
        for form, tok in tokens.items()
    }
    rounds, seconds = (1, 1) if quick else (9, 4)
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
    rc = ctx.new_redis()
    client = FeatureClient(
        rc,
        version,
        readthrough=ReadThrough(EntryStore(rc, version, registry=REGISTRY), ctx.engine),
        registry=REGISTRY,
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
        rounds=1 if quick else 7,
        calls=100 if quick else 4000,
        concurrency=16,
    )
    rc.close()
    return {
        "rounds": rounds,
        "seconds": seconds,
        "server_workers": reference_app.server_workers(quick),
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
                _part(
                    res,
                    "ryw",
                    lambda: read_your_writes.both(ctx, pipe, conninfo, writers, quick, trials),
                )
        finally:
            pipe.close()
    res["targets"] = _targets(res)
    res["parameters"] = {
        "rates": list(RATES),
        "load_rate": LOAD_RATE,
        "trial_threads": TRIAL_THREADS,
        "trial_rate": TRIAL_RATE,
        "feature_sets": list(FEATURE_SETS),
        "before_connector": BEFORE_CONNECTOR,
        "after_connector": LATENCY_SETTINGS,
        "batch_max_wait_ms": ctx.settings.batch_max_wait_ms,
        "batches_as_fetched": True,
        "token_wait_ms": ctx.settings.token_wait_ms,
        "dataset": {"users": data.users, "transactions": data.transactions},
    }
    return res


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
            f"`GET /v1/features/txn_90d/{{id}}` on `freshline serve` "
            f"({tok.get('server_workers', 2)} workers, tier off) "
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
            + _warmup(cdc_res)
            + (
                "per window, each rate twice per configuration in the order before, after, "
                "after, before (each window adds rows to the busy users' current UTC day, "
                "which slows the next: so each configuration runs first and last once), "
                "the two windows' changes taken together. "
                if cdc_res.get("order") == "abba"
                else "per window, each rate once per configuration, in the order of the columns. "
            )
            + "Before: connector "
            + ", ".join(f"`{k}={v}`" for k, v in cfg["before"]["connector"].items())
            + " (the rest Debezium's and Connect's defaults). After: "
            + ", ".join(f"`{k}={v}`" for k, v in cfg["after"]["connector"].items())
            + " (`pipeline/cdc/connect.py`, `LATENCY_SETTINGS`). The consumer is the same in "
            f"both (`freshline consume`; {common.batching(res['parameters'])}). "
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
            f"{TRIAL_THREADS} threads, {TRIAL_RATE:g} trials a second in all (each thread on a "
            "schedule), each trial committing an INSERT for a user of its thread's and "
            "then reading `txn_90d` with `after=` its token (the server's default `wait_ms`, "
            f"{res['parameters'].get('token_wait_ms', 100)} ms, unless the row says), beside "
            f"{LOAD_RATE} SQL writes/s of background load on other users. Half the tokens "
            "come from inside the transaction, half from right after commit. Latency runs "
            "from the COMMIT's return to the answer. Before each path the work earlier "
            "writes left is finished (the derived paths' pending changes folded, "
            "autovacuum let end: `bench.read_your_writes.settle`), so the trials run at "
            "their own load, not the CDC windows' leftovers. Through domain events the "
            "writers also publish `transaction.created` after each commit, and the "
            "connector is paused (a deployment fed by domain events alone runs none).",
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


def _warmup(cdc_res: dict[str, Any]) -> str:
    """The windows' warm-up as the section says it; nothing for a run without one."""
    windows = [w for run in cdc_res["windows"].values() for w in run.get("windows", [run])]
    warmup = max((w.get("warmup_s", 0) for w in windows), default=0)
    if not warmup:
        return ""
    return (
        f"after {warmup:g} s of writes at the rate that are not counted (each window starts "
        "a consumer and may restart the connector's task: `bench.cdc_stages.WARMUP_S`) "
    )


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
