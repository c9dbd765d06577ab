"""Processes for the tests and the benchmarks: a free loopback port, a condition waited on
with a deadline, and a server started until it answers, then stopped.

One copy of each, for ``tests/`` and ``bench/`` alike (docs/contributing.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TypeVar

import httpx

T = TypeVar("T")

POLL_S = 0.005
"""How often a condition is asked again: a polling interval, never synchronisation."""


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nobody listens on now."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def wait_until(
    condition: Callable[[], bool], timeout: float = 5.0, interval: float = POLL_S
) -> bool:
    """Ask ``condition`` every ``interval`` seconds until it holds or ``timeout`` seconds
    pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def wait_for(
    condition: Callable[[], bool], what: str, timeout: float = 60.0, interval: float = POLL_S
) -> None:
    """:func:`wait_until` ``condition`` holds; ``TimeoutError`` naming ``what`` if not."""
    if not wait_until(condition, timeout, interval):
        raise TimeoutError(f"timed out waiting for {what}")


class DidNotStart(Exception):
    """A server exited, or did not answer in time; the message ends with its log."""


def stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """Stop a process started in a session of its own as Ctrl-C does (SIGINT to its
    group); SIGKILL the group if it has not exited ``grace_s`` later."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def enter_together(
    stack: contextlib.ExitStack[bool | None],
    managers: Sequence[contextlib.AbstractContextManager[T]],
) -> list[T]:
    """Enter ``managers`` side by side, a thread each; ``stack`` exits them side by side
    too: servers that start (and stop) together take the time of the slowest."""
    own = [contextlib.ExitStack() for _ in managers]
    stack.callback(_exit_together, own)  # before entering: exits those that did enter
    with ThreadPoolExecutor(max(1, len(managers))) as pool:
        futures = [pool.submit(s.enter_context, m) for s, m in zip(own, managers, strict=True)]
    return [f.result() for f in futures]


def _exit_together(stacks: Sequence[contextlib.ExitStack[bool | None]]) -> None:
    with ThreadPoolExecutor(max(1, len(stacks))) as pool:
        futures = [pool.submit(s.close) for s in stacks]
    for f in futures:
        f.result()


def _answers(url: str, verify: ssl.SSLContext | bool) -> bool:
    try:
        return httpx.get(url, timeout=1, verify=verify).status_code < 500
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def serving(
    argv: list[str],
    port: int,
    *,
    ready: str = "/healthz",
    env: Mapping[str, str] | None = None,
    log: IO[bytes] | None = None,
    scheme: str = "http",
    verify: ssl.SSLContext | bool = True,
    timeout: float = 60.0,
    grace_s: float = 15.0,
) -> Iterator[str]:
    """Run ``argv`` (an HTTP server on ``port``, in a process group of its own) until
    ``GET ready`` answers below 500; yield its base URL; stop it on exit (:func:`stop`).

    ``env`` replaces the environment; its output goes to ``log`` (a scratch file when
    none). A server that exits first or misses ``timeout`` raises :class:`DidNotStart`.
    """
    sink = log if log is not None else tempfile.TemporaryFile()  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        argv,
        env=dict(env) if env is not None else None,
        stdout=sink,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"{scheme}://127.0.0.1:{port}"
    try:
        started = lambda: proc.poll() is not None or _answers(url + ready, verify)  # noqa: E731
        if not wait_until(started, timeout, interval=0.05):
            raise DidNotStart(f"{argv[0]} did not answer in {timeout:.0f} s: {_tail(sink)}")
        if proc.poll() is not None:
            raise DidNotStart(f"{argv[0]} exited with {proc.returncode}: {_tail(sink)}")
        yield url
    finally:
        stop(proc, grace_s)
        if log is None:
            sink.close()


def _tail(sink: IO[bytes]) -> str:
    sink.flush()
    sink.seek(0)
    return sink.read()[-2000:].decode(errors="replace")
