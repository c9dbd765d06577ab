"""What an entry's ceiling is believed to be before it has outcomes: a prior per
embedding model, calibrated on labelled pairs.

The model (:mod:`freshline.pipeline.semantic.decision` uses it)
------------------------------------------------------
Each cached entry has an unknown **ceiling** ``u``: the highest similarity at which a
prompt that is *not* a paraphrase of it (a near miss: same topic, another intent or
another name) still reaches it. Above its ceiling, serving the entry is right. At or
below it, a prompt is a near miss with probability ``near_miss_rate`` (rho). So serving
at similarity ``s`` is wrong with probability ``rho * P(u >= s)``. A label (an
exploration's comparison, a flag) is itself wrong with probability ``label_error``
(eps), so one label never settles an entry.

Before an entry has outcomes, ``u`` follows this prior: a normal distribution (mean,
standard deviation) on a grid of similarities from 0 to 1 in steps of
:data:`STEP`. Where it sits depends on the embedding model: all-MiniLM-L6-v2 puts
paraphrases at 0.4-0.96 and near misses at 0.06-0.88 on the shipped pairs, a larger
model elsewhere. So a prior names its model, and the cache refuses one fitted for
another.

Calibration (:func:`fit`)
-------------------------
rho and eps are assumptions, not fitted: rho = 0.5 says nothing about whether a prompt below
the ceiling is a near miss or a paraphrase, and eps = 0.05 leaves room for a response
worded differently and a mistaken flag. The mean and standard deviation maximise the
marginal likelihood of labelled pairs that pass the numbers check (the others are
never candidates), grouped by question: pairs whose ``kind`` starts with the same
question (``refund_status``, ``refund_status: one order number differs``,
``refund_status vs damaged_item``) share one ceiling, as the paraphrases and near
misses of one cached question would; pairs without a ``kind`` are grouped by their
first prompt. Pairs that differ only in a name are kept, though the names check
(:func:`freshline.pipeline.semantic.entry.names_match`) stops them too: they widen the prior,
so the names check is a margin the prior does not count on (fitted without them, the
prior narrows to a deviation of 0.02 and serves near misses at 3.5% on the stream of
``bench/paraphrases.py``). A grid search (mean 0.30-0.99, deviation 0.02-0.30, both in steps of
0.005) finds the maximum; the shipped prior for the local model is its result on the
shipped pairs (``freshline semantic tune --write-prior``).
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
    """The question a pair's outcomes belong to (module docstring)."""
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
    """The prior that maximises the grouped marginal likelihood (module docstring)."""
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
