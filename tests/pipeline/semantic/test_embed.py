"""The local embedding model: whole vectors against stored ones, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from freshline.pipeline.semantic.embed import MiniLM, local_model

# Texts without a special-token literal ([CLS], [SEP], [UNK], [PAD], [MASK]): accents,
# punctuation, CJK and Hangul, an emoji, control whitespace, long words split into
# pieces, and one past 256 tokens (truncated).
SENTENCES = [
    "This is an example sentence",
    "Where is my refund for order 68517?",
    "Héllo, Wörld! Ça va? naïve café résumé",
    "The card ending 4242 was declined at 03:14 UTC; retry limit: 3/5.",
    "東京の天気はどうですか 北京 and mixed 한국어 text",
    "emoji 🙂 and tabs\tand\nnewlines   with   spaces",
    "unbelievably antidisestablishmentarianism hyperparameterisation",
    " ".join(f"word{i} refund order" for i in range(120)),
]
# MiniLM.embed(SENTENCES), one batch, as computed by the hand-written WordPiece
# tokenizer and safetensors reader that the libraries replaced.
REFERENCE = Path(__file__).parent / "data" / "minilm_reference.npy"


@pytest.fixture(scope="module")
def model() -> MiniLM:
    return local_model()


@pytest.mark.slow  # embeds with the local model
def test_vectors_equal_the_stored_reference(model: MiniLM) -> None:
    expected = np.load(REFERENCE)
    assert expected.shape == (len(SENTENCES), 384) and expected.dtype == np.float32
    vectors = model.embed(SENTENCES)
    assert vectors.shape == expected.shape and vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=1e-6)


def test_special_token_literals_are_read_as_those_tokens(model: MiniLM) -> None:
    # As tokenizers, and so sentence-transformers, read them: one token each, not the
    # pieces of "[", "cls", "]". Lower case is text.
    def ids(text: str) -> list[int]:
        return list(model.tokenizer.encode(text).ids)

    cls, sep, unk, pad, mask = (
        model.tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[UNK]", "[PAD]", "[MASK]")
    )
    assert ids("[CLS] literal")[:2] == [cls, cls]
    assert ids("an [UNK] token") == [cls, ids("an")[1], unk, ids("token")[1], sep]
    assert ids("[PAD][PAD] padded")[1:3] == [pad, pad]
    assert ids("[SEP] and [MASK]") == [cls, sep, ids("and")[1], mask, sep]
    assert ids("[cls] literal")[1:5] == ids("[ cls ] literal")[1:5]
    assert cls not in ids("[cls] literal")[1:]
    # A literal [PAD] is a real token: it counts in the mean, unlike padding.
    padded = model.embed(["[PAD] refund"])[0]
    assert not np.allclose(padded, model.embed(["refund"])[0], atol=1e-3)


def test_texts_are_cut_at_256_tokens(model: MiniLM) -> None:
    long = SENTENCES[-1]
    assert len(model.tokenizer.encode(long).ids) == 256
    np.testing.assert_allclose(
        model.embed([long]), model.embed([long + " and more words past the cut"]), atol=1e-6
    )
