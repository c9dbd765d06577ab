"""scripts/bootstrap takes any Python from 3.11 on, as pyproject.toml's requires-python says.

Bootstrap runs from a copy in a temporary directory (it works on the directory above its
own), with ``--check-python`` so it only chooses the interpreter. The interpreters are
fakes: each claims a version both to ``--version`` and to code run with ``-c``, so the
test holds however bootstrap asks, and refuses anything else (such as ``-m venv``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import error_line

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """\
#!{executable}
import collections
import sys

VersionInfo = collections.namedtuple("version_info", "major minor micro releaselevel serial")
sys.version_info = VersionInfo({major}, {minor}, {micro}, "final", 0)
sys.version = "{version} (fake)"
args = sys.argv[1:]
if args in (["--version"], ["-V"]):
    print("Python {version}")
elif len(args) >= 2 and args[0] == "-c":
    sys.argv = ["-c", *args[2:]]
    exec(compile(args[1], "<string>", "exec"), {{"__name__": "__main__"}})
else:
    sys.exit("fake Python {version}: unexpected arguments %r" % (args,))
"""

# What a pyenv shim for a version that is not selected does.
BROKEN_SHIM = '#!/bin/sh\necho "pyenv: $(basename "$0"): command not found" >&2\nexit 127\n'


def fake_python(path: Path, version: str) -> Path:
    major, minor, micro = (int(part) for part in version.split("."))
    write_executable(
        path,
        FAKE_PYTHON.format(
            executable=sys.executable, version=version, major=major, minor=minor, micro=micro
        ),
    )
    return path


def write_executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def check_python(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``scripts/bootstrap --check-python`` from a copy, PYTHON unset unless given."""
    copy = tmp_path / "repo" / "scripts" / "bootstrap"
    copy.parent.mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "bootstrap", copy)
    base = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    return subprocess.run(
        [str(copy), "--check-python"],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=60,
    )


@pytest.mark.parametrize("version", ["3.11.9", "3.12.4", "3.13.1"])
def test_accepts_python_3_11_and_later(tmp_path: Path, version: str) -> None:
    python = fake_python(tmp_path / "bin" / "python", version)
    r = check_python(tmp_path, PYTHON=str(python))
    assert r.returncode == 0, r.stderr
    minor = version.rpartition(".")[0]
    assert f"Python {minor}" in r.stdout and str(python) in r.stdout


def test_refuses_python_3_10_in_one_line(tmp_path: Path) -> None:
    python = fake_python(tmp_path / "bin" / "python", "3.10.13")
    line = error_line(check_python(tmp_path, PYTHON=str(python)))
    assert "3.10" in line and "3.11 or later" in line and str(python) in line


@pytest.mark.parametrize(
    ("installed", "chosen"),
    [
        pytest.param(
            {"python3.13": "3.13.1", "python3.12": "3.12.4", "python3.11": "3.11.9"},
            "3.11",
            id="the-locks-3.11-first",
        ),
        pytest.param(
            {"python3.11": None, "python3.12": "3.12.4", "python3.13": "3.13.1"},
            "3.12",
            id="the-next-that-runs",
        ),
    ],
)
def test_without_PYTHON_the_first_interpreter_that_runs_is_chosen(
    tmp_path: Path, installed: dict[str, str | None], chosen: str
) -> None:
    """requirements/dev.txt is compiled on 3.11: a machine that has it uses it; where it
    does not run (``None``: a pyenv shim of a version not installed), the next that does."""
    bin_dir = tmp_path / "bin"
    for name, version in installed.items():
        if version is None:
            write_executable(bin_dir / name, BROKEN_SHIM)
        else:
            fake_python(bin_dir / name, version)
    r = check_python(tmp_path, PATH=f"{bin_dir}:/usr/bin:/bin")
    assert r.returncode == 0, r.stderr
    assert f"Python {chosen}" in r.stdout and r.stdout.strip().endswith(f"python{chosen}")


def test_without_PYTHON_an_old_python3_alone_is_refused(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    for name in ("python3.13", "python3.12", "python3.11"):
        write_executable(bin_dir / name, BROKEN_SHIM)
    fake_python(bin_dir / "python3", "3.10.13")
    line = error_line(check_python(tmp_path, PATH=f"{bin_dir}:/usr/bin:/bin"))
    assert "3.11 or later" in line and "PYTHON=" in line


def test_stack_help_names_the_cluster_topology() -> None:
    done = subprocess.run(
        [str(ROOT / "scripts" / "stack"), "--help"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert "--topology cluster" in done.stdout and "scripts/stack up" in done.stdout
    refused = subprocess.run(
        [str(ROOT / "scripts" / "stack"), "bogus"], capture_output=True, text=True, timeout=30
    )
    assert refused.returncode == 2 and "--topology single|cluster" in refused.stderr


def test_demo_refuses_an_unknown_argument_with_its_usage() -> None:
    done = subprocess.run(
        [str(ROOT / "scripts" / "demo"), "--bogus"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and done.stderr.strip() == "usage: scripts/demo [--ci]"


def shell_function(script: Path, name: str) -> str:
    """The text of shell function ``name`` in ``script`` (from ``name() {`` to its ``}``)."""
    lines = script.read_text().splitlines()
    start = lines.index(f"{name}() {{")
    return "\n".join(lines[start : lines.index("}", start) + 1])


def test_a_kafka_cluster_id_never_starts_with_a_dash(tmp_path: Path) -> None:
    """kafka-storage reads ``-t -x...`` as an option: an id must not start with "-", as
    Kafka's own Uuid.randomUuid guarantees (one cluster up in 64 failed to format so)."""
    made = tmp_path / "made"
    program = shell_function(ROOT / "scripts" / "stack", "kafka_cluster_id") + (
        # 640 ids (about ten would start with "-" if drawn plainly), then a kept good id
        # and a kept bad one.
        f'\nfor i in $(seq 640); do rm -f "{made}"; kafka_cluster_id "{made}"; done'
        f'\nprintf keptAAAAAAAAAAAAAAAAAA >"{made}"; kafka_cluster_id "{made}"'
        f'\nprintf -- -badAAAAAAAAAAAAAAAAAA >"{made}"; kafka_cluster_id "{made}"; cat "{made}"'
    )
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    *fresh, kept, remade, stored = done.stdout.splitlines()
    assert len(fresh) == 640
    assert all(len(i) == 22 and not i.startswith("-") for i in fresh)
    assert set("".join(fresh)) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    )
    assert kept == "keptAAAAAAAAAAAAAAAAAA"
    assert not remade.startswith("-") and len(remade) == 22 and stored == remade


def test_a_start_is_not_taken_for_a_death_before_the_child_execs(tmp_path: Path) -> None:
    """Just after ``setsid ... &``, the child is still a copy of the script: its command
    line and directory are not yet the service's. wait_until must not call it dead (CI's
    cluster topology once failed so: "kafka-2: process exited during start-up")."""
    stack = tmp_path / "stack"
    (stack / "run").mkdir(parents=True)
    functions = "\n".join(
        shell_function(ROOT / "scripts" / "stack", name)
        for name in ("fail", "alive", "pid_of", "wait_until")
    )
    program = f"""{functions}
STACK={stack} TIMEOUT=20
(cd / && exec sleep 30) &  # alive, but nothing of it points into STACK
echo $! >"$STACK/run/svc.pid"
polls=0
ready() {{ polls=$((polls + 1)); [[ $polls -ge 2 ]]; }}
wait_until svc "" svc ready && echo "ready after $polls polls"
kill %1
"""
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ready after 2 polls"
