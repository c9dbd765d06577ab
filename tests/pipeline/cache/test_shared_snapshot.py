"""compute_in_snapshot: a feature set computed on another connection, in an exported
snapshot, sees what the exporting transaction sees and ranks the same."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.recompute import (
    compute,
    compute_in_snapshot,
    export_snapshot,
    take_snapshot,
    unpack_watermark,
)
from tests.helpers import REGISTRY


def test_a_set_computed_in_an_exported_snapshot_misses_later_commits_as_its_exporter_does(
    engine: Engine, tenant_factory: Callable[..., SeedSummary]
) -> None:
    tenant = tenant_factory(users=10, transactions=200).tenants[0]
    refs = [(tenant, "3")]
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        snapshot = take_snapshot(conn)
        snapshot_id = export_snapshot(conn)
        with engine.begin() as writer:  # after the snapshot: not in it; an IP of no range
            writer.execute(
                sa.text(
                    "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
                    "VALUES (:t, 3, 9999.00, 'm-later', '1.2.3.4')"
                ),
                {"t": tenant},
            )
        for name in ("txn_90d", "geo"):
            fs = REGISTRY[name]
            here = compute(conn, fs, refs)
            beside = compute_in_snapshot(engine, snapshot_id, fs, refs)
            now = compute(engine, fs, refs)
            assert beside.values == here.values != now.values, name
            rank = unpack_watermark(snapshot.watermark)[0]
            assert unpack_watermark(beside.watermark)[0] == rank, name
            assert unpack_watermark(now.watermark)[0] > rank, name
        conn.rollback()


def test_a_snapshot_id_is_checked_before_it_is_inlined(engine: Engine) -> None:
    with pytest.raises(ValueError, match="not an exported snapshot id"):
        compute_in_snapshot(engine, "1'; DROP TABLE users; --", REGISTRY["geo"], [("a", "1")])
