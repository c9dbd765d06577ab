"""The stepped wall clock of ``tests/faults/clock``, which the ``consumer-clock-step``
scenario starts a consumer with: a step moves ``time.time``/``time.time_ns`` by the
offset, from the real clock, and leaves the monotonic clock alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.injectors import step_clock
from tests.faults.processes import CLOCK_SHIM

PROBE = """
import sys, time
for line in sys.stdin:
    print(time.time(), time.time_ns(), time.monotonic(), flush=True)
"""


def test_a_step_moves_the_wall_clock_and_not_the_monotonic_one(tmp_path: Path) -> None:
    clock = tmp_path / "clock"
    clock.write_text("0")
    env = {**os.environ, "PYTHONPATH": str(CLOCK_SHIM), "FRESHLINE_FAULTS_CLOCK": str(clock)}
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert probe.stdin is not None and probe.stdout is not None

    def read() -> tuple[float, int, float]:
        assert probe.stdin is not None and probe.stdout is not None
        probe.stdin.write("\n")
        probe.stdin.flush()
        wall, wall_ns, mono = probe.stdout.readline().split()
        return float(wall), int(wall_ns), float(mono)

    try:
        step_clock(clock, 0)  # the shim has started and taken the file
        wall, _, mono = read()
        assert wall == pytest.approx(time.time(), abs=60)  # not stepped yet
        for offset in (3600, -3600):
            step_clock(clock, offset)
            stepped, stepped_ns, mono_after = read()
            real = time.time()
            assert stepped - real == pytest.approx(offset, abs=60)
            assert stepped_ns / 1e9 - real == pytest.approx(offset, abs=60)
            assert mono_after >= mono  # the monotonic clock never steps
            mono = mono_after
    finally:
        probe.stdin.close()
        probe.wait(timeout=30)
        probe.stdout.close()
