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

from freshline.pipeline.core.errors import CorruptEntry, SchemaVersionMismatch
from freshline.pipeline.core.types import Entry, FeatureValues, Watermark

ENTRY_TAG = b"1"
TOMBSTONE_TAG = b"T"
WATERMARK_HEX = 30
HEADER = 1 + WATERMARK_HEX


def watermark_hex(watermark: Watermark) -> bytes:
    if watermark < 0 or watermark >= 1 << (4 * WATERMARK_HEX):
        raise ValueError(f"watermark out of range: {watermark}")
    return b"%030x" % watermark


def encode_entry(
    values: Sequence[Any], schema_version: int, computed_at_ms: int, watermark: Watermark
) -> bytes:
    body = orjson.dumps([schema_version, computed_at_ms, list(values)])
    return ENTRY_TAG + watermark_hex(watermark) + body


def encode_tombstone(watermark: Watermark) -> bytes:
    return TOMBSTONE_TAG + watermark_hex(watermark)


Row = tuple[FeatureValues, int, bytes]
"""A decoded entry's values (by field name), ``computed_at_ms`` and watermark (30 hex
digits, as stored: :func:`parse_watermark` reads it)."""

_ENTRY, _TOMBSTONE = ENTRY_TAG[0], TOMBSTONE_TAG[0]


def decode_rows(
    raws: Sequence[bytes | str | None],
    fields: Sequence[str],
    schema_version: int,
    floor: bytes | str | None = None,
) -> list[Row | None]:
    """Decode the entries of one feature set, as :func:`decode_entry` does each, in one loop.

    ``None`` where a value is missing, a tombstone, or below ``floor`` (the feature
    set's truncate floor, 30 hex digits, when it has one). Raises as
    :func:`decode_entry` does on a foreign or corrupt entry.
    """
    if isinstance(floor, str):
        floor = floor.encode()
    loads = orjson.loads
    width = len(fields)
    out: list[Row | None] = []
    append = out.append
    for reply in raws:
        if reply is None:
            append(None)
            continue
        raw = reply.encode() if isinstance(reply, str) else reply
        tag = raw[0] if len(raw) > HEADER else None
        if tag != _ENTRY:
            if raw[:1] == TOMBSTONE_TAG:
                append(None)
                continue
            raise CorruptEntry(f"not a freshline entry: {raw[:40]!r}")
        try:
            version, computed_at_ms, values = loads(raw[HEADER:])
        except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
            raise CorruptEntry(f"entry does not decode: {exc}") from exc
        if version != schema_version:
            raise SchemaVersionMismatch(schema_version, version)
        if type(values) is not list or len(values) != width:
            raise CorruptEntry(f"entry has {values!r:.80} as values, schema has {width} fields")
        if type(computed_at_ms) is not int:
            raise CorruptEntry(f"entry's computed_at is {computed_at_ms!r:.40}")
        watermark = raw[1:HEADER]
        if floor is not None and watermark < floor:
            append(None)  # computed before a truncate of its source: void
            continue
        # The length was checked: a strict zip would only cost time.
        append((dict(zip(fields, values, strict=False)), computed_at_ms, watermark))
    return out


def parse_watermark(hex_watermark: bytes) -> Watermark:
    """A :data:`Row`'s watermark as a number; raises :class:`CorruptEntry` if it is not one."""
    try:
        return int(hex_watermark, 16)
    except ValueError as exc:
        raise CorruptEntry(f"entry's watermark is not hex: {hex_watermark!r}") from exc


def decode_entry(raw: bytes, fields: Sequence[str], schema_version: int) -> Entry | None:
    """Decode ``raw``; ``None`` for a tombstone. Raises on a foreign or corrupt entry."""
    [row] = decode_rows([raw], fields, schema_version)
    if row is None:
        return None
    return Entry(row[0], schema_version, row[1], parse_watermark(row[2]))
