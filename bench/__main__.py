"""``python -m bench [--quick [--jobs N]] [--only|--skip NAME ...] [--out DIR] [--no-plots]``.

Runs the benchmarks in order against the local stack (``scripts/stack up``), each in
an isolated world (:class:`bench.common.Context`), and writes ``results.json``,
``RESULTS.md`` and PNG plots into the output directory (``bench/`` by default). The
smoke run, ``--quick``, checks that each benchmark runs, not its figures: smallest
sizes, one round, no warm-up, several benchmarks side by side (``--jobs``), into a
scratch directory unless ``--out`` names another (never ``bench/``).

A benchmark is a module ``bench/<name>.py`` with ``run(quick: bool) -> dict`` (JSON-able
figures, parameters, references, ratios and targets) and ``markdown(results) -> str``
(its section of RESULTS.md). Benchmarks print figures; they never decide pass or fail
on speed. The exit status is 1 only when a benchmark raised.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import confluent_kafka
import orjson

from bench import common
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.services import translate_errors

BENCHMARKS = (
    "seed",
    "recompute",
    "incremental",
    "read_path",
    "reference_app",
    "idle_connections",
    "abuse",
    "write_path",
    "cdc_freshness",
    "freshness",
    "inference",
    "semantic",
    "memory",
    "redis_writes",
    "deploy",
    "local_tier",
    "consistency",
    "cluster_scaling",
    "rls",
    "training",
    "served_log",
)

LIBRARIES = (
    "redis",
    "hiredis",
    "confluent-kafka",
    "SQLAlchemy",
    "psycopg",
    "numpy",
    "orjson",
    "starlette",
    "granian",
    "httpx",
    "matplotlib",
    "faiss-cpu",
)


def _sh(*cmd: str) -> str:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _kafka_version() -> str:
    pom = common.REPO / "pom.xml"
    try:
        text = pom.read_text()
    except OSError:
        return ""
    import re

    found = re.search(r"<version\.kafka>([^<]+)</version\.kafka>", text)
    return found.group(1) if found else ""


def environment(ctx: common.Context | None) -> dict[str, Any]:
    """Versions and the machine, so a reader can tell what the figures came from."""
    versions: dict[str, str] = {"python": platform.python_version()}
    for lib in LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[lib] = metadata.version(lib)
    versions["librdkafka"] = confluent_kafka.libversion()[0]
    if ctx is not None:
        try:
            versions["redis-server"] = str(ctx.redis.info("server")["redis_version"])
        except Exception:
            versions["redis-server"] = _sh("redis-server", "--version")
        try:
            import sqlalchemy as sa

            with ctx.engine.connect() as conn:
                versions["postgres"] = str(conn.execute(sa.text("SHOW server_version")).scalar())
        except Exception:
            pass
    versions["kafka"] = _kafka_version()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "versions": versions,
        "machine": {
            "nproc": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "memory_gib": _memory_gib(),
            "cpu_model": _cpu_model(),
            "kernel": platform.release(),
            "loadavg_at_start": [round(x, 2) for x in load] if load else None,
        },
    }


def _git_commit() -> str:
    commit = _sh("git", "-C", str(common.REPO), "rev-parse", "--short=12", "HEAD")
    dirty = _sh("git", "-C", str(common.REPO), "status", "--porcelain", "--untracked-files=no")
    return f"{commit}{' (working tree not clean)' if dirty else ''}"


def _command(argv: list[str]) -> str:
    return " ".join([".venv/bin/python", "-m", "bench", *(shlex.quote(a) for a in argv)])


def _has_matplotlib(quick: bool) -> bool:
    """Plots need matplotlib, which the lock (``requirements/dev.txt``) installs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if not quick:
            print(
                "bench: matplotlib is missing, so no plots (run ./scripts/bootstrap)",
                file=sys.stderr,
            )
        return False
    return True


def render(doc: dict[str, Any], sections: dict[str, str]) -> str:
    env = doc["environment"]
    m = env["machine"]
    v = env["versions"]
    lines = [
        "# freshline benchmarks",
        "",
        f"- date: {doc['date']}",
        f"- git commit: `{doc['commit']}`",
        f"- command: `{doc['command']}` (from the repository root, with the stack up: "
        "`scripts/stack up`)",
        f"- mode: {'quick (smoke sizes, not figures to quote)' if doc['quick'] else 'full'}; "
        f"took {doc['elapsed_s']:.0f} s",
        f"- machine: {m['nproc']} CPUs ({m['usable_cpus']} usable), {m['memory_gib']} GiB, "
        f"{m['cpu_model']}, Linux {m['kernel']}; load average at start "
        f"{m['loadavg_at_start']}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        *(
            [
                "- a run with `--only` replaces only its own sections and keeps the others: each "
                "section names the run that measured it"
            ]
            if any(
                r.get("measured", {}).get("command") != doc["command"]
                for r in doc["results"].values()
            )
            else []
        ),
        "",
        "The machine is shared with other work, so absolute times are noisy: each figure "
        "is read against a reference measured in the same run, interleaved round by "
        "round, and the ratio is the figure to quote. Nothing here is asserted; a missed "
        "target is reported as missed.",
        "",
    ]
    summary = [
        (
            name,
            t["name"],
            common.fmt(t["value"], 2),
            f"{t['op']} {common.fmt(t['limit'])}",
            t["unit"],
            "met" if t["met"] else ("**missed**" if t["met"] is False else "-"),
        )
        for name, res in doc["results"].items()
        if isinstance(res, dict)
        for t in res.get("targets", [])
    ]
    if summary:
        lines += [
            "## Targets at a glance",
            "",
            common.table(["benchmark", "target", "this run", "goal", "unit", ""], summary),
            "",
        ]
    for name, text in sections.items():
        lines += [_with_provenance(text, doc["results"].get(name, {})).rstrip(), ""]
    return "\n".join(lines)


def _with_provenance(section: str, result: dict[str, Any]) -> str:
    """``section`` with a line under its heading naming the run that measured it."""
    measured = result.get("measured")
    if not measured or "\n" not in section:
        return section
    head, rest = section.split("\n", 1)
    load = f"; load {measured['load']}" if measured.get("load") is not None else ""
    return (
        f"{head}\n\n*Measured {measured['date']} at `{measured['commit']}` by "
        f"`{measured['command']}`{load}.*\n{rest}"
    )


_STALE = "**not rendered**: its results predate the current format"


def _section(name: str, result: dict[str, Any]) -> str:
    """The RESULTS.md section of a stored result. One that an older version of the
    benchmark wrote is shown as its own run rendered it (``rendered``, kept with every
    result), or, without that, named with the command that measures it again."""
    if "error" in result:
        return f"## {name}\n\n**failed**: `{result['error'][:300]}`\n"
    try:
        return _markdown(importlib.import_module(f"bench.{name}"), result)
    except (KeyError, TypeError, IndexError) as exc:
        if isinstance(result.get("rendered"), str):
            return str(result["rendered"])  # as its run rendered it; the stamp names the run
        return (
            f"## {name}\n\n{_STALE} (`{type(exc).__name__}: {exc}`); re-run "
            f"`python -m bench --only {name}`.\n"
        )


_RUNNER_KEYS = ("measured", "rendered")
"""What the runner adds to a benchmark's result: the run that measured it, and the
section as that run rendered it (shown again when a later format cannot render it)."""


def _markdown(module: Any, result: dict[str, Any]) -> str:
    """A benchmark's section, from its result as it returned it: the runner's
    provenance stamp is not the benchmark's to render (some iterate their results)."""
    return str(module.markdown({k: v for k, v in result.items() if k not in _RUNNER_KEYS}))


def _measured(argv: list[str]) -> dict[str, Any]:
    """When, at which commit, by which command and under what load a result was taken:
    a run with --only keeps the other benchmarks' results, each with its own."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git_commit(),
        "command": _command(argv),
        "load": round(load[0], 2) if load else None,
    }


def _kept_results(path: Path, replaced: set[str]) -> dict[str, Any]:
    """The full-mode results already in ``path`` that this run does not replace, each
    stamped with the run that measured it (quick results are never kept)."""
    try:
        previous = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    if previous.get("quick", True):
        return {}
    stamp = {
        "date": previous.get("date"),
        "commit": previous.get("commit"),
        "command": previous.get("command"),
        "load": None,
    }
    return {
        name: {"measured": stamp, **result}
        for name, result in previous.get("results", {}).items()
        if name in BENCHMARKS and name not in replaced and isinstance(result, dict)
    }


def rerender(out: Path) -> int:
    """RESULTS.md again from ``out/results.json`` (after a change to a ``markdown``)."""
    doc = orjson.loads((out / "results.json").read_bytes())
    sections = {name: _section(name, result) for name, result in doc["results"].items()}
    stale = [name for name, text in sections.items() if _STALE in text]
    (out / "RESULTS.md").write_text(render(doc, sections))
    if stale:
        print(
            f"bench: results of {', '.join(stale)} predate their current format; re-run "
            f"them with --only",
            file=sys.stderr,
        )
        return 1
    return 0


QUICK_JOBS = 3
"""Processes of a smoke run: its benchmarks mostly wait (servers starting, consumers
joining their groups, Kafka Connect), so three side by side fit two cores."""
SLOWEST_FIRST = (
    "training",
    "consistency",
    "freshness",
    "read_path",
    "abuse",
    "served_log",
    "cdc_freshness",
    "reference_app",
    "write_path",
)
"""A smoke run's longest benchmarks, slowest first: handed out before the others, so
that none of them starts last and runs on alone (the others follow in the standard
order)."""


class _ContextError(Exception):
    """The run's isolated world could not be opened (a login, a service): one line."""


def _run_benchmark(name: str, quick: bool, argv: list[str]) -> tuple[dict[str, Any], str]:
    """Run one benchmark: its result (with ``error`` if it raised) and its section."""
    module = importlib.import_module(f"bench.{name}")
    print(f"bench: {name} ...", file=sys.stderr, flush=True)
    t0, cpu0 = time.monotonic(), _cpu_s()
    measured = _measured(argv)
    try:
        with translate_errors():
            result = module.run(quick)
        result["elapsed_s"] = round(time.monotonic() - t0, 1)
        result["cpu_s"] = round(_cpu_s() - cpu0, 1)
        result["measured"] = measured
        section = result["rendered"] = _markdown(module, result)
    except FreshlineError as exc:  # a tool or a login missing: one line says which
        print(f"bench: {name}: error: {exc}", file=sys.stderr)
        result = {"error": str(exc), "elapsed_s": round(time.monotonic() - t0, 1)}
        section = f"## {name}\n\n**failed**: {str(exc)[:300]}\n"
    except Exception as exc:
        print(traceback.format_exc(), file=sys.stderr)
        result = {
            "error": f"{type(exc).__name__}: {exc}",
            "elapsed_s": round(time.monotonic() - t0, 1),
        }
        section = f"## {name}\n\n**failed**: `{type(exc).__name__}: {str(exc)[:300]}`\n"
    print(f"bench: {name} done in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    return result, section


def _cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (the servers
    and commands a benchmark starts): what a benchmark costs a shared machine."""
    import resource

    return sum(
        u.ru_utime + u.ru_stime
        for u in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )


def _open_context(quick: bool) -> common.Context:
    try:
        with translate_errors():
            return common.context(quick)
    except FreshlineError as exc:
        raise _ContextError(str(exc)) from exc


Outcome = tuple[dict[str, Any], dict[str, str], dict[str, Any]]
"""Results and sections by benchmark, and the environment they ran in."""


def _run_here(selected: list[str], argv: list[str]) -> Outcome:
    """The benchmarks one after another in this process, in one context."""
    quick = bool(common.quick())
    ctx = _open_context(quick)
    results: dict[str, Any] = {}
    sections: dict[str, str] = {}
    try:
        for name in selected:
            results[name], sections[name] = _run_benchmark(name, quick, argv)
        env = environment(ctx)
    finally:
        common.close_context()
    return results, sections, env


def _worker(
    index: int, todo: Any, done: Any, out: Path, quick: bool, plots: bool, argv: list[str]
) -> None:
    """A process of :func:`_run_in_workers`: its own context (database, topics, data
    set, and Redis database: the ``index``-th after ``FRESHLINE_BENCH_REDIS_DB``, since
    a deploy pointer and the roster of running processes are per Redis database and
    ``consistency`` flips one), then benchmarks from ``todo`` until ``None``; what it
    did goes to ``done``."""
    base = int(os.environ.get("FRESHLINE_BENCH_REDIS_DB", "3"))
    os.environ["FRESHLINE_BENCH_REDIS_DB"] = str(base + index)

    def on_term(_signum: int, _frame: object) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_term)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    common.configure(out, quick, plots=plots)
    try:
        ctx = _open_context(quick)
    except _ContextError as exc:
        done.put(("fatal", str(exc)))
        return
    try:
        while (name := todo.get()) is not None:
            done.put(("result", name, *_run_benchmark(name, quick, argv)))
        done.put(("exit", environment(ctx)))
    finally:
        common.close_context()


def _run_in_workers(selected: list[str], jobs: int, argv: list[str]) -> Outcome:
    """The benchmarks of a smoke run in ``jobs`` processes side by side, each taking
    the next as it finishes one; each process opens its own isolated context."""
    import multiprocessing
    import queue

    mp = multiprocessing.get_context("spawn")
    todo, done = mp.Queue(), mp.Queue()
    for name in handout(selected):
        todo.put(name)
    for _ in range(jobs):
        todo.put(None)
    args = (todo, done, common.out_dir(), common.quick(), common.plots(), argv)
    # By its importable name: a spawned process does not import a package's __main__
    # under the name __main__, so it finds nothing there by that name.
    target = importlib.import_module("bench.__main__")._worker
    workers = [mp.Process(target=target, args=(i, *args), name=f"bench-{i}") for i in range(jobs)]
    for w in workers:
        w.start()
    results: dict[str, Any] = {}
    sections: dict[str, str] = {}
    env: dict[str, Any] | None = None
    fatal: list[str] = []
    finished = 0
    try:
        while finished < jobs:
            try:
                msg = done.get(timeout=1.0)
            except queue.Empty:
                if not any(w.is_alive() for w in workers) and done.empty():
                    break  # a worker died without a word: its benchmark is reported missing
                continue
            if msg[0] == "result":
                results[msg[1]], sections[msg[1]] = msg[2], msg[3]
            else:
                finished += 1
                if msg[0] == "fatal":
                    fatal.append(msg[1])
                else:
                    env = env or msg[1]
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()  # SIGTERM: it closes its context on the way out
        for w in workers:
            w.join(60)
    if fatal:
        raise _ContextError(fatal[0])
    for name in selected:
        if name not in results:
            results[name] = {"error": "its worker process died"}
            sections[name] = f"## {name}\n\n**failed**: its worker process died\n"
    order = {name: i for i, name in enumerate(BENCHMARKS)}
    ordered = sorted(results, key=order.__getitem__)
    return (
        {n: results[n] for n in ordered},
        {n: sections[n] for n in ordered},
        env or environment(None),
    )


def handout(selected: list[str]) -> list[str]:
    """The order a smoke run hands ``selected`` out in: :data:`SLOWEST_FIRST`, then the
    rest in the standard order. No benchmark relies on what another left before it in
    its process (write_path, which reads a topic from its start, has topics of its own)."""
    first = [name for name in SLOWEST_FIRST if name in selected]
    return first + [name for name in selected if name not in first]


def options(argv: list[str]) -> argparse.Namespace:
    """The command line, with the defaults that depend on ``--quick``: a smoke run writes
    to a new scratch directory (never over the committed ``bench/RESULTS.md``) and runs
    :data:`QUICK_JOBS` benchmarks side by side; a full run, one at a time into bench/."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke sizes: under two minutes")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        choices=BENCHMARKS,
        help="run only these benchmarks (in the standard order)",
    )
    parser.add_argument(
        "--skip", nargs="+", metavar="NAME", choices=BENCHMARKS, help="run all but these"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where results.json, RESULTS.md and plots go (default: bench/; with --quick "
        "a new scratch directory, never bench/)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help=f"with --quick: run the benchmarks in N processes side by side (default "
        f"{QUICK_JOBS}); a full run measures one at a time",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite RESULTS.md from the results.json in --out; run nothing",
    )
    args = parser.parse_args(argv)
    if args.quick and args.out is not None and args.out.resolve() == common.BENCH_DIR:
        parser.error("--quick never writes over bench/RESULTS.md: give --out another directory")
    if args.jobs is None:
        args.jobs = QUICK_JOBS if args.quick else 1
    elif args.jobs < 1:
        parser.error("--jobs: at least 1")
    elif args.jobs > 1 and not args.quick:
        parser.error("--jobs: benchmarks measured side by side would time each other")
    if args.out is None:
        quick = args.quick and not args.render_only
        args.out = Path(tempfile.mkdtemp(prefix="bench-quick-")) if quick else common.BENCH_DIR
    return args


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    args = options(args_list)
    if args.render_only:
        return rerender(args.out)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    plots = not args.no_plots and _has_matplotlib(args.quick)
    common.configure(out, args.quick, plots=plots)
    selected = [
        b for b in BENCHMARKS if (not args.only or b in args.only) and b not in (args.skip or ())
    ]

    def on_term(_signum: int, _frame: object) -> None:
        raise SystemExit(143)  # unwinds through the finally below, which cleans up

    signal.signal(signal.SIGTERM, on_term)
    started = time.monotonic()
    jobs = min(args.jobs, len(selected))
    try:
        if jobs > 1:
            results, sections, env = _run_in_workers(selected, jobs, args_list)
        else:
            results, sections, env = _run_here(selected, args_list)
    except _ContextError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 1
    failed = any("error" in result for result in results.values())
    doc = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git_commit(),
        "command": _command(args_list),
        "quick": args.quick,
        "elapsed_s": round(time.monotonic() - started, 1),
        "environment": env,
        "results": results,
    }
    if (args.only or args.skip) and not args.quick:
        kept = _kept_results(out / "results.json", set(selected))
        doc["results"] = {
            name: {**kept, **results}[name]
            for name in BENCHMARKS
            if name in kept or name in results
        }
        sections = {
            name: sections.get(name) or _section(name, result)
            for name, result in doc["results"].items()
        }
    (out / "results.json").write_bytes(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n"
    )
    (out / "RESULTS.md").write_text(render(doc, sections))
    print(
        f"bench: wrote {out / 'RESULTS.md'} and results.json in {doc['elapsed_s']:.0f}s",
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
