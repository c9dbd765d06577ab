"""Choosing a threshold: hit rate and false-hit rate on labelled prompt pairs.

A pair is two prompts and a label: ``paraphrase`` (one cached answer serves both) or
``different`` (it must not). At a threshold, a pair "hits" when the cache would serve
one prompt's entry for the other: exact cosine similarity at or above it and, as the
cache checks, the same numbers and names in both
(:func:`freshline.pipeline.semantic.entry.literals_match`).
The hit rate is over the paraphrases, the false-hit rate over the different pairs.

The shipped set (``pipeline/semantic/data/pairs.json``, 360 pairs written for
freshline) holds customer-support and fraud-operations questions; a third of its
"different" pairs differ in one order number, amount, card, transaction id or name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.semantic.embed import Embedder
from freshline.pipeline.semantic.entry import literals_match

PAIRS = Path(__file__).resolve().parent / "data" / "pairs.json"
HOLDOUT = PAIRS.parent / "pairs-holdout.json"
"""A second set (336 pairs), written apart from :data:`PAIRS` and never used to fit a
prior: other domains and intents, hard negatives that differ in a name or share most
words (upgrade / downgrade). ``bench/semantic.py`` measures on both."""
THRESHOLDS = tuple(round(0.85 + i / 100, 2) for i in range(13))
LABELS = ("paraphrase", "different")


class InvalidPairs(FreshlineError):
    """A labelled set that is not a list of ``{"a", "b", "label"}`` pairs."""


@dataclass(frozen=True, slots=True)
class Pair:
    a: str
    b: str
    label: str
    kind: str = ""


@dataclass(frozen=True, slots=True)
class Row:
    threshold: float
    hit_rate: float
    false_hit_rate: float
    false_hits: int
    unguarded_false_hit_rate: float
    """The false-hit rate on similarity alone, without the numbers check."""


def load_pairs(path: Path = PAIRS) -> list[Pair]:
    """Pairs from a JSON file: a list, or an object with ``"pairs"``."""
    try:
        doc: Any = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise InvalidPairs(f"cannot read {path}: {exc.strerror}") from exc
    except orjson.JSONDecodeError as exc:
        raise InvalidPairs(f"{path} is not JSON: {exc}") from exc
    items = doc.get("pairs") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise InvalidPairs(f"{path}: expected a non-empty list of pairs")
    pairs: list[Pair] = []
    for n, item in enumerate(items):
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("a"), str)
            or not isinstance(item.get("b"), str)
            or item.get("label") not in LABELS
        ):
            raise InvalidPairs(
                f'{path}: pair {n} is not {{"a": str, "b": str, '
                f'"label": "paraphrase" | "different"}}'
            )
        pairs.append(Pair(item["a"], item["b"], item["label"], str(item.get("kind", ""))))
    return pairs


def similarities(embedder: Embedder, pairs: list[Pair]) -> np.ndarray:
    """Each pair's cosine similarity, embedding every prompt once in one batch."""
    texts = sorted({p.a for p in pairs} | {p.b for p in pairs})
    where = {t: i for i, t in enumerate(texts)}
    vectors = embedder.embed(texts).astype(np.float64)
    a = vectors[[where[p.a] for p in pairs]]
    b = vectors[[where[p.b] for p in pairs]]
    out: np.ndarray = np.einsum("ij,ij->i", a, b) / (
        np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    )
    return out


def sweep(
    pairs: list[Pair], sims: np.ndarray, thresholds: tuple[float, ...] = THRESHOLDS
) -> list[Row]:
    """Hit and false-hit rates at each threshold (module docstring)."""
    same = np.array([p.label == "paraphrase" for p in pairs])
    guard = np.array([literals_match(p.a, p.b) for p in pairs])
    if not same.any() or same.all():
        raise InvalidPairs("the set needs both paraphrase and different pairs")
    rows: list[Row] = []
    for t in thresholds:
        above = sims >= t - 1e-12
        hits = above & guard
        rows.append(
            Row(
                t,
                float(hits[same].mean()),
                float(hits[~same].mean()),
                int(hits[~same].sum()),
                float(above[~same].mean()),
            )
        )
    return rows


def false_hits(pairs: list[Pair], sims: np.ndarray, threshold: float) -> list[tuple[Pair, float]]:
    """The different pairs the cache would confuse at ``threshold``."""
    return [
        (p, float(s))
        for p, s in zip(pairs, sims, strict=True)
        if p.label == "different" and s >= threshold and literals_match(p.a, p.b)
    ]
