"""The HTTP floor: a minimal Starlette + redis.asyncio app, measured beside freshline.

The reference answers the read API's two feature requests with nothing but the Redis
call: ``GET /v1/features/{feature_set}/{entity_id}`` does one GET and ``POST
/v1/features/batch`` one MGET of the body's entities. No auth, no validation, no
decoding: it returns the stored JSON as is. Served by the same granian launch as
``freshline serve`` (:func:`freshline.pipeline.cli.serve.run_granian`, the same workers), it is
what a Python ASGI server does on this machine against this Redis, so every HTTP
figure of freshline is reported as a ratio to it, measured in the same run.

A second reference, ``minimal+decode``, is the same app answering what freshline
answers: it also reads each feature set's truncate floor in the MGET, decodes every
entry with freshline's decoder (:func:`freshline.pipeline.core.codec.decode_rows`: schema version,
field count, tombstone, floor) and sends the same JSON object per entity (named
values, age, source, schema version). Still no auth, id validation, version pointer,
metrics or hot-read sampling: it is the floor of freshline's answer format, so
``freshline / minimal+decode`` is what the rest of freshline costs.

freshline runs twice: with the in-process tier off (every read a Redis round trip)
and on, warm (no round trip). ``wrk`` (``apt-get install wrk``) loads every server
for a few seconds per figure, in interleaved rounds; figures are medians over rounds
and each ratio the median of the rounds' ratios.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import common
from freshline.pipeline.dev import processes
from freshline.pipeline.dev.tools import require

FEATURE_SET = "txn_90d"
ENTITIES = 1000
MIN_LIFE_S = 1800
"""Entries :func:`prepared` keeps must live at least this long: an entry whose user has
a row about to age out of the 90-day window ends at that moment (its horizon), and a
benchmark of hits would meet it as a miss."""
BATCH = 100
SERVER_WORKERS = 2


def levels(quick: bool) -> tuple[int, ...]:
    """The concurrencies :func:`compare` runs wrk at: a smoke run's, c=16 alone (the
    same code; c=1 would be as many seconds of wrk again)."""
    return (16,) if quick else (1, 16)


def server_workers(quick: bool) -> int:
    """Workers of each server a benchmark starts: :data:`SERVER_WORKERS`, one in a smoke
    run (whose figures are not read: each worker is a process that imports freshline,
    seconds of CPU on a machine the run shares with its other benchmarks)."""
    return 1 if quick else SERVER_WORKERS


FRESHLINE = str(Path(sys.executable).with_name("freshline"))
HEADER = 31  # tag + watermark ahead of an entry's JSON (freshline.pipeline.core.codec.HEADER)
SERVERS = ("minimal", "minimal+decode", "freshline", "freshline+tier")
FLOOR = "minimal+decode"
ENDPOINTS = ("GET", "batch 100")
START_DEADLINE_S = 180.0
"""A deadline, not a measure: at a load average of 35 a server took over a minute to
answer (abuse's two, started together beside a smoke run's other benchmarks)."""


# -- the minimal app -------------------------------------------------------------------


def app_from_env() -> Any:
    """The reference app; ``BENCH_REFERENCE_REDIS_URL`` and ``_PREFIX`` from the launcher.

    ``_PREFIX`` is the feature key up to the entity: ``feat:<v>:<set>:{<tenant>:``. With
    ``BENCH_REFERENCE_DECODE`` (the schema version) it is ``minimal+decode``.
    """
    import redis.asyncio as aioredis
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    url = os.environ["BENCH_REFERENCE_REDIS_URL"]
    prefix = os.environ["BENCH_REFERENCE_PREFIX"]
    client = aioredis.Redis.from_url(url)

    async def get(request: Request) -> Response:
        raw = await client.get(f"{prefix}{request.path_params['entity_id']}}}")
        if raw is None:
            return Response(b'{"error":"miss"}', status_code=404, media_type="application/json")
        return Response(raw[HEADER:], media_type="application/json")

    async def mget(request: Request) -> Response:
        body = orjson.loads(await request.body())
        raws: list[Any] = await client.mget([f"{prefix}{e}}}" for e in body["entities"]])
        out = b",".join(b"null" if r is None else r[HEADER:] for r in raws)
        return Response(b"[" + out + b"]", media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    decode = os.environ.get("BENCH_REFERENCE_DECODE")
    if decode:
        get, mget = _decoding_routes(client, prefix, int(decode))
    return Starlette(
        routes=[
            Route("/v1/features/batch", mget, methods=["POST"]),
            Route("/v1/features/{feature_set}/{entity_id}", get),
        ],
        lifespan=lifespan,
    )


def _decoding_routes(client: Any, prefix: str, version: int) -> tuple[Any, Any]:
    """``minimal+decode``: the same reads with the floor, decoded and answered as
    freshline answers (see the module docstring)."""
    from starlette.requests import Request
    from starlette.responses import Response

    from freshline.pipeline.core.clock import now_ms
    from freshline.pipeline.core.codec import decode_rows
    from tests.helpers import REGISTRY

    fields = REGISTRY[FEATURE_SET].field_names
    floor = f"floor:{version}:{FEATURE_SET}"

    def answers(entities: list[str], raws: list[Any]) -> list[dict[str, Any]]:
        now = now_ms()
        return [
            {
                "feature_set": FEATURE_SET,
                "entity": e,
                "values": None,
                "hit": False,
                "source": "miss",
                "age_ms": 0,
                "schema_version": version,
            }
            if row is None
            else {
                "feature_set": FEATURE_SET,
                "entity": e,
                "values": row[0],
                "hit": True,
                "source": "hit",
                "age_ms": max(0, now - row[1]),
                "schema_version": version,
            }
            for e, row in zip(
                entities, decode_rows(raws[:-1], fields, version, raws[-1]), strict=True
            )
        ]

    async def get(request: Request) -> Response:
        entity = request.path_params["entity_id"]
        [answer] = answers([entity], await client.mget([f"{prefix}{entity}}}", floor]))
        if answer["values"] is None:
            return Response(b'{"error":"miss"}', status_code=404, media_type="application/json")
        return Response(orjson.dumps(answer), media_type="application/json")

    async def mget(request: Request) -> Response:
        entities = orjson.loads(await request.body())["entities"]
        raws = await client.mget([f"{prefix}{e}}}" for e in entities] + [floor])
        items = answers(entities, raws)
        return Response(
            orjson.dumps({"schema_version": version, "items": items}), media_type="application/json"
        )

    return get, mget


# -- servers ---------------------------------------------------------------------------


free_port = processes.free_port


def launch(
    argv: list[str], env: dict[str, str], port: int, ready: str
) -> contextlib.AbstractContextManager[str]:
    """Run ``argv`` in a process group of its own, with ``env`` on top of this
    environment, until ``ready`` answers (within :data:`START_DEADLINE_S`); yields the
    URL (``processes.serving``)."""
    return processes.serving(
        argv, port, ready=ready, env={**os.environ, **env}, timeout=START_DEADLINE_S, grace_s=10
    )


def serve_freshline(
    ctx: common.Context,
    version: int,
    *,
    local_cache_size: int = 0,
    env: dict[str, str] | None = None,
) -> contextlib.AbstractContextManager[str]:
    """``freshline serve`` on a free port, with ``env`` on top of the benchmark's
    (another checkout's ``PYTHONPATH``, say); yields its URL."""
    port = free_port()
    own = {
        "FRESHLINE_POSTGRES_URL": ctx.settings.postgres_url,
        "FRESHLINE_REDIS_URL": ctx.settings.redis_url,
        "FRESHLINE_SCHEMA_VERSION": str(version),
        "FRESHLINE_LOCAL_CACHE_SIZE": str(local_cache_size),
        # One key drives the whole load: its rate limit would answer 429s, cheap
        # responses that would flatter the figures. Every other check stays on.
        "FRESHLINE_API_RATE_PER_S": "0",
    }
    return launch(
        [FRESHLINE, "serve", "--port", str(port), "--workers", str(server_workers(ctx.quick))],
        {**own, **(env or {})},
        port,
        "/readyz",
    )


def serve_reference(
    ctx: common.Context, version: int, tenant: str, *, decode: bool = False
) -> contextlib.AbstractContextManager[str]:
    """The minimal app (``decode``: minimal+decode) on a free port, launched as
    ``freshline serve`` launches the API."""
    port = free_port()
    env = {
        "BENCH_REFERENCE_REDIS_URL": ctx.settings.redis_url,
        "BENCH_REFERENCE_PREFIX": f"feat:{version}:{FEATURE_SET}:{{{tenant}:",
        "BENCH_REFERENCE_DECODE": str(version) if decode else "",
    }
    code = (
        "from freshline.pipeline.cli.serve import run_granian; "
        f"run_granian('bench.reference_app:app_from_env', '127.0.0.1', {port}, "
        f"{server_workers(ctx.quick)})"
    )
    return launch([sys.executable, "-c", code], env, port, "/v1/features/x/0")


# -- wrk -------------------------------------------------------------------------------

_WRK_LATENCY = re.compile(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_WRK_RATE = re.compile(r"Requests/sec:\s+([\d.]+)")


def wrk_script(key: str, users: list[int], *, batch: bool) -> str:
    """A Lua script cycling through ``users`` (or batches of them) in cache-only mode."""
    if batch:
        bodies = [
            orjson.dumps(
                {"feature_sets": [FEATURE_SET], "entities": [str(u) for u in users[i : i + BATCH]]}
            ).decode()
            for i in range(0, len(users), BATCH)
        ]
        items = ", ".join(f"'{b}'" for b in bodies)
        return (
            f"local bodies = {{{items}}}\nlocal i = 0\n"
            "request = function()\n  i = i % #bodies + 1\n"
            "  return wrk.format('POST', '/v1/features/batch?mode=cache-only', "
            f"{{['Authorization'] = 'Bearer {key}', "
            "['Content-Type'] = 'application/json'}, bodies[i])\nend\n"
        )
    return wrk_get_script(key, users, FEATURE_SET, "?mode=cache-only")


def wrk_get_script(key: str, users: list[int], feature_set: str, query: str) -> str:
    """A Lua script cycling through ``users``, one GET of ``feature_set`` each, with
    ``query`` (``""`` or from ``?``) appended to the path."""
    ids = ", ".join(str(u) for u in users)
    return (
        f"local ids = {{{ids}}}\nlocal i = 0\n"
        "request = function()\n  i = i % #ids + 1\n"
        f"  return wrk.format('GET', '/v1/features/{feature_set}/' .. ids[i] .. '{query}', "
        f"{{['Authorization'] = 'Bearer {key}'}})\nend\n"
    )


def wrk(url: str, script: str, *, concurrency: int, seconds: float) -> dict[str, Any]:
    """One wrk run: p50/p75/p90/p99 in µs, requests/s and non-2xx responses."""
    exe = require("wrk")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        threads = 1 if concurrency == 1 else 2
        out = subprocess.run(
            [
                exe,
                f"-t{threads}",
                f"-c{concurrency}",
                f"-d{seconds}s",
                "--latency",
                "-s",
                f.name,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 30,
            check=False,
        ).stdout
    finally:
        os.unlink(f.name)
    scale = {"us": 1.0, "ms": 1000.0, "s": 1e6}
    lat = {f"p{p}_us": round(float(v) * scale[u], 1) for p, v, u in _WRK_LATENCY.findall(out)}
    rate = _WRK_RATE.search(out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {
        **lat,
        "ops_per_s": float(rate.group(1)) if rate else 0.0,
        "errors": int(non2xx.group(1)) if non2xx else 0,
    }


def compare(
    urls: dict[str, str],
    key: str,
    users: list[int],
    *,
    rounds: int,
    seconds: float,
    levels: tuple[int, ...] = (1, 16),
) -> dict[str, Any]:
    """wrk every server on both endpoints at each of ``levels`` of concurrency (c=1 and
    c=16), interleaved round by round.

    ``urls`` maps a server name of :data:`SERVERS` to its URL; the first is the
    reference. Returns the median figures per ``c<n>:<endpoint>:<server>``, the
    median ratio of each to the reference's figure of the same round (``ratios``) and,
    for freshline's servers, to :data:`FLOOR`'s (``to_floor``), when it runs.
    """
    scripts = {e: wrk_script(key, users, batch=e != "GET") for e in ENDPOINTS}
    ref = next(iter(urls))
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):
        for conc in levels:
            for endpoint in ENDPOINTS:
                names = list(urls)
                order = names[r % len(names) :] + names[: r % len(names)]
                for server in order:
                    res = wrk(urls[server], scripts[endpoint], concurrency=conc, seconds=seconds)
                    runs.setdefault(f"c{conc}:{endpoint}:{server}", []).append(res)
        common.note(f"wrk round {r + 1}/{rounds} done")
    figures = {
        name: {m: statistics.median(run[m] for run in rs) for m in rs[0]}
        for name, rs in runs.items()
    }

    def ratio(rs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, float]:
        return {
            m: round(
                statistics.median(a[m] / b[m] for a, b in zip(rs, base, strict=True) if b.get(m)), 2
            )
            for m in ("p50_us", "p99_us", "ops_per_s")
            if m in rs[0]
        }

    ratios: dict[str, dict[str, float]] = {}
    to_floor: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        level, endpoint, server = name.split(":")
        if server == ref:
            continue
        ratios[name] = ratio(rs, runs[f"{level}:{endpoint}:{ref}"])
        if FLOOR in urls and server not in (ref, FLOOR):
            to_floor[name] = ratio(rs, runs[f"{level}:{endpoint}:{FLOOR}"])
    return {"figures": figures, "ratios": ratios, "to_floor": to_floor}


def targets(
    ratios: dict[str, dict[str, float]], figures: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The issue's targets, from ratios to the minimal app in the same run."""
    out: list[dict[str, Any]] = []
    for conc in ("c1", "c16"):
        for endpoint, lat_max, rate_min in (("GET", 1.2, 0.8), ("batch 100", 1.5, 0.6)):
            r = ratios.get(f"{conc}:{endpoint}:freshline")
            if r is None:
                continue
            what = f"{endpoint} vs minimal ({conc[1:]} conn.)"
            out += [
                common.target(f"{what}: p50", r.get("p50_us"), "<=", lat_max, "x"),
                common.target(f"{what}: p99", r.get("p99_us"), "<=", lat_max, "x"),
                common.target(f"{what}: req/s", r.get("ops_per_s"), ">=", rate_min, "x"),
            ]
        warm = ratios.get(f"{conc}:GET:freshline+tier")
        if warm is not None:
            out.append(
                common.target(
                    f"GET, tier warm, vs minimal ({conc[1:]} conn.): p50",
                    warm.get("p50_us"),
                    "<",
                    1.0,
                    "x",
                )
            )
    return out


def print_ratios(res: dict[str, Any]) -> None:
    """The ratios on stderr, one line per figure, readable at 80 columns."""
    for title, ratios in (("the minimal app", res["ratios"]), (FLOOR, res.get("to_floor", {}))):
        if not ratios:
            continue
        common.note(f"{'ratio to ' + title:<30}p50     p99   req/s")
        for name, r in ratios.items():
            common.note(
                f"{name:<28}{r.get('p50_us', 0):>5.2f}x {r.get('p99_us', 0):>6.2f}x "
                f"{r.get('ops_per_s', 0):>6.2f}x"
            )


def warm(url: str, key: str, users: list[int], passes: int = 3) -> None:
    """Read every user a few times, so each worker's in-process tier holds them."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
        for _ in range(passes):
            for u in users:
                c.get(f"/v1/features/{FEATURE_SET}/{u}", params={"mode": "cache-only"})


@contextlib.contextmanager
def servers(
    ctx: common.Context, version: int, tenant: str, key: str, users: list[int]
) -> Iterator[dict[str, str]]:
    """The minimal app, minimal+decode, freshline with the tier off and with it on
    (warm): name -> URL, in :data:`SERVERS` order. They start side by side: most of a
    start is waiting for the workers to answer."""
    starting = {
        "minimal": serve_reference(ctx, version, tenant),
        FLOOR: serve_reference(ctx, version, tenant, decode=True),
        "freshline": serve_freshline(ctx, version),
        "freshline+tier": serve_freshline(ctx, version, local_cache_size=10 * len(users)),
    }
    with contextlib.ExitStack() as stack:
        urls = dict(
            zip(starting, processes.enter_together(stack, list(starting.values())), strict=True)
        )
        warm(urls["freshline+tier"], key, users, passes=1 if ctx.quick else 3)
        yield urls


def prepared(ctx: common.Context) -> tuple[int, str, str, list[int]]:
    """A schema version of the run's own with ``txn_90d`` entries of up to 1,000 users
    (200 with ``--quick``).

    Returns ``(version, tenant, api_key, users)``.
    """
    from freshline.pipeline.api.accounts import create_api_key
    from freshline.pipeline.cache.recompute import compute
    from freshline.pipeline.cache.store import EntryStore
    from freshline.pipeline.core.types import EntityRef
    from tests.helpers import REGISTRY

    data = ctx.dataset()
    version = ctx.schema_version()
    users = list(range(1, min(200 if ctx.quick else ENTITIES, data.users) + 1))
    store = EntryStore(ctx.redis, version, registry=REGISTRY)
    for chunk in common.chunks(users, 500):
        store.write(
            compute(ctx.engine, REGISTRY[FEATURE_SET], [(data.tenant, str(u)) for u in chunk])
        )
    pipe = ctx.redis.pipeline(transaction=False)
    for u in users:
        pipe.pttl(store.key(EntityRef(FEATURE_SET, data.tenant, str(u))))
    lives = pipe.execute()
    users = [u for u, ms in zip(users, lives, strict=True) if ms >= MIN_LIFE_S * 1000]
    return version, data.tenant, create_api_key(ctx.engine, data.tenant), users


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    version, tenant, key, users = prepared(ctx)
    rounds, seconds = (1, 1) if quick else (3, 5)
    with servers(ctx, version, tenant, key, users) as urls:
        res = compare(urls, key, users, rounds=rounds, seconds=seconds, levels=levels(quick))
    print_ratios(res)
    return {
        "parameters": {
            "feature_set": FEATURE_SET,
            "entities": len(users),
            "batch": BATCH,
            "server_workers": server_workers(quick),
            "rounds": rounds,
            "seconds": seconds,
        },
        **res,
        "targets": targets(res["ratios"], res["figures"]),
    }


def table_rows(res: dict[str, Any]) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for name, f in res["figures"].items():
        r = res["ratios"].get(name, {})
        fl = res.get("to_floor", {}).get(name, {})
        rows.append(
            (
                name,
                f.get("p50_us"),
                f.get("p99_us"),
                f.get("ops_per_s"),
                r.get("p50_us", "1"),
                r.get("p99_us", "1"),
                r.get("ops_per_s", "1"),
                fl.get("p50_us", ""),
                fl.get("ops_per_s", ""),
            )
        )
    return rows


def section(res: dict[str, Any]) -> list[str]:
    """The wrk table: figures and their ratios to the minimal app."""
    p = res["parameters"]
    return [
        f"wrk, {p['rounds']} interleaved round(s) of {p['seconds']} s per figure (medians; "
        f"each ratio the median of the rounds' ratios to the minimal app), granian with "
        f"{p['server_workers']} workers for every server, `mode=cache-only`. "
        "`freshline+tier`: the in-process tier on and warm. `minimal+decode`: the minimal "
        "app answering freshline's JSON (floors read, entries decoded, named values); "
        "the last two columns are freshline's ratios to it.",
        "",
        common.table(
            [
                "conc:endpoint:server",
                "p50 µs",
                "p99 µs",
                "req/s",
                "p50 x",
                "p99 x",
                "req/s x",
                "p50 x floor",
                "req/s x floor",
            ],
            table_rows(res),
        ),
        "",
    ]


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "## reference_app: freshline's HTTP API against a minimal app",
        "",
        "The minimal app: Starlette + redis.asyncio, one GET route and one MGET route, "
        "no auth, validation or decoding. minimal+decode: the same app decoding each "
        "entry (with its feature set's truncate floor) and answering freshline's JSON.",
        "",
    ]
    lines += section(res)
    lines.append(common.targets_table(res["targets"]))
    return "\n".join(lines)
