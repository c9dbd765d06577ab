"""The ``/status`` page: one self-contained HTML document, no external assets.

The document is ``status.html``, shipped beside this module as package data and read
once. The report (:meth:`freshline.pipeline.observe.status.StatusBoard.report`) is embedded in the
page, so it renders at once, and fetched again from ``status.json`` every 15 seconds.
The charts are inline SVG drawn by a few lines of vanilla JavaScript: the page works
air-gapped.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

import orjson

_SLOT = b"__DATA__"


@cache
def _template() -> tuple[bytes, bytes]:
    """The document split around its one data slot: (before, after)."""
    document = files(__package__).joinpath("status.html").read_bytes()
    before, _, after = document.partition(_SLOT)
    return before, after


def page(report: dict[str, Any]) -> bytes:
    """The page with ``report`` embedded (``</`` escaped so it cannot end the script)."""
    before, after = _template()
    return before + orjson.dumps(report).replace(b"</", b"<\\/") + after
