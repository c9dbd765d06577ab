"""The model-side inference cache: predictions keyed by model version and rounded input.

A scoring service wraps its model with :class:`InferenceCache` and calls
:meth:`InferenceCache.predict` with a batch of input vectors. Each row is rounded to
``decimals``, made canonical and hashed (BLAKE2b) into its key under the model, its
version, the tenant and the arm; a batch is one ``MGET``, one ``model.predict`` of the
misses as given, and one pipeline of writes with a TTL, within the tenant's budget.

The digest step by step (for another language), the value's encoding and the order of
a batch: docs/reading.md, "The inference cache's keys and values".
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import redis

from freshline.pipeline.core.budget import TenantBudget
from freshline.pipeline.core.cluster import is_cluster, mget, scan_chunks
from freshline.pipeline.core.errors import ModelError
from freshline.pipeline.core.keys import inference_budget_keys, inference_pattern, inference_prefix

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CANONICAL_NAN = np.uint64(0x7FF8000000000000)
DIGEST_SIZE = 16

# dtype code -> little-endian dtype. Codes are part of the stored format: never reuse one.
_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype("<f8"),
    2: np.dtype("<f4"),
    3: np.dtype("<i8"),
    4: np.dtype("<i4"),
    5: np.dtype("<f2"),
    6: np.dtype("<i2"),
    7: np.dtype("i1"),
    8: np.dtype("<u8"),
    9: np.dtype("<u4"),
    10: np.dtype("<u2"),
    11: np.dtype("u1"),
    12: np.dtype("?"),
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

Array = npt.NDArray[Any]


class Model(Protocol):
    """What the cache needs from a model.

    ``predict`` takes a float array of shape ``(n, d)`` and returns one row per input:
    shape ``(n,)`` or ``(n, k)``. A model may also expose ``n_features: int``; inputs
    of another width are then refused before any lookup.
    """

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def deterministic(self) -> bool: ...

    def predict(self, x: Array, /) -> Array: ...


class InvalidInput(ModelError, ValueError):
    """Inputs the cache cannot key: not 2-D, not real numbers, or the wrong width."""


class NonDeterministicModel(ModelError):
    """A model whose output may differ for the same input; its predictions are not cached."""

    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = version
        super().__init__(
            f"model {name!r} version {version!r} is marked non-deterministic "
            "(deterministic=False); its predictions cannot be cached: call the model directly"
        )


@dataclass(frozen=True, slots=True)
class Predictions:
    """A batch answer: ``values[i]`` is the prediction for input row ``i``.

    ``hit[i]`` is True when row ``i`` was served from Redis, False when the model
    computed it in this call.
    """

    values: Array
    hit: npt.NDArray[np.bool_]
    model: str
    model_version: str

    def __len__(self) -> int:
        return int(self.hit.shape[0])


@dataclass(frozen=True, slots=True)
class Prediction:
    """One input's answer: ``value`` is the model's output row (0-d for a scalar)."""

    value: Array
    hit: bool
    model: str
    model_version: str


def canonical_rows(inputs: object, decimals: int) -> tuple[Array, Array]:
    """Validate ``inputs`` and return ``(original, canonical)``, both shaped ``(n, d)``.

    ``original`` is the caller's array (integers widened to float64), what the model
    sees; ``canonical`` is the rounded, sign- and NaN-normalised float64 array that is
    hashed (docs/reading.md, steps 1-4).
    """
    try:
        x = np.asarray(inputs)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"inputs are not a rectangular array of numbers: {exc}") from exc
    if x.dtype.kind not in "fiu":
        raise InvalidInput(f"inputs must be real numbers, got dtype {x.dtype}")
    if x.ndim != 2:
        raise InvalidInput(
            f"inputs must be 2-D with shape (n, d), got shape {x.shape}; "
            "use predict_one for a single vector"
        )
    if x.shape[1] == 0:
        raise InvalidInput("inputs have no features (d == 0)")
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    canon = np.array(x, dtype=np.float64, order="C", copy=True)
    scale = 10.0**decimals
    with np.errstate(over="ignore", invalid="ignore"):
        roundable = np.abs(canon) < (2.0**52 / scale)
        rounded = np.rint(canon * scale) / scale
        np.copyto(canon, rounded, where=roundable)
        canon += 0.0  # -0.0 + 0.0 == +0.0 under round-to-nearest
    bits = canon.view(np.uint64)
    bits[np.isnan(canon)] = CANONICAL_NAN
    return x, canon


def digests(canonical: Array, decimals: int) -> list[str]:
    """The hex BLAKE2b-128 digest of each canonical row (docs/reading.md, step 5)."""
    n, d = canonical.shape
    width = 8 + 8 * d
    buf = np.empty((n, width), dtype=np.uint8)
    buf[:, :8] = np.frombuffer(np.array([d, decimals], dtype="<u4").tobytes(), dtype=np.uint8)
    buf[:, 8:] = np.ascontiguousarray(canonical, dtype="<f8").view(np.uint8).reshape(n, 8 * d)
    view = buf.reshape(-1).data
    blake = hashlib.blake2b
    return [
        blake(view[i : i + width], digest_size=DIGEST_SIZE).hexdigest()
        for i in range(0, n * width, width)
    ]


def encode(row: npt.ArrayLike) -> bytes:
    """One output row as stored (its encoding: docs/reading.md)."""
    return encode_rows(np.asarray(row)[np.newaxis])[0]


def encode_rows(values: Array) -> list[bytes]:
    """Each row of a model's output (shape ``(n,)`` or ``(n, k)``) as stored."""
    code = _CODES.get(_little(values.dtype))
    if code is None or values.ndim not in (1, 2):
        raise ModelError(f"cannot cache predictions of dtype {values.dtype}, shape {values.shape}")
    if values.ndim == 1:
        header = bytes((FORMAT_VERSION, code, 0))
    else:
        header = bytes((FORMAT_VERSION, code, 1)) + int(values.shape[1]).to_bytes(4, "little")
    data = np.ascontiguousarray(values, dtype=_DTYPES[code]).tobytes()
    size = values.itemsize * (values.shape[1] if values.ndim == 2 else 1)
    return [header + data[i * size : (i + 1) * size] for i in range(values.shape[0])]


def decode(blob: bytes) -> Array | None:
    """The output row stored in ``blob``, or None if it is not a valid entry."""
    if len(blob) < 3 or blob[0] != FORMAT_VERSION or blob[1] not in _DTYPES:
        return None
    dtype = _DTYPES[blob[1]]
    if blob[2] == 0:
        if len(blob) != 3 + dtype.itemsize:
            return None
        return np.frombuffer(blob, dtype=dtype, offset=3).reshape(())
    if blob[2] != 1 or len(blob) < 7:
        return None
    width = int.from_bytes(blob[3:7], "little")
    if len(blob) != 7 + width * dtype.itemsize:
        return None
    return np.frombuffer(blob, dtype=dtype, offset=7)


def _little(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


class InferenceCache:
    """Caches a deterministic model's predictions in Redis, one key per input row.

    ``decimals`` sets how finely inputs are compared (rows that round equal share a
    prediction); ``ttl_s`` bounds how long a prediction lives. With a ``budget``, each
    tenant's predictions stay within its keys and bytes, its oldest going first (rows
    predicted without a tenant are not counted: they are the service's own). Safe to
    share between threads: it holds no state besides the Redis client.
    """

    def __init__(
        self,
        redis_client: redis.Redis,
        *,
        decimals: int = 4,
        ttl_s: int = 3600,
        budget: TenantBudget | None = None,
    ) -> None:
        if isinstance(decimals, bool) or not isinstance(decimals, int) or not 0 <= decimals <= 12:
            raise ValueError(f"decimals must be an integer from 0 to 12, got {decimals!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1:
            raise ValueError(f"ttl_s must be a positive integer, got {ttl_s!r}")
        if redis_client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the inference cache needs a Redis client with decode_responses=False")
        self.redis = redis_client
        self.decimals = decimals
        self.ttl_ms = ttl_s * 1000
        self.budget = budget

    def keys(
        self, model: Model, inputs: object, *, tenant: str | None = None, arm: str | None = None
    ) -> list[str]:
        """The Redis key of each input row (for inspection and tests)."""
        _, canon = canonical_rows(inputs, self.decimals)
        return self._keys(model, canon, tenant, arm)

    def predict(
        self,
        model: Model,
        inputs: Array | Sequence[Sequence[float]],
        *,
        tenant: str | None = None,
        arm: str | None = None,
    ) -> Predictions:
        """Predictions for every row of ``inputs`` (shape ``(n, d)``), in input order.

        Raises :class:`NonDeterministicModel` for a model marked non-deterministic and
        :class:`InvalidInput` for inputs that are not a 2-D array of real numbers or
        whose width is not the model's ``n_features``.
        """
        if not model.deterministic:
            raise NonDeterministicModel(model.name, model.version)
        x, canon = canonical_rows(inputs, self.decimals)
        expected = getattr(model, "n_features", None)
        if isinstance(expected, int) and canon.shape[1] != expected:
            raise InvalidInput(
                f"model {model.name!r} version {model.version!r} expects {expected} "
                f"features per row, got {canon.shape[1]}"
            )
        n = canon.shape[0]
        if n == 0:
            return Predictions(np.empty(0), np.zeros(0, dtype=bool), model.name, model.version)

        # Each distinct row is hashed, looked up and computed once.
        first, inverse = _distinct(canon)

        keys = self._keys(model, canon[first], tenant, arm)
        found, stored = self._lookup(keys)
        missing = np.setdiff1d(np.arange(len(keys)), found, assume_unique=True)

        computed: Array | None = None
        if missing.size:
            batch = x[first[missing]]
            computed = _checked_output(model, model.predict(batch), missing.size)
            # NaN and infinities are never cached: JSON cannot carry them, and a
            # cached one would be served as if it were an answer.
            finite = ~np.isin(np.arange(missing.size), non_finite_rows(computed))
            entries = [
                (keys[j], blob)
                for j, blob in zip(missing[finite], encode_rows(computed[finite]), strict=True)
            ]
            self._store(entries, tenant)

        distinct = _assemble(model, len(keys), (found, stored), (missing, computed))
        hit = np.zeros(len(keys), dtype=bool)
        hit[found] = True
        return Predictions(distinct[inverse], hit[inverse], model.name, model.version)

    def predict_one(
        self,
        model: Model,
        x: Array | Sequence[float],
        *,
        tenant: str | None = None,
        arm: str | None = None,
    ) -> Prediction:
        """The prediction for one input vector of shape ``(d,)``."""
        vector = np.asarray(x)
        if vector.ndim != 1:
            raise InvalidInput(f"predict_one takes one vector of shape (d,), got {vector.shape}")
        out = self.predict(model, vector.reshape(1, -1), tenant=tenant, arm=arm)
        return Prediction(out.values[0], bool(out.hit[0]), out.model, out.model_version)

    def _store(self, entries: list[tuple[str, bytes]], tenant: str | None) -> None:
        """Write ``entries``, within ``tenant``'s budget (docs/reading.md, a batch's steps 5-6).

        A Redis at its ``maxmemory`` refuses the writes: the predictions are answered
        all the same, uncached (a cache that cannot store must not fail its reads).
        """
        if not entries:
            return
        try:
            self._write(entries, tenant)
        except redis.exceptions.OutOfMemoryError as exc:
            log.warning("Redis is full (%s); %d predictions not cached", exc, len(entries))

    def _write(self, entries: list[tuple[str, bytes]], tenant: str | None) -> None:
        evicted: set[str] = set()
        if self.budget is not None and tenant is not None:
            evicted = self.budget.admit(
                inference_budget_keys(tenant), [(k, len(b)) for k, b in entries], self.ttl_ms
            )
        pipe = self.redis.pipeline(transaction=False)
        for key, blob in entries:
            if key not in evicted:
                # execute_command skips set()'s argument handling: a quarter of a
                # cold batch's time goes to building these commands.
                pipe.execute_command(  # type: ignore[no-untyped-call]
                    "SET", key, blob, "PX", self.ttl_ms
                )
        ours = {key for key, _ in entries}
        for key in evicted - ours:
            pipe.unlink(key)  # one key per command: on a cluster, each to its own slot
        pipe.execute()

    def _keys(self, model: Model, canon: Array, tenant: str | None, arm: str | None) -> list[str]:
        # inference_prefix validates every part once; each digest is the key's hash tag.
        prefix = inference_prefix(model.name, model.version, tenant, arm)
        return [f"{prefix}{{{digest}}}" for digest in digests(canon, self.decimals)]

    def _lookup(self, keys: list[str]) -> tuple[npt.NDArray[np.intp], Array | None]:
        """One MGET: the positions of the readable entries and their rows, stacked."""
        blobs = mget(self.redis, keys)
        found: list[int] = []
        present: list[bytes] = []
        for j, blob in enumerate(blobs):
            if isinstance(blob, bytes):
                found.append(j)
                present.append(blob)
        stacked = _decode_stack(present)
        if stacked is not None or not present:
            return np.array(found, dtype=np.intp), stacked
        # Entries of more than one format: decode one by one, skip unreadable ones.
        good: list[int] = []
        rows: list[Array] = []
        for j, blob in zip(found, present, strict=True):
            row = decode(blob)
            if row is None:
                log.warning("unreadable inference entry %s; recomputing it", keys[j])
            else:
                good.append(j)
                rows.append(row)
        if len({row.shape for row in rows}) > 1:
            raise ModelError(
                f"cached predictions under {keys[0].rsplit(':', 1)[0]} have different shapes; "
                "was the model changed without a version bump?"
            )
        return np.array(good, dtype=np.intp), np.stack(rows) if rows else None


def non_finite_rows(values: Array) -> list[int]:
    """The rows of ``values`` holding a NaN or an infinity (none for an integer array)."""
    if values.dtype.kind not in "fc" or values.size == 0:
        return []
    flat = values.reshape(values.shape[0], -1)
    return [int(i) for i in np.flatnonzero(~np.isfinite(flat).all(axis=1))]


def _decode_stack(blobs: list[bytes]) -> Array | None:
    """Every blob decoded into one array, when all share one header and length (the
    usual case: one model version writes one format); None otherwise."""
    if not blobs:
        return None
    row = decode(blobs[0])
    if row is None:
        return None
    size = len(blobs[0])
    head = size - row.nbytes
    header = blobs[0][:head]
    if any(len(blob) != size or blob[:head] != header for blob in blobs):
        return None
    data = b"".join([blob[head:] for blob in blobs])
    return np.frombuffer(data, dtype=row.dtype).reshape((len(blobs), *row.shape))


def _distinct(canon: Array) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """``(first, inverse)``: where each distinct row first appears, in input order, and
    for each input row the index of its distinct row."""
    n = canon.shape[0]
    if n == 1:
        zero = np.zeros(1, dtype=np.intp)
        return zero, zero
    rows = canon.view(np.dtype((np.void, canon.dtype.itemsize * canon.shape[1]))).ravel()
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return first[order], rank[inverse.ravel()]


def _checked_output(model: Model, out: object, rows: int) -> Array:
    values = np.asarray(out)
    if values.ndim not in (1, 2) or values.shape[0] != rows:
        raise ModelError(
            f"model {model.name!r} version {model.version!r} returned shape {values.shape} "
            f"for {rows} input rows; expected ({rows},) or ({rows}, k)"
        )
    if _little(values.dtype) not in _CODES:
        raise ModelError(
            f"model {model.name!r} returned dtype {values.dtype}; only real numbers and "
            "booleans can be cached"
        )
    return values


def _assemble(
    model: Model,
    n: int,
    stored: tuple[npt.NDArray[np.intp], Array | None],
    computed: tuple[npt.NDArray[np.intp], Array | None],
) -> Array:
    """One array of the ``n`` distinct rows' predictions: ``(positions, rows)`` read
    from Redis and computed by the model."""
    parts = [(at, rows) for at, rows in (stored, computed) if rows is not None and len(rows)]
    shapes = {rows.shape[1:] for _, rows in parts}
    if len(shapes) != 1:
        raise ModelError(
            f"predictions of model {model.name!r} version {model.version!r} have different "
            f"shapes {sorted(shapes)}; was the model changed without a version bump?"
        )
    dtype = np.result_type(*(rows.dtype for _, rows in parts))
    out = np.empty((n, *shapes.pop()), dtype=dtype)
    for at, rows in parts:
        out[at] = rows
    return out


def purge(
    redis_client: redis.Redis,
    model: str,
    version: str,
    batch: int = 500,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete every cached prediction of one model version; return how many keys went.

    Walks ``SCAN MATCH infer:<model>:<version>:* COUNT batch`` and ``UNLINK``s what
    each step returns, so Redis is never blocked and memory is freed in the
    background. Interrupting it is harmless; running it again finishes the job.
    ``progress`` is called with the running total after each deletion.
    """
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    pattern = inference_pattern(model, version)
    removed = 0
    if is_cluster(redis_client):  # every master, one UNLINK per slot (redis-py splits)
        for chunk in scan_chunks(redis_client, pattern, batch):
            removed += int(redis_client.unlink(*chunk))
            if progress is not None:
                progress(removed)
        return removed
    cursor = 0
    while True:
        cursor, found = redis_client.scan(cursor=cursor, match=pattern, count=batch)
        if found:
            removed += int(redis_client.unlink(*found))
            if progress is not None:
                progress(removed)
        if cursor == 0:
            return removed
