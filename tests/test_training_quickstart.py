"""docs/training.md's step by step, as written, on the real stack, after the README's
quick start (``tests/test_quickstart.py``): a user turns history on, makes an insert, a
correction and a delete, reads what the API serves after each, and builds a training set
with the CLI and with Python. Every row of both equals, field for field, what the API
served just before the row's moment.

The section's fenced blocks are read from the doc when the test runs and followed in
order, as a reader would: the ``toml`` block is added to ``myrepo/freshline.toml``, the
``python`` block saved as ``train.py``, and each ``console`` block typed command by
command into the terminal the README's block ran in (its logins, ``$operator``,
``$consumer`` and ``$api``, and nothing else). The user's session writes moments in
Newfoundland's zone (``PGTZ``, UTC-03:30), which freshline's own sessions must not
follow.
"""

from __future__ import annotations

import datetime as dt
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from freshline.pipeline.core.settings import Settings
from tests.helpers import ROOT, forget_repository
from tests.test_quickstart import (
    Terminal,
    checkout,
    commands,
    readme_block,
    user_env,
)

pytestmark = [pytest.mark.kafka, pytest.mark.connect, pytest.mark.slow]

pa = pytest.importorskip("pyarrow")
pcsv = pytest.importorskip("pyarrow.csv")
pq = pytest.importorskip("pyarrow.parquet")

HEADING = "## Step by step, with the quick-start repository"
ZONE = "America/St_Johns"
"""The user's session zone: a negative offset with minutes, far from UTC."""
COMPLETE_S = 90.0
"""How long the training set is asked for again while history is not complete yet."""
FIELDS = ("open_loans", "overdue", "last_loan_at")
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def blocks() -> list[tuple[str, str]]:
    """The fenced blocks of the section, in order: (language, text)."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index(HEADING) :]
    section = section[: section.index("\n## ", len(HEADING))]
    return [(m[1], m[2]) for m in re.finditer(r"```(\w+)\n(.*?)```", section, re.DOTALL)]


@contextmanager
def terminal_for(tmp_path: Path, base_settings: Settings) -> Iterator[tuple[Terminal, Path]]:
    """A terminal at a checkout's root for database ``qs_<run>``, in the user's zone;
    afterwards the repository's connector, slot, database, topics and ACLs go."""
    db = f"qs_{uuid.uuid4().hex[:6]}t"
    root = checkout(tmp_path)
    terminal = Terminal(root, user_env(db) | {"PGTZ": ZONE}, db)
    try:
        yield terminal, root
    finally:
        terminal.close()
        forget_repository(base_settings, db)


def training_set(terminal: Terminal, command: str) -> None:
    """Type the ``training-set`` command again while history is not complete to the
    spine's last moment, as the doc says to (within a deadline)."""
    deadline = time.monotonic() + COMPLETE_S
    while True:
        status, output = terminal.type(command)
        if status == 0:
            return
        assert "not caught up" in output, f"{command!r} exited {status}\n{terminal}"
        assert time.monotonic() < deadline, f"history never complete\n{terminal}"
        time.sleep(1.0)  # a user running it again a moment later, not a synchronisation


def as_served(value: Any, field: str) -> Any:
    """A training set's value as the API's JSON writes it (timestamps: epoch ms)."""
    if isinstance(value, dt.datetime):
        return (value - EPOCH) // dt.timedelta(milliseconds=1)
    return value


def test_the_training_quick_start_gives_back_what_was_served(
    base_settings: Settings, tmp_path: Path
) -> None:
    readme = commands(readme_block())
    assert readme[-1].startswith("kill %1 %2"), readme[-1]
    found = blocks()
    assert [lang for lang, _ in found] == ["toml", "console", "python", "console"], found
    served: list[dict[str, Any]] = []
    with terminal_for(tmp_path, base_settings) as (terminal, root):
        for step in readme[:-1]:  # the README's block, its consumer and API left running
            if step.startswith("curl"):
                terminal.until_served(step)
            else:
                terminal.must(step)
        for lang, text in found:
            if lang == "toml":  # "add this to myrepo/freshline.toml"
                config = root / "myrepo" / "freshline.toml"
                config.write_text(config.read_text() + "\n" + text)
                continue
            if lang == "python":  # "save this as train.py"
                (root / "train.py").write_text(text)
                continue
            for step in commands(text):
                if step.startswith("curl"):
                    served.append(terminal.until_served(step))
                elif "training-set" in step:
                    training_set(terminal, step)
                else:
                    terminal.must(step)
        assert "Traceback" not in str(terminal), str(terminal)
        spine = pcsv.read_csv(root / "spine.csv")
        by_cli = pcsv.read_csv(root / "train.csv")
        by_python = pq.read_table(root / "train.parquet")
    assert len(served) == 3 == spine.num_rows
    assert "-03:30" in (root / "spine.csv").read_text()  # moments in the user's zone
    # the story the doc tells: book 2 open, corrected out of the window, then the last loan
    # deleted
    values = [answer["values"] for answer in served]
    assert [v["open_loans"] for v in values] == [1, 0, 0]
    assert values[0]["last_loan_at"] == values[1]["last_loan_at"] is not None
    assert values[2]["last_loan_at"] is None
    for train in (by_cli, by_python):
        assert train.column_names == [
            *spine.column_names,
            *(f"loans_30d__{f}" for f in FIELDS),
        ]
        for name in spine.column_names:  # the spine passes through unchanged
            assert train.column(name).to_pylist() == spine.column(name).to_pylist(), name
        rows = train.to_pylist()
        for row, answer in zip(rows, values, strict=True):
            got = {f: as_served(row[f"loans_30d__{f}"], f) for f in FIELDS}
            assert got == answer, (row, answer)
    assert by_python.schema.field("loans_30d__last_loan_at").type == pa.timestamp("ms", tz="UTC")
    assert by_python.schema.field("loans_30d__open_loans").type == pa.int64()
