"""Two builds of freshline side by side: the same work, in alternating processes.

A figure against code that is gone (the hand-written incremental path the generator
replaced, say) cannot be measured in one process: each build runs in a process of its
own, from its own checkout (``git worktree add /tmp/old <commit>``) and its own bench
database, and the driver asks each in turn for one measurement, round after round, so
the noise of a shared machine hits both alike. Read the median of the per-round
ratios; the medians are context.

    python -m bench.trees compute --rounds 10 old=/tmp/old new=.
    python -m bench.trees drain --rounds 8 --events 30000 old=/tmp/old new=.

``compute``: one ``compute`` of ``txn_90d`` (the median of 5) for the 20 busiest users
of the seeded tenant, and for those with 400 others drawn at random (a write-path
batch). ``drain``: the real consumer (``Worker``) drains a stream of
``transaction.updated`` events routed to ``--sets`` only (80% on the 20 busiest users),
events/s. A ``NAME=TREE?VAR=VALUE&...`` argument sets environment variables for that
build alone. Run it as the other benchmarks are run: as the operator, with the stack's
settings in the environment (``bench/RESULTS.md`` gives the variables).

A build runs this file as a script in its own checkout, so the child half imports only
what every build has: ``bench.common``, ``bench.write_path``, ``compute``, ``Worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

HOT_USERS = 20
OTHERS = 400


class Build:
    """One checkout's child process: a line in, a JSON line out."""

    def __init__(self, name: str, spec: str, args: list[str], env: dict[str, str]) -> None:
        tree, _, extra = spec.partition("?")
        self.name = name
        self.tree = Path(tree).resolve()
        env = dict(env, FRESHLINE_REPO=str(self.tree / "examples" / "fraud"))
        env.update(dict(kv.split("=", 1) for kv in extra.split("&") if kv))
        python = self.tree / ".venv" / "bin" / "python"
        self.proc = subprocess.Popen(
            [str(python if python.exists() else sys.executable), __file__, "--child", *args],
            cwd=self.tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = self.ask(None)

    def ask(self, request: str | None) -> dict[str, Any]:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        if request is not None:
            stdin.write(request + "\n")
            stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} ({self.tree}) stopped: see its output above")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def drive(mode: str, rounds: int, builds: dict[str, str], child_args: list[str]) -> None:
    env = dict(os.environ)
    started = [Build(name, spec, [mode, *child_args], env) for name, spec in builds.items()]
    try:
        for b in started:
            print(f"{b.name}: {b.tree} ready ({b.ready})", flush=True)
        kinds = ["hot", "batch"] if mode == "compute" else ["drain"]
        figures: dict[tuple[str, str], list[float]] = {}
        for r in range(rounds):
            order = started if r % 2 == 0 else started[::-1]
            for kind in kinds:
                for b in order:
                    value = float(b.ask(kind)["value"])
                    figures.setdefault((b.name, kind), []).append(value)
            print(f"round {r + 1}/{rounds}", flush=True)
    finally:
        for b in started:
            b.close()
    base = started[0].name
    unit = "ms" if mode == "compute" else "events/s"
    for kind in kinds:
        for b in started:
            mine, ref = figures[(b.name, kind)], figures[(base, kind)]
            pairs = statistics.median(x / y for x, y in zip(mine, ref, strict=True))
            print(
                f"{kind:6} {b.name:12} median {statistics.median(mine):10.1f} {unit}  "
                f"per-round ratio to {base}: median {pairs:.3f}  "
                f"(rounds: {', '.join(f'{x:.0f}' for x in mine)})"
            )


# -- the child half: runs inside one build's checkout ---------------------------------


def _child(mode: str, argv: list[str], out: IO[str]) -> None:
    sys.path.insert(0, os.getcwd())  # this build's packages, not the installed ones
    if mode == "compute":
        _child_compute(out)
    else:
        _child_drain(int(argv[0]), argv[1].split(","), out)


def _child_compute(out: IO[str]) -> None:
    import random

    import sqlalchemy as sa

    from bench import common
    from freshline.pipeline.cache.recompute import compute
    from tests.helpers import REGISTRY

    ctx = common.context(False)
    data = ctx.dataset()
    engine = ctx.engine
    fs = REGISTRY["txn_90d"]
    with engine.connect() as conn:
        hot = [
            str(u)
            for (u,) in conn.execute(
                sa.text(
                    "SELECT user_id FROM transactions WHERE tenant_id = :t "
                    "GROUP BY 1 ORDER BY count(*) DESC, 1 LIMIT :n"
                ),
                {"t": data.tenant, "n": HOT_USERS},
            )
        ]
        users = [
            str(u)
            for (u,) in conn.execute(
                sa.text("SELECT id FROM users WHERE tenant_id = :t ORDER BY id"),
                {"t": data.tenant},
            )
        ]
    others = random.Random(7).sample(users, min(OTHERS, len(users)))
    keys = {
        "hot": sorted((data.tenant, u) for u in hot),
        "batch": sorted({(data.tenant, u) for u in hot + others}),
    }
    print(json.dumps({"keys": len(keys["batch"])}), file=out, flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            with engine.connect() as conn:
                compute(conn, fs, keys[line.strip()])
            times.append((time.perf_counter() - started) * 1000)
        print(json.dumps({"value": statistics.median(times)}), file=out, flush=True)


def _child_drain(events: int, sets: list[str], out: IO[str]) -> None:
    from unittest import mock

    from bench import common, write_path
    from freshline.pipeline.core.features import Registry
    from tests.helpers import REGISTRY

    ctx = common.context(False)
    data = ctx.dataset()
    ctx.kafka_topics()
    write_path._produce(ctx.settings, data.tenant, data.users, events, seed=5)
    routed = Registry(fs for fs in REGISTRY if fs.name in sets)
    print(json.dumps({"events": events, "sets": sets}), file=out, flush=True)
    for _ in sys.stdin:
        with mock.patch("freshline.consumers.worker.REGISTRY", routed):
            result = write_path._real(ctx.settings, [ctx.schema_version()], events)
        print(json.dumps({"value": result["events_per_s"]}), file=out, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--child"]:
        # The child's own prints (progress notes) go to stderr; stdout is the protocol.
        out, sys.stdout = sys.stdout, sys.stderr
        _child(args[1], args[2:], out)
        return
    parser = argparse.ArgumentParser(
        prog="python -m bench.trees", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("mode", choices=["compute", "drain"])
    parser.add_argument("builds", nargs="+", metavar="NAME=TREE", help="the first is the reference")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--events", type=int, default=30_000, help="drain: events per drain")
    parser.add_argument("--sets", default="txn_90d", help="drain: feature sets routed to")
    ns = parser.parse_args(args)
    builds = dict(b.split("=", 1) for b in ns.builds)
    if len(builds) < 2 or any(not spec for spec in builds.values()):
        parser.error("name two builds or more, as NAME=TREE")
    child_args = [] if ns.mode == "compute" else [str(ns.events), ns.sets]
    drive(ns.mode, ns.rounds, builds, child_args)


if __name__ == "__main__":
    main()
