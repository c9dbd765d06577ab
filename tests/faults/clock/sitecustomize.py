"""A wall clock that steps on request, for a consumer process of the fault suite.

faketime is not installed, so this does what its ``FAKETIME`` file does, for Python:
with this directory on ``PYTHONPATH``, Python imports this module at start-up, and
``time.time`` and ``time.time_ns`` return the real wall clock plus the offset (integer
nanoseconds) written in the file ``FRESHLINE_FAULTS_CLOCK`` names, read every 20 ms by
a daemon thread, which writes each offset it takes to ``<file>.seen``. The monotonic
clock is left alone, as a wall-clock step (NTP, an operator's ``date -s``) leaves it.
C libraries (librdkafka, libpq) keep the real clock.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_FILE = os.environ.get("FRESHLINE_FAULTS_CLOCK")
_POLL_S = 0.02


def _install(path: Path) -> None:
    real_time, real_time_ns = time.time, time.time_ns
    offset = [0]

    def watch() -> None:
        seen = path.with_name(path.name + ".seen")
        while True:
            try:
                wanted = int(path.read_text().strip() or "0")
            except (OSError, ValueError):
                wanted = offset[0]
            if wanted != offset[0] or not seen.exists():
                offset[0] = wanted
                seen.write_text(str(wanted))
            time.sleep(_POLL_S)  # polling interval, not synchronisation

    def stepped_time() -> float:
        return real_time() + offset[0] / 1e9

    def stepped_time_ns() -> int:
        return real_time_ns() + offset[0]

    time.time = stepped_time
    time.time_ns = stepped_time_ns
    threading.Thread(target=watch, name="faults-clock", daemon=True).start()


if _FILE:
    _install(Path(_FILE))
