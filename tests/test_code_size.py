"""Sizes ruff does not check (issue 59). No library function is over ``MAX_LINES`` lines
without a one-line reason where it is defined: a comment ``# long: <why>`` on the line
above the ``def`` (above its decorators) or at the end of the ``def`` line. Ruff's
PLR0911/0912/0913/0915 count branches, returns, arguments and statements; this counts
what a reader scrolls through. And a module docstring says what the module is for in a
few lines (``MAX_DOCSTRING`` at most) and links the doc page with the reasoning.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT

MAX_LINES = 80
LIBRARY = ("pipeline", "consumers", "schemas", "migrations", "freshline")
"""The folders the wheel installs (``freshline`` holds symlinks to the others: skipped)."""
MAX_DOCSTRING = 30
"""About 25 lines of text, with the quotes and a line or two of slack."""
LONG_DOCSTRINGS: frozenset[str] = frozenset()
"""Modules whose docstring may be longer, for now: each one's content is to move to the
docs page it belongs to. The list only shrinks."""
REASON = re.compile(r"#\s*long:\s*\S")
"""``# long: <why>``, with some text after the colon."""


@dataclass(frozen=True)
class Function:
    path: Path
    line: int
    name: str
    length: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} {self.name} ({self.length} lines)"


def library_files(root: Path) -> Iterator[Path]:
    """The library's modules, each once: nothing reached through a symlink."""
    for folder in LIBRARY:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if not any((root / p).is_symlink() for p in (rel, *rel.parents)):
                yield path


def has_reason(lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A ``# long:`` comment on the ``def`` line or on the line above its first decorator."""
    first = min([d.lineno for d in fn.decorator_list] + [fn.lineno])
    candidates = [lines[fn.lineno - 1]]
    if first >= 2:
        candidates.append(lines[first - 2])
    return any(REASON.search(line) for line in candidates)


def offenders(root: Path = ROOT, max_lines: int = MAX_LINES) -> list[Function]:
    """The functions over ``max_lines`` (``def`` line to last line) with no reason,
    longest first."""
    found = []
    for path in library_files(root):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > max_lines and not has_reason(lines, node):
                found.append(Function(path, node.lineno, node.name, length))
    return sorted(found, key=lambda f: -f.length)


def test_no_library_function_is_long_without_a_reason() -> None:
    found = offenders()
    assert not found, (
        f"{len(found)} function(s) over {MAX_LINES} lines with no '# long: <why>' above the "
        "def: split them, or say why they are long\n" + "\n".join(map(str, found))
    )


@pytest.mark.parametrize(
    ("above", "at_def", "caught"),
    [
        ("", "def f():", True),
        ("# long: one table of cases, read top to bottom", "def f():", False),
        ("", "def f():  # long: the steps in order", False),
        ("# long:", "def f():", True),  # a reason says something
        ("# a comment", "def f():", True),
    ],
)
def test_the_check_finds_a_long_function_and_takes_a_reason(
    tmp_path: Path, above: str, at_def: str, caught: bool
) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "m.py").write_text(f"{above}\n@decorator\n{at_def}\n{body}\n")
    found = offenders(tmp_path)
    assert [(f.name, f.line, f.length) for f in found] == (
        [("f", 3, MAX_LINES + 1)] if caught else []
    )


def long_docstrings(root: Path = ROOT, max_lines: int = MAX_DOCSTRING) -> dict[str, int]:
    """Each module whose docstring is over ``max_lines`` lines, with its length."""
    found = {}
    for path in library_files(root):
        body = ast.parse(path.read_text(), filename=str(path)).body
        first = body[0] if body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            length = (first.end_lineno or first.lineno) - first.lineno + 1
            if length > max_lines:
                found[path.relative_to(root).as_posix()] = length
    return found


def test_module_docstrings_are_short() -> None:
    found = long_docstrings()
    over = {name: n for name, n in found.items() if name not in LONG_DOCSTRINGS}
    assert not over, (
        f"module docstrings over {MAX_DOCSTRING} lines: say what the module is for and "
        f"link the docs page with the reasoning\n{over}"
    )
    trimmed = LONG_DOCSTRINGS - set(found)
    assert not trimmed, f"short now: take them off LONG_DOCSTRINGS: {sorted(trimmed)}"
