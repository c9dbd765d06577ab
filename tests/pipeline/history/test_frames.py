"""A batch read and a training set agree: the frame ``FeatureClient.get_frame`` reads
from the entries equals, column for column and type for type, the training set at the
snapshots those entries were computed from, so a model trained on one scores the other
as it was trained."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.history import tables
from freshline.pipeline.history.training import training_set
from tests.helpers import REGISTRY, ROOT, fresh_version
from tests.pipeline.history import recording

pa = pytest.importorskip("pyarrow")
FRAUD = ROOT / "examples" / "fraud"


def test_a_frame_read_equals_the_training_set_at_its_entries_snapshots(
    engine: Engine,
    api: Engine,
    captured: None,
    redis_client: redis.Redis,
    tenant_factory: Callable[..., SeedSummary],
) -> None:
    tenant = tenant_factory(users=8, transactions=300).tenants[0]
    with engine.begin() as conn:  # the seeded rows, as history's backfill holds them
        for table in ("transactions", "user_devices", "devices"):
            conn.execute(
                sa.text(
                    f"INSERT INTO freshline.{recording.history_name(table)} SELECT t.*, "
                    "'3'::xid8, NULL, '0/0', NULL, :s, NULL, '0/0' FROM public.{table} t "
                    "WHERE tenant_id = :t".replace("{table}", table)
                ),
                {"s": recording.LONG_AGO, "t": tenant},
            )
        geoip = recording.history_name("geoip")  # global: the seed may have just loaded it
        conn.execute(
            sa.text(
                f"INSERT INTO freshline.{geoip} SELECT g.*, '3'::xid8, NULL, '0/0', NULL, :s, "
                f"NULL, '0/0' FROM public.geoip g "
                f"WHERE NOT EXISTS (SELECT FROM freshline.{geoip})"
            ),
            {"s": recording.LONG_AGO},
        )
    users = [5, 1, 8, 3]
    version = fresh_version()
    store = EntryStore(redis_client, version, registry=REGISTRY)
    batches = {fs.name: compute(api, fs, [(tenant, str(u)) for u in users]) for fs in REGISTRY}
    for batch in batches.values():
        store.write(batch)
    frame = FeatureClient(redis_client, version, registry=REGISTRY).get_frame(
        [fs.name for fs in REGISTRY], tenant, users
    )
    for name, batch in batches.items():
        spine = pa.table(
            {
                "tenant_id": [tenant] * len(users),
                "user_id": pa.array(users, pa.int64()),
                "timestamp": pa.array(
                    [tables.from_epoch_us(batch.as_of_us)] * len(users),
                    pa.timestamp("us", tz="UTC"),
                ),
                "snapshot": [batch.snapshot] * len(users),
            }
        )
        train = training_set(FRAUD, spine, [name], engine=api, at="snapshot")
        columns = ["tenant_id", "user_id", *(f"{name}__{f}" for f in REGISTRY[name].field_names)]
        assert frame.select(columns).equals(train.select(columns)), name
