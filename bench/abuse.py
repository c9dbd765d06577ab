"""One abusive tenant beside a well-behaved one: what the abuser costs the other.

``freshline serve`` (granian, 2 workers, the semantic routes mounted, every limit at
its default) runs on loopback. The well-behaved tenant reads ``txn_90d`` features of
its own users (entries present, the default read-through mode), one request at a
time at a fixed pace, from one keep-alive connection; each latency runs from the
request's scheduled moment, so requests held up behind a slow one are charged their
wait and ones never sent count as failed. The abusive tenant, from the
same address, floods the server on several connections at once with:

* **predictions of distinct rows**: ``POST /v1/models/{name}/predict``, 100 rows never
  seen before per request (every row a miss and a new cached prediction);
* **ghost ids**: reads of ids that have no source row, by GET and by batches of 100,
  every id new (each a read-through that reaches Postgres);
* **fresh reads**: GETs with ``max_staleness_ms=0``, which no cached entry answers: each
  a recompute in the thread pool, as a token read's can be;
* **bad keys**: requests with random keys that are in no table;
* **LLM flag floods**: ``POST /v1/llm/cache/flag`` for namespaces never stored into.

The abuser runs in a spawned process of its own, so its client threads never hold the
GIL of the process that times the well-behaved tenant, at the lowest CPU priority
(``nice`` 19, :data:`ABUSER_NICE`, in a session of its own whose autogroup has that
``nice`` too, and ``SCHED_IDLE``, :data:`ABUSER_IDLE`), and so does the second
server below: on a real deployment the abuser's client is on a machine of its own,
and on this 2-CPU one a client at normal priority takes CPU from the server it floods,
which is not the server's isolation failing. What the server spends on the abuser's
requests stays at full priority, so it is charged in full; the abuser's own request
rate per phase is reported beside, to show it kept flooding.

Phases rotate without the abuser, with it on a second server, and with it on the
well-behaved tenant's server (without, elsewhere, with, without, ...), so drift and the
load of other work on the machine land on all alike. The second server is the same
``freshline serve`` on the same machine, Postgres and Redis: what the abuser costs the
well-behaved tenant there is what it costs through the machine (CPUs, Postgres, Redis),
which no isolation inside a server can remove; the ratio with / elsewhere is what
sharing the server adds on top. The figures are the well-behaved tenant's p99 and
success rate in each kind of phase, and the p99 ratios (median of the rounds' ratios).
Targets (issue 30): p99 with / without within 1.5x, and every well-behaved request
answered 200.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import secrets
import statistics
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import common, reference_app
from freshline.pipeline.dev import processes

FEATURE_SET = "txn_90d"
SERVER_WORKERS = 2
GOOD_RATE = 50.0
"""The well-behaved tenant's requests per second (open loop, one connection)."""
ALL_KINDS = ("predict", "ghost get", "ghost batch", "fresh get", "bad key", "llm flag")
ABUSE_KINDS = tuple(
    k for k in os.environ.get("FRESHLINE_BENCH_ABUSE_KINDS", ",".join(ALL_KINDS)).split(",") if k
)
"""The kinds of abuse sent (``FRESHLINE_BENCH_ABUSE_KINDS``, comma-separated, to see
what each one costs alone)."""
ABUSE_CONNECTIONS = 2
"""Connections per kind of abuse, each sending as fast as it is answered."""
ABUSER_NICE = int(os.environ.get("FRESHLINE_BENCH_ABUSER_NICE", "19"))
"""CPU priority of the abuser's client and of the second server (standing in for
machines of their own); 0 runs them as co-located peers of the server under test.

Each runs in a session of its own with this ``nice`` for the session's autogroup too
(``/proc/<pid>/autogroup``): where the kernel groups tasks by session
(``sched_autogroup_enabled``, on by default), a task's own ``nice`` weighs only against
its session's other tasks, and a server started in a session of its own would take its
full share against the server under test whatever its ``nice``."""
AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
ABUSER_IDLE = os.environ.get("FRESHLINE_BENCH_ABUSER_IDLE", "1") != "0"
"""Whether the abuser's client and the second server also run under ``SCHED_IDLE``
(``FRESHLINE_BENCH_ABUSER_IDLE=0``: ``nice`` alone). Under ``nice`` alone they still
take a CPU the server under test is woken for, until the scheduler gets round to
preempting them (a wakeup preemption needs a lead of about a millisecond): the
well-behaved tenant's p99 is a few milliseconds, and that wait showed even with the
abuser flooding the other server. A ``SCHED_IDLE`` task is preempted by any other at
once (the kernel's ``check_preempt_wakeup``), which is nearer to the machine of its
own the abuser stands in for; the work the server under test does for it keeps its
full priority."""


def _lower_priority() -> None:
    """This process, in a new session, at :data:`ABUSER_NICE`: the task's and, where
    the kernel groups tasks by session, the session's."""
    os.setsid()
    os.nice(ABUSER_NICE)
    if AUTOGROUP.exists() and AUTOGROUP.read_text().strip() == "1":
        Path("/proc/self/autogroup").write_text(str(ABUSER_NICE))
    if ABUSER_IDLE:  # inherited by the threads started after it
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


PREDICT_ROWS = 100
GHOST_BATCH = 100
GHOST_BASE = 900_000_000
"""Ghost ids start here: far past any seeded user id, so none has a source row."""
FRESH_IDS = 1000
"""The fresh reads cycle through ids 1 to this: each read computes anew all the same."""
FEATURES = ("a", "b", "c")
SERVER_LIMITS = (
    "FRESHLINE_API_RATE_PER_S",
    "FRESHLINE_API_RATE_BURST",
    "FRESHLINE_API_TENANT_CONCURRENCY",
    "FRESHLINE_API_TENANT_POOL_SHARE",
)
"""The settings each profile's header shows."""
UNTRUSTED_TENANT = {
    "rate_per_s": 20.0,
    "rate_burst": 40,
    "concurrency": 1,
    "pool_share": 0.01,
    "rows_per_s": 50.0,
    "rows_burst": 100,
}
"""The limits ``docs/security.md`` gives a tenant the platform does not trust, set with
``freshline tenants limits`` (:func:`freshline.pipeline.api.accounts.set_tenant_limits`)."""
PROFILES: dict[str, dict[str, Any]] = {
    "defaults": {"server": {}, "abuser": {}},
    "untrusted tenant": {"server": {}, "abuser": UNTRUSTED_TENANT},
}
"""Each profile is measured in full: servers started with its ``server`` settings (the
variables set in the environment apply to every profile), the abuser's tenant with its
own ``abuser`` limits, the well-behaved tenant with none."""
TARGET_PROFILE = "untrusted tenant"
PHASES = ("without", "elsewhere", "with")
"""No abuser; the abuser on a second server on this machine; the abuser on the
well-behaved tenant's server."""
FRESHLINE = str(Path(sys.executable).with_name("freshline"))
PHASE_SPAN = 10_000_000
"""Ghost ids and prediction rows of one phase: phase ``n`` starts at ``n * PHASE_SPAN``,
so none is sent twice in a run."""


def _model(name: str, directory: Path) -> Path:
    from freshline.pipeline.inference.models import LogisticModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, len(FEATURES)))
    fitted = LogisticModel.fit(
        x, (x[:, 0] > 0).astype(float), version="v1", feature_names=FEATURES, name=name, epochs=5
    )
    return fitted.save(directory / f"{name}.json")


@contextlib.contextmanager
def _server(
    ctx: common.Context, version: int, limits: dict[str, str], nice: int = 0
) -> Iterator[str]:
    port = reference_app.free_port()
    env = {
        **limits,
        "FRESHLINE_POSTGRES_URL": ctx.settings.postgres_url,
        "FRESHLINE_REDIS_URL": ctx.settings.redis_url,
        "FRESHLINE_SCHEMA_VERSION": str(version),
        "FRESHLINE_SEMANTIC_ENABLED": "true",
        "FRESHLINE_OPS_PORT": "0",  # no operator port: several benchmarks may run at once
    }
    # launch() starts it in a session of its own: that session's autogroup gets the
    # nice too (ABUSER_NICE's docstring).
    workers = 1 if ctx.quick else SERVER_WORKERS  # as reference_app.server_workers
    idle = "chrt --idle 0 " if ABUSER_IDLE else ""
    lowered = f'echo {nice} > /proc/self/autogroup 2>/dev/null; exec {idle}nice -n {nice} "$@"'
    with reference_app.launch(
        [
            *(["sh", "-c", lowered, "sh"] if nice else []),
            *(FRESHLINE, "serve", "--port", str(port), "--workers", str(workers)),
        ],
        env,
        port,
        "/readyz",
    ) as url:
        yield url


class Abuser:
    """The abusive tenant's connections, each sending its kind of request in a loop
    until :meth:`stop`; counts the answers by kind and status."""

    def __init__(
        self,
        url: str,
        key: str,
        model: str,
        tag: str,
        kinds: tuple[str, ...] = ALL_KINDS,
        phase: int = 0,
    ) -> None:
        self.url, self.key, self.model, self.tag, self.kinds = url, key, model, tag, kinds
        self._ids = itertools.count(GHOST_BASE + phase * PHASE_SPAN)
        self._rows = itertools.count(phase * PHASE_SPAN + 1)
        self.answers: Counter[tuple[str, int]] = Counter()
        self.samples: dict[tuple[str, int], str] = {}
        """The first answer of each (kind, status), cut short: what the abuser was told."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _request(self, kind: str) -> Callable[[httpx.Client], httpx.Response]:
        auth = {"Authorization": f"Bearer {self.key}"}

        def predict(c: httpx.Client) -> httpx.Response:
            start = next(self._rows) * PREDICT_ROWS
            rows = [[float(start + i), 0.5, -0.5] for i in range(PREDICT_ROWS)]
            return c.post(f"/v1/models/{self.model}/predict", json={"inputs": rows}, headers=auth)

        def ghost_get(c: httpx.Client) -> httpx.Response:
            return c.get(f"/v1/features/{FEATURE_SET}/{next(self._ids)}", headers=auth)

        def ghost_batch(c: httpx.Client) -> httpx.Response:
            ids = [str(next(self._ids)) for _ in range(GHOST_BATCH)]
            body = {"feature_sets": [FEATURE_SET], "entities": ids}
            return c.post("/v1/features/batch", json=body, headers=auth)

        def fresh_get(c: httpx.Client) -> httpx.Response:
            entity = next(self._rows) % FRESH_IDS + 1
            query = {"max_staleness_ms": 0}
            return c.get(f"/v1/features/{FEATURE_SET}/{entity}", params=query, headers=auth)

        def bad_key(c: httpx.Client) -> httpx.Response:
            bad = {"Authorization": f"Bearer fl_{secrets.token_urlsafe(32)}"}
            return c.get(f"/v1/features/{FEATURE_SET}/1", headers=bad)

        def llm_flag(c: httpx.Client) -> httpx.Response:
            n = next(self._rows)
            body = {
                "model": f"abuse{self.tag}{n}",
                "model_version": "v1",
                "template_version": "t1",
                "entry_id": secrets.token_hex(8),
            }
            return c.post("/v1/llm/cache/flag", json=body, headers=auth)

        return {
            "predict": predict,
            "ghost get": ghost_get,
            "ghost batch": ghost_batch,
            "fresh get": fresh_get,
            "bad key": bad_key,
            "llm flag": llm_flag,
        }[kind]

    def _loop(self, kind: str) -> None:
        send = self._request(kind)
        seen: Counter[tuple[str, int]] = Counter()
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.is_set():
                try:
                    answer = send(client)
                    status, text = answer.status_code, answer.text[:160]
                except httpx.HTTPError as exc:
                    status, text = 0, type(exc).__name__  # a timeout or a refused connection
                seen[(kind, status)] += 1
                if seen[(kind, status)] == 1:
                    with self._lock:
                        self.samples.setdefault((kind, status), text)
        with self._lock:
            self.answers.update(seen)

    def start(self) -> Abuser:
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._loop, args=(kind,), name=f"abuse-{kind}", daemon=True)
            for kind in self.kinds
            for _ in range(ABUSE_CONNECTIONS)
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def _abuse_in_process(
    args: tuple[str, str, str, str, tuple[str, ...], int],
    ready: Any,
    stop: Any,
    out: Any,
    lower: bool = True,
) -> None:
    """An :class:`Abuser` in a process of its own (its threads must not hold the GIL of
    the process that times the well-behaved tenant), at :data:`ABUSER_NICE` (with
    ``lower``), until ``stop``; its counts to ``out``."""
    if lower:
        _lower_priority()
    abuser = Abuser(*args).start()
    ready.set()
    stop.wait()
    abuser.stop()
    out.put((dict(abuser.answers), abuser.samples))


@contextlib.contextmanager
def _abusing(
    url: str, key: str, model: str, tag: str, phase: int, lower: bool = True
) -> Iterator[dict[str, Any]]:
    """The abuser running in a spawned process (at a lowered priority with ``lower``)
    while the block runs; yields a dict that holds its ``answers`` and ``samples`` once
    the block is done."""
    mp = multiprocessing.get_context("spawn")
    ready, stop, out = mp.Event(), mp.Event(), mp.Queue()
    proc = mp.Process(
        target=_abuse_in_process,
        args=((url, key, model, tag, ABUSE_KINDS, phase), ready, stop, out, lower),
        daemon=True,
    )
    proc.start()
    got: dict[str, Any] = {}
    try:
        if not ready.wait(60):
            raise RuntimeError("the abuser's process did not start")
        yield got
    finally:
        stop.set()
        try:
            got["answers"], got["samples"] = out.get(timeout=60)
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def _good_phase(url: str, key: str, users: list[int], seconds: float) -> tuple[list[int], int]:
    """The well-behaved tenant's reads, scheduled at ``GOOD_RATE`` for ``seconds``:
    (latencies ns of its 200s, requests that failed or were never sent).

    Latency runs from each request's scheduled moment, not from when the client got to
    send it, so a server that holds this tenant back is charged for the wait of every
    request queued behind a slow one (no coordinated omission); a request the window
    ended before it was sent counts as failed."""
    samples: list[int] = []
    failures = 0
    ids = itertools.cycle(users)
    interval_ns = 1e9 / GOOD_RATE
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=10
    ) as client:
        client.get(f"/v1/features/{FEATURE_SET}/{users[0]}")  # the connection, outside
        sent = 0
        started = common.now_ns()
        for i in common.paced(GOOD_RATE, seconds):
            due = started + int(i * interval_ns)
            sent += 1
            try:
                ok = client.get(f"/v1/features/{FEATURE_SET}/{next(ids)}").status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                samples.append(common.now_ns() - due)
            else:
                failures += 1
    return samples, failures + max(0, int(seconds * GOOD_RATE) - sent)


def _warm(url: str, key: str, model: str, tag: str, *, quick: bool = False) -> None:
    """Each worker loads the model and the embedding model before anything is timed
    (a smoke run, whose figures are not read, sends each kind once)."""
    abuser = Abuser(url, key, model, tag)
    with httpx.Client(base_url=url, timeout=60) as client:
        for kind in ABUSE_KINDS:
            for _ in range(1 if quick else 4 * SERVER_WORKERS):
                abuser._request(kind)(client)


def _redis_footprint(ctx: common.Context, tenant: str) -> dict[str, int]:
    """Keys the abusive tenant holds in Redis, by kind, after the run."""
    from freshline.pipeline.core.budget import usage
    from freshline.pipeline.core.keys import inference_budget_keys

    keys, size = usage(ctx.redis, inference_budget_keys(tenant))
    semantic = sum(1 for _ in ctx.redis.scan_iter(match=f"sem:*{{{tenant}:*", count=1000))
    return {"prediction_keys": keys, "prediction_bytes": size, "semantic_keys": semantic}


def run(quick: bool) -> dict[str, Any]:
    from freshline.pipeline.api.accounts import create_api_key, create_tenant, set_tenant_limits
    from freshline.pipeline.inference.models import ModelRegistry

    ctx = common.context(quick)
    version, _, key, users = reference_app.prepared(ctx)
    abuser_tenant = f"{ctx.tenant_prefix()}abuser"
    create_tenant(ctx.engine, abuser_tenant)
    abuser_key = create_api_key(ctx.engine, abuser_tenant)
    model = f"bench{ctx.tag}abuse"
    models = tempfile.TemporaryDirectory()  # the registry names the file: kept for the run
    ModelRegistry(ctx.redis).register(_model(model, Path(models.name)))
    pairs, seconds = (1, 1.0) if quick else (5, 10.0)
    # A smoke run takes the target's profile alone: the other runs the same code.
    chosen = {TARGET_PROFILE: PROFILES[TARGET_PROFILE]} if quick else PROFILES
    with models:
        profiles = {}
        for n, (name, profile) in enumerate(chosen.items()):
            # Set before the profile's servers start: they read it with the key.
            reset = dict.fromkeys(UNTRUSTED_TENANT)
            set_tenant_limits(ctx.engine, None, abuser_tenant, {**reset, **profile["abuser"]})
            profiles[name] = _profile(
                ctx, version, key, users, abuser_key, model, profile["server"], n, pairs, seconds
            )
            profiles[name]["tenant_limits"] = profile["abuser"]
    held = _redis_footprint(ctx, abuser_tenant)
    measured = profiles[TARGET_PROFILE]
    return {
        "parameters": {
            "server_workers": 1 if quick else SERVER_WORKERS,
            "good_rate_per_s": GOOD_RATE,
            "phase_s": seconds,
            "pairs": pairs,
            "abuse_connections_per_kind": ABUSE_CONNECTIONS,
            "predict_rows": PREDICT_ROWS,
            "ghost_batch": GHOST_BATCH,
            "cpus": os.cpu_count(),
            "abuser_nice": 0 if quick else ABUSER_NICE,
            "abuser_idle": ABUSER_IDLE and not quick,
            "kinds": list(ABUSE_KINDS),
        },
        "profiles": profiles,
        "abuser_redis": held,
        "targets": [
            common.target(
                "well-behaved p99 with / without the abuser (its tenant's limits for "
                "an untrusted tenant)",
                measured["p99_ratio_median"],
                "<=",
                1.5,
                "x",
            ),
            common.target(
                "well-behaved p99 with the abuser on its server / on another server",
                measured["p99_ratio_with_elsewhere_median"],
                "<=",
                1.5,
                "x",
            ),
            common.target(
                "well-behaved requests answered 200 with the abuser",
                100 * min(p["results"]["with"]["success_rate"] or 0 for p in profiles.values()),
                ">=",
                100,
                "%",
            ),
        ],
    }


def _profile(
    ctx: common.Context,
    version: int,
    key: str,
    users: list[int],
    abuser_key: str,
    model: str,
    limits: dict[str, str],
    index: int,
    pairs: int,
    seconds: float,
) -> dict[str, Any]:
    """The rounds of one profile of limits, on servers started with them."""
    series: dict[str, list[int]] = {phase: [] for phase in PHASES}
    failures = dict.fromkeys(PHASES, 0)
    ratios: dict[str, list[float]] = {"with": [], "elsewhere": [], "with_elsewhere": []}
    abuser_answers: Counter[tuple[str, int]] = Counter()
    abuser_sent = {"with": 0, "elsewhere": 0}
    told: dict[tuple[str, int], str] = {}
    with contextlib.ExitStack() as stack:
        # A smoke run keeps the abuser and its server at full priority: at idle priority
        # the server did not answer within three minutes on a busy machine (a load
        # average of 20-35), and a smoke run's figures are not read.
        nice = 0 if ctx.quick else ABUSER_NICE
        url, elsewhere = processes.enter_together(
            stack, [_server(ctx, version, limits), _server(ctx, version, limits, nice=nice)]
        )
        _warm(url, abuser_key, model, ctx.tag, quick=ctx.quick)
        _warm(elsewhere, abuser_key, model, ctx.tag, quick=ctx.quick)
        for p in range(pairs):
            p99: dict[str, float] = {}
            for phase in PHASES:
                if phase == "without":
                    samples, failed = _good_phase(url, key, users, seconds)
                else:
                    target = url if phase == "with" else elsewhere
                    # No id sent twice in the run.
                    round_ = 2 * (index * pairs + p) + (1 if phase == "with" else 2)
                    with _abusing(
                        target, abuser_key, model, ctx.tag, round_, lower=not ctx.quick
                    ) as got:
                        samples, failed = _good_phase(url, key, users, seconds)
                    abuser_answers.update(got["answers"])
                    abuser_sent[phase] += sum(got["answers"].values())
                    for k, v in got["samples"].items():
                        told.setdefault(k, v)
                series[phase].extend(samples)
                failures[phase] += failed
                p99[phase] = common.stats_ns(samples).get("p99_us", 0.0)
            if p99["without"] and p99["elsewhere"]:
                ratios["with"].append(p99["with"] / p99["without"])
                ratios["elsewhere"].append(p99["elsewhere"] / p99["without"])
                ratios["with_elsewhere"].append(p99["with"] / p99["elsewhere"])
            common.note(
                f"round {p + 1}/{pairs}: p99 {p99['without'] / 1000:.1f} ms without, "
                f"{p99['elsewhere'] / 1000:.1f} ms with the abuser on another server, "
                f"{p99['with'] / 1000:.1f} ms with it on this one"
            )
    results: dict[str, dict[str, Any]] = {}
    for phase, samples in series.items():
        sent = len(samples) + failures[phase]
        results[phase] = {
            **common.stats_ns(samples),
            "failures": failures[phase],
            "success_rate": round(len(samples) / sent, 5) if sent else None,
        }
    overall = (
        round(results["with"]["p99_us"] / results["without"]["p99_us"], 3)
        if results["with"].get("n") and results["without"].get("n")
        else None
    )
    medians = {k: round(statistics.median(v), 3) if v else None for k, v in ratios.items()}
    median_ratio = medians["with"]
    abuse = {
        kind: {str(status): n for (k, status), n in sorted(abuser_answers.items()) if k == kind}
        for kind in ABUSE_KINDS
    }
    return {
        "limits": limits,
        "results": results,
        "p99_ratio_median": median_ratio,
        "p99_ratio_overall": overall,
        "pair_ratios": [round(r, 3) for r in ratios["with"]],
        "p99_ratio_elsewhere_median": medians["elsewhere"],
        "elsewhere_ratios": [round(r, 3) for r in ratios["elsewhere"]],
        "p99_ratio_with_elsewhere_median": medians["with_elsewhere"],
        "abuser_answers": abuse,
        "abuser_rate_per_s": {
            phase: round(n / (pairs * seconds)) for phase, n in abuser_sent.items()
        },
        "abuser_told": {f"{kind} {status}": text for (kind, status), text in sorted(told.items())},
    }


def _effective(limits: dict[str, str]) -> dict[str, str]:
    """Each limit the profile's servers ran with: the profile's, the environment's, or
    the setting's default."""
    from freshline.pipeline.core.settings import Settings

    fields = Settings.model_fields
    return {
        var: limits.get(var)
        or os.environ.get(var)
        or str(fields[var.removeprefix("FRESHLINE_").lower()].default)
        for var in SERVER_LIMITS
    }


def _profile_markdown(name: str, prof: dict[str, Any]) -> list[str]:
    rows = [
        (
            phase,
            r.get("n", 0),
            r.get("failures", 0),
            None if r.get("success_rate") is None else f"{100 * r['success_rate']:.2f}%",
            r.get("p50_us"),
            r.get("p90_us"),
            r.get("p99_us"),
            r.get("max_us"),
        )
        for phase, r in prof["results"].items()
    ]
    answers = [
        (kind, ", ".join(f"{status}: {common.fmt(n)}" for status, n in counts.items()) or "-")
        for kind, counts in prof["abuser_answers"].items()
    ]
    limits = ", ".join(
        f"`{var.removeprefix('FRESHLINE_')}={value}`"
        for var, value in _effective(prof["limits"]).items()
    )
    own = prof.get("tenant_limits") or {}
    tenant = (
        "; the abuser's tenant's own (`freshline tenants limits`): "
        + ", ".join(f"`{name}={value:g}`" for name, value in own.items())
        if own
        else ""
    )
    return [
        f"### {name}: server {limits}{tenant}",
        "",
        common.table(
            ["phase", "requests ok", "failed or not sent", "success", "p50", "p90", "p99", "max"],
            rows,
        ),
        "",
        f"p99 with / without: {common.fmt(prof['p99_ratio_median'], 3)}x (median of the "
        f"rounds' ratios {prof['pair_ratios']}); over all samples "
        f"{common.fmt(prof['p99_ratio_overall'], 3)}x. With the abuser on another "
        f"server: {common.fmt(prof.get('p99_ratio_elsewhere_median'), 3)}x "
        f"({prof.get('elsewhere_ratios')}); on this server / on another: "
        f"{common.fmt(prof.get('p99_ratio_with_elsewhere_median'), 3)}x.",
        "",
        "The abuser sent "
        + " and ".join(
            f"{common.fmt(n)} requests/s {phase}"
            for phase, n in prof.get("abuser_rate_per_s", {}).items()
        )
        + ". What it got (status: answers):",
        "",
        common.table(["abuse", "answers"], answers),
        "",
    ]


def markdown(res: dict[str, Any]) -> str:
    p = res["parameters"]
    held = res["abuser_redis"]
    lines = [
        "## abuse: one abusive tenant beside a well-behaved one",
        "",
        f"`freshline serve` (granian, {p['server_workers']} workers, semantic routes on) on "
        "loopback. The well-behaved tenant reads its own `txn_90d` entries at "
        f"{common.fmt(p['good_rate_per_s'])} requests/s on one connection. The abuser, from "
        f"the same address and with one key, keeps {p['abuse_connections_per_kind']} "
        "connections busy per kind of abuse: predictions of "
        f"{p['predict_rows']} distinct rows, reads of ids with no source row (GET, and "
        f"batches of {p['ghost_batch']}), "
        + (
            "reads with `max_staleness_ms=0` (each a recompute), "
            if "fresh get" in p.get("kinds", ())
            else ""
        )
        + "random bad keys, and LLM flags for "
        f"namespaces never stored into. For each profile of limits, {p['pairs']} rounds of "
        f"three {p['phase_s']:.1f} s phases: without the abuser, with it flooding a second "
        "`freshline serve` on this machine at the abuser's priority (`elsewhere`: what it "
        "costs through the shared CPUs, Postgres and Redis, which no server can isolate), "
        "and with it flooding the well-behaved tenant's server. Times in µs, the "
        "well-behaved tenant's, from each request's scheduled moment (a request held up "
        "behind a slow one is charged its wait); `failed` counts requests answered "
        "otherwise than 200 and those the phase ended before they could be sent. The "
        f"abuser runs in a process of its own on the same {p['cpus']} CPUs as the servers, "
        f"at CPU priority `nice {p.get('abuser_nice', 0)}`"
        + (" under `SCHED_IDLE`" if p.get("abuser_idle") else "")
        + " (as the second server is; "
        "each in a session of its own whose scheduler autogroup has that `nice` too: "
        "where the kernel groups tasks by session, a task's own `nice` weighs only "
        "inside its session"
        + (
            "; a `SCHED_IDLE` task gives way at once to any other woken on its CPU"
            if p.get("abuser_idle")
            else ""
        )
        + "), "
        "standing in for machines of their own: the server under test spends at full "
        "priority whatever the abuser's requests cost it. `defaults` runs every limit at "
        "its default; `untrusted tenant` gives the abuser's tenant the limits "
        "`docs/security.md` gives a tenant the platform does not trust (the target's), "
        "the well-behaved tenant and the servers keeping the defaults.",
        "",
    ]
    for name, prof in res["profiles"].items():
        lines += _profile_markdown(name, prof)
    lines += [
        f"It holds {common.fmt(held['prediction_keys'])} cached predictions "
        f"({common.fmt(held['prediction_bytes'])} bytes, within its budget) and "
        f"{common.fmt(held['semantic_keys'])} semantic keys afterwards.",
        "",
        common.targets_table(res["targets"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    quick = "--quick" in sys.argv
    print(json.dumps(common.run_standalone(run, quick), indent=2))
