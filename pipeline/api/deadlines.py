"""Time limits on awaits, checked by one timer per event loop instead of one per await.

``asyncio.timeout`` schedules a timer for every call (a ``TimerHandle`` pushed on the
loop's heap, then cancelled): on a GET served in a couple of hundred microseconds that
timer was the largest single cost of the API's own code. :class:`Deadlines` instead
notes each bounded await's deadline in a dict, and one periodic check per loop
cancels the tasks past theirs, which then raise :class:`TimeoutError` as with
``asyncio.timeout``. The check runs every ``tick_s`` while anything is in flight (and
not at all when nothing is), so an await is cut off between ``limit_s`` and
``limit_s + tick_s`` after it began.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Deadlines:
    """``await deadlines.bound(awaitable, limit_s)``: its result, or :class:`TimeoutError`
    once ``limit_s`` (plus at most ``tick_s``) has passed.

    One instance serves one event loop at a time (the API's workers each run one); a
    first use on another loop starts afresh there. A bound inside another on the same
    task is the outer one's: only the outermost limit applies.
    """

    def __init__(self, tick_s: float) -> None:
        if tick_s <= 0:
            raise ValueError(f"tick_s must be positive, not {tick_s!r}")
        self.tick_s = tick_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due: dict[asyncio.Task[object], float] = {}  # task -> loop.time() deadline
        self._cut: set[asyncio.Task[object]] = set()  # cancelled by the check
        self._check: asyncio.TimerHandle | None = None

    async def bound(self, awaitable: Awaitable[T], limit_s: float) -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None or task in self._due:  # no task to cancel, or bounded already
            return await awaitable
        if loop is not self._loop:
            self._loop, self._due, self._cut, self._check = loop, {}, set(), None
        self._due[task] = loop.time() + limit_s
        if self._check is None:
            self._check = loop.call_later(self.tick_s, self._run_check, loop)
        cancelling = task.cancelling()
        try:
            return await awaitable
        except asyncio.CancelledError:
            # Ours only if the check cut it and no one else cancelled the task too.
            if task in self._cut and task.uncancel() <= cancelling:
                raise TimeoutError(f"no answer within {limit_s:g} s") from None
            raise
        finally:
            del self._due[task]
            self._cut.discard(task)

    def _run_check(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return  # scheduled on a loop this instance has since left
        now = loop.time()
        for task, due in self._due.items():
            if due <= now and task not in self._cut:
                self._cut.add(task)
                task.cancel()
        self._check = loop.call_later(self.tick_s, self._run_check, loop) if self._due else None

    @property
    def in_flight(self) -> int:
        """Awaits bounded right now."""
        return len(self._due)
