"""A batch of hits answered by splicing the stored bytes (:mod:`freshline.pipeline.api.splice`):
byte for byte what decoding and encoding the same entries answers, and only then."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import orjson
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.api.reader import Lookup
from freshline.pipeline.api.splice import Spliced, Splicer
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.codec import decode_rows, encode_entry, encode_tombstone, watermark_hex
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, fresh_version, running

VERSION = 3
NOW = 1_733_200_000_000

# Scalars as the feature queries produce them, and the edges of their JSON text.
INTS = [0, 1, -1, 7, 2**31, 2**53 + 1, 2**63 - 1, -(2**63)]
FLOATS = [
    0.0,
    -0.0,
    0.1,
    1.5,
    -2.25,
    1e-7,
    1e16,
    1.7976931348623157e308,
    5e-324,
    123456.789,
    2.0**60,
    1 / 3,
]


def value(kind: str, rng: random.Random) -> Any:
    if rng.random() < 0.1:
        return None
    if kind == "int":
        return rng.choice([*INTS, rng.randint(-(10**6), 10**6)])
    if kind == "float":
        return rng.choice([*FLOATS, rng.uniform(-1000000.0, 1000000.0), rng.random()])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "timestamp":
        return NOW - rng.randint(0, 10**9)
    raise AssertionError(kind)


def decoded_body(
    feature_set: str, entities: list[str], raws: list[bytes | None], floor: bytes | None
) -> bytes:
    """What the API answered before splicing: decode, build each answer, encode."""
    rows = decode_rows(raws, REGISTRY[feature_set].field_names, VERSION, floor)
    items = [
        {
            "feature_set": feature_set,
            "entity": e,
            "values": None,
            "hit": False,
            "source": "miss",
            "age_ms": 0,
            "schema_version": VERSION,
        }
        if row is None
        else {
            "feature_set": feature_set,
            "entity": e,
            "values": row[0],
            "hit": True,
            "source": "hit",
            "age_ms": NOW - row[1] if row[1] < NOW else 0,
            "schema_version": VERSION,
        }
        for e, row in zip(entities, rows, strict=True)
    ]
    return orjson.dumps({"schema_version": VERSION, "items": items})


def spliced(
    feature_set: str, entities: list[str], raws: list[bytes | None], floor: bytes | None = None
) -> bytes | None:
    """The body a fresh :class:`Splicer` makes, checked against the one it makes again
    from what it kept of the same entries."""
    splicer = Splicer(feature_set, REGISTRY[feature_set].field_names, VERSION)
    found = splicer.body(entities, raws, floor, NOW)
    again = splicer.body(entities, raws, floor, NOW)
    assert again == found
    return None if found is None else found.body


def entries(feature_set: str, n: int, seed: int) -> tuple[list[str], list[bytes | None]]:
    rng = random.Random(seed)
    kinds = [f.type for f in REGISTRY[feature_set].fields]
    ids = [str(rng.randint(0, 10**12)) for _ in range(n)]
    raws: list[bytes | None] = [
        encode_entry(
            [value(k, rng) for k in kinds],
            VERSION,
            NOW + rng.randint(-(10**7), 1000),
            rng.randint(0, 2**100),
        )
        for _ in range(n)
    ]
    return ids, raws


@pytest.mark.parametrize("feature_set", ["txn_90d", "device_risk"])
@pytest.mark.parametrize("seed", range(20))
def test_spliced_hits_are_the_decoded_answer_byte_for_byte(feature_set: str, seed: int) -> None:
    ids, raws = entries(feature_set, 1 + seed * 5, seed)
    body = spliced(feature_set, ids, raws)
    assert body is not None
    assert body == decoded_body(feature_set, ids, raws, None)
    # And with a floor every entry is at or above.
    low = min(r[1:31] for r in raws if r is not None)
    assert spliced(feature_set, ids, raws, low) == decoded_body(feature_set, ids, raws, low)


@pytest.mark.parametrize("width", [1, 2, 3])
def test_a_set_of_one_two_or_three_fields_splices_as_it_decodes(width: int) -> None:
    """The first and last values are cut from their brackets column by column; with one
    field they are the same value."""
    rng = random.Random(width)
    fields = [f"f{i}" for i in range(width)]
    ids = [str(i) for i in range(1, 12)]
    raws: list[bytes | None] = [
        encode_entry(
            [value(rng.choice(["int", "float", "bool"]), rng) for _ in fields],
            VERSION,
            NOW - rng.randint(0, 10**6),
            rng.randint(0, 2**100),
        )
        for _ in ids
    ]
    found = Splicer("w", fields, VERSION).body(ids, raws, None, NOW)
    assert found is not None
    rows = decode_rows(raws, fields, VERSION)
    assert orjson.loads(found.body)["items"] == [
        {
            "feature_set": "w",
            "entity": e,
            "values": row[0],
            "hit": True,
            "source": "hit",
            "age_ms": NOW - row[1],
            "schema_version": VERSION,
        }
        for e, row in zip(ids, rows, strict=True)
        if row is not None
    ]


def test_what_a_splicer_keeps_is_bounded_and_answers_as_a_fresh_one_would() -> None:
    ids, raws = entries("txn_90d", 30, 99)
    splicer = Splicer("txn_90d", REGISTRY["txn_90d"].field_names, VERSION, max_entries=10)
    for start in (0, 10, 5, 20, 0):  # overlapping windows: some entries kept, some not
        window = slice(start, start + 10)
        found = splicer.body(ids[window], raws[window], None, NOW + start)
        fresh = Splicer("txn_90d", REGISTRY["txn_90d"].field_names, VERSION).body(
            ids[window], raws[window], None, NOW + start
        )
        assert found is not None and found == fresh
        assert len(splicer) <= 10
    # A batch larger than what it keeps: answered all the same.
    found = splicer.body(ids, raws, None, NOW)
    assert found is not None and len(splicer) == 10
    assert found == Splicer("txn_90d", REGISTRY["txn_90d"].field_names, VERSION).body(
        ids, raws, None, NOW
    )
    # A bad entry among kept ones: no answer, and nothing of it kept.
    sixth = raws[5]
    assert sixth is not None
    bad = [*raws[:5], sixth[:-3]]
    assert splicer.body(ids[:6], bad, None, NOW) is None
    assert sixth[:-3] not in splicer._seen


def _mutations() -> dict[str, Callable[[list[bytes | None]], list[Any]]]:
    def at(i: int, raw: bytes | None) -> Callable[[list[bytes | None]], list[Any]]:
        return lambda rs: [*rs[:i], raw, *rs[i + 1 :]]

    wm = watermark_hex(5)
    return {
        "a miss": at(1, None),
        "a tombstone": at(2, encode_tombstone(5)),
        "a string value": at(
            0, encode_entry(["x", 1.0, 1.0, 1.0, 1.0, 1, 1, NOW], VERSION, NOW, 5)
        ),
        "a nested value": at(
            0, encode_entry([[1], 1.0, 1.0, 1.0, 1.0, 1, 1, NOW], VERSION, NOW, 5)
        ),
        "too few fields": at(0, encode_entry([1, 1.0, 1.0, 1.0, 1.0, 1, 1], VERSION, NOW, 5)),
        "another version": at(0, encode_entry([1] * 8, VERSION + 1, NOW, 5)),
        "a float computed_at": at(0, b"1" + wm + b"[3,1.5,[1,1,1,1,1,1,1,1]]"),
        "not JSON": at(0, b"1" + wm + b"[3,1,[1,1,1,1,1,1,1,1x]]"),
        "whitespace": at(0, b"1" + wm + b"[3,1,[1,1,1,1,1,1,1, 1]]"),
        "another tag": at(0, b"2" + wm + b"[3,1,[1,1,1,1,1,1,1,1]]"),
        "a short watermark": at(0, b"1" + wm[1:] + b"[3,1,[1,1,1,1,1,1,1,1]]"),
        "a decoded reply": lambda rs: [r.decode() if r is not None else r for r in rs],
        "NaN": at(0, b"1" + wm + b"[3,1,[1,1,1,1,1,1,1,NaN]]"),
    }


@pytest.mark.parametrize("mutation", list(_mutations()))
def test_anything_but_plain_hits_is_left_to_the_decoder(mutation: str) -> None:
    ids, raws = entries("txn_90d", 6, 99)
    assert spliced("txn_90d", ids, raws) is not None
    assert spliced("txn_90d", ids, _mutations()[mutation](raws)) is None


def test_an_entry_below_the_floor_is_left_to_the_decoder() -> None:
    ids, raws = entries("txn_90d", 6, 7)
    oldest = min(r[1:31] for r in raws if r is not None)
    floor = watermark_hex(int(oldest, 16) + 1)
    assert spliced("txn_90d", ids, raws, floor) is None
    # which answers it as a miss
    assert b'"source":"miss"' in decoded_body("txn_90d", ids, raws, floor)


def _hits(text: str, feature_set: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "freshline_api_feature_hits_total"
        and s.labels == {"feature_set": feature_set, "tier": "redis"}
    )


def test_the_api_answers_a_batch_of_hits_as_the_decoding_path_does(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant_factory_module: Callable[..., SeedSummary],
) -> None:
    tenant = tenant_factory_module(users=8, transactions=120).tenants[0]
    version = fresh_version()
    store = EntryStore(redis_client, version, registry=REGISTRY)
    ids = [str(u) for u in range(1, 9)]
    store.write(compute(engine, REGISTRY["txn_90d"], [(tenant, u) for u in ids]))
    app = create_app(
        settings.model_copy(update={"schema_version": version, "local_cache_size": 0}),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        registry=REGISTRY,
    )
    reader = app.state.services.reader
    with running(app, create_api_key(engine, tenant)) as api:
        # The batch is spliced (on the app's own loop, with its asyncio client)...
        found = api.portal.call(reader.cached_batch, Lookup(tenant, ["txn_90d"], ids), "cache-only")
        assert isinstance(found, Spliced)
        before = _hits(api.ops("/metrics").text, "txn_90d")
        for mode in ("cache-only", "read-through"):
            got = api.post(
                f"/v1/features/batch?mode={mode}",
                json={"feature_sets": ["txn_90d"], "entities": ids},
            )
            assert got.status_code == 200 and got.headers["content-type"] == "application/json"
            # ...and the thread pool's path (EntryStore.read, an Entry per item) answers
            # the same JSON, encoded by orjson; only the ages move with the clock.
            answers = reader.read(Lookup(tenant, ["txn_90d"], ids), "cache-only")
            for answer, item in zip(answers, got.json()["items"], strict=True):
                answer["age_ms"] = item["age_ms"]
            assert got.content == orjson.dumps({"schema_version": version, "items": answers})
        assert _hits(api.ops("/metrics").text, "txn_90d") - before == 2 * len(ids)

        # A miss among them: decoded, and answered as before.
        mixed = api.post(
            "/v1/features/batch?mode=cache-only",
            json={"feature_sets": ["txn_90d"], "entities": [*ids, "999"]},
        )
        assert [i["source"] for i in mixed.json()["items"]] == ["hit"] * len(ids) + ["miss"]
    [entry] = store.read([EntityRef("txn_90d", tenant, "1")])
    assert entry is not None and entry.schema_version == version
