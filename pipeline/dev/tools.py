"""The external programs the dev tools, tests and benchmarks run, found or named.

``scripts/packages.txt`` is the one list of them, with the Debian package of each;
``scripts/apt-install --for COMMAND`` installs what is missing. :func:`require` finds a
program or raises :class:`MissingTool`, whose message is the one line a person needs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from freshline.pipeline.core.errors import FreshlineError

MANIFEST = Path(__file__).resolve().parents[2] / "scripts" / "packages.txt"


def manifest(path: Path = MANIFEST) -> dict[str, str]:
    """``{command: Debian package}`` from ``scripts/packages.txt`` (empty if absent)."""
    if not path.is_file():
        return {}
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2:
            found[fields[0]] = fields[1]
    return found


class MissingTool(FreshlineError):
    """A program that is not installed, with the command that installs it."""

    def __init__(self, command: str) -> None:
        self.command = command
        package = manifest().get(command)
        how = (
            f"scripts/apt-install --for {command} (Debian package {package})"
            if package
            else f"add {command} to scripts/packages.txt with its Debian package"
        )
        super().__init__(f"{command} is not installed; install it with: {how}")


def require(command: str) -> str:
    """The path of ``command`` on PATH, or :class:`MissingTool`."""
    found = shutil.which(command)
    if found is None:
        raise MissingTool(command)
    return found
