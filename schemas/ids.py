"""The id rule of the contracts: which tenant and entity ids may reach a key.

Allowed: ASCII letters, digits, ``_``, ``.`` and ``-``, starting with a letter or
digit, at most 64 characters. That rules out the key separator ``:``, hash-tag
braces, glob wildcards, whitespace and control characters. Event decoding and the
key scheme (:func:`freshline.pipeline.core.keys.validate_id`) apply this one rule.
"""

from __future__ import annotations

import re

MAX_ID_LENGTH = 64
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def id_problem(value: object) -> str | None:
    """Why ``value`` cannot be an id, or ``None`` if it can."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return "must be a string or an integer"
    text = str(value)
    if not text:
        return "must not be empty"
    if len(text) > MAX_ID_LENGTH:
        return f"longer than {MAX_ID_LENGTH} characters"
    if not ID_PATTERN.fullmatch(text):
        return "only letters, digits, '_', '.' and '-' are allowed, starting alphanumeric"
    return None
