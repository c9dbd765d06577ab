"""``python -m bench.abuse_cpu``: what each kind of :mod:`bench.abuse`'s abuse costs a
worker, per answer, in CPU time and in round trips to Postgres and Redis.

:mod:`bench.abuse` times the well-behaved tenant over HTTP on a machine whose load moves
its figures; the CPU time a worker spends on each abusive request moves much less. This
calls the API app in process through ASGI (as :mod:`bench.request_cpu` does), every
limit at its default, and sends each kind of abuse alone from ``--loops`` concurrent
loops for ``--seconds``, twice: from a tenant with the server's limits (nearly every
request served) and from one with the untrusted tenant's (:data:`bench.abuse.UNTRUSTED_TENANT`:
most held, then refused). Per answer it reports the process's CPU time
(``time.process_time``: the event loop and the thread pool, less what the idle app
spends in the same time; not Redis nor Postgres), the SQL statements the app's engine
ran and the Redis round trips it made, and the answers by status.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import orjson
import redis
import redis.asyncio.connection
import sqlalchemy as sa

from bench import abuse, common, reference_app
from bench.request_cpu import Asgi, _call, _lifespan
from tests.helpers import REGISTRY

KINDS = abuse.ALL_KINDS

_trips = [0]


def _count_round_trips() -> None:
    """Count every packed command redis-py sends, sync or asyncio: a round trip each."""
    for cls in (redis.connection.AbstractConnection, redis.asyncio.connection.AbstractConnection):
        original = cls.send_packed_command

        if cls is redis.connection.AbstractConnection:

            def sync(self: Any, *args: Any, _o: Any = original, **kw: Any) -> Any:
                _trips[0] += 1
                return _o(self, *args, **kw)

            cls.send_packed_command = sync  # type: ignore[method-assign]
        else:

            async def asy(self: Any, *args: Any, _o: Any = original, **kw: Any) -> Any:
                _trips[0] += 1
                return await _o(self, *args, **kw)

            cls.send_packed_command = asy  # type: ignore[method-assign]


class Requests:
    """The abusive requests of :class:`bench.abuse.Abuser`, as ASGI calls."""

    def __init__(self, key: str, model: str, tag: str, start: int) -> None:
        self.key, self.model, self.tag = key, model, tag
        self._ids = itertools.count(abuse.GHOST_BASE + start)
        self._rows = itertools.count(start + 1)

    def send(self, app: Asgi, kind: str) -> Awaitable[int]:
        fs = abuse.FEATURE_SET
        if kind == "predict":
            first = next(self._rows) * abuse.PREDICT_ROWS
            rows = [[float(first + i), 0.5, -0.5] for i in range(abuse.PREDICT_ROWS)]
            body = orjson.dumps({"inputs": rows})
            return _call(app, "POST", f"/v1/models/{self.model}/predict", b"", body, self.key)
        if kind == "ghost get":
            return _call(app, "GET", f"/v1/features/{fs}/{next(self._ids)}", b"", b"", self.key)
        if kind == "ghost batch":
            ids = [str(next(self._ids)) for _ in range(abuse.GHOST_BATCH)]
            body = orjson.dumps({"feature_sets": [fs], "entities": ids})
            return _call(app, "POST", "/v1/features/batch", b"", body, self.key)
        if kind == "fresh get":
            entity = next(self._rows) % abuse.FRESH_IDS + 1
            path = f"/v1/features/{fs}/{entity}"
            return _call(app, "GET", path, b"max_staleness_ms=0", b"", self.key)
        if kind == "bad key":
            bad = f"fl_{secrets.token_urlsafe(32)}"
            return _call(app, "GET", f"/v1/features/{fs}/1", b"", b"", bad)
        if kind == "llm flag":
            n = next(self._rows)
            body = orjson.dumps(
                {
                    "model": f"abuse{self.tag}{n}",
                    "model_version": "v1",
                    "template_version": "t1",
                    "entry_id": secrets.token_hex(8),
                }
            )
            return _call(app, "POST", "/v1/llm/cache/flag", b"", body, self.key)
        raise ValueError(kind)


async def _flood(
    app: Asgi, requests: Requests, kind: str, loops: int, seconds: float
) -> tuple[Counter[int], float]:
    """``loops`` loops sending ``kind`` until ``seconds`` are up: answers by status, and
    the wall time until the last was answered."""
    answers: Counter[int] = Counter()
    started = time.monotonic()
    until = started + seconds

    async def loop() -> None:
        while time.monotonic() < until:
            answers[await requests.send(app, kind)] += 1

    await asyncio.gather(*(loop() for _ in range(loops)))
    return answers, time.monotonic() - started


async def _together(
    app: Asgi,
    statements: list[int],
    requests: Requests,
    kinds: tuple[str, ...],
    loops: int,
    seconds: float,
    idle: float,
) -> dict[str, Any]:
    """Every kind at once, ``loops`` loops each, as :mod:`bench.abuse`'s abuser sends
    them: answers by kind and status, and the CPU time, statements and round trips per
    second of the whole."""
    answers: Counter[tuple[str, int]] = Counter()
    cpu, sql, trips = time.process_time(), statements[0], _trips[0]
    started = time.monotonic()
    until = started + seconds

    async def loop(kind: str) -> None:
        while time.monotonic() < until:
            answers[(kind, await requests.send(app, kind))] += 1

    await asyncio.gather(*(loop(kind) for kind in kinds for _ in range(loops)))
    wall = time.monotonic() - started
    spent = time.process_time() - cpu - idle * wall
    return {
        "answers": {f"{k} {s}": n for (k, s), n in sorted(answers.items())},
        "answers_per_s": round(sum(answers.values()) / wall, 1),
        "cpu_ms_per_s": round(spent / wall * 1e3, 1),
        "cpu_us_per_answer": round(spent / sum(answers.values()) * 1e6, 1),
        "sql_per_s": round((statements[0] - sql) / wall, 1),
        "redis_trips_per_s": round((_trips[0] - trips) / wall, 1),
    }


async def _idle_cpu_per_s(seconds: float) -> float:
    """The app's own CPU time per second with nothing sent (its background threads)."""
    started, cpu = time.monotonic(), time.process_time()
    await asyncio.sleep(seconds)
    return (time.process_time() - cpu) / (time.monotonic() - started)


async def _measure(
    app: Asgi,
    statements: list[int],
    requests: Requests,
    kinds: tuple[str, ...],
    loops: int,
    seconds: float,
    idle: float,
) -> dict[str, dict[str, Any]]:
    out = {}
    for kind in kinds:
        cpu, sql, trips = time.process_time(), statements[0], _trips[0]
        answers, wall = await _flood(app, requests, kind, loops, seconds)
        spent = time.process_time() - cpu - idle * wall
        n = sum(answers.values())
        out[kind] = {
            "answers": dict(sorted(answers.items())),
            "cpu_us_per_answer": round(spent / n * 1e6, 1),
            "cpu_ms_per_s": round(spent / wall * 1e3, 1),
            "sql_per_answer": round((statements[0] - sql) / n, 3),
            "redis_trips_per_answer": round((_trips[0] - trips) / n, 3),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.abuse_cpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--loops", type=int, default=abuse.ABUSE_CONNECTIONS * 2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--profiles", default="defaults,untrusted tenant")
    parser.add_argument(
        "--together",
        type=int,
        default=0,
        help="instead: this many periods of --seconds with every kind at once (untrusted)",
    )
    args = parser.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    from freshline.pipeline.api import create_app
    from freshline.pipeline.api.accounts import create_api_key, create_tenant, set_tenant_limits
    from freshline.pipeline.core.db import make_engine
    from freshline.pipeline.inference.models import ModelRegistry

    _count_round_trips()
    ctx = common.context(True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        version, _, _, _ = reference_app.prepared(ctx)
        model = f"bench{ctx.tag}abusecpu"
        models = tempfile.TemporaryDirectory()
        ModelRegistry(ctx.redis).register(abuse._model(model, Path(models.name)))
        settings = ctx.settings_for(schema_version=version, semantic_enabled=True)
        engine = make_engine(settings, pool_size=10)
        statements = [0]

        @sa.event.listens_for(engine, "before_cursor_execute")
        def _counted(*_: Any) -> None:
            statements[0] += 1

        app = create_app(settings, engine=engine, registry=REGISTRY, follow_deploys=True)
        profiles = {
            "defaults": {},
            "untrusted tenant": abuse.UNTRUSTED_TENANT,
            # Every request over the rate: what a refusal (429, or a bad key's 401) costs.
            "refused": {**abuse.UNTRUSTED_TENANT, "rate_per_s": 0.001, "rate_burst": 1},
        }

        async def run() -> None:
            stop = await _lifespan(app)
            try:
                idle = await _idle_cpu_per_s(2.0)
                print(f"idle app: {idle * 1e3:.1f} ms CPU per s (subtracted)")
                if args.together:
                    tenant = f"{ctx.tenant_prefix()}abuser"
                    create_tenant(ctx.engine, tenant)
                    set_tenant_limits(ctx.engine, None, tenant, dict(abuse.UNTRUSTED_TENANT))
                    key = create_api_key(ctx.engine, tenant)
                    requests = Requests(key, model, ctx.tag, abuse.PHASE_SPAN)
                    for kind in kinds:
                        await requests.send(app, kind)
                    for period in range(args.together):
                        got = await _together(
                            app, statements, requests, kinds, args.loops, args.seconds, idle
                        )
                        print(f"period {period + 1}: {orjson.dumps(got).decode()}")
                    return
                for n, name in enumerate(p for p in args.profiles.split(",") if p):
                    tenant = f"{ctx.tenant_prefix()}abuser"
                    create_tenant(ctx.engine, tenant)
                    set_tenant_limits(
                        ctx.engine,
                        None,
                        tenant,
                        {**dict.fromkeys(abuse.UNTRUSTED_TENANT), **profiles[name]},
                    )
                    key = create_api_key(ctx.engine, tenant)
                    requests = Requests(key, model, ctx.tag, (n + 1) * abuse.PHASE_SPAN)
                    for kind in kinds:  # warm: the model, the embedding model, the key
                        await requests.send(app, kind)
                    results[name] = await _measure(
                        app, statements, requests, kinds, args.loops, args.seconds, idle
                    )
            finally:
                await stop()

        with models:
            asyncio.run(run())
        engine.dispose()
    finally:
        common.close_context()
    print(
        f"per answer, in process; {args.loops} loops per kind for {args.seconds:g} s; "
        "CPU less the idle app's"
    )
    for name, by_kind in results.items():
        print(f"{name}:")
        for kind, r in by_kind.items():
            statuses = " ".join(f"{s}:{c}" for s, c in r["answers"].items())
            print(
                f"  {kind:<12} {r['cpu_us_per_answer']:9.1f} µs  {r['cpu_ms_per_s']:7.1f} ms/s  "
                f"sql {r['sql_per_answer']:6.3f}  redis {r['redis_trips_per_answer']:6.3f}  "
                f"[{statuses}]"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
