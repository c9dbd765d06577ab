from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

FRESHLINE = str(Path(sys.executable).with_name("freshline"))


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FRESHLINE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_unreachable_postgres_is_one_line_naming_it_and_the_fix() -> None:
    r = run("db", "upgrade", FRESHLINE_POSTGRES_URL="postgresql+psycopg://u:pw@127.0.0.1:1/x")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Postgres" in lines[0] and "127.0.0.1:1" in lines[0]
    assert "scripts/stack up" in lines[0]
    assert "pw" not in lines[0]
    assert "Traceback" not in r.stderr


def test_bad_arguments_give_a_usage_error() -> None:
    r = run("seed", "--users", "zero")
    assert r.returncode == 2
    assert "Usage" in r.stderr or "usage" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_setting_is_one_line() -> None:
    r = run("db", "upgrade", FRESHLINE_SCHEMA_VERSION="-1")
    assert r.returncode == 1
    assert "FRESHLINE_SCHEMA_VERSION" in r.stderr
    assert "Traceback" not in r.stderr


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_advise_with_no_api_running_says_to_start_the_api_not_the_stack() -> None:
    port = free_port()
    r = run(
        "advise", "--window", "1s", FRESHLINE_API_HOST="127.0.0.1", FRESHLINE_API_PORT=str(port)
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"http://127.0.0.1:{port}/metrics" in lines[0]
    assert (
        "the API is not running: start it with `freshline serve`, or pass `--from-metrics URL`"
    ) in lines[0]
    assert "scripts/stack up" not in lines[0]
    assert "Traceback" not in r.stderr


def test_advise_from_a_dead_metrics_url_names_it_and_the_option() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    r = run("advise", "--window", "1s", "--from-metrics", url)
    assert r.returncode == 1
    assert url in r.stderr and "--from-metrics" in r.stderr
    assert "scripts/stack up" not in r.stderr
    assert "Traceback" not in r.stderr
