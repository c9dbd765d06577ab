"""A batch answer spliced from the stored bytes, for a batch of one feature set's hits.

The API answers each entity with its values by field name::

    {"feature_set": ..., "entity": ..., "values": {"f1": v1, ...}, "hit": true,
     "source": "hit", "age_ms": ..., "schema_version": ...}

Decoding every entry and encoding the answer again (:func:`pipeline.core.codec.decode_rows`,
then orjson) costs more than the rest of a batch request. When every entry of the
batch is a hit whose values are JSON scalars (numbers, booleans, null: every feature
set's fields today), the values' JSON text is already in the stored entry, in field
order: :func:`hits_body` checks the entries as :func:`decode_rows` does and copies
each value's text into a template of the answer, which makes the same bytes as
decoding and encoding would (orjson wrote the entries, and writes a number the same
way again). Anything else (a miss, a tombstone, an entry below its floor, a string or
nested value, whitespace, an entry that does not parse or has another schema version
or field count) returns ``None``: the caller then decodes as before, which answers
misses and raises :class:`pipeline.core.errors.CorruptEntry` where it always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import NamedTuple, cast

import orjson

from pipeline.core.codec import HEADER

_first, _second, _third = itemgetter(0), itemgetter(1), itemgetter(2)
_NOT_SPLICED = (b'"', b"{", b"\\", b" ", b"\t", b"\n", b"\r")


class Spliced(NamedTuple):
    """A batch answer's body, and each entry's ``computed_at_ms`` (for XFetch)."""

    body: bytes
    computed_at_ms: list[int]


def _literal(value: object) -> bytes:
    """``value`` as orjson writes it, safe inside a %-template."""
    return orjson.dumps(value).replace(b"%", b"%%")


def item_template(feature_set: str, fields: Sequence[str], schema_version: int) -> bytes:
    """One hit's answer, with ``%b`` for the entity and each value and ``%d`` for its age."""
    values = b",".join(_literal(f) + b":%b" for f in fields)
    return (b'{"feature_set":' + _literal(feature_set) + b',"entity":"%b","values":{'
            + values + b'},"hit":true,"source":"hit","age_ms":%d,"schema_version":'
            + _literal(schema_version) + b"}")


def hits_body(template: bytes, width: int, schema_version: int, entities: Sequence[str],
              raws: Sequence[bytes | str | None], floor: bytes | str | None,
              now_ms: int) -> Spliced | None:
    """``{"schema_version": v, "items": [...]}`` for ``entities``, whose entries are
    ``raws`` (one feature set's, ``width`` fields, ``template`` from
    :func:`item_template`), or ``None`` unless every one is a plain hit (see the
    module docstring)."""
    n = len(raws)
    if n == 0 or n != len(entities) or set(map(type, raws)) != {bytes}:
        return None  # a miss (None), or a client that decodes replies (str)
    entries = cast(Sequence[bytes], raws)
    blob = b",".join(entries)
    # No string, object or whitespace, and two "[" per entry: no value is a list.
    if any(c in blob for c in _NOT_SPLICED) or blob.count(b"[") != 2 * n:
        return None
    try:
        # The checks of decode_rows, on one parse of them all.
        parsed = orjson.loads(b"[" + b",".join([r[HEADER:] for r in entries]) + b"]")
        if (set(map(len, parsed)) != {3} or set(map(_first, parsed)) != {schema_version}
                or set(map(len, map(_third, parsed))) != {width}):
            return None
    except (orjson.JSONDecodeError, TypeError):
        return None  # not JSON, or an entry that is not [version, computed_at, values]
    computed = list(map(_second, parsed))
    if set(map(type, computed)) != {int}:
        return None
    # Scalars only and no whitespace: each entry's text is exactly
    # 1<watermark>[<version>,<computed_at>,[<v1>,...,<vn>]], so its n + 2 pieces
    # between commas are the head, computed_at, "[" v1, v2... and vn "]]".
    tokens = blob.split(b",")
    step = width + 2
    if len(tokens) != step * n:
        return None
    heads = tokens[0::step]
    joined = b"".join(heads)
    size = HEADER + 1 + len(str(schema_version))
    if (len(joined) != size * n or joined[0::size] != b"1" * n
            or joined[HEADER::size] != b"[" * n):
        return None  # a tag other than an entry's, or a version written otherwise
    if floor is not None:
        if isinstance(floor, str):
            floor = floor.encode()
        # Every head has the same length, tag and version: the least is the oldest.
        if min(heads)[1:HEADER] < floor:
            return None  # below the truncate floor: a miss, decoded as such
    ids = ",".join(entities).encode()
    if not ids.isascii() or b'"' in ids or b"\\" in ids:
        return None
    id_list = ids.split(b",")
    if len(id_list) != n:
        return None
    # The template's arguments, item after item: the id, the values, the age; filled
    # a column at a time (C-level slice assignments). The first and last values are
    # cut from their "[" and "]]" on one join of their column each ("[v1,[v1,..." and
    # "vn]],vn]],...": no value holds "[" or "]").
    per = width + 2
    args: list[bytes | int] = [b""] * (per * n)
    args[0::per] = id_list
    if width == 1:  # "[v1]]"
        args[1::per] = [t[1:-2] for t in tokens[2::step]]
    else:
        args[1::per] = b",".join(tokens[2::step])[1:].split(b",[")
        for j in range(1, width - 1):
            args[1 + j::per] = tokens[2 + j::step]
        args[width::per] = b",".join(tokens[step - 1::step])[:-2].split(b"]],")
    args[per - 1::per] = [now_ms - c if now_ms > c else 0 for c in computed]
    items = b",".join([template] * n) % tuple(args)
    return Spliced(b'{"schema_version":' + orjson.dumps(schema_version) + b',"items":['
                   + items + b"]}", computed)
