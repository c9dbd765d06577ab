"""No test is lost to the tiers: every test id that main collected before them
(``tests/collected_before_tiers.txt``, at ce4c3f6) is still collected, or is renamed as
``RENAMED`` says. A new test needs nothing here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

BEFORE = ROOT / "tests" / "collected_before_tiers.txt"

RENAMED: dict[str, str] = {
    # One rate per tenant, all its keys (issue 48).
    "tests/pipeline/api/test_limits.py::test_a_key_over_its_rate_gets_429_with_retry_after": (
        "tests/pipeline/api/test_limits.py::"
        "test_a_tenant_over_its_rate_gets_429_with_retry_after_on_every_key"
    ),
    # The writer with no grant moved to the role tests of the derived path (issue 47).
    "tests/test_derived.py::test_a_writer_without_grants_on_freshline_logs_its_own_inserts": (
        "tests/test_derived_roles.py::test_a_writer_with_no_grant_on_freshline_has_its_writes_logged"
    ),
    # The README's block as written, twice on one stack (issue 49).
    "tests/test_quickstart.py::test_the_readme_quick_start_serves_a_change_made_with_plain_sql": (
        "tests/test_quickstart.py::test_the_readme_quick_start_runs_as_written_twice_on_one_stack"
    ),
}
"""Old test id -> its new id, for a test renamed since."""


def collected() -> set[str]:
    """The ids ``pytest --collect-only`` finds now, over the whole of ``tests/``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("FRESHLINE_CHAOS_PROFILE", None)  # the fault scenarios' ids follow it
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


@pytest.mark.slow  # collects the whole suite in a process of its own
def test_every_test_collected_before_the_tiers_is_still_collected() -> None:
    before = set(BEFORE.read_text().splitlines())
    now = collected()
    lost = sorted(RENAMED.get(test, test) for test in before if RENAMED.get(test, test) not in now)
    assert not lost, f"{len(lost)} test ids no longer collected: {lost[:20]}"
