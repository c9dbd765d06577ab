"""Token buckets by name: the one counting device of the API's limits (rates per
tenant, rows per tenant, pool time per tenant, failed authentications and probes per
client address)."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable


class TokenBuckets:
    """A token bucket per name: ``burst`` tokens, refilled at ``rate_per_s``.

    At most ``max_entries`` names are tracked (least recently used are forgotten, which
    only ever forgives). ``rate_per_s`` 0 means no limit. Each method may be given a
    name's own ``rate`` and ``burst`` (a tenant's limits), over the bucket's.
    """

    def __init__(
        self,
        rate_per_s: float,
        burst: float,
        *,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate_per_s
        self.burst = float(burst)
        self.max_entries = max_entries
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _level(self, name: str, now: float, rate: float, burst: float) -> float:
        tokens, at = self._buckets.get(name, (burst, now))
        return min(burst, tokens + (now - at) * rate)

    def limits(self, rate: float | None, burst: float | None) -> tuple[float, float]:
        return (self.rate if rate is None else rate, self.burst if burst is None else burst)

    def wait(
        self, name: str, rate: float | None = None, burst: float | None = None, cost: float = 1.0
    ) -> float:
        """Seconds until ``name`` has ``cost`` tokens (0 if it has now); takes nothing."""
        rate, burst = self.limits(rate, burst)
        if rate <= 0:
            return 0.0
        tokens = self._level(name, self.clock(), rate, burst)
        return 0.0 if tokens >= cost else (cost - tokens) / rate

    def take(self, name: str) -> float:
        """Take a token: 0 if one was there, else the seconds until one will be."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        tokens = self._level(name, now, self.rate, self.burst)
        if tokens < 1:
            self._store(name, tokens, now)
            return (1 - tokens) / self.rate
        self._store(name, tokens - 1, now)
        return 0.0

    def give(self, name: str, tokens: float = 1.0) -> None:
        """Give back ``tokens`` taken for what did not happen (up to the burst)."""
        if self.rate > 0 and name in self._buckets:
            now = self.clock()
            level = self._level(name, now, self.rate, self.burst)
            self._store(name, min(self.burst, level + tokens), now)

    def reserve(
        self,
        name: str,
        max_wait_s: float,
        rate: float | None = None,
        burst: float | None = None,
        cost: float = 1.0,
    ) -> float | None:
        """Take ``cost`` tokens, into debt if need be: the seconds until they are due (0:
        now), or ``None``, taking nothing, if that is more than ``max_wait_s``."""
        rate, burst = self.limits(rate, burst)
        if rate <= 0:
            return 0.0
        now = self.clock()
        tokens = self._level(name, now, rate, burst)
        wait = 0.0 if tokens >= cost else (cost - tokens) / rate
        if wait > max_wait_s:
            return None
        self._store(name, tokens - cost, now)
        return wait

    def charge(
        self, name: str, cost: float, rate: float | None = None, burst: float | None = None
    ) -> None:
        """Take ``cost`` tokens for work already done: into debt, if need be."""
        rate, burst = self.limits(rate, burst)
        if rate > 0:
            now = self.clock()
            self._store(name, self._level(name, now, rate, burst) - cost, now)

    def level(self, name: str, rate: float | None = None, burst: float | None = None) -> float:
        """``name``'s tokens now (negative: in debt; infinite with no limit)."""
        rate, burst = self.limits(rate, burst)
        return self._level(name, self.clock(), rate, burst) if rate > 0 else math.inf

    def owed(self, name: str, rate: float | None = None, burst: float | None = None) -> float:
        """Seconds until ``name`` is out of debt (0 if it is not in debt)."""
        rate, burst = self.limits(rate, burst)
        if rate <= 0:
            return 0.0
        return max(0.0, -self._level(name, self.clock(), rate, burst) / rate)

    def _store(self, name: str, tokens: float, now: float) -> None:
        self._buckets[name] = (tokens, now)
        self._buckets.move_to_end(name)
        while len(self._buckets) > self.max_entries:
            self._buckets.popitem(last=False)
