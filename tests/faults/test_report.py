"""``bench/CHAOS.md`` as ``freshline chaos`` renders it: one row per case, the readers'
results beside the oracle's. Pure Python: no stack."""

from __future__ import annotations

from freshline.pipeline.dev.chaos import CaseResult, render_markdown


def _render(*results: CaseResult) -> list[str]:
    text = render_markdown(
        results, profile_name="long", seed=1, command="freshline chaos", total_s=1, exit_code=0
    )
    return [line for line in text.splitlines() if line.startswith("| ")]


def test_a_row_shows_the_reads_checked_and_their_mismatches() -> None:
    result = CaseResult(
        "kafka-partition",
        2,
        passed=True,
        duration_s=61.0,
        checked=714,
        present=489,
        accounting={"produced": 1783, "counted": 1844, "dead_lettered": 0},
        readers={"answers": 15552, "present": 11935, "mismatches": 0},
    )
    header, _rule, row = _render(result)
    assert "reads checked (present) | reader mismatches" in header
    assert row == (
        "| kafka-partition | 2 | pass | 714 (489) | 0 | 15552 (11935) | 0 "
        "| 1783 / 1844 | 0 | 0 | 61 s |"
    )


def test_a_case_without_readers_says_so() -> None:
    result = CaseResult("redis-restart", 1, passed=False, duration_s=3.0)
    row = _render(result)[2]
    assert "| **FAIL** | 0 (0) | 0 | - (-) | - |" in row
