"""The consumer's one backoff loop (:func:`freshline.consumers.worker.retry`), without services."""

from __future__ import annotations

import threading

import pytest

from freshline.consumers.worker import FIRST_BACKOFF_S, MAX_BACKOFF_S, retry


class Refused(Exception):
    pass


class Attempts:
    """Fails with ``errors`` in turn, then succeeds."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)


def test_it_waits_twice_as_long_each_time_up_to_the_maximum() -> None:
    attempt = Attempts(*[Refused(str(i)) for i in range(9)])
    seen: list[tuple[str, float]] = []
    pauses: list[float] = []

    def failed(exc: Refused, delay: float) -> bool:
        seen.append((str(exc), delay))
        return True

    retry(attempt, Refused, failed, pause=pauses.append, stop=threading.Event())
    assert attempt.calls == 10
    assert pauses == [min(FIRST_BACKOFF_S * 2**i, MAX_BACKOFF_S) for i in range(9)]
    assert pauses[-1] == MAX_BACKOFF_S and [d for _, d in seen] == pauses
    assert [m for m, _ in seen] == [str(i) for i in range(9)]


def test_a_failure_it_is_told_not_to_wait_for_is_retried_at_once() -> None:
    attempt = Attempts(Refused("now"), Refused("later"))
    pauses: list[float] = []
    retry(
        attempt,
        (Refused,),
        lambda exc, delay: str(exc) == "later",
        pause=pauses.append,
        stop=threading.Event(),
    )
    assert attempt.calls == 3 and pauses == [FIRST_BACKOFF_S]  # not doubled by "now"


def test_a_stop_raises_the_failure_and_other_failures_are_not_retried() -> None:
    stop = threading.Event()
    stop.set()
    pauses: list[float] = []
    with pytest.raises(Refused):
        retry(Attempts(Refused()), Refused, lambda e, d: True, pause=pauses.append, stop=stop)
    with pytest.raises(KeyError):
        retry(
            Attempts(KeyError("x")),
            Refused,
            lambda e, d: True,
            pause=pauses.append,
            stop=threading.Event(),
        )
    assert pauses == []
