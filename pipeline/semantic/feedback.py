"""Labels without an LLM of freshline's own: explorations, their stores, and flags.

An **exploration** (:mod:`freshline.pipeline.semantic.decision`) answers a lookup with a miss
and the candidate it would have served; it is remembered as a probe in the
namespace's hash ``sem:x``, under the explored prompt's id, for
:data:`PROBE_TTL_MS`. The caller, having missed, asks its model and stores the
response, as it always does: that store takes the probe and compares the model's
response with the candidate's (:func:`same_response`); whether they agree is the
candidate's outcome at the probe's similarity, appended to ``sem:o`` (the newest
:data:`~freshline.pipeline.semantic.decision.MAX_OUTCOMES`). A **flag** with the prompt it was
served for is a wrong outcome at that prompt's similarity.

Each outcome is also kept for its **template pair** (the entry's prompt and the
explored one with numbers and names masked,
:func:`freshline.pipeline.semantic.entry.template`), in the namespace's hash :func:`pairs_key`:
the checks make numbers and names equal, so what was learned serving "move account
14205 down" for "... up" holds for every account. A lookup reads its prompt
template's pairs in its one round trip.

Bounds: a namespace holds at most :data:`MAX_PROBES` probes; a lookup that would
explore beyond that answers a plain miss. The probe hash expires
:data:`PROBE_TTL_MS` after its last write, and probes older than that are ignored, so
a full hash of forgotten probes stops explorations for at most that long. An entry's
outcomes live as long as entries do (``FRESHLINE_SEMANTIC_TTL_S`` from the last
outcome) and go with the entry when it is evicted, flagged away or purged.
"""

from __future__ import annotations

import re
import struct
import unicodedata
from dataclasses import dataclass
from typing import Any

import redis

from freshline.pipeline.core.keys import semantic_outcomes_key, semantic_probes_key
from freshline.pipeline.semantic.decision import Outcomes, decode, encode

PROBE_TTL_MS = 600_000
"""How long an exploration waits for its store: ten minutes of model call."""
MAX_PROBES = 10_000
"""Explorations awaiting their store, per namespace."""

MAX_PAIRS = 10_000
"""Prompt templates whose pairs' outcomes a namespace keeps (about: two stores at
once may each add one past it)."""
MAX_PAIRED = 32
"""Entry templates kept per prompt template, the most recently labelled."""
PAIRS_ID = 0
"""The outcomes key id of the namespace's template pairs: no prompt's entry id in
practice (ids are 63 bits of a hash)."""

_PROBE = struct.Struct("<QfBQ")


def pairs_key(namespace: str) -> str:
    """The namespace's hash of template-pair outcomes: a field per prompt template
    (:func:`freshline.pipeline.semantic.entry.template_id` in hex) holding the outcomes of each
    entry template it was labelled against (:func:`encode_pairs`), so a lookup reads
    its candidates' pairs with one ``HGET`` in its one round trip."""
    return semantic_outcomes_key(namespace, PAIRS_ID)


_PAIRED = struct.Struct("<QH")


def encode_pairs(pairs: dict[int, Outcomes]) -> bytes:
    """``[uint64 entry template][uint16 length][outcomes]...``, the newest
    :data:`MAX_PAIRED` (a dict's order: the last updated last)."""
    out = bytearray()
    for template, outcomes in list(pairs.items())[-MAX_PAIRED:]:
        raw = encode(outcomes)
        out += _PAIRED.pack(template, len(raw)) + raw
    return bytes(out)


def decode_pairs(raw: bytes | None) -> dict[int, Outcomes]:
    """What :func:`encode_pairs` packed; an unreadable tail is dropped."""
    pairs: dict[int, Outcomes] = {}
    at = 0
    while raw and at + _PAIRED.size <= len(raw):
        template, size = _PAIRED.unpack_from(raw, at)
        at += _PAIRED.size
        pairs[template] = decode(raw[at : at + size])
        at += size
    return pairs


# Set the probe unless the hash is full (a probe already there may be replaced), and
# the hash's TTL: one round trip, and the bound holds under concurrent lookups.
_WRITE_PROBE = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0
   and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""


@dataclass(frozen=True, slots=True)
class Probe:
    """An exploration awaiting its store: the candidate entry and the similarity."""

    candidate: int
    similarity: float
    audit: bool
    expires_ms: int
    params: str

    def encode(self) -> bytes:
        return (
            _PROBE.pack(self.candidate, self.similarity, self.audit, self.expires_ms)
            + self.params.encode()
        )

    @classmethod
    def decode(cls, raw: bytes) -> Probe | None:
        try:
            candidate, similarity, audit, expires_ms = _PROBE.unpack_from(raw)
            params = raw[_PROBE.size :].decode()
        except (struct.error, UnicodeDecodeError):
            return None
        return cls(candidate, float(similarity), bool(audit), expires_ms, params)


class Probes:
    """The namespaces' probes in Redis (module docstring)."""

    def __init__(self, client: redis.Redis, max_probes: int = MAX_PROBES) -> None:
        self.redis = client
        self.max_probes = max_probes
        self._write = client.register_script(_WRITE_PROBE)

    def put(self, namespace: str, prompt_id: int, probe: Probe) -> bool:
        """Remember ``probe`` for the prompt; False when the namespace is full."""
        written: Any = self._write(
            keys=[semantic_probes_key(namespace)],
            args=[f"{prompt_id:016x}", probe.encode(), self.max_probes, PROBE_TTL_MS],
        )
        return bool(written)

    def take_into(self, pipe: Any, namespace: str, prompt_ids: list[int]) -> None:
        """Add to ``pipe``: read the prompts' probes, then delete them (see :meth:`taken`)."""
        key = semantic_probes_key(namespace)
        fields = [f"{p:016x}" for p in prompt_ids]
        pipe.hmget(key, fields)
        pipe.hdel(key, *fields)

    @staticmethod
    def taken(reply: list[bytes | None], now_ms: int) -> list[Probe | None]:
        """The probes an ``HMGET`` of :meth:`take_into` read; expired ones as None."""
        out: list[Probe | None] = []
        for raw in reply:
            probe = Probe.decode(raw) if raw else None
            out.append(probe if probe is not None and probe.expires_ms > now_ms else None)
        return out


_SPACE = re.compile(r"\s+")


def normalise(response: str) -> str:
    """A response as compared: NFKC, case-folded, runs of whitespace as one space,
    without whitespace or final punctuation (``. ! ?``) at either end."""
    text = _SPACE.sub(" ", unicodedata.normalize("NFKC", response).casefold())
    return text.strip().rstrip(".!?").strip()


def same_response(model: str, cached: str) -> bool:
    """Whether the model's response to an explored prompt is the candidate's.

    Equal once normalised (:func:`normalise`), and nothing looser: an answer worded
    otherwise counts as a disagreement, which makes the entry more careful, never
    less. Embedding similarity of the two answers would be looser, and is no judge of
    "Yes, you can." against "No, you can't."
    """
    return normalise(model) == normalise(cached)
