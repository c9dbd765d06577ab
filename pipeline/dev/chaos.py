"""The fault-injection suite's profiles, its results, and the runner behind ``freshline chaos``.

The suite itself is ``tests/faults`` (pytest, marker ``faults``): each scenario runs a
seeded workload against a private stack, injects its faults, waits for the consumers
to quiesce and then checks the oracle (served values equal the defining full query
and a plain Python reference over the raw rows, every record accounted for, every key
with a TTL, every process alive). This module
holds what the suite and the command share:

* :data:`PROFILES`: ``short`` (CI: a few scenarios, one seed) and ``long`` (every
  scenario, three seeds), chosen with ``FRESHLINE_CHAOS_PROFILE``;
* :class:`CaseResult`: one scenario run with one seed, appended as a JSON line to
  ``FRESHLINE_CHAOS_RESULTS`` by the suite;
* :func:`run`: runs pytest on the suite and writes ``bench/CHAOS.md`` and
  ``bench/chaos.json`` from the results.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

ProfileName = Literal["short", "long"]

PROFILE_ENV = "FRESHLINE_CHAOS_PROFILE"
SEED_ENV = "FRESHLINE_CHAOS_SEED"
RESULTS_ENV = "FRESHLINE_CHAOS_RESULTS"
ONLY_ENV = "FRESHLINE_CHAOS_SCENARIOS"
DEFAULT_SEED = 1


@dataclass(frozen=True, slots=True)
class Profile:
    """How much of the suite to run, and how big each scenario's workload is."""

    name: ProfileName
    seeds: int
    every_scenario: bool
    changes: int
    rate: float
    entities: int = 300
    """How many entities each scenario's tenant is seeded with."""
    rows: int = 6000
    """How many source rows (the fraud example: its rows of history) in all."""


PROFILES: dict[str, Profile] = {
    # CI: the scenarios marked short, one seed each; minutes, not tens of minutes.
    "short": Profile("short", seeds=1, every_scenario=False, changes=500, rate=40.0),
    # Every scenario, three seeds, longer workloads.
    "long": Profile("long", seeds=3, every_scenario=True, changes=1200, rate=40.0),
}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown chaos profile {name!r}: choose {', '.join(PROFILES)}") from None


def seeds(chosen: Profile, base: int = DEFAULT_SEED) -> list[int]:
    """The seeds a profile runs: ``base``, ``base + 1``, ..."""
    return [base + i for i in range(chosen.seeds)]


@dataclass
class CaseResult:
    """One scenario run with one seed: the oracle's verdict and what led to it."""

    scenario: str
    seed: int
    passed: bool
    duration_s: float
    failures: list[str] = field(default_factory=list)
    """One line per failed check."""
    checked: int = 0
    """Entries compared with Postgres (touched entities and present keys, per feature set)."""
    present: int = 0
    mismatches: int = 0
    mismatch_examples: list[dict[str, Any]] = field(default_factory=list)
    accounting: dict[str, Any] = field(default_factory=dict)
    ttl_violations: int = 0
    dead_processes: list[str] = field(default_factory=list)
    readers: dict[str, Any] = field(default_factory=dict)
    """What the readers (the API, the Python client) were served: answers, present,
    mismatches (true at no moment within their grace), staleness."""
    faults: list[str] = field(default_factory=list)
    """The fault history, each line tagged with the workload's progress (changes)."""
    workload: dict[str, Any] = field(default_factory=dict)
    logs: str = ""
    """The tails of the logs that explain a failure."""

    def to_json(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> CaseResult:
        data = orjson.loads(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def append_result(path: Path, result: CaseResult) -> None:
    """Add one result as a JSON line (the suite calls this once per case)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as sink:
        sink.write(result.to_json() + b"\n")


def read_results(path: Path) -> list[CaseResult]:
    if not path.exists():
        return []
    return [CaseResult.from_json(line) for line in path.read_bytes().splitlines() if line.strip()]


def render_markdown(
    results: Sequence[CaseResult],
    *,
    profile_name: str,
    seed: int,
    command: str,
    total_s: float,
    exit_code: int,
) -> str:
    """``bench/CHAOS.md``: one row per case, then the failures in detail."""
    passed = sum(r.passed for r in results)
    lines = [
        "# Fault injection: results",
        "",
        f"`{command}`: profile `{profile_name}`, base seed {seed}, {len(results)} cases, "
        f"{passed} passed, {len(results) - passed} failed, {total_s:.0f} s "
        f"(pytest exit code {exit_code}).",
        "",
        "Each case runs a seeded workload on a private stack, injects the scenario's faults, "
        "waits for the consumers to quiesce, and checks: served values equal both the "
        "defining full query and a plain Python reference over the raw rows (correct "
        "or absent), every record applied, dead-lettered or "
        "skipped, every feature key with a TTL, every consumer alive unless the "
        "scenario killed it, and every value the readers (the read API and the Python "
        "client, during the case and after it) were served true at some moment within "
        "its grace. See docs/faults.md.",
        "",
        "| scenario | seed | result | checked (present) | mismatches | reads checked "
        "(present) | reader mismatches | records (produced / counted) | dead-lettered "
        "| TTL-less keys | duration |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        acc, reads = r.accounting, r.readers
        lines.append(
            f"| {r.scenario} | {r.seed} | {'pass' if r.passed else '**FAIL**'} "
            f"| {r.checked} ({r.present}) | {r.mismatches} "
            f"| {reads.get('answers', '-')} ({reads.get('present', '-')}) "
            f"| {reads.get('mismatches', '-')} "
            f"| {acc.get('produced', '?')} / {acc.get('counted', '?')} "
            f"| {acc.get('dead_lettered', '?')} | {r.ttl_violations} | {r.duration_s:.0f} s |"
        )
    failed = [r for r in results if not r.passed]
    if failed:
        lines += ["", "## Failures", ""]
        for r in failed:
            lines += [f"### {r.scenario}, seed {r.seed}", ""]
            lines += [f"- {f}" for f in r.failures]
            if r.faults:
                lines += ["", "Faults (`@N`: after N workload changes):", ""]
                lines += [f"    {f}" for f in r.faults]
            if r.logs:
                lines += ["", "```", r.logs.strip(), "```"]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_report(
    results: Sequence[CaseResult],
    out_dir: Path,
    *,
    profile_name: str,
    seed: int,
    command: str,
    total_s: float,
    exit_code: int,
) -> tuple[Path, Path]:
    """Write ``CHAOS.md`` and ``chaos.json`` into ``out_dir``; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "CHAOS.md"
    js = out_dir / "chaos.json"
    md.write_text(
        render_markdown(
            results,
            profile_name=profile_name,
            seed=seed,
            command=command,
            total_s=total_s,
            exit_code=exit_code,
        )
    )
    js.write_bytes(
        orjson.dumps(
            {
                "profile": profile_name,
                "seed": seed,
                "command": command,
                "duration_s": round(total_s, 1),
                "pytest_exit_code": exit_code,
                "cases": [dataclasses.asdict(r) for r in results],
            },
            option=orjson.OPT_INDENT_2,
        )
        + b"\n"
    )
    return md, js


def pytest_command(root: Path, extra: Iterable[str] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        str(root / "tests" / "faults"),
        "-m",
        "faults",
        "-p",
        "no:cacheprovider",
        *extra,
    ]


def run(
    root: Path,
    *,
    profile_name: str,
    seed: int,
    out_dir: Path,
    scenarios: Sequence[str] = (),
    pytest_args: Sequence[str] = (),
) -> tuple[int, list[CaseResult]]:
    """Run the suite with ``profile_name`` and ``seed``; write the report into ``out_dir``.

    Returns pytest's exit code and the results.
    """
    profile(profile_name)
    with tempfile.TemporaryDirectory(prefix="freshline-chaos-") as tmp:
        results_path = Path(tmp) / "results.jsonl"
        env = {
            **os.environ,
            PROFILE_ENV: profile_name,
            SEED_ENV: str(seed),
            RESULTS_ENV: str(results_path),
        }
        if scenarios:
            env[ONLY_ENV] = ",".join(scenarios)
        started = time.monotonic()
        code = subprocess.call(pytest_command(root, pytest_args), cwd=root, env=env)
        total = time.monotonic() - started
        results = read_results(results_path)
    command = f"freshline chaos --profile {profile_name} --seed {seed}"
    if scenarios:
        command += "".join(f" --scenario {s}" for s in scenarios)
    write_report(
        results,
        out_dir,
        profile_name=profile_name,
        seed=seed,
        command=command,
        total_s=total,
        exit_code=code,
    )
    return code, results
