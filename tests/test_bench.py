"""The benchmark runner names only benchmarks that exist: a missing one fails the run."""

from __future__ import annotations

import importlib
from pathlib import Path

import orjson

from bench.__main__ import BENCHMARKS, rerender


def test_every_benchmark_the_runner_names_imports_and_has_run_and_markdown() -> None:
    for name in BENCHMARKS:
        module = importlib.import_module(f"bench.{name}")
        assert callable(module.run) and callable(module.markdown), name


def test_render_only_names_results_older_than_their_benchmark(tmp_path: Path) -> None:
    doc = orjson.loads((Path(__file__).parents[1] / "bench" / "results.json").read_bytes())
    doc["results"] = {"memory": doc["results"]["memory"], "read_path": {"rounds": 1}}
    (tmp_path / "results.json").write_bytes(orjson.dumps(doc))
    assert rerender(tmp_path) == 1
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## read_path" in text and "re-run `python -m bench --only read_path`" in text
    memory = text.split("## memory")[1].split("\n## ")[0]
    assert memory.strip() and "not rendered" not in memory
