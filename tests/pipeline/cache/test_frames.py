"""Batch scoring reads as Arrow tables: ``FeatureClient.get_frame`` and
``get_many(..., as_="arrow")`` on real Redis, in one MGET, named and typed as training
sets are (:mod:`freshline.pipeline.core.frames`)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline import Entity, FeatureSet, Field, Table
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.frames import FrameError, arrow_type
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY, fresh_version
from tests.pipeline.cache.test_client import CountingRedis

pa = pytest.importorskip("pyarrow")

SETS = ("txn_90d", "device_risk", "geo")


@pytest.fixture
def served(
    redis_client: redis.Redis, engine: Engine, tenant_factory: Callable[..., SeedSummary]
) -> tuple[int, str]:
    """A schema version of its own with users 1..5 of a fresh tenant computed."""
    version = fresh_version()
    tenant = tenant_factory(users=8, transactions=200).tenants[0]
    store = EntryStore(redis_client, version, registry=REGISTRY)
    for fs in REGISTRY:
        store.write(compute(engine, fs, [(tenant, str(u)) for u in range(1, 6)]))
    return version, tenant


def test_a_frame_is_a_row_per_entity_typed_as_a_training_set_in_one_mget(
    settings: Settings, served: tuple[int, str]
) -> None:
    version, tenant = served
    counting = CountingRedis.from_url(settings.redis_url)
    assert isinstance(counting, CountingRedis)
    client = FeatureClient(counting, version, registry=REGISTRY)
    ids: list[str | int] = [3, "1", 5, 7]  # 7 was never computed: a miss
    frame = client.get_frame(["txn_90d", "device_risk", "geo:distinct_countries_30d"], tenant, ids)
    assert counting.commands == ["MGET"]
    columns = [
        *(f"txn_90d__{f.name}" for f in REGISTRY["txn_90d"].fields),
        *(f"device_risk__{f.name}" for f in REGISTRY["device_risk"].fields),
        "geo__distinct_countries_30d",
    ]
    assert frame.column_names == ["tenant_id", "user_id", *columns]
    assert frame.column("tenant_id").to_pylist() == [tenant] * 4
    assert frame.column("user_id").to_pylist() == [3, 1, 5, 7]
    assert frame.schema.field("user_id").type == pa.int64()
    for fs in ("txn_90d", "device_risk"):
        for f in REGISTRY[fs].fields:
            assert frame.schema.field(f"{fs}__{f.name}").type == arrow_type(f.type)
    # each value is what get_many serves, timestamps as the training set's ms column
    reads = client.get_many([(fs, tenant, u) for fs in SETS for u in (3, 1, 5, 7)])
    for n, fs in enumerate(SETS):
        for row, read in enumerate(reads[n * 4 : n * 4 + 4]):
            wanted = [c for c in columns if c.startswith(f"{fs}__")]
            got = {c: frame.column(c)[row] for c in wanted}
            if read is None:
                assert all(v.as_py() is None for v in got.values())
                continue
            for c, value in got.items():
                field = c.split("__")[1]
                expect = read.values[field]
                if REGISTRY[fs].fields[REGISTRY[fs].field_names.index(field)].type == "timestamp":
                    assert value.cast(pa.int64()).as_py() == expect, c
                else:
                    assert value.as_py() == expect, c
    assert reads[3] is None  # user 7


def test_get_many_as_arrow_is_a_row_per_item(
    served: tuple[int, str], redis_client: redis.Redis
) -> None:
    version, tenant = served
    client = FeatureClient(redis_client, version, registry=REGISTRY)
    items: list[tuple[str, str, str | int]] = [
        ("geo", tenant, "2"),
        ("txn_90d", tenant, 4),
        ("geo", tenant, 9),
    ]
    table = client.get_many(items, as_="arrow")
    assert table.column_names[:5] == ["feature_set", "tenant", "entity", "age_ms", "schema_version"]
    assert table.column("feature_set").to_pylist() == ["geo", "txn_90d", "geo"]
    assert table.column("entity").to_pylist() == ["2", "4", "9"]
    assert table.column("schema_version").to_pylist() == [version, version, None]
    assert table.column("age_ms").null_count == 1
    reads = client.get_many(items)
    assert reads[0] is not None and reads[1] is not None
    for f in REGISTRY["geo"].fields:
        column = table.column(f"geo__{f.name}")
        assert column.type == arrow_type(f.type)
        assert column[1].as_py() is None and column[2].as_py() is None  # not geo; a miss
    assert table.column("txn_90d__txn_count").to_pylist() == [
        None,
        reads[1].values["txn_count"],
        None,
    ]


def test_bad_frames_are_one_clear_error(
    served: tuple[int, str], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    version, tenant = served
    client = FeatureClient(redis_client, version, registry=REGISTRY)
    with pytest.raises(FrameError, match="unknown feature set 'txn_9d'"):
        client.get_frame(["txn_9d"], tenant, [1])
    with pytest.raises(InvalidId):
        client.get_frame(["txn_90d"], tenant, ["seven"])
    with pytest.raises(ValueError, match="as_ is 'features' or 'arrow'"):
        client.get_many([("geo", tenant, 1)], as_="pandas")  # type: ignore[call-overload]
    device = Entity("device", key="device_id", type="text", tenant="tenant_id")
    shared = FeatureSet(
        "device_users",
        entity=device,
        ttl="1h",
        sources=(Table("user_devices", entities={device: "device_id"}),),
        fields=(Field("users", "int"),),
        query="SELECT k.tenant_id, k.device_id, 0 AS users FROM keys k",
    )
    mixed = FeatureClient(redis_client, version, registry=Registry([*REGISTRY, shared]))
    with pytest.raises(FrameError, match="a frame is about one entity: 'geo' is about 'user'"):
        mixed.get_frame(["geo", "device_users"], tenant, [1])
    # A fake: pyarrow cannot be uninstalled under a running suite; None in sys.modules
    # makes `import pyarrow` fail as it does where the extra is not installed.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(FrameError, match=r"need pyarrow: pip install 'freshline\[training\]'"):
        client.get_frame(["geo"], tenant, [1])
    with pytest.raises(FrameError, match="need pyarrow"):
        client.get_many([("geo", tenant, 1)], as_="arrow")
    assert client.get("geo", tenant, 1) is not None  # the read path does without it
