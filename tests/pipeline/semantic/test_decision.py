"""The per-entry decision under an error bound, and the prior it starts from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from freshline.pipeline.semantic import decision, prior
from freshline.pipeline.semantic.decision import EMPTY, MAX_OUTCOMES, Learned, Outcomes
from freshline.pipeline.semantic.embed import local_model
from freshline.pipeline.semantic.tune import load_pairs, similarities

MINILM = prior.shipped("all-MiniLM-L6-v2")


@pytest.fixture
def learned() -> Learned:
    assert MINILM is not None
    return Learned(MINILM, max_error=0.02)


def outcomes(*labelled: tuple[float, bool]) -> Outcomes:
    out = EMPTY
    for s, right in labelled:
        out = decision.append(out, s, right)
    return out


def test_a_fresh_entry_serves_where_the_prior_bounds_the_error(learned: Learned) -> None:
    # The shipped prior starts MiniLM entries just above the highest near miss of the
    # shipped pairs (0.883), nowhere near the 0.93 fitted for another embedding model.
    assert 0.86 <= learned.start <= 0.9
    sims = np.arange(0.5, 1.0, 0.01)
    errors = [learned.estimate(EMPTY, float(s)).error for s in sims]
    assert errors == sorted(errors, reverse=True)  # more similar, less risk
    for s, error in zip(sims, errors, strict=True):
        est = learned.estimate(EMPTY, float(s))
        assert est.serve == (error <= 0.02) == (s >= learned.start - 1e-9)
        assert est.threshold == learned.start


def test_the_bound_is_the_setting(learned: Learned) -> None:
    assert MINILM is not None
    looser = Learned(MINILM, max_error=0.10)
    stricter = Learned(MINILM, max_error=0.005)
    assert stricter.start > learned.start > looser.start
    with pytest.raises(ValueError, match="max_error"):
        Learned(MINILM, max_error=0)


def test_right_answers_lower_an_entrys_threshold_and_wrong_ones_raise_it(
    learned: Learned,
) -> None:
    thresholds = [learned.threshold(outcomes(*[(0.80, True)] * n)) for n in range(5)]
    assert thresholds == sorted(thresholds, reverse=True)
    assert thresholds[0] == learned.start and thresholds[-1] <= 0.80
    # Now served at 0.80; a wrong answer at 0.82 puts the line back above it.
    four = outcomes(*[(0.80, True)] * 4)
    assert learned.estimate(four, 0.80).serve
    five = decision.append(four, 0.82, False)
    assert learned.threshold(five) > 0.82
    assert not learned.estimate(five, 0.80).serve and not learned.estimate(five, 0.82).serve
    # A fresh entry flagged at 0.90 is no longer served there, nor just above it.
    flagged = outcomes((0.90, False))
    assert learned.threshold(flagged) > 0.93
    assert not learned.estimate(flagged, 0.90).serve
    assert not learned.estimate(flagged, 0.92).serve


def test_one_label_never_settles_an_entry(learned: Learned) -> None:
    # Labels may be wrong (a differently worded answer, a mistaken flag): right answers
    # after a wrong one bring the entry back.
    after = outcomes((0.85, False), *[(0.86, True)] * 12)
    assert learned.estimate(after, 0.90).serve


def test_exploration_follows_the_posterior(learned: Learned) -> None:
    # A miss explores with the chance that the ceiling is below the similarity: rarely
    # far below the line, often near it.
    far, near = learned.estimate(EMPTY, 0.55), learned.estimate(EMPTY, 0.85)
    assert not far.serve and not near.serve
    assert far.explore < 0.1 < 0.8 < near.explore <= 1
    # A hit is audited at most 5% of the time, at the edge of the bound, and less inside.
    edge, inside = learned.estimate(EMPTY, learned.start), learned.estimate(EMPTY, 0.97)
    assert edge.serve and inside.serve
    assert 0 < inside.explore < edge.explore <= decision.AUDIT


def test_outcomes_pack_small_and_keep_the_newest() -> None:
    labelled = outcomes((0.8123, True), (0.5, False), (1.0, True))
    back = decision.decode(decision.encode(labelled))
    np.testing.assert_allclose(back.sims, [0.8123, 0.5, 1.0])
    assert back.right.tolist() == [True, False, True]
    many = outcomes(*[(i / 1000, i % 2 == 0) for i in range(200)])
    raw = decision.encode(many)
    assert len(raw) == 1 + 2 * MAX_OUTCOMES
    kept = decision.decode(raw)
    assert len(kept) == MAX_OUTCOMES and kept.sims[-1] == pytest.approx(0.199)
    assert len(decision.decode(None)) == 0 and len(decision.decode(b"\x09junk")) == 0
    # Rounded never toward serving more: a right answer down, a wrong one up.
    edges = decision.decode(decision.encode(outcomes((0.80999, True), (0.80001, False))))
    assert edges.sims.tolist() == [0.8099, 0.8001]


@pytest.mark.slow  # embeds every pair with the local model
def test_the_shipped_prior_is_the_fit_on_the_shipped_pairs() -> None:
    """`freshline semantic tune --write-prior` on the shipped pairs with the local model
    writes the shipped prior: it is reproducible, not a hand-set number."""
    assert MINILM is not None
    pairs = load_pairs()
    fitted = prior.fit("all-MiniLM-L6-v2", pairs, similarities(local_model(), pairs))
    assert fitted == MINILM
    assert (fitted.pairs, fitted.groups) == (272, 30)


def test_a_prior_names_its_embedding_model(tmp_path: Path) -> None:
    assert MINILM is not None
    assert prior.for_model("all-MiniLM-L6-v2") == MINILM
    with pytest.raises(prior.InvalidPrior, match="FRESHLINE_SEMANTIC_PRIOR"):
        prior.for_model("text-embedding-3-small")
    path = tmp_path / "prior.json"
    path.write_bytes(MINILM.to_json())
    with pytest.raises(prior.InvalidPrior, match="fitted for 'all-MiniLM-L6-v2'"):
        prior.for_model("text-embedding-3-small", str(path))
    path.write_bytes(b'{"embedding_model": "m", "mean": 2, "sd": 0.1}')
    with pytest.raises(prior.InvalidPrior, match="out of range"):
        prior.for_model("m", str(path))
