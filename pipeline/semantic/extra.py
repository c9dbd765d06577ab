"""Whether the ``freshline[semantic]`` extra is installed, found without importing it.

The semantic cache needs FAISS, ``tokenizers`` and ``safetensors``; a plain
``pip install freshline`` has none of them and serves features all the same. The API
and the CLI ask here before they import the rest of :mod:`freshline.pipeline.semantic`, which
needs them.
"""

from __future__ import annotations

import importlib.util

from freshline.pipeline.core.errors import ConfigError

MODULES = ("faiss", "tokenizers", "safetensors")
"""What the extra installs, by import name (faiss comes from ``faiss-cpu``)."""

INSTALL = "pip install 'freshline[semantic]'"


class SemanticNotInstalled(ConfigError):
    """Something needs the semantic extra and it is not installed."""

    def __init__(self, what: str, missing: list[str]) -> None:
        self.missing = missing
        super().__init__(
            f"{what} needs the semantic extra, which is not installed "
            f"(no {', '.join(missing)}): {INSTALL}"
        )


def missing() -> list[str]:
    """The extra's modules that cannot be imported here (none when it is installed)."""
    return [name for name in MODULES if importlib.util.find_spec(name) is None]


def require_extra(what: str) -> None:
    """Raise :class:`SemanticNotInstalled`, naming ``what`` needs it, unless installed."""
    gone = missing()
    if gone:
        raise SemanticNotInstalled(what, gone)
