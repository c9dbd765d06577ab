"""A cached response as one Redis string, and the checks a candidate must pass.

Encoding::

    byte 0        format version, 1
    bytes 1-4     length n of the JSON header, uint32 little-endian
    bytes 5..     the header: {"prompt", "response", "created_at_ms", "params"}
    rest          the prompt's unit vector, float32 little-endian

``params`` is the digest of the generation parameters (:func:`params_digest`): a
response generated with another temperature, ``seed``, ``max_tokens`` or ``stop`` is
never served.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.semantic.embed import Vectors

FORMAT_VERSION = 1


class CorruptSemanticEntry(FreshlineError):
    """Bytes under a semantic key that do not decode as an entry."""


class InvalidPrompt(FreshlineError, ValueError):
    """A prompt, response or request the cache cannot take (empty, not text, too long)."""


@dataclass(frozen=True, slots=True)
class Entry:
    prompt: str
    response: str
    created_at_ms: int
    params: str
    vector: Vectors


def entry_id(prompt: str) -> int:
    """The id of a prompt in its namespace: 63 bits of BLAKE2b of its text.

    Storing the same prompt again replaces its entry instead of adding a twin.
    """
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def params_digest(params: dict[str, Any]) -> str:
    """A digest of the parameters that shape a response.

    ``deterministic`` is a claim about the backend, not a parameter, so it is left
    out; the temperature counts as a float (``0`` and ``0.0`` are one).
    """
    rest = {k: v for k, v in params.items() if k != "deterministic"}
    if isinstance(rest.get("temperature"), int | float):
        rest["temperature"] = float(rest["temperature"])
    return hashlib.blake2b(
        orjson.dumps(rest, option=orjson.OPT_SORT_KEYS), digest_size=8
    ).hexdigest()


def encode(entry: Entry) -> bytes:
    header = orjson.dumps(
        {
            "prompt": entry.prompt,
            "response": entry.response,
            "created_at_ms": entry.created_at_ms,
            "params": entry.params,
        }
    )
    vector = np.ascontiguousarray(entry.vector, dtype="<f4").tobytes()
    return bytes([FORMAT_VERSION]) + struct.pack("<I", len(header)) + header + vector


def decode(raw: bytes) -> Entry:
    try:
        if raw[0] != FORMAT_VERSION:
            raise ValueError(f"format version {raw[0]}")
        (size,) = struct.unpack_from("<I", raw, 1)
        header = orjson.loads(raw[5 : 5 + size])
        vector = np.frombuffer(raw, dtype="<f4", offset=5 + size).astype(np.float32)
        return Entry(
            header["prompt"],
            header["response"],
            int(header["created_at_ms"]),
            header["params"],
            vector,
        )
    except (
        IndexError,
        ValueError,
        KeyError,
        TypeError,
        struct.error,
        orjson.JSONDecodeError,
    ) as exc:
        raise CorruptSemanticEntry(f"not a semantic cache entry: {exc}") from exc


def vector_bytes(raw: bytes | None, dim: int) -> bytes | None:
    """The vector's bytes at the end of an encoded entry, or None when ``raw`` is not
    an entry with a ``dim``-wide vector. Parses no JSON: index builds read millions."""
    if not raw or raw[0] != FORMAT_VERSION or len(raw) < 5:
        return None
    (size,) = struct.unpack_from("<I", raw, 1)
    if len(raw) - 5 - size != 4 * dim:
        return None
    return raw[5 + size :]


_LITERAL = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[^\W\d_][\w'\u2019-]*")
_SENTENCE = re.compile(r"[^.!?:;\n]+")
_POSSESSIVE = re.compile(r"['\u2019]s?$")
_NOT_NAMES = frozenset({"i", "i'm", "i've", "i'd", "i'll"})
_CACHED_CHARS = 2000
"""Prompts up to this long have their parts remembered (:func:`_parts`): a cached
entry's prompt is checked on every lookup it is a candidate for."""


@dataclass(frozen=True, slots=True)
class _Parts:
    numbers: tuple[str, ...]
    names: frozenset[str]
    words: frozenset[str]
    template_id: int


def _plain(word: str) -> str:
    return _POSSESSIVE.sub("", word.replace("\u2019", "'")).casefold()


def _split(text: str) -> _Parts:
    found: set[str] = set()
    if text != text.lower():
        for sentence in _SENTENCE.findall(text):
            for word in _WORD.findall(sentence)[1:]:  # the opening word is capitalised anyway
                if word != word.lower() and _plain(word) not in _NOT_NAMES:
                    found.add(_plain(word))
    words = frozenset(_plain(w) for w in _WORD.findall(text)) if found else frozenset()
    masked = _LITERAL.sub("#", text)
    if found:
        masked = _WORD.sub(lambda m: "@" if _plain(m.group()) in found else m.group(), masked)
    return _Parts(
        tuple(sorted(_LITERAL.findall(text))),
        frozenset(found),
        words,
        entry_id("\x00template\x00" + masked),
    )


_split_cached = functools.lru_cache(maxsize=4096)(_split)


def _parts(text: str) -> _Parts:
    return _split_cached(text) if len(text) <= _CACHED_CHARS else _split(text)


def literals(text: str) -> Counter[str]:
    """The numbers in a prompt (order ids, amounts, dates' digits), as a multiset."""
    return Counter(_LITERAL.findall(text))


def names(text: str) -> frozenset[str]:
    """The capitalised words inside a prompt's sentences, case-folded: names of
    people, places, products, plans (``Li Wei``, ``Lisbon``, ``iPhone``, ``VAT``).
    The word that opens a sentence is left out (it is capitalised anyway), a
    possessive ``'s`` is dropped, and "I" and its contractions are not names."""
    return _parts(text).names


def names_match(a: str, b: str) -> bool:
    """True when every name in one prompt (:func:`names`) is a word of the other, in
    any case and anywhere (so a name that opens one phrasing still matches).
    "Where is Li Wei's card?" and "Li Wei's card: where is it?" match; "... Lu Wei's
    card?" does not."""
    p, q = _parts(a), _parts(b)
    return _names_within(p, b, q) and _names_within(q, a, p)


def _names_within(p: _Parts, other: str, q: _Parts) -> bool:
    if not p.names:
        return True
    words = q.words or frozenset(_plain(w) for w in _WORD.findall(other))
    return p.names <= words


def literals_match(a: str, b: str) -> bool:
    """True when two prompts hold the same numbers and the same names.

    Embeddings place "refund for order 123" and "... order 124" closer than many true
    paraphrases, so similarity alone cannot tell them apart; the numbers can. Names
    are the same case: "Li Wei" and "Lu Wei", "Lisbon" and "Porto" sit at 0.87-0.95,
    above most paraphrases (:func:`names_match`). A name written in lower case in both
    prompts is not seen as one.
    """
    p, q = _parts(a), _parts(b)
    return p.numbers == q.numbers and _names_within(p, b, q) and _names_within(q, a, p)


def template_id(text: str) -> int:
    """The id of a prompt's template: the prompt with its numbers as ``#`` and its
    names (:func:`names`) as ``@``, what entries that differ only in their entities
    have in common. Outcomes are kept per pair of templates, the cached entry's and
    the prompt's (:mod:`freshline.pipeline.semantic.feedback`): every entry and prompt with those
    two shares them, whatever their numbers and names (which the checks make equal),
    so "move account 14205 up" served for "... down" teaches every account."""
    return _parts(text).template_id


def cosine(a: Vectors, b: Vectors) -> float:
    """Exact cosine similarity, in float64."""
    x = a.astype(np.float64)
    y = b.astype(np.float64)
    den = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y) / den if den > 0 else 0.0
