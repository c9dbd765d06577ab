"""The fault-injection suite's selection and its session fixture: a private stack.

Not part of the default run: every test here is marked ``faults`` and skipped unless
asked for, with ``-m faults`` or ``FRESHLINE_CHAOS_PROFILE=short|long``. Asked for, it
never skips: a missing tool or a stack that will not start is an error (under CI too).

* ``FRESHLINE_CHAOS_PROFILE``: ``short`` (default when asked for) or ``long``;
* ``FRESHLINE_CHAOS_SEED``: the base seed (default 1); a profile runs ``seed``,
  ``seed + 1``, ...;
* ``FRESHLINE_CHAOS_SCENARIOS``: a comma-separated subset of scenario names;
* ``FRESHLINE_CHAOS_RESULTS``: a file to append each case's result to (JSON lines),
  as ``freshline chaos`` does;
* ``FRESHLINE_CHAOS_KEEP=1``: keep the private stack's data after the session (logs
  are always kept, under ``.stack/faults/``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from freshline.pipeline.dev.chaos import (
    DEFAULT_SEED,
    ONLY_ENV,
    PROFILE_ENV,
    SEED_ENV,
    Profile,
    profile,
    seeds,
)
from tests.faults.harness import Case, FaultEnv
from tests.faults.scenarios import SCENARIOS
from tests.faults.stack import ROOT, PrivateStack

HERE = Path(__file__).resolve().parent


def _asked(config: pytest.Config) -> bool:
    markexpr = str(config.getoption("markexpr", "") or "")
    return bool(os.environ.get(PROFILE_ENV)) or (
        "faults" in markexpr and "not faults" not in markexpr
    )


def chosen_profile() -> Profile:
    return profile(os.environ.get(PROFILE_ENV) or "short")


def chosen_cases() -> list[Case]:
    """(scenario, seed) pairs of the chosen profile, narrowed by FRESHLINE_CHAOS_SCENARIOS."""
    prof = chosen_profile()
    only = [s.strip() for s in os.environ.get(ONLY_ENV, "").split(",") if s.strip()]
    unknown = [s for s in only if s not in SCENARIOS]
    if unknown:
        raise pytest.UsageError(
            f"{ONLY_ENV}: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}"
        )
    names = only or [n for n, s in SCENARIOS.items() if prof.every_scenario or s.short]
    base = int(os.environ.get(SEED_ENV) or DEFAULT_SEED)
    return [(n, s) for n in names for s in seeds(prof, base)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ == "test_scenario":
        cases = chosen_cases()
        metafunc.parametrize("case", cases, ids=[f"{n}-seed{s}" for n, s in cases])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _asked(config):
        return
    skip = pytest.mark.skip(
        reason=f"fault-injection suite: run with -m faults or {PROFILE_ENV}=short|long"
    )
    for item in items:
        if item.get_closest_marker("faults") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _quiet_own_clients() -> None:
    """This process's own Kafka clients (the workload's producer, the oracle's probes)
    complain through every broker outage a scenario causes, as expected; the consumers'
    logs are the ones that matter, and a failure quotes them."""
    logging.getLogger("freshline.kafka").setLevel(logging.CRITICAL)


@pytest.fixture(scope="session")
def faults_profile() -> Profile:
    return chosen_profile()


@pytest.fixture(scope="session")
def fault_env(request: pytest.FixtureRequest, faults_profile: Profile) -> Iterator[FaultEnv]:
    """The private stack, ready for every case this session runs (one tenant per case)."""
    cases = [
        item.callspec.params["case"]
        for item in request.session.items
        if hasattr(item, "callspec") and "case" in item.callspec.params
    ]
    directory = ROOT / ".stack" / "faults" / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    stack = PrivateStack.allocate(directory)
    env: FaultEnv | None = None
    try:
        env = FaultEnv.create(stack, cases, faults_profile)
        yield env
    finally:
        if env is not None:
            env.close()
        stack.down(keep_data=os.environ.get("FRESHLINE_CHAOS_KEEP") == "1")
