"""Every registered fault scenario, once per seed of the chosen profile.

Each case runs the seeded workload on the private stack, injects the scenario's faults
and asks the oracle (:mod:`tests.faults.oracle`); the failure message lists every check
that failed, the fault history and the consumers' log lines that explain it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.dev.chaos import RESULTS_ENV, Profile, append_result
from tests.faults.harness import Case, FaultEnv, run_case
from tests.faults.scenarios import SCENARIOS

pytestmark = [pytest.mark.faults, pytest.mark.kafka, pytest.mark.connect, pytest.mark.slow]


def test_scenario(case: Case, fault_env: FaultEnv, faults_profile: Profile) -> None:
    name, seed = case
    scenario = SCENARIOS[name]
    result = run_case(
        fault_env, scenario, seed, faults_profile, fault_env.stack.directory / f"{name}-seed{seed}"
    )
    results = os.environ.get(RESULTS_ENV)
    if results:
        append_result(Path(results), result)
    if not result.passed:
        lines = [
            f"{name} (seed {seed}): {scenario.description}",
            *result.failures,
            "faults:",
            *(f"  {f}" for f in result.faults),
        ]
        if result.logs:
            lines += ["consumer logs (errors and warnings):", result.logs]
        pytest.fail("\n".join(lines), pytrace=False)
