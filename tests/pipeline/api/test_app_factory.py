"""The app factory that ``freshline serve`` runs in each worker."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.core.settings import Settings


def test_a_worker_moves_its_long_lived_objects_out_of_the_collector(settings: Settings) -> None:
    """A full collection then skips the ~100,000 objects made at start-up (gc.freeze):
    walking them stalled every request in flight (README, read path)."""
    code = (
        "import gc; from pipeline.api.app import app_from_env; "
        "before = gc.get_freeze_count(); app_from_env(); "
        "print(before, gc.get_freeze_count(), len(gc.get_objects()))"
    )
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    before, frozen, tracked = map(int, out.stdout.split()[-3:])
    assert before == 0
    assert frozen > 10_000 and tracked < frozen / 10  # nearly all of it, right after start
