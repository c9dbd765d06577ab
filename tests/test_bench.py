"""The benchmark runner names only benchmarks that exist: a missing one fails the run."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import orjson
import pytest

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


def test_a_run_with_only_keeps_the_other_results_each_naming_its_run(tmp_path: Path) -> None:
    from bench.__main__ import _kept_results, _section, render

    doc = orjson.loads((Path(__file__).parents[1] / "bench" / "results.json").read_bytes())
    unstamped = {
        name: {k: v for k, v in doc["results"][name].items() if k != "measured"}
        for name in ("memory", "redis_writes", "seed")
    }
    stamp = {"date": "E", "commit": "F", "command": "G", "load": None}
    doc["results"] = {**unstamped, "seed": {**unstamped["seed"], "measured": stamp}}
    path = tmp_path / "results.json"
    path.write_bytes(orjson.dumps(doc))
    kept = _kept_results(path, {"memory"})
    assert set(kept) == {"redis_writes", "seed"}
    # a result without a stamp gets its run's; one with a stamp keeps it
    assert kept["redis_writes"]["measured"]["commit"] == doc["commit"]
    assert kept["seed"]["measured"] == stamp

    now = {
        **doc,
        "command": ".venv/bin/python -m bench --only memory",
        "results": {
            "memory": {
                **doc["results"]["memory"],
                "measured": {"date": "D", "commit": "C", "command": "X --only memory", "load": 1.5},
            },
            **kept,
        },
    }
    text = render(now, {name: _section(name, r) for name, r in now["results"].items()})
    memory = text.split("## memory")[1].split("\n## ")[0]
    writes = text.split("## redis_writes")[1].split("\n## ")[0]
    assert "*Measured D at `C` by `X --only memory`; load 1.5.*" in memory
    assert f"at `{doc['commit']}`" in writes and "replaces only its own sections" in text

    quick = {**doc, "quick": True}
    path.write_bytes(orjson.dumps(quick))
    assert _kept_results(path, {"memory"}) == {}  # smoke results are never kept


def test_a_result_the_current_format_cannot_render_is_shown_as_its_run_rendered_it() -> None:
    from bench.__main__ import _section, render

    doc = orjson.loads((Path(__file__).parents[1] / "bench" / "results.json").read_bytes())
    stamp = {"date": "D", "commit": "C", "command": "X --only read_path", "load": None}
    old = {
        "rounds": 1,
        "measured": stamp,
        "rendered": "## read_path: from raw redis-py to HTTP\n\nthe old table\n",
    }
    memory = {**doc["results"]["memory"], "rendered": "## memory\n\nstale text\n"}
    doc["results"] = {"read_path": old, "memory": memory}
    text = render(doc, {name: _section(name, r) for name, r in doc["results"].items()})
    section = text.split("## read_path")[1].split("\n## ")[0]
    assert "the old table" in section and "*Measured D at `C`" in section
    assert "not rendered" not in text
    # A result the current format renders is rendered again, not taken from the store;
    # the stored text is the runner's, never passed to the benchmark's markdown.
    assert "stale text" not in text and "## memory: " in text and "**failed**" not in text


def test_training_renders_a_missed_target_and_a_failed_feast_run() -> None:
    from bench import training

    window = {
        "writes": 100,
        "writes_per_s": 20.0,
        "lag_records_mean": 1.5,
        "lag_records_p95": 3,
        "lag_records_max": 4,
        "drain_s": 0.1,
    }
    result = {
        "parameters": {
            **training.QUICK.__dict__,
            "load_at_start": [1.0, 1.0, 1.0],
            "load_at_end": [2.0, 2.0, 2.0],
            "postgres": "127.0.0.1:5432",
        },
        "cost": {
            "on": {**window, "history_bytes": 50_000, "history_bytes_per_change": 500.0},
            "off": window,
            "recorder": {
                "backlog": 100,
                "seconds_from_first_commit": 0.5,
                "seconds_from_start": 2.0,
                "changes_per_s": 200.0,
            },
        },
        "history": {
            "versions": 10,
            "recorded": 5,
            "ended": 2,
            "s0": "S0",
            "complete_to": "C",
            "complete_to_set_by": "recorder",
            "span_s": 9,
        },
        "throughput": {"rows": 400, "seconds": 2.0, "rows_per_s": 200.0, "peak_rss_mib": 150.0},
        "naive": {
            "rows": 40,
            "lateral_rows_per_s": 400.0,
            "naive_rows_per_s": 100.0,
            "ratio": 4.0,
            "same_values": True,
        },
        "feast_error": "feast exited 1: no module",
    }
    text = training.markdown(result)
    assert "Target >= 20x: **missed**" in text
    assert "Feast: **failed**" in text and "1,000,000" in text


def test_a_smoke_run_writes_to_a_scratch_directory_never_over_the_figures() -> None:
    from bench.__main__ import QUICK_JOBS, options
    from bench.common import BENCH_DIR

    quick = options(["--quick"])
    try:
        assert quick.out != BENCH_DIR and not any(quick.out.iterdir())
        assert quick.jobs == QUICK_JOBS
    finally:
        shutil.rmtree(quick.out)
    assert options([]).out == BENCH_DIR and options([]).jobs == 1
    for refused in (
        ["--quick", "--out", str(BENCH_DIR)],
        ["--jobs", "2"],
        ["--quick", "--jobs", "0"],
    ):
        with pytest.raises(SystemExit) as exit_:
            options(refused)
        assert exit_.value.code == 2


def test_a_smoke_run_hands_out_every_benchmark_once_its_slowest_first() -> None:
    from bench.__main__ import SLOWEST_FIRST, handout

    assert set(SLOWEST_FIRST) <= set(BENCHMARKS)
    everything = handout(list(BENCHMARKS))
    assert sorted(everything) == sorted(BENCHMARKS)
    assert everything[: len(SLOWEST_FIRST)] == list(SLOWEST_FIRST)
    picked = ["seed", "memory", "abuse", "freshness"]
    assert handout(picked) == ["freshness", "abuse", "seed", "memory"]
    assert handout(["abuse", "training"]) == ["training", "abuse"]
