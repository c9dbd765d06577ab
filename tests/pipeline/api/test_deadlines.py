"""One check per loop bounds the API's awaits (:class:`freshline.pipeline.api.deadlines.Deadlines`).

Each test runs under an outer ``asyncio.timeout`` of its own: a deadline on the test
(a broken check would hang it), not a claim about speed.
"""

from __future__ import annotations

import asyncio

import pytest

from freshline.pipeline.api.deadlines import Deadlines

TEST_DEADLINE_S = 30


def run(coro: object) -> object:
    async def bounded() -> object:
        async with asyncio.timeout(TEST_DEADLINE_S):
            return await coro  # type: ignore[misc]

    return asyncio.run(bounded())


async def answer_after(event: asyncio.Event, value: int) -> int:
    await event.wait()
    return value


def test_an_await_that_answers_in_time_returns_its_answer_and_leaves_nothing_behind() -> None:
    deadlines = Deadlines(tick_s=0.01)

    async def main() -> None:
        done = asyncio.Event()
        done.set()
        assert await deadlines.bound(answer_after(done, 7), 5.0) == 7
        assert deadlines.in_flight == 0
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        # The check stops rescheduling itself once nothing is in flight.
        while deadlines._check is not None:
            await asyncio.sleep(0.01)  # yields to the loop: the check runs

    run(main())


def test_an_await_past_its_limit_raises_timeout_error_and_the_task_carries_on() -> None:
    deadlines = Deadlines(tick_s=0.01)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        never = asyncio.Event()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await deadlines.bound(answer_after(never, 1), 0.05)
        assert loop.time() - started >= 0.05  # never before its limit
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # the cut was undone
        assert deadlines.in_flight == 0
        # The task is usable, and bounded again, afterwards.
        done = asyncio.Event()
        done.set()
        assert await deadlines.bound(answer_after(done, 2), 5.0) == 2
        await asyncio.sleep(0)

    run(main())


def test_only_the_late_await_is_cut_among_concurrent_ones() -> None:
    deadlines = Deadlines(tick_s=0.01)

    async def main() -> None:
        never, later = asyncio.Event(), asyncio.Event()
        slow = asyncio.create_task(deadlines.bound(answer_after(never, 1), 0.05))
        fast = [
            asyncio.create_task(deadlines.bound(answer_after(later, i), 30.0)) for i in range(5)
        ]
        with pytest.raises(TimeoutError):
            await slow
        assert not any(t.done() for t in fast)
        later.set()
        assert await asyncio.gather(*fast) == list(range(5))
        assert deadlines.in_flight == 0

    run(main())


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    deadlines = Deadlines(tick_s=0.01)

    async def main() -> None:
        never = asyncio.Event()
        task = asyncio.create_task(deadlines.bound(answer_after(never, 1), 30.0))
        while deadlines.in_flight == 0:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert deadlines.in_flight == 0

    run(main())


def test_each_event_loop_gets_its_own_check() -> None:
    deadlines = Deadlines(tick_s=0.01)

    async def timed_out() -> None:
        with pytest.raises(TimeoutError):
            await deadlines.bound(answer_after(asyncio.Event(), 1), 0.02)

    run(timed_out())
    run(timed_out())  # a new loop: the first one's check is gone with it


def test_a_tick_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tick_s"):
        Deadlines(tick_s=0)
