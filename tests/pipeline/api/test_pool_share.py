"""A tenant's thread-pool share is per worker (issue 30): ``freshline check --workers N``
warns when N workers' shares let one tenant keep every CPU of the host busy."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from typer.testing import CliRunner

from freshline.pipeline.cli.deploy import POOL_THREADS, share_problem
from freshline.pipeline.core.lock import Lock


async def _pool_threads() -> int:
    return int(anyio.to_thread.current_default_thread_limiter().total_tokens)


def test_the_pool_size_is_the_one_the_api_runs_on() -> None:
    assert anyio.run(_pool_threads) == POOL_THREADS


@pytest.mark.parametrize(
    ("share", "concurrency", "workers", "cpus", "threads"),
    [
        (1.0, 4, 1, 2, None),  # the defaults, one worker on two CPUs: half of them
        (1.0, 4, 2, 2, "2"),  # a worker per CPU: one tenant may take them all
        (0.5, 4, 4, 2, "2"),
        (0.4, 4, 4, 2, None),
        (8.0, 1, 1, 2, None),  # the concurrency binds first
        (0.0, 3, 1, 2, "3"),  # no share: the concurrency still bounds it
        (100.0, 0, 1, 64, None),  # 40 threads is all a worker has
        (100.0, 0, 2, 64, "80"),
        (0.0, 0, 8, 2, None),  # no limit at all: a choice, one tenant
    ],
)
def test_a_share_times_the_workers_is_compared_with_the_cpus(
    share: float, concurrency: int, workers: int, cpus: int, threads: str | None
) -> None:
    problem = share_problem(share, concurrency, workers, cpus)
    if threads is None:
        assert problem is None
    else:
        assert problem is not None and f"keep {threads} threads busy" in problem, problem


def test_check_warns_about_the_share_of_the_workers_it_is_told_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from freshline.pipeline.cli import app

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("FRESHLINE_API_TENANT_POOL_SHARE", "1")
    monkeypatch.setenv("FRESHLINE_API_TENANT_CONCURRENCY", "4")
    lock = tmp_path / "features.lock.json"
    Lock({}).save(lock)
    runner = CliRunner()
    assert runner.invoke(app, ["check", "--lock", str(lock), "--update-lock"]).exit_code == 0

    def warning(*args: str) -> str:
        result = runner.invoke(app, ["check", "--lock", str(lock), *args])
        assert result.exit_code == 0, result.output
        return " ".join(line for line in result.output.splitlines() if "pool work" in line)

    if cpus > 1:
        assert warning() == ""
    said = warning("--workers", str(cpus))
    assert f"keep {cpus} threads busy" in said and f"{cpus} CPU(s)" in said, said
