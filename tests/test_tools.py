"""Every program the code runs is installed by the scripts or is on the bare image.

A bare machine is Debian 12 with Python 3.11, Java 17, Maven and git, nothing else added
by hand. ``scripts/packages.txt`` lists every other program a script, test or benchmark
runs, with its Debian package; ``scripts/apt-install --for`` installs them. These tests
read the code for the programs it runs (``shutil.which``, the first item of a subprocess
argument list, ``require``, and in the shell scripts every command word that is a
program) and fail on one that is neither listed nor bare: a tool installed by hand where
the tests last passed is exactly what a fresh machine lacks.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from freshline.pipeline.dev.tools import MissingTool, manifest, require

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# Debian 12's required and important packages (coreutils, util-linux, procps, findutils,
# grep, sed, mawk, tar, gzip, debianutils, dpkg, apt) and the machine's own Python, Java,
# Maven and git. A program here needs no install step.
BARE = {
    "apt-get",
    "awk",
    "base64",
    "basename",
    "bash",
    "cat",
    "chmod",
    "chown",
    "cp",
    "cut",
    "date",
    "dirname",
    "env",
    "find",
    "git",
    "grep",
    "gzip",
    "head",
    "hostname",
    "id",
    "java",
    "kill",
    "ln",
    "ls",
    "mkdir",
    "mktemp",
    "mv",
    "mvn",
    "nproc",
    "pkill",
    "printf",
    "ps",
    "pwd",
    "python3",
    "readlink",
    "realpath",
    "rm",
    "runuser",
    "sed",
    "seq",
    "setsid",
    "sh",
    "sha256sum",
    "sleep",
    "sort",
    "stat",
    "tail",
    "tar",
    "tee",
    "timeout",
    "touch",
    "tr",
    "true",
    "false",
    "uname",
    "uniq",
    "wc",
    "xargs",
    "test",
    "which",
    "sha1sum",
    "dir",
}
PYTHON_DIRS = ("pipeline", "consumers", "bench", "tests", "migrations", "schemas", "examples")
SCRIPTS = [p for p in (ROOT / "scripts").iterdir() if p.is_file() and p.suffix != ".txt"] + [
    ROOT / ".ci" / "run"
]
RUNNERS = {"run", "Popen", "call", "check_call", "check_output", "create_subprocess_exec"}


def installed(command: str) -> bool:
    """Listed in the manifest, on the bare image, or an entry point of the lock's."""
    return (
        command in manifest()
        or command in BARE
        or (VENV_BIN / command).exists()
        or command.startswith((".venv/", "scripts/"))
    )


def python_programs() -> dict[str, set[str]]:
    """``{program: {file, ...}}`` for every literal program name the Python code runs."""
    found: dict[str, set[str]] = {}
    for top in PYTHON_DIRS:
        for path in (ROOT / top).rglob("*.py") if (ROOT / top).is_dir() else ():
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                name = (
                    node.func.attr
                    if isinstance(node.func, ast.Attribute)
                    else node.func.id
                    if isinstance(node.func, ast.Name)
                    else ""
                )
                first = node.args[0]
                if name in RUNNERS and isinstance(first, ast.List | ast.Tuple) and first.elts:
                    first = first.elts[0]
                elif not (
                    name in {"which", "require", "_sh"}
                    or (name == "installed" and len(node.args) == 2)  # tests.helpers'
                ):
                    continue
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    found.setdefault(first.value, set()).add(str(path.relative_to(ROOT)))
    return found


COMMAND_WORD = re.compile(  # a word at command position that is not a case label
    r"(?:^|[|;&(]|(?<!\$)\{|\$\(|\b(?:then|do|else|exec|timeout \d+)\s)\s*"
    r"([A-Za-z_][\w.+-]*)(?![\w.+-]|\)|=)"  # not an assignment's name
)
COMMAND_V = re.compile(r"\bcommand -v ([A-Za-z_][\w.+-]*)")
BUILTINS = {
    "alias",
    "bg",
    "break",
    "builtin",
    "case",
    "cd",
    "command",
    "compgen",
    "continue",
    "declare",
    "do",
    "done",
    "echo",
    "elif",
    "else",
    "esac",
    "eval",
    "exec",
    "exit",
    "export",
    "fi",
    "for",
    "function",
    "getopts",
    "hash",
    "if",
    "in",
    "local",
    "mapfile",
    "read",
    "readonly",
    "return",
    "select",
    "set",
    "shift",
    "source",
    "then",
    "time",
    "trap",
    "type",
    "ulimit",
    "umask",
    "unset",
    "until",
    "wait",
    "while",
}


HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


def script_programs() -> dict[str, set[str]]:
    """``{program: {script, ...}}``: command words of the shell scripts that are programs
    on this machine's PATH (config keys and variables are not), or in ``command -v``."""
    found: dict[str, set[str]] = {}
    for path in SCRIPTS:
        text = path.read_text()
        functions = set(re.findall(r"^\s*([\w-]+)\(\)\s*\{", text, re.M))
        heredoc = None  # the delimiter of the here-document being read: its lines are data
        for raw in text.splitlines():
            if heredoc is not None:
                if raw.strip() == heredoc:
                    heredoc = None
                continue
            if raw.strip().startswith("#"):
                continue
            opened = HEREDOC.search(raw)
            if opened:
                heredoc = opened.group(1)
            line = re.sub(r"'[^']*'", "''", raw.strip())
            asked = set(COMMAND_V.findall(line))
            for word in asked | set(COMMAND_WORD.findall(line)):
                if word in BUILTINS or word in functions:
                    continue
                if shutil.which(word) or word in asked:
                    found.setdefault(word, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_program_the_python_code_runs_is_installed_by_the_scripts() -> None:
    programs = python_programs()
    assert {"wrk", "redis-server", "chromium", "openssl"} <= set(programs)  # the scan works
    missing = {p: sorted(f) for p, f in programs.items() if not installed(p)}
    assert not missing, f"add these to scripts/packages.txt: {missing}"


def test_every_program_the_scripts_run_is_installed_by_the_scripts() -> None:
    programs = script_programs()
    assert {"psql", "redis-server", "curl", "promtool", "java"} <= set(programs)  # ditto
    missing = {p: sorted(f) for p, f in programs.items() if not installed(p)}
    assert not missing, f"add these to scripts/packages.txt: {missing}"


def test_every_command_the_scripts_ask_apt_install_for_is_in_the_manifest() -> None:
    asked = set()
    for path in SCRIPTS:
        code = "\n".join(
            line for line in path.read_text().splitlines() if not line.strip().startswith("#")
        )
        for args in re.findall(r"apt-install\"? --for ([^|;&\n]+)", code):
            asked |= {a for a in args.split() if not a.startswith(("$", '"$', "||"))}
    assert {"promtool", "wrk", "openssl", "go"} <= asked
    assert not asked - set(manifest()), asked - set(manifest())


def test_the_scan_would_catch_a_tool_installed_by_hand(tmp_path: Path) -> None:
    assert not installed("kcat") and not installed("faketime")
    assert installed("wrk") and installed("py-spy") and installed("git")


def test_a_missing_tool_is_one_line_naming_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        MissingTool,
        match=r"^wrk is not installed; install it with: "
        r"scripts/apt-install --for wrk \(Debian package wrk\)$",
    ):
        require("wrk")


def test_apt_install_refuses_a_command_missing_from_the_manifest() -> None:
    done = subprocess.run(
        [str(ROOT / "scripts" / "apt-install"), "--for", "no-such-tool"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "apt-install: error: no-such-tool is not in "
        "scripts/packages.txt; add it with its Debian package"
    )


def test_apt_install_does_nothing_when_every_command_is_there() -> None:
    present = [c for c in manifest() if (os.access(c, os.X_OK) if "/" in c else shutil.which(c))]
    done = subprocess.run(
        [str(ROOT / "scripts" / "apt-install"), "--for", *present],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done
