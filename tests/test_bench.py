"""The benchmark runner names only benchmarks that exist: a missing one fails the run."""

from __future__ import annotations

import importlib

from bench.__main__ import BENCHMARKS


def test_every_benchmark_the_runner_names_imports_and_has_run_and_markdown() -> None:
    for name in BENCHMARKS:
        module = importlib.import_module(f"bench.{name}")
        assert callable(module.run) and callable(module.markdown), name
