from __future__ import annotations

import hashlib
import struct
import uuid
from typing import Any

import numpy as np
import pytest
import redis

from freshline.pipeline.core.errors import ModelError
from freshline.pipeline.core.keys import inference_key, inference_pattern
from freshline.pipeline.dev.models import SlowModel
from freshline.pipeline.inference.models import LogisticModel
from freshline.pipeline.inference.predictions import (
    Array,
    InferenceCache,
    InvalidInput,
    NonDeterministicModel,
    decode,
    encode,
    purge,
)

TTL_S = 600


@pytest.fixture
def cache(redis_client: redis.Redis) -> InferenceCache:
    return InferenceCache(redis_client, decimals=4, ttl_s=TTL_S)


def unique_name() -> str:
    return f"m_{uuid.uuid4().hex[:12]}"


def logistic(name: str, version: str = "v1", d: int = 4, seed: int = 0) -> LogisticModel:
    rng = np.random.default_rng(seed)
    return LogisticModel(
        name=name,
        version=version,
        feature_names=tuple(f"f{i}" for i in range(d)),
        weights=rng.normal(size=d),
        bias=float(rng.normal()),
        mean=rng.normal(size=d),
        scale=rng.uniform(0.5, 2.0, size=d),
    )


def counted(name: str | None = None, **kwargs: Any) -> tuple[SlowModel, LogisticModel]:
    inner = logistic(name or unique_name(), **kwargs)
    return SlowModel(inner), inner


class TwoColumnModel:
    """A deterministic model with 2-D float32 output, to check shapes and dtypes survive."""

    deterministic = True

    def __init__(self, name: str, version: str = "v1") -> None:
        self.name = name
        self.version = version

    def predict(self, x: Array, /) -> Array:
        s = np.asarray(x, dtype=np.float64).sum(axis=1)
        return np.stack([np.sin(s), np.cos(s)], axis=1).astype(np.float32)


def keys_of(client: redis.Redis, model: str, version: str) -> list[bytes]:
    return list(client.scan_iter(match=inference_pattern(model, version), count=500))


def test_cache_returns_exactly_the_models_own_output(cache: InferenceCache) -> None:
    model, inner = counted()
    X = np.random.default_rng(1).normal(size=(300, 4))
    expected = inner.predict(X)

    first = cache.predict(model, X)
    assert np.array_equal(first.values, expected)
    assert first.values.dtype == expected.dtype
    assert not first.hit.any()
    assert (first.model, first.model_version) == (inner.name, "v1")
    assert model.calls == 1 and model.rows == [300]

    second = cache.predict(model, X)
    assert np.array_equal(second.values, expected)
    assert second.hit.all()
    assert model.calls == 1


def test_vector_outputs_keep_their_shape_and_dtype(cache: InferenceCache) -> None:
    model = TwoColumnModel(unique_name())
    X = np.random.default_rng(2).uniform(-3, 3, size=(40, 3))
    expected = model.predict(X)
    for _ in range(2):
        out = cache.predict(model, X)
        assert out.values.shape == (40, 2)
        assert out.values.dtype == np.float32
        assert np.array_equal(out.values, expected)
    assert out.hit.all()


def test_a_mixed_batch_sends_only_the_misses_in_one_call(cache: InferenceCache) -> None:
    model, inner = counted()
    rng = np.random.default_rng(3)
    old = rng.normal(size=(50, 4))
    new = rng.normal(size=(30, 4))
    cache.predict(model, old)
    assert model.calls == 1

    mixed = np.concatenate([old, new])
    order = rng.permutation(len(mixed))
    batch = mixed[order]
    out = cache.predict(model, batch)

    assert model.calls == 2 and model.rows == [50, 30]
    assert model.last_input is not None
    is_new = order >= 50
    assert np.array_equal(model.last_input, batch[is_new])  # the misses, in input order
    assert np.array_equal(out.hit, ~is_new)
    assert np.array_equal(out.values, inner.predict(batch))


def test_duplicates_in_a_batch_are_computed_once(cache: InferenceCache) -> None:
    model, inner = counted()
    rows = np.random.default_rng(4).normal(size=(5, 4))
    batch = rows[[0, 1, 0, 2, 1, 0, 3, 4, 4]]
    batch[5] += 1e-7  # rounds equal to rows[0]
    out = cache.predict(model, batch)
    assert model.calls == 1 and model.rows == [5]
    assert np.array_equal(out.values[[0, 1, 3, 6, 7]], inner.predict(rows[:5]))
    assert out.values[2] == out.values[0] == out.values[5]
    assert not out.hit.any()  # computed in this call, not served from Redis


def test_predict_one(cache: InferenceCache) -> None:
    model, inner = counted()
    x = np.array([0.5, -1.25, 3.0, 0.1])
    first = cache.predict_one(model, x)
    second = cache.predict_one(model, list(x))
    assert first.value.shape == ()
    assert first.value == second.value == inner.predict(x[None, :])[0]
    assert (first.hit, second.hit) == (False, True)
    assert model.calls == 1
    with pytest.raises(InvalidInput):
        cache.predict_one(model, x[None, :])


def nan_with_bits(bits: int) -> float:
    value = float(np.array([bits], dtype=np.uint64).view(np.float64)[0])
    assert np.isnan(value)
    return value


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ([0.0, 1.0], [-0.0, 1.0]),
        ([-0.00001, 1.0], [0.0, 1.0]),  # rounds to -0.0, then normalised
        ([np.nan, 1.0], [-np.nan, 1.0]),
        ([np.nan, 1.0], [nan_with_bits(0x7FF0000000000001), 1.0]),  # signalling NaN
        ([np.nan, 1.0], [nan_with_bits(0xFFF8000000000123), 1.0]),  # negative, payload
        ([0.1, 2.675], np.array([0.1, 2.675], dtype=np.float32)),
        ([0.12344, 7.0], [0.12341, 7.0]),
        ([1.0, 2.0], [1, 2]),
        ([1e300, -np.inf], [1e300, -np.inf]),
    ],
)
def test_inputs_that_round_equal_share_a_key(cache: InferenceCache, a: Any, b: Any) -> None:
    model = logistic(unique_name(), d=2)
    key_a = cache.keys(model, np.array([a]))
    key_b = cache.keys(model, np.array([b]))
    assert key_a == key_b


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ([0.1234, 1.0], [0.1235, 1.0]),
        ([0.0, 1.0], [np.nan, 1.0]),
        ([np.inf, 1.0], [-np.inf, 1.0]),
        ([1e300, 1.0], [1.0000000000000002e300, 1.0]),
    ],
)
def test_inputs_that_differ_beyond_the_rounding_do_not(
    cache: InferenceCache, a: Any, b: Any
) -> None:
    model = logistic(unique_name(), d=2)
    assert cache.keys(model, np.array([a])) != cache.keys(model, np.array([b]))


def test_the_width_and_the_rounding_are_part_of_the_digest(redis_client: redis.Redis) -> None:
    name = unique_name()
    narrow, wide = logistic(name, d=2), logistic(name, d=3)
    four = InferenceCache(redis_client, decimals=4)
    two = InferenceCache(redis_client, decimals=2)
    assert four.keys(narrow, [[1.0, 2.0]]) != four.keys(wide, [[1.0, 2.0, 0.0]])
    assert four.keys(narrow, [[1.0, 2.0]]) != two.keys(narrow, [[1.0, 2.0]])


def test_equal_rounded_inputs_are_served_as_one(cache: InferenceCache) -> None:
    model, _ = counted(d=2)
    batch = np.array([[0.0, 1.5], [-0.0, 1.50001]])
    out = cache.predict(model, batch)
    again = cache.predict(model, batch.astype(np.float32))
    assert model.calls == 1 and model.rows == [1]
    assert again.hit.all()
    assert np.array_equal(out.values, again.values)
    # Every NaN input is one NaN, whatever its sign or payload.
    nans = np.array([[0.0, np.nan], [-0.0, -np.nan]])
    assert len(set(cache.keys(model, nans))) == 1


def test_non_finite_predictions_are_never_cached(
    cache: InferenceCache, redis_client: redis.Redis
) -> None:
    model, _ = counted(d=2)
    batch = np.array([[0.0, np.nan], [1.0, 2.0]])  # the first row's prediction is NaN
    first = cache.predict(model, batch)
    again = cache.predict(model, batch)
    assert np.isnan(first.values[0]) and np.isfinite(first.values[1])
    assert again.hit.tolist() == [False, True]
    assert model.rows == [2, 1]
    [nan_key, finite_key] = cache.keys(model, batch)
    assert redis_client.exists(nan_key) == 0 and redis_client.exists(finite_key) == 1


def test_the_digest_follows_the_documented_recipe(cache: InferenceCache) -> None:
    """Reproduce a key from the module docstring alone, as another language would."""
    model = logistic(unique_name(), d=3)
    row = [0.123456, -0.00001, float("nan")]
    canonical = [0.1235, 0.0, float("nan")]
    message = struct.pack("<II", 3, 4) + b"".join(
        struct.pack("<Q", 0x7FF8000000000000) if v != v else struct.pack("<d", v) for v in canonical
    )
    digest = hashlib.blake2b(message, digest_size=16).hexdigest()
    assert cache.keys(model, [row], tenant="acme", arm="b") == [
        inference_key(model.name, "v1", digest, tenant="acme", arm="b")
    ]


def test_a_new_version_never_serves_the_old_ones_predictions(cache: InferenceCache) -> None:
    name = unique_name()
    v1, v2 = SlowModel(logistic(name, "v1", seed=1)), SlowModel(logistic(name, "v2", seed=2))
    X = np.random.default_rng(5).normal(size=(20, 4))
    old = cache.predict(v1, X)
    new = cache.predict(v2, X)
    assert (v1.calls, v2.calls) == (1, 1)
    assert not new.hit.any()
    assert new.model_version == "v2"
    assert np.array_equal(new.values, v2.inner.predict(X))
    assert not np.array_equal(new.values, old.values)
    assert cache.predict(v1, X).hit.all()


def test_tenants_and_arms_are_kept_apart(cache: InferenceCache) -> None:
    model, _ = counted()
    X = np.random.default_rng(6).normal(size=(10, 4))
    spaces: list[dict[str, str]] = [
        {},
        {"tenant": "acme"},
        {"tenant": "globex"},
        {"arm": "a"},
        {"arm": "b"},
        {"tenant": "acme", "arm": "a"},
    ]
    for space in spaces:
        assert not cache.predict(model, X, **space).hit.any()
    assert model.calls == len(spaces)
    for space in spaces:
        assert cache.predict(model, X, **space).hit.all()
    assert model.calls == len(spaces)


def test_a_non_deterministic_model_is_refused_and_nothing_is_written(
    cache: InferenceCache, redis_client: redis.Redis
) -> None:
    model, _ = counted()
    sampler = SlowModel(model.inner, deterministic=False)
    with pytest.raises(NonDeterministicModel, match="non-deterministic") as info:
        cache.predict(sampler, np.zeros((3, 4)))
    assert isinstance(info.value, ModelError)
    with pytest.raises(ModelError):
        cache.predict_one(sampler, np.zeros(4))
    assert sampler.calls == 0
    assert keys_of(redis_client, model.name, "v1") == []


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (np.zeros(4), "2-D"),
        (np.zeros((2, 2, 4)), "2-D"),
        ([[1.0, 2.0], [3.0]], "rectangular"),
        (np.array([["a", "b", "c", "d"]]), "real numbers"),
        (np.array([[1 + 2j] * 4]), "real numbers"),
        (np.array([[None] * 4]), "real numbers"),
        (np.zeros((2, 3)), "expects 4 features"),
        (np.zeros((2, 0)), "no features"),
    ],
)
def test_malformed_inputs_are_refused(
    cache: InferenceCache, redis_client: redis.Redis, inputs: Any, message: str
) -> None:
    model, _ = counted()
    with pytest.raises(InvalidInput, match=message) as info:
        cache.predict(model, inputs)
    assert isinstance(info.value, ModelError)
    assert model.calls == 0
    assert keys_of(redis_client, model.name, "v1") == []


def test_an_empty_batch_touches_nothing(cache: InferenceCache) -> None:
    model, _ = counted()
    out = cache.predict(model, np.zeros((0, 4)))
    assert len(out) == 0 and out.values.shape == (0,)
    assert model.calls == 0


class WrongRows:
    deterministic = True
    version = "v1"

    def __init__(self, name: str) -> None:
        self.name = name

    def predict(self, x: Array, /) -> Array:
        return np.zeros(len(x) + 1)


def test_a_model_answering_the_wrong_number_of_rows_is_not_cached(
    cache: InferenceCache, redis_client: redis.Redis
) -> None:
    model = WrongRows(unique_name())
    with pytest.raises(ModelError, match="returned shape"):
        cache.predict(model, np.zeros((3, 2)))
    assert keys_of(redis_client, model.name, "v1") == []


def test_every_key_written_expires(cache: InferenceCache, redis_client: redis.Redis) -> None:
    model, _ = counted()
    cache.predict(model, np.random.default_rng(7).normal(size=(100, 4)), tenant="acme", arm="a")
    keys = keys_of(redis_client, model.name, "v1")
    assert len(keys) == 100
    pipe = redis_client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    ttls = pipe.execute()
    assert all(0 < ttl <= TTL_S * 1000 for ttl in ttls)


def test_an_unreadable_entry_is_recomputed(
    cache: InferenceCache, redis_client: redis.Redis
) -> None:
    model, inner = counted()
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    (key,) = cache.keys(model, x)
    redis_client.set(key, b"garbage", px=60_000)
    out = cache.predict(model, x)
    assert not out.hit[0] and model.calls == 1
    assert np.array_equal(out.values, inner.predict(x))
    assert cache.predict(model, x).hit[0]


def test_a_bad_entry_in_a_batch_costs_only_its_own_row(
    cache: InferenceCache, redis_client: redis.Redis
) -> None:
    model, inner = counted()
    X = np.random.default_rng(9).normal(size=(6, 4))
    keys = cache.keys(model, X)
    cache.predict(model, X)
    redis_client.set(keys[2], b"garbage", px=60_000)
    out = cache.predict(model, X)
    assert np.array_equal(out.hit, [True, True, False, True, True, True])
    assert model.rows == [6, 1]
    assert np.array_equal(out.values, inner.predict(X))


def test_entries_of_different_shapes_are_a_model_error(
    cache: InferenceCache, redis_client: redis.Redis
) -> None:
    model, _ = counted()
    X = np.random.default_rng(10).normal(size=(2, 4))
    keys = cache.keys(model, X)
    redis_client.set(keys[0], encode(np.float64(0.5)), px=60_000)
    redis_client.set(keys[1], encode(np.array([0.5, 0.5])), px=60_000)
    with pytest.raises(ModelError, match="version bump"):
        cache.predict(model, X)


@pytest.mark.parametrize(
    "row",
    [
        np.float64(0.25),
        np.float32(-1.5),
        np.int64(7),
        np.bool_(True),
        np.array([0.1, 0.2, 0.3]),
        np.array([1, 2], dtype=np.int32),
        np.zeros(0, dtype=np.float64),
    ],
)
def test_encoding_round_trips_byte_for_byte(row: Any) -> None:
    arr = np.asarray(row)
    blob = encode(arr)
    back = decode(blob)
    assert back is not None
    assert back.dtype == arr.dtype and back.shape == arr.shape
    assert np.array_equal(back, arr)
    if arr.dtype == np.float64 and arr.ndim == 0:
        assert len(blob) == 11


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\x01",
        b"\x02\x01\x00" + bytes(8),
        b"\x01\x63\x00",
        b"\x01\x01\x00" + bytes(7),
        b"\x01\x01\x01\x02\x00\x00\x00",
    ],
)
def test_decoding_refuses_foreign_bytes(blob: bytes) -> None:
    assert decode(blob) is None


def test_purge_removes_exactly_one_versions_keys(
    cache: InferenceCache, redis_client: redis.Redis
) -> None:
    name = unique_name()
    v1, v2 = logistic(name, "v1"), logistic(name, "v2")
    other = logistic(unique_name(), "v1")
    X = np.random.default_rng(8).normal(size=(250, 4))
    for model in (v1, v2, other):
        cache.predict(model, X)
    cache.predict(v1, X[:20], tenant="acme")

    seen: list[int] = []
    assert purge(redis_client, name, "v1", batch=50, progress=seen.append) == 270
    assert seen and seen[-1] == 270 and seen == sorted(seen)
    assert keys_of(redis_client, name, "v1") == []
    assert len(keys_of(redis_client, name, "v2")) == 250
    assert len(keys_of(redis_client, other.name, "v1")) == 250
    assert purge(redis_client, name, "v1") == 0  # rerunning is harmless


def test_the_cache_refuses_bad_settings(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="decimals"):
        InferenceCache(redis_client, decimals=13)
    with pytest.raises(ValueError, match="ttl_s"):
        InferenceCache(redis_client, ttl_s=0)
