"""Whether to serve an entry at a similarity: a per-entry estimate of the error, bounded.

For each candidate a lookup finds, :meth:`Learned.estimate` gives the probability that
serving it at the prompt's similarity ``s`` is wrong, from the entry's own labelled
outcomes and, until it has enough, the prior of the embedding model
(:mod:`freshline.pipeline.semantic.prior` describes the model: a ceiling ``u`` per entry,
``error(s) = rho * P(u >= s | outcomes)``). The cache serves only when that is at most
``max_error`` (δ, ``FRESHLINE_SEMANTIC_MAX_ERROR``).

The posterior over an entry's ceiling is exact on the prior's grid: every outcome
multiplies the ceilings below its similarity by one factor and the others by another
(a right answer at ``s`` says the ceiling is probably below ``s``, a wrong one that it
is probably not), so an entry's posterior is its prior times two counts per grid point.
An estimate costs a few microseconds, and entries without outcomes cost nothing: their
estimates are the prior's, computed once.

Exploration, the source of labels
---------------------------------
A lookup that would miss with a candidate at similarity ``s`` **explores** it with
probability ``P(u < s | outcomes)``: the chance that a ceiling drawn from the posterior
would call ``s`` safe (Thompson sampling). A miss costs the caller the model call
either way; an explored one also teaches the candidate whether ``s`` was safe, once
the caller stores the model's response. Candidates far below their ceiling are
explored rarely, those near the line often. A lookup that would serve is **audited**
(answered as a miss and explored) with probability ``audit * error(s) / δ``: never
deep inside the bound, at most ``audit`` (5%) at its edge. Audits measure the error of
what is served without waiting for flags, at the cost of a few hits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from freshline.pipeline.semantic.prior import GRID, STEP, Prior

_PER_STEP = round(1 / STEP)
_LAST = len(GRID) - 1
MAX_OUTCOMES = 64
"""Outcomes kept per entry, the newest: enough to place a ceiling, bounded in Redis."""
AUDIT = 0.05
_FORMAT = 1
_SCALE = 10_000  # similarities are kept to 4 decimals


@dataclass(frozen=True, slots=True)
class Outcomes:
    """An entry's labelled outcomes: the similarities and whether serving was right."""

    sims: np.ndarray
    right: np.ndarray

    def __len__(self) -> int:
        return len(self.sims)


EMPTY = Outcomes(np.zeros(0), np.zeros(0, dtype=bool))


def encode(outcomes: Outcomes) -> bytes:
    """``[1][uint16 ...]``: each outcome as its similarity in ten-thousandths (15
    bits) and whether it was right (the top bit), little-endian, oldest first. A
    right answer's similarity is rounded down and a wrong one's up: never in the
    direction that would serve more."""
    keep = slice(max(0, len(outcomes) - MAX_OUTCOMES), None)
    right = outcomes.right[keep]
    scaled = outcomes.sims[keep] * _SCALE
    rounded = np.where(right, np.floor(scaled + 1e-9), np.ceil(scaled - 1e-9))
    sims = np.clip(rounded, 0, _SCALE).astype(np.uint16)
    packed = sims | (right.astype(np.uint16) << 15)
    return bytes([_FORMAT]) + bytes(packed.astype("<u2").tobytes())


def decode(raw: bytes | None) -> Outcomes:
    """The outcomes :func:`encode` packed; none for a missing or unknown value."""
    if not raw or raw[0] != _FORMAT or len(raw) % 2 != 1:
        return EMPTY
    packed = np.frombuffer(raw, dtype="<u2", offset=1)
    return Outcomes((packed & 0x7FFF) / _SCALE, (packed >> 15).astype(bool))


def append(outcomes: Outcomes, similarity: float, right: bool) -> Outcomes:
    return Outcomes(np.append(outcomes.sims, similarity), np.append(outcomes.right, bool(right)))


@dataclass(frozen=True, slots=True)
class Estimate:
    """``error``: the probability that serving at this similarity is wrong;
    ``serve``: ``error <= max_error``; ``explore``: the probability of exploring
    (or, when ``serve``, of auditing); ``threshold``: the lowest similarity at which
    the entry is served now."""

    error: float
    serve: bool
    explore: float
    threshold: float


class Learned:
    """The per-entry decision under an error bound (module docstring)."""

    def __init__(self, prior: Prior, max_error: float, audit: float = AUDIT) -> None:
        if not 0 < max_error < 1:
            raise ValueError(f"max_error {max_error} is not in (0, 1)")
        self.prior = prior
        self.max_error = max_error
        self.audit = audit
        rho, eps = prior.near_miss_rate, prior.label_error
        self._rho = rho
        self._log_prior = np.log(prior.weights() + 1e-300)
        # Per outcome, by whether the grid ceiling is below its similarity:
        self._right = (np.log(1 - eps), np.log((1 - rho) * (1 - eps)))
        self._wrong = (np.log(eps), np.log(rho + (1 - rho) * eps))
        self._prior_tail = self._tail(prior.weights())
        self._prior_list: list[float] = self._prior_tail.tolist()
        self._floors: dict[float, int] = {}
        self.start = self._threshold(self._prior_tail)
        """The similarity a fresh entry is served at: the prior's threshold."""

    @property
    def name(self) -> str:
        return "learned"

    def floor(self, min_explore: float) -> float:
        """The lowest similarity at which an entry without outcomes is explored with at
        least ``min_explore``."""
        self.worth(EMPTY, 0.0, min_explore)
        j = self._floors[min_explore]
        return float(GRID[j]) if j < len(GRID) else 1.0

    def worth(self, outcomes: Outcomes, similarity: float, min_explore: float) -> bool:
        """Whether an entry at ``similarity`` could be served or explored with at least
        ``min_explore``: for one without outcomes (most candidates), a comparison."""
        if len(outcomes):
            est = self.estimate(outcomes, similarity)
            return est.serve or est.explore >= min_explore
        floor = self._floors.get(min_explore)
        if floor is None:  # the first grid point where the prior's explore reaches it
            ok = np.nonzero(np.asarray(self._prior_list) <= 1.0 - min_explore)[0]
            floor = self._floors[min_explore] = int(ok[0]) if len(ok) else len(GRID)
        return math.floor(similarity * _PER_STEP + 1e-9) >= floor

    def estimate(self, outcomes: Outcomes, similarity: float) -> Estimate:
        """Serve, explore or miss an entry with ``outcomes`` at ``similarity``."""
        if len(outcomes):
            tail = self._tail(self.posterior(outcomes)).tolist()
            threshold = self._threshold(np.asarray(tail))
        else:  # most candidates: the prior's, computed once
            tail, threshold = self._prior_list, self.start
        # P(u >= the grid point at or below s): conservative by up to one grid step,
        # and exactly what the threshold says (served at and above it).
        above = tail[min(_LAST, max(0, math.floor(similarity * _PER_STEP + 1e-9)))]
        error = self._rho * above
        serve = error <= self.max_error
        explore = self.audit * error / self.max_error if serve else 1.0 - above
        return Estimate(error, serve, min(1.0, explore), threshold)

    def estimate_both(self, own: Outcomes, pair: Outcomes, similarity: float) -> Estimate:
        """The estimate for serving an entry for a prompt, from the outcomes of its
        template pair (:func:`freshline.pipeline.semantic.entry.template_id`; the prior's until it
        has some) and the entry's own: the pair's, unless the entry's own say it is
        worse. An entry's own outcomes come from prompts of every template, so they
        only ever make it more careful (a flag stops it for every similar prompt);
        only a pair's may make it bolder, for prompts worded as the pair's were.
        Never their product: a label is in both, and counting it twice would make an
        entry surer than it is."""
        mine = self.estimate(pair, similarity)
        if not len(own):
            return mine
        theirs = self.estimate(own, similarity)
        return mine if mine.error >= theirs.error else theirs

    def threshold(self, outcomes: Outcomes) -> float:
        """The lowest similarity at which an entry with ``outcomes`` is served."""
        if not len(outcomes):
            return self.start
        return self._threshold(self._tail(self.posterior(outcomes)))

    def posterior(self, outcomes: Outcomes) -> np.ndarray:
        """The probability of each ceiling in :data:`GRID` given ``outcomes``."""
        n = len(GRID)
        # Outcome k is "above the ceiling" at grid points i < j_k.
        j = np.searchsorted(GRID, outcomes.sims, side="left")
        logp = self._log_prior.copy()
        for mask, (above, at_or_below) in (
            (outcomes.right, self._right),
            (~outcomes.right, self._wrong),
        ):
            counts = np.bincount(j[mask], minlength=n + 1)
            # how many of these outcomes lie above each grid ceiling i: sum of counts[i+1:]
            over = np.cumsum(counts[::-1])[::-1][1 : n + 1]
            logp += over * above + (int(mask.sum()) - over) * at_or_below
        p: np.ndarray = np.exp(logp - logp.max())
        out: np.ndarray = p / p.sum()
        return out

    def _tail(self, p: np.ndarray) -> np.ndarray:
        """``tail[j] = P(u >= GRID[j])``, with ``tail[len(GRID)] = 0``."""
        out: np.ndarray = np.append(np.cumsum(p[::-1])[::-1], 0.0)
        return out

    def _threshold(self, tail: np.ndarray) -> float:
        """The smallest grid similarity whose error is within the bound."""
        ok = np.nonzero(self._rho * tail <= self.max_error)[0]
        j = int(ok[0]) if len(ok) else len(GRID)
        return float(GRID[j]) if j < len(GRID) else 1.0
