"""Every registered fault scenario, once per seed of the chosen profile.

Each case runs the seeded workload on the private stack, injects the scenario's faults
and asks the oracle (:mod:`tests.faults.oracle`); the failure message lists every check
that failed, the fault history and the consumers' log lines that explain it. Then, as
``freshline reconcile --no-repair`` would, every user of the case's tenant is computed on
both paths: the derived incremental path of ``txn_90d`` (its partials and log, kept by
triggers and the consumers' folds through the faults) must give the full query's values.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa

from freshline.pipeline.dev.chaos import RESULTS_ENV, Profile, append_result
from freshline.pipeline.observe.reconcile import Drift, compare
from tests.faults.harness import Case, FaultEnv, run_case
from tests.faults.scenarios import SCENARIOS
from tests.helpers import REGISTRY

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
    drifts = _drift(fault_env, fault_env.tenants[case])
    if not result.passed or drifts:
        lines = [
            f"{name} (seed {seed}): {scenario.description}",
            *result.failures,
            *(f"reconcile: {d.feature_set} {d.entity} drifted: {d.fields}" for d in drifts),
            "faults:",
            *(f"  {f}" for f in result.faults),
        ]
        if result.logs:
            lines += ["consumer logs (errors and warnings):", result.logs]
        pytest.fail("\n".join(lines), pytrace=False)


def _drift(env: FaultEnv, tenant: str) -> list[Drift]:
    """Both paths of every feature set that has two, for every user of ``tenant``."""
    with env.engine.connect() as conn:
        users = conn.execute(
            sa.text("SELECT DISTINCT user_id FROM transactions WHERE tenant_id = :t"),
            {"t": tenant},
        ).scalars()
        refs = [(tenant, str(u)) for u in users]
    return compare(env.engine, refs, registry=REGISTRY)
