"""What an entry's ceiling is believed to be before it has outcomes: a prior per
embedding model, calibrated on labelled pairs.

An entry's unknown **ceiling** is the highest similarity at which a near miss still
reaches it; before the entry has outcomes it follows this prior, a normal distribution
on a grid of :data:`STEP`, fitted per embedding model (:func:`fit`: the mean and
deviation that maximise the marginal likelihood of labelled pairs grouped by question;
``near_miss_rate`` and ``label_error`` are assumptions, not fitted).
:mod:`freshline.pipeline.semantic.decision` uses it.

The model, the calibration and why each assumption: docs/reading.md, "The prior on an
entry's ceiling, and its calibration".
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.semantic.entry import literals
from freshline.pipeline.semantic.tune import Pair

STEP = 0.005
GRID = np.round(np.arange(0.0, 1.0 + STEP / 2, STEP), 3)
"""The ceilings an entry may have: 0, 0.005, ..., 1."""

NEAR_MISS_RATE = 0.5
LABEL_ERROR = 0.05
DATA = Path(__file__).resolve().parent / "data"
"""Where the shipped priors are, one file per embedding model: ``prior-<model>.json``."""


class InvalidPrior(ConfigError):
    """A prior file that cannot be read, or one fitted for another embedding model."""


@dataclass(frozen=True, slots=True)
class Prior:
    """A normal prior on an entry's ceiling, and the model's two assumptions."""

    embedding_model: str
    mean: float
    sd: float
    near_miss_rate: float = NEAR_MISS_RATE
    label_error: float = LABEL_ERROR
    pairs: int = 0
    """How many labelled pairs (passing the numbers check) it was fitted on."""
    groups: int = 0

    def weights(self) -> np.ndarray:
        """The prior's probability of each ceiling in :data:`GRID`."""
        return normal_weights(self.mean, self.sd)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2)


def normal_weights(mean: float, sd: float) -> np.ndarray:
    logp = -0.5 * ((GRID - mean) / sd) ** 2
    p: np.ndarray = np.exp(logp - logp.max())
    out: np.ndarray = p / p.sum()
    return out


def load(path: Path) -> Prior:
    """A prior from its JSON file (:meth:`Prior.to_json`)."""
    try:
        doc: Any = orjson.loads(path.read_bytes())
        prior = Prior(
            str(doc["embedding_model"]),
            float(doc["mean"]),
            float(doc["sd"]),
            float(doc.get("near_miss_rate", NEAR_MISS_RATE)),
            float(doc.get("label_error", LABEL_ERROR)),
            int(doc.get("pairs", 0)),
            int(doc.get("groups", 0)),
        )
    except OSError as exc:
        raise InvalidPrior(f"cannot read the prior {path}: {exc.strerror}") from exc
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise InvalidPrior(f"{path} is not a prior: {exc}") from exc
    if not (
        0 < prior.sd <= 1
        and 0 <= prior.mean <= 1
        and 0 < prior.near_miss_rate <= 1
        and 0 < prior.label_error < 0.5
    ):
        raise InvalidPrior(f"{path}: a parameter is out of range: {prior}")
    return prior


def shipped(embedding_model: str) -> Prior | None:
    """The prior shipped for ``embedding_model``, or None."""
    path = DATA / f"prior-{embedding_model}.json"
    return load(path) if path.is_file() else None


def for_model(embedding_model: str, path: str = "") -> Prior:
    """The prior at ``path`` (``FRESHLINE_SEMANTIC_PRIOR``), else the one shipped for
    ``embedding_model``; :class:`InvalidPrior` when neither fits it."""
    prior = load(Path(path)) if path else shipped(embedding_model)
    if prior is None:
        raise InvalidPrior(
            f"no prior for the embedding model {embedding_model!r}: write one with "
            "`freshline semantic tune --write-prior FILE` on labelled pairs and set "
            "FRESHLINE_SEMANTIC_PRIOR=FILE, or set FRESHLINE_SEMANTIC_DECISION=static"
        )
    if prior.embedding_model != embedding_model:
        raise InvalidPrior(
            f"FRESHLINE_SEMANTIC_PRIOR {path} was fitted for {prior.embedding_model!r}, "
            f"not the embedding model in use, {embedding_model!r}"
        )
    return prior


def group_of(pair: Pair) -> str:
    """The question a pair's outcomes belong to (docs/reading.md)."""
    if pair.kind:
        return re.split(r": | vs |/", pair.kind, maxsplit=1)[0]
    return pair.a


def log_likelihoods(
    sims: np.ndarray, right: np.ndarray, near_miss_rate: float, label_error: float
) -> np.ndarray:
    """Each grid ceiling's log-likelihood of outcomes ``(sims[i], right[i])``."""
    rho, eps = near_miss_rate, label_error
    below = GRID[None, :] < sims[:, None]  # the ceiling is below s: serving is right
    good = np.where(below, np.log(1 - eps), np.log((1 - rho) * (1 - eps)))
    bad = np.where(below, np.log(eps), np.log(rho + (1 - rho) * eps))
    out: np.ndarray = np.where(right[:, None], good, bad).sum(axis=0)
    return out


def fit(embedding_model: str, pairs: list[Pair], sims: np.ndarray) -> Prior:
    """The prior that maximises the grouped marginal likelihood (docs/reading.md)."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        if literals(p.a) == literals(p.b):
            groups.setdefault(group_of(p), []).append(i)
    right = np.array([p.label == "paraphrase" for p in pairs])
    loglik = np.array(
        [
            log_likelihoods(sims[ix], right[ix], NEAR_MISS_RATE, LABEL_ERROR)
            for ix in groups.values()
        ]
    )
    best = (-np.inf, 0.0, 0.0)
    for sd in np.arange(0.02, 0.3001, STEP):
        for mean in np.arange(0.30, 0.9901, STEP):
            logp = np.log(normal_weights(float(mean), float(sd)) + 1e-300)
            total = float(np.logaddexp.reduce(loglik + logp, axis=1).sum())
            if total > best[0]:
                best = (total, float(mean), float(sd))
    _, mean, sd = best
    return Prior(
        embedding_model,
        round(mean, 3),
        round(sd, 3),
        pairs=sum(len(ix) for ix in groups.values()),
        groups=len(groups),
    )
