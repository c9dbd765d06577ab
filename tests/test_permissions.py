"""A refused write is one line naming the role, the setting and the remedy; commands that
write log in as the owner (FRESHLINE_POSTGRES_ADMIN_URL) when it is set.

Each command runs as a person runs it: the ``freshline`` process (or ``python -m bench``),
against the test database, with ``FRESHLINE_POSTGRES_URL`` the API's least-privilege role.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from freshline.pipeline.core.settings import Settings
from tests.helpers import FRESHLINE, role_url

ROOT = Path(__file__).resolve().parents[1]


def api_url(settings: Settings) -> str:
    """The test database's URL, logged in as the API's read-only role."""
    return role_url(settings, "FRESHLINE_STACK_POSTGRES_API_URL")


def run(argv: list[str], settings: Settings, admin: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": api_url(settings),
        "FRESHLINE_POSTGRES_ADMIN_URL": admin,
        "FRESHLINE_REDIS_URL": settings.redis_url,
    }
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def assert_one_line_naming_the_fix(done: subprocess.CompletedProcess[str], role: str) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "sqlalchemy" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, done.stderr
    line = errors[0]
    assert "permission denied" in line
    assert f"'{role}'" in line and "FRESHLINE_POSTGRES_URL" in line
    assert "FRESHLINE_POSTGRES_ADMIN_URL" in line and ".stack/env" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["tenants", "create", "perm-test"],
        ["fraud", "seed", "--users", "2", "--transactions", "5", "--tenant-prefix", "perm-"],
        ["fraud", "simulate", "--count", "1"],
    ],
    ids=["tenants-create", "seed", "simulate"],
)
def test_a_write_with_the_read_only_role_is_one_line(
    settings: Settings, tenant_factory: Callable[..., object], argv: list[str]
) -> None:
    tenant_factory(users=2, transactions=5)  # simulate changes existing users
    role = make_url(api_url(settings)).username
    assert_one_line_naming_the_fix(run([FRESHLINE, *argv], settings, admin=""), str(role))


def test_the_benchmarks_with_the_read_only_role_are_one_line(settings: Settings) -> None:
    done = run(
        [sys.executable, "-m", "bench", "--quick", "--only", "read_path"], settings, admin=""
    )
    assert_one_line_naming_the_fix(done, str(make_url(api_url(settings)).username))


def test_writing_commands_log_in_as_the_owner_when_the_admin_url_is_set(
    settings: Settings, engine: sa.Engine
) -> None:
    done = run(
        [FRESHLINE, "tenants", "create", "perm-owner"], settings, admin=settings.postgres_url
    )
    assert done.returncode == 0, done.stderr
    with engine.connect() as conn:
        assert conn.execute(
            sa.text("SELECT 1 FROM freshline.tenants WHERE id = 'perm-owner'")
        ).first()
