"""The entry encoding: compact, and simple to read from any language.

An entry is one Redis string::

    b"1" <watermark: 30 lower-case hex digits>
         <JSON: [schema_version, computed_at_ms, [v1, ..., vn]]>

The values are positional, in the feature set's declared field order for that schema
version (``schemas/features.lock.json`` lists the fields; a field change always comes
with a SCHEMA_VERSION bump, so positions never shift under a reader). Timestamps are
epoch milliseconds; a missing value is ``null``.

A tombstone, left by an invalidation, is ``b"T" <watermark>`` and reads as a miss.
Watermarks are fixed-width hex so that Redis-side Lua compares them as strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from pipeline.core.errors import CorruptEntry, SchemaVersionMismatch
from pipeline.core.types import Entry, Watermark

ENTRY_TAG = b"1"
TOMBSTONE_TAG = b"T"
WATERMARK_HEX = 30
HEADER = 1 + WATERMARK_HEX


def watermark_hex(watermark: Watermark) -> bytes:
    if watermark < 0 or watermark >= 1 << (4 * WATERMARK_HEX):
        raise ValueError(f"watermark out of range: {watermark}")
    return b"%030x" % watermark


def encode_entry(values: Sequence[Any], schema_version: int, computed_at_ms: int,
                 watermark: Watermark) -> bytes:
    body = orjson.dumps([schema_version, computed_at_ms, list(values)])
    return ENTRY_TAG + watermark_hex(watermark) + body


def encode_tombstone(watermark: Watermark) -> bytes:
    return TOMBSTONE_TAG + watermark_hex(watermark)


def decode_entry(raw: bytes, fields: Sequence[str], schema_version: int) -> Entry | None:
    """Decode ``raw``; ``None`` for a tombstone. Raises on a foreign or corrupt entry."""
    tag = raw[:1]
    if tag == TOMBSTONE_TAG:
        return None
    if tag != ENTRY_TAG or len(raw) <= HEADER:
        raise CorruptEntry(f"not a freshline entry: {raw[:40]!r}")
    try:
        version, computed_at_ms, values = orjson.loads(raw[HEADER:])
        watermark = int(raw[1:HEADER], 16)
    except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
        raise CorruptEntry(f"entry does not decode: {exc}") from exc
    if version != schema_version:
        raise SchemaVersionMismatch(schema_version, version)
    if len(values) != len(fields):
        raise CorruptEntry(f"entry has {len(values)} values, schema has {len(fields)} fields")
    return Entry(dict(zip(fields, values, strict=True)), version, computed_at_ms, watermark)
