"""``python -m bench.profile``: where a read API worker's time goes, under wrk.

Starts ``freshline serve`` (in-process tier off, so every read reaches Redis), loads
it with wrk (batches of 100, or single GETs with ``--single``) and samples its
workers with py-spy (``pip install py-spy``; a bench extra), then prints a summary:
the share of samples idle in the event loop, blocked in a synchronous socket read,
and the functions with the most samples of their own.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from bench import common, reference_app

_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+)(?::\d+)?\)$")
_SYNC_READ = ("read_response (redis/", "read_from_socket (_parsers/", "_socket_can_read")


def _frame(raw: str) -> str:
    m = _FRAME.match(raw.strip())
    if m is None:
        return raw.strip()
    short = "/".join(Path(m["file"]).parts[-2:])
    return f"{m['func']} ({short})"


def summarise(collapsed: str, top: int = 10) -> str:
    """A readable summary of py-spy's collapsed stacks (``record --idle -f raw``).

    Only the workers' serving threads count: the event loop (idle when its leaf is
    the selector's poll) and the thread pool (idle when waiting for work).
    """
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    loop = loop_idle = pool = blocked = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";")[1:]]
        if not frames:
            continue
        if any(f.startswith("BaseEventLoop.run_forever") for f in frames):
            loop += count
            if frames[-1].startswith("EpollSelector.select"):
                loop_idle += count
                continue
        elif any(f.startswith("WorkerThread.run") for f in frames):
            if any(f.startswith("Queue.get") for f in frames):
                continue
            pool += count
        else:
            continue
        if any(s in f for f in frames for s in _SYNC_READ):
            blocked += count
        own[frames[-1]] += count
        for f in set(frames):
            if "(api/" in f or "(cache/" in f or "(core/" in f:
                inclusive[f] += count
    busy = (loop - loop_idle) + pool
    if not busy:
        return "no busy samples"
    pct = 100 / busy
    lines = [
        f"event loop idle {loop_idle / max(loop, 1):.0%} of its samples; of the "
        f"{busy} busy samples: thread pool {pool * pct:.0f}%, blocked in a "
        f"synchronous Redis read {blocked * pct:.0f}%",
        "top own samples (% of busy):",
    ]
    lines += [f"  {n * pct:5.1f}%  {name[:68]}" for name, n in own.most_common(top)]
    lines.append("freshline frames, inclusive (% of busy):")
    lines += [f"  {n * pct:5.1f}%  {name[:68]}" for name, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--single", action="store_true", help="single GETs, not batches")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, help="also keep the collapsed stacks here")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    ctx = common.context(True)
    try:
        version, _tenant, key, users = reference_app.prepared(ctx)
        with reference_app.serve_freshline(ctx, version) as url:
            pid = _server_pid(url)
            script = reference_app.wrk_script(key, users, batch=not args.single)
            load = threading.Thread(
                target=reference_app.wrk,
                args=(url, script),
                kwargs={"concurrency": args.concurrency, "seconds": args.seconds + 2},
            )
            load.start()
            with tempfile.NamedTemporaryFile(suffix=".txt") as out:
                subprocess.run(
                    [
                        spy,
                        "record",
                        "--subprocesses",
                        "--idle",
                        "-r",
                        "250",
                        "-d",
                        str(args.seconds),
                        "-f",
                        "raw",
                        "-o",
                        out.name,
                        "-p",
                        str(pid),
                    ],
                    capture_output=True,
                    check=True,
                )
                collapsed = Path(out.name).read_text()
            load.join()
        if args.out:
            args.out.write_text(collapsed)
        print(summarise(collapsed))
    finally:
        common.close_context()
    return 0


def _server_pid(url: str) -> int:
    """The granian main process listening on ``url``'s port."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=False
    ).stdout
    pids = [int(p) for p in re.findall(r"pid=(\d+)", out)]
    if not pids:
        raise RuntimeError(f"no process listens on port {port}")
    return min(pids)


if __name__ == "__main__":
    sys.exit(main())
