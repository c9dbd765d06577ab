"""The audit log: who administered tenants and keys, and which requests were refused.

One JSON object per line on the ``freshline.audit`` logger: ``{"ts", "event", ...}``
with the key's public id (``key_id``), never the key or its hash. Events:
``tenant.create``, ``apikey.create``, ``apikey.revoke``, ``auth.refused`` (a 401:
``reason`` missing_key, malformed_header, unknown_key, revoked_key, expired_key or
throttled) and ``rate.limited`` (a 429).

:func:`configure` sends the lines to a file (``FRESHLINE_AUDIT_LOG``) or to stderr.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

LOGGER = logging.getLogger("freshline.audit")
_HANDLER_NAME = "freshline-audit"


def record(event: str, **fields: Any) -> None:
    """Write one audit line (``fields`` must not hold a key)."""
    if not LOGGER.isEnabledFor(logging.INFO):
        return
    line = {"ts": datetime.now(UTC).isoformat(timespec="milliseconds"), "event": event, **fields}
    LOGGER.info("%s", orjson.dumps(line, default=str).decode())


def configure(path: str = "") -> None:
    """Send audit lines to ``path`` (appended), or to stderr when it is empty.

    Idempotent: a second call replaces the handler the first one added.
    """
    for old in [h for h in LOGGER.handlers if h.get_name() == _HANDLER_NAME]:
        LOGGER.removeHandler(old)
        old.close()
    handler: logging.Handler = (
        logging.FileHandler(path, encoding="utf-8") if path else logging.StreamHandler(sys.stderr)
    )
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False
