"""The README's quick start, as written, on the real stack: the console block under
"Quick start: your own Postgres" is read from README.md when the test runs and typed,
command by command, into a shell at a checkout's root, as a new user would: the logins
are the ones ``.stack/env`` holds and the block hands each role, nothing else (the
shell starts from an environment with no ``FRESHLINE_*`` or ``PG*`` variable at all).

Only what the README says may change is set beforehand: the database name (``DB``) and
the ports, so that runs never collide. A ``curl`` whose comment names a served value
(``# "open_loans": 1``) is typed again until the answer has it, within a deadline.
A second repository (another database and topic prefix) runs the whole block on the
same stack while the first one still serves, and the first one serves on.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from freshline.pipeline.core.settings import Settings
from tests.helpers import FRESHLINE, ROOT, forget_repository, free_port

pytestmark = [pytest.mark.kafka, pytest.mark.connect, pytest.mark.slow]

HEADING = "## Quick start: your own Postgres"
COMMAND_S = 240.0
"""The longest one command may take (``apply`` migrates, then waits for the connector)."""
SERVED_S = 90.0
"""How long a ``curl`` is typed again until its answer holds the value its comment names."""
EXPECTED = re.compile(r'#\s*"(?P<field>\w+)":\s*(?P<value>\S+)\s*$')


def readme_block() -> str:
    """The first ``console`` block after the quick start's heading in README.md."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index(HEADING) :]
    found = re.search(r"```console\n(.*?)```", after, re.DOTALL)
    assert found is not None, f"no console block under {HEADING!r}"
    return found.group(1)


def commands(block: str) -> list[str]:
    """The block's commands, as a shell reads them: a line ending in a backslash, or
    one that leaves a double quote open, goes on with the next; comment lines go."""
    out: list[str] = []
    pending = ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\") or pending.count('"') % 2:
            continue
        out.append(pending)
        pending = ""
    assert not pending, f"the block ends inside a command: {pending!r}"
    return out


class Terminal:
    """A bash reading commands one at a time, like a terminal a user types into.

    Each command runs with its standard input on /dev/null (nothing it starts can eat
    the next command), then the shell prints a marker with its exit status. Background
    jobs (``&``) write to the same output, which a reader thread collects.
    """

    def __init__(self, cwd: Path, env: dict[str, str], name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.transcript: list[str] = []
        self._count = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.type("set -o pipefail")  # a failure inside KEY=$(... | tail -1) shows

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace"))
        self.lines.put(None)

    def type(self, command: str, timeout: float = COMMAND_S) -> tuple[int, str]:
        """Run ``command``; its exit status and what the shell printed meanwhile."""
        assert self.proc.stdin is not None
        self._count += 1
        marker = f"__quickstart_done_{self._count}__"
        self.transcript.append(f"$ {command}\n")
        self.proc.stdin.write(
            f"{{ {command}\n}} </dev/null\nprintf '\\n{marker} %s\\n' $?\n".encode()
        )
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        output: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{self.name}: {command!r} still runs after {timeout:.0f} s\n{self}")
            if line is None:
                pytest.fail(f"{self.name}: the shell exited during {command!r}\n{self}")
            if line.startswith(marker):
                status = int(line.split()[1])
                self.transcript.append(f"[exit {status}]\n")
                return status, "".join(output)
            output.append(line)
            self.transcript.append(line)

    def must(self, command: str) -> str:
        """Run ``command``; fail the test with the transcript unless it succeeds."""
        status, output = self.type(command)
        assert status == 0, f"{self.name}: {command!r} exited {status}\n{self}"
        return output

    def until_served(self, command: str) -> dict[str, Any]:
        """Type ``command`` (a curl) until its answer holds the value its comment names."""
        wanted = EXPECTED.search(command)
        assert wanted is not None, command
        field, value = wanted["field"], json.loads(wanted["value"])
        deadline = time.monotonic() + SERVED_S
        seen: list[Any] = []
        while time.monotonic() < deadline:
            start = len(self.transcript)
            _, output = self.type(command)
            answer = served(output)
            if answer is not None:
                seen.append(answer.get("values", {}).get(field))
                if seen[-1] == value:
                    return answer
            # Keep what the background jobs printed meanwhile, not each repeated read.
            self.transcript[start:] = [
                line for line in self.transcript[start + 1 : -1] if '{"' not in line
            ]
            time.sleep(0.5)  # a user typing the read again, not a synchronisation
        self.transcript.append(f"$ {command}\n{output}")
        pytest.fail(
            f"{self.name}: never served {field} = {value!r} ({len(seen)} reads, the last "
            f"{seen[-3:]})\n{self}"
        )

    def close(self) -> None:
        """Stop whatever the block left running: the shell's session, SIGTERM then SIGKILL."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._reader.join(timeout=30)  # EOF once every process of the session is gone
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()

    def __str__(self) -> str:
        return "".join(self.transcript)[-6000:]


def served(output: str) -> dict[str, Any] | None:
    """The JSON object a curl printed amid the background jobs' log lines, if any."""
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r'\{"', output)):
        try:
            found, _ = decoder.raw_decode(output, start)
        except json.JSONDecodeError:
            continue
        if isinstance(found, dict) and "values" in found:
            return found
    return None


def checkout(tmp_path: Path) -> Path:
    """A directory that looks like a checkout's root where the block needs it (the
    stack's ``.stack``, the ``.venv`` running this test, ``docs``), so ``freshline init
    myrepo`` writes into it rather than into the real checkout."""
    root = tmp_path / "checkout"
    root.mkdir(parents=True)
    (root / ".stack").symlink_to((ROOT / ".stack").resolve())
    (root / ".venv").symlink_to(Path(FRESHLINE).parents[1])
    (root / "docs").symlink_to(ROOT / "docs")
    return root


def user_env(db: str) -> dict[str, str]:
    """A new user's environment: PATH and HOME, the database name and free ports."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": "C.UTF-8",
        "DB": db,
        "FRESHLINE_API_PORT": str(free_port()),
        "FRESHLINE_OPS_PORT": str(free_port()),
        "FRESHLINE_CONSUMER_METRICS_PORT": str(free_port()),
    }


@contextmanager
def repository(tmp_path: Path, base_settings: Settings, tag: str) -> Iterator[Terminal]:
    """A terminal for a user whose database is named ``qs_<tag>``; afterwards, as the
    operator, the connector and its slot, the database, and the topics and ACLs of
    its prefix are removed."""
    db = f"qs_{tag}"
    terminal = Terminal(checkout(tmp_path / tag), user_env(db), db)
    try:
        yield terminal
    finally:
        terminal.close()
        forget_repository(base_settings, db)


def run_until_stop(terminal: Terminal, steps: list[str]) -> list[str]:
    """Type every command up to the last (which stops the jobs); return the reads."""
    reads = []
    for step in steps[:-1]:
        if step.startswith("curl"):
            terminal.until_served(step)
            reads.append(step)
        else:
            terminal.must(step)
    return reads


def test_the_readme_quick_start_runs_as_written_twice_on_one_stack(
    base_settings: Settings, tmp_path: Path
) -> None:
    steps = commands(readme_block())
    assert steps[0].startswith("set -a; . .stack/env"), steps[0]
    assert steps[-1].startswith("kill %1 %2"), steps[-1]
    reads = [s for s in steps if s.startswith("curl")]
    assert [EXPECTED.search(r)["value"] for r in reads] == ["1", "0"]  # type: ignore[index]
    run = uuid.uuid4().hex[:6]
    with ExitStack() as stack:
        first = stack.enter_context(repository(tmp_path, base_settings, f"{run}a"))
        run_until_stop(first, steps)
        # A second repository: another database and topic prefix, its own ports, on the
        # same stack, while the first one's consumer and API still run.
        second = stack.enter_context(repository(tmp_path, base_settings, f"{run}b"))
        run_until_stop(second, steps)
        second.must(steps[-1])
        first.until_served(reads[-1])  # the first one still serves its value
        first.must(steps[-1])
        for terminal in (first, second):
            assert "Traceback" not in str(terminal), str(terminal)
