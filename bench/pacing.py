"""Open-loop pacing, with nothing else imported: :mod:`bench.sql_load`'s writer process
is spawned (a new interpreter) for every window, and what its module imports is what
each spawn pays before its first write."""

from __future__ import annotations

import time
from collections.abc import Iterator


def paced(rate: float, window: float) -> Iterator[int]:
    """Yield 0, 1, 2, ... at ``rate`` per second, open loop, until ``window`` s have passed."""
    started = time.monotonic()
    i = 0
    while True:
        now = time.monotonic()
        if now - started >= window:
            return
        due = started + i / rate
        if due > now:
            time.sleep(due - now)  # pacing the offered rate
        yield i
        i += 1
