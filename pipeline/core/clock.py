"""Wall-clock time as freshline records it in entries: integer milliseconds."""

from __future__ import annotations

import time


def now_ms() -> int:
    """Milliseconds since the epoch, from the wall clock."""
    return time.time_ns() // 1_000_000
