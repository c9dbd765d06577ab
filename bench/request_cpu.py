"""``python -m bench.request_cpu``: the CPU time of one request, in process, per app.

wrk's figures on a shared machine move with everyone else's load; the CPU time a
worker spends on a request moves much less. This calls each app (the minimal one,
``minimal+decode`` and freshline with the in-process tier off, as in
:mod:`bench.reference_app`) directly through ASGI, one request at a time on one event
loop against the same Redis entries, and reports the process CPU time per request
(``time.process_time``: the app, Starlette and the Redis client; not the HTTP
server, which is the same for all, nor Redis itself), the median of interleaved
rounds, and each app's ratio to the minimal one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from bench import common, reference_app
from tests.helpers import REGISTRY

Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def _lifespan(app: Any) -> Callable[[], Awaitable[None]]:
    """Start ``app``'s lifespan; returns the coroutine function that ends it."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    started, stopped = asyncio.Event(), asyncio.Event()
    await queue.put({"type": "lifespan.startup"})

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()
        elif message["type"] == "lifespan.shutdown.complete":
            stopped.set()
        elif message["type"].endswith(".failed"):
            raise RuntimeError(message)

    task = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, queue.get, send)
    )
    await asyncio.wait_for(started.wait(), 30)

    async def stop() -> None:
        await queue.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(stopped.wait(), 30)
        await task

    return stop


async def _call(app: Asgi, method: str, path: str, query: bytes, body: bytes, key: str) -> int:
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # no disconnect while the request runs
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    headers = [(b"authorization", f"Bearer {key}".encode()), (b"host", b"bench")]
    if body:
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
    await app(
        {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 80),
            "state": {},
        },
        receive,
        send,
    )
    return status


async def _measure(
    apps: dict[str, Asgi], key: str, users: list[int], *, rounds: int, calls: int
) -> dict[str, dict[str, list[float]]]:
    batches = [
        orjson.dumps(
            {
                "feature_sets": [reference_app.FEATURE_SET],
                "entities": [str(u) for u in users[i : i + reference_app.BATCH]],
            }
        )
        for i in range(0, len(users), reference_app.BATCH)
    ]
    out: dict[str, dict[str, list[float]]] = {"GET": {}, "batch 100": {}}
    for r in range(rounds):
        names = list(apps)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            app = apps[name]
            for endpoint, by_app in out.items():
                started = time.process_time()
                for i in range(calls):
                    if endpoint == "GET":
                        u = users[i % len(users)]
                        status = await _call(
                            app,
                            "GET",
                            f"/v1/features/{reference_app.FEATURE_SET}/{u}",
                            b"mode=cache-only",
                            b"",
                            key,
                        )
                    else:
                        status = await _call(
                            app,
                            "POST",
                            "/v1/features/batch",
                            b"mode=cache-only",
                            batches[i % len(batches)],
                            key,
                        )
                    if status != 200:
                        raise RuntimeError(f"{name} {endpoint} answered {status}")
                spent = (time.process_time() - started) / calls * 1e6
                by_app.setdefault(name, []).append(spent)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.request_cpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    ctx = common.context(True)
    try:
        version, tenant, key, users = reference_app.prepared(ctx)
        from freshline.pipeline.api import create_app

        os.environ.update(
            {
                "BENCH_REFERENCE_REDIS_URL": ctx.settings.redis_url,
                "BENCH_REFERENCE_PREFIX": f"feat:{version}:{reference_app.FEATURE_SET}:{{{tenant}:",
            }
        )
        os.environ["BENCH_REFERENCE_DECODE"] = ""
        minimal = reference_app.app_from_env()
        os.environ["BENCH_REFERENCE_DECODE"] = str(version)
        floor = reference_app.app_from_env()
        freshline = create_app(
            ctx.settings_for(schema_version=version, local_cache_size=0, api_rate_per_s=0),
            registry=REGISTRY,
        )
        apps = {"minimal": minimal, reference_app.FLOOR: floor, "freshline": freshline}

        async def run() -> dict[str, dict[str, list[float]]]:
            stops = [await _lifespan(app) for app in apps.values()]
            try:
                await _measure(apps, key, users, rounds=1, calls=200)  # warm up
                return await _measure(apps, key, users, rounds=args.rounds, calls=args.calls)
            finally:
                for stop in stops:
                    await stop()

        res = asyncio.run(run())
    finally:
        common.close_context()
    print(
        f"CPU µs per request, in process, c=1; median of {args.rounds} interleaved "
        f"rounds of {args.calls} (ratio to minimal: median of the rounds' ratios)"
    )
    for endpoint, by_app in res.items():
        base = by_app["minimal"]
        for name, values in by_app.items():
            ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
            print(
                f"  {endpoint:<10} {name:<15} {statistics.median(values):8.1f} µs  "
                f"{ratio:5.2f}x  ({' '.join(f'{v:.0f}' for v in values)})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
