"""The fraud example trains from history: a row per transaction, features as of its
moment, so a transaction never sees itself reversed or anything committed later."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from fraud.training import MODEL_INPUTS, dataset, spine
from tests.pipeline.history import recording
from tests.pipeline.history.test_evaluator import txn

pytest.importorskip("pyarrow")
COUNT = MODEL_INPUTS.index(("txn_90d", "txn_count"))


def test_the_example_trains_on_each_transaction_as_of_its_moment(
    engine: Engine,
    api: Engine,
    captured: None,
    tenant_factory: Callable[..., SeedSummary],
) -> None:
    tenant = tenant_factory(users=40, transactions=600).tenants[0]
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
        rows = conn.execute(
            sa.text(
                "SELECT user_id, created_at, status = 'reversed' FROM transactions "
                "WHERE tenant_id = :t AND created_at <= now() ORDER BY created_at, id"
            ),
            {"t": tenant},
        ).all()
        # a transaction committed later with an earlier event time: in no row's features
        late = dt.datetime.now(dt.UTC)
        for n, (user, created_at, _) in enumerate(rows[:5]):
            recording.version(
                conn, "transactions", txn(tenant, 10_000_000 + n, user, created_at), late
            )
    x, y = dataset(api, tenant)
    assert x.shape == (len(rows), len(MODEL_INPUTS))
    assert y.tolist() == [float(r[2]) for r in rows]
    # txn_count at each transaction's moment: that user's transactions in the 90 days up
    # to it (backfilled rows count from history's start, so it counts itself)
    by_user: dict[int, list[dt.datetime]] = defaultdict(list)
    for user, created_at, _ in rows:
        by_user[user].append(created_at)
    expected = [
        sum(1 for c in by_user[user] if at - dt.timedelta(days=90) < c <= at)
        for user, at, _ in rows
    ]
    assert x[:, COUNT].tolist() == expected
    assert np.all(x[:, COUNT] >= 1)
    assert spine(api, tenant) is not None


def test_the_spine_stops_where_history_is_complete_to(
    engine: Engine,
    api: Engine,
    captured: None,
    tenant_factory: Callable[..., SeedSummary],
) -> None:
    """A transaction after the moment history is complete to (the recorder has not read
    its commit yet) is left out of the spine, not a refusal of the whole training set."""
    tenant = tenant_factory(users=20, transactions=200).tenants[0]
    with engine.begin() as conn:
        for table in ("transactions", "user_devices", "devices"):
            conn.execute(
                sa.text(
                    f"INSERT INTO freshline.{recording.history_name(table)} SELECT t.*, "
                    "'3'::xid8, NULL, '0/0', NULL, :s, NULL, '0/0' FROM public.{table} t "
                    "WHERE tenant_id = :t".replace("{table}", table)
                ),
                {"s": recording.LONG_AGO, "t": tenant},
            )
        moments = list(
            conn.execute(
                sa.text(
                    "SELECT created_at FROM transactions WHERE tenant_id = :t "
                    "AND created_at <= now() ORDER BY created_at, id"
                ),
                {"t": tenant},
            ).scalars()
        )
    complete_to = moments[len(moments) // 2]
    with engine.begin() as conn:
        was = conn.execute(
            sa.text(
                "SELECT complete_to FROM freshline.history_tables "
                "WHERE source_schema = 'public' AND source_table = 'user_devices'"
            )
        ).scalar_one()
        conn.execute(
            sa.text(
                "UPDATE freshline.history_tables SET complete_to = :c "
                "WHERE source_schema = 'public' AND source_table = 'user_devices'"
            ),
            {"c": complete_to},
        )
    try:
        rows = spine(api, tenant)
        assert rows is not None
        assert rows.num_rows == sum(1 for m in moments if m <= complete_to)
        x, y = dataset(api, tenant)
        assert x.shape == (rows.num_rows, len(MODEL_INPUTS)) and len(y) == rows.num_rows
    finally:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE freshline.history_tables SET complete_to = :c "
                    "WHERE source_schema = 'public' AND source_table = 'user_devices'"
                ),
                {"c": was},
            )
