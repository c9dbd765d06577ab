"""A batch answer spliced from the stored bytes, for a batch of one feature set's hits.

The API answers each entity with its values by field name::

    {"feature_set": ..., "entity": ..., "values": {"f1": v1, ...}, "hit": true,
     "source": "hit", "age_ms": ..., "schema_version": ...}

Decoding every entry and encoding the answer again
(:func:`freshline.pipeline.core.codec.decode_rows`,
then orjson) costs more than the rest of a batch request. When every entry of the
batch is a hit whose values are JSON scalars (numbers, booleans, null: every feature
set's fields today), the values' JSON text is already in the stored entry, in field
order: :class:`Splicer` checks the entries as :func:`decode_rows` does and copies
each value's text into a template of the answer, which makes the same bytes as
decoding and encoding would (orjson wrote the entries, and writes a number the same
way again). Anything else (a miss, a tombstone, an entry below its floor, a string or
nested value, whitespace, an entry that does not parse or has another schema version
or field count) returns ``None``: the caller then decodes as before, which answers
misses and raises :class:`freshline.pipeline.core.errors.CorruptEntry` where it always did.

A hot entity's entry is read again and again, unchanged until it is rewritten. A
:class:`Splicer` keeps, per stored entry's exact bytes, what the checks and the copy
made of it (its values as the answer's JSON object, and its ``computed_at_ms``): a
pure function of those bytes, so a hit needs a dictionary lookup, and only the
entries it has not seen are checked and cut, all together as before. It holds at
most ``max_entries`` (the oldest go first).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from operator import itemgetter
from typing import NamedTuple, cast

import orjson

from freshline.pipeline.core.codec import HEADER

_first, _second, _third = itemgetter(0), itemgetter(1), itemgetter(2)
_NOT_SPLICED = (b'"', b"{", b"\\", b" ", b"\t", b"\n", b"\r")


class Spliced(NamedTuple):
    """A batch answer's body, and each entry's ``computed_at_ms`` (for XFetch)."""

    body: bytes
    computed_at_ms: list[int]


def _literal(value: object) -> bytes:
    """``value`` as orjson writes it, safe inside a %-template."""
    return orjson.dumps(value).replace(b"%", b"%%")


def item_template(feature_set: str, schema_version: int) -> bytes:
    """One hit's answer, with ``%b`` for the entity and its values object, ``%d`` for
    its age."""
    return (
        b'{"feature_set":' + _literal(feature_set) + b',"entity":"%b","values":%b,'
        b'"hit":true,"source":"hit","age_ms":%d,"schema_version":' + _literal(schema_version) + b"}"
    )


def values_template(fields: Sequence[str]) -> bytes:
    """An entry's values as the answer's object, with ``%b`` for each value."""
    return b"{" + b",".join(_literal(f) + b":%b" for f in fields) + b"}"


class Splicer:
    """Batch answers of one feature set in one schema version; see the module docstring."""

    def __init__(
        self,
        feature_set: str,
        fields: Sequence[str],
        schema_version: int,
        *,
        max_entries: int = 20_000,
    ) -> None:
        self.width = len(fields)
        self.schema_version = schema_version
        self.max_entries = max_entries
        self._item = item_template(feature_set, schema_version)
        self._values = values_template(fields)
        self._head = b'{"schema_version":' + orjson.dumps(schema_version) + b',"items":['
        self._seen: dict[bytes, tuple[bytes, int]] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def body(
        self,
        entities: Sequence[str],
        raws: Sequence[bytes | str | None],
        floor: bytes | str | None,
        now_ms: int,
    ) -> Spliced | None:
        """``{"schema_version": v, "items": [...]}`` for ``entities``, whose entries are
        ``raws``, or ``None`` unless every one is a plain hit (module docstring)."""
        n = len(raws)
        if n == 0 or n != len(entities) or set(map(type, raws)) != {bytes}:
            return None  # a miss (None), or a client that decodes replies (str)
        entries = cast(Sequence[bytes], raws)
        seen = self._seen
        known = list(map(seen.get, entries))
        if None in known:
            fresh = [r for r, k in zip(entries, known, strict=True) if k is None]
            made = self._cut(fresh)
            if made is None:
                return None
            seen.update(zip(fresh, made, strict=True))
            if len(seen) > self.max_entries:  # (may drop some of these too)
                for old in list(itertools.islice(seen, len(seen) - self.max_entries)):
                    del seen[old]
            cut = iter(made)
            known = [next(cut) if k is None else k for k in known]
        pieces = cast(list[tuple[bytes, int]], known)
        if floor is not None:
            if isinstance(floor, str):
                floor = floor.encode()
            # Every entry was checked to be one (tag, 30 hex digits of watermark).
            if min(r[1:HEADER] for r in entries) < floor:
                return None  # below the truncate floor: a miss, decoded as such
        ids = ",".join(entities).encode()
        if not ids.isascii() or b'"' in ids or b"\\" in ids:
            return None
        id_list = ids.split(b",")
        if len(id_list) != n:
            return None
        computed = list(map(_second, pieces))
        args: list[bytes | int] = [b""] * (3 * n)
        args[0::3] = id_list
        args[1::3] = list(map(_first, pieces))
        args[2::3] = [now_ms - c if now_ms > c else 0 for c in computed]
        items = b",".join([self._item] * n) % tuple(args)
        return Spliced(self._head + items + b"]}", computed)

    def _cut(self, entries: Sequence[bytes]) -> list[tuple[bytes, int]] | None:
        """Each entry's values object and ``computed_at_ms``, checked as
        :func:`~freshline.pipeline.core.codec.decode_rows` checks them; ``None`` if one is not a
        plain entry of this set and version."""
        n, width, schema_version = len(entries), self.width, self.schema_version
        blob = b",".join(entries)
        # No string, object or whitespace, and two "[" per entry: no value is a list.
        if any(c in blob for c in _NOT_SPLICED) or blob.count(b"[") != 2 * n:
            return None
        try:
            # The checks of decode_rows, on one parse of them all.
            parsed = orjson.loads(b"[" + b",".join([r[HEADER:] for r in entries]) + b"]")
            if (
                set(map(len, parsed)) != {3}
                or set(map(_first, parsed)) != {schema_version}
                or set(map(len, map(_third, parsed))) != {width}
            ):
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
        if (
            len(joined) != size * n
            or joined[0::size] != b"1" * n
            or joined[HEADER::size] != b"[" * n
        ):
            return None  # a tag other than an entry's, or a version written otherwise
        # The values, entry after entry, filled a column at a time (C-level slice
        # assignments). The first and last are cut from their "[" and "]]" on one join
        # of their column each ("[v1,[v1,..." and "vn]],vn]],...": no value holds "[" or "]").
        values: list[bytes] = [b""] * (width * n)
        if width == 1:  # "[v1]]"
            values[0::1] = [t[1:-2] for t in tokens[2::step]]
        else:
            values[0::width] = b",".join(tokens[2::step])[1:].split(b",[")
            for j in range(1, width - 1):
                values[j::width] = tokens[2 + j :: step]
            values[width - 1 :: width] = b",".join(tokens[step - 1 :: step])[:-2].split(b"]],")
        objects = (b"\x00".join([self._values] * n) % tuple(values)).split(b"\x00")
        return list(zip(objects, computed, strict=True))
