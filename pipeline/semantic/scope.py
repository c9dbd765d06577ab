"""The semantic cache's vocabulary: who asks (:class:`Scope`), what a lookup, a store
and a flag answer, and which generations may be cached at all.

Only deterministic generations: ``params["temperature"] == 0``, or
``params["deterministic"] is True`` (a seeded, pinned backend that says so). Anything
else is refused with :class:`NonDeterministicParams`, on lookup as on store: a
sampled response served again is not what the caller asked for.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.keys import (
    semantic_namespace,
)
from freshline.pipeline.semantic.entry import (
    InvalidPrompt,
)

_HEX16 = re.compile(r"[0-9a-fA-F]{16}")


class NonDeterministicParams(FreshlineError):
    """A generation that may differ for the same prompt: never stored nor served."""


class EntryOverBudget(FreshlineError):
    """A store that could never fit its tenant's budget: one entry (or the batch)
    costs more bytes, or is more entries, than the whole budget holds."""

    def __init__(self, cost: int, entries: int, max_bytes: int, max_keys: int) -> None:
        super().__init__(
            f"{entries} entries of {cost:,} bytes (prompts, responses, vectors and "
            f"Redis's overhead) over the tenant's budget of {max_keys:,} entries and "
            f"{max_bytes:,} bytes"
        )
        self.cost = cost
        self.entries = entries
        self.max_bytes = max_bytes
        self.max_keys = max_keys


@dataclass(frozen=True, slots=True)
class Scope:
    """Who asks and for what: the parts of a namespace."""

    tenant: str
    model: str
    model_version: str
    template_version: str

    @property
    def namespace(self) -> str:
        return semantic_namespace(
            self.tenant, self.model, self.model_version, self.template_version
        )


@dataclass(frozen=True, slots=True)
class Lookup:
    """A lookup's answer. ``response`` is None on a miss.

    ``similarity`` is the served entry's exact cosine similarity (on a miss, the best
    candidate's, or None without one); ``lookup_s`` excludes ``embed_s``. ``warming``:
    a miss because this process's index of the namespace is still being built.
    ``threshold`` is the similarity the deciding entry is served at (with a learned
    decision, that entry's own; without a candidate, a fresh entry's).
    ``candidate_id``: on an exploration, the entry the caller's store will label
    (``audit``: one that would have been served). ``estimated_error``: the served (or
    explored) entry's estimated error.
    """

    hit: bool
    response: str | None
    similarity: float | None
    age_ms: int | None
    entry_id: str | None
    threshold: float
    embed_s: float
    lookup_s: float
    warming: bool = False
    candidate_id: str | None = None
    estimated_error: float | None = None
    audit: bool = False


@dataclass(frozen=True, slots=True)
class Stored:
    """``agreed``: when the store answered an exploration, whether the model's
    response was the candidate's (None otherwise)."""

    entry_id: str
    embed_s: float
    agreed: bool | None = None


@dataclass(frozen=True, slots=True)
class Flagged:
    """A flag's effect: the entry removed, or a wrong outcome recorded for it at
    ``similarity`` (then ``threshold`` is the similarity it is served at now)."""

    removed: bool
    similarity: float | None = None
    threshold: float | None = None


def parse_entry_id(entry: object) -> int:
    """An entry id as the caller sent it (16 hex digits, any case) as a number."""
    if not isinstance(entry, str) or _HEX16.fullmatch(entry) is None:
        raise InvalidPrompt(f"entry id {entry!r} is not 16 hex digits")
    return int(entry, 16)


def check_deterministic(params: Mapping[str, Any]) -> None:
    """Raise :class:`NonDeterministicParams` unless the generation is deterministic."""
    if not isinstance(params, Mapping):
        raise NonDeterministicParams('params must be an object such as {"temperature": 0}')
    declared = params.get("deterministic")
    if declared is not None and not isinstance(declared, bool):
        raise NonDeterministicParams("params.deterministic must be true or false")
    if declared is True:
        return
    temperature = params.get("temperature")
    if temperature is None:
        raise NonDeterministicParams(
            "params.temperature is required: only temperature 0 (or params.deterministic "
            "= true) responses are cached"
        )
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise NonDeterministicParams(f"params.temperature {temperature!r} is not a number >= 0")
    if temperature != 0:
        raise NonDeterministicParams(
            f"temperature {temperature:g} is not deterministic: only temperature 0 (or "
            "params.deterministic = true) responses are cached; call the model directly"
        )
