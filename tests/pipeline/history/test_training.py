"""``training_set`` and ``freshline training-set``: a spine in, a typed frame out, and
one clear line for input it cannot use."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.core.repository import load
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.history.evaluator import AtCommitTime, Evaluator
from freshline.pipeline.history.training import SpineError, training_set
from tests.helpers import REGISTRY, ROOT, cli, error_line, role_url
from tests.pipeline.history import recording
from tests.pipeline.history.test_evaluator import txn

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

HOUR = dt.timedelta(hours=1)
FRAUD = ROOT / "examples" / "fraud"


@pytest.fixture
def spine(engine: Engine, captured: None, tenant: str, t: dt.datetime) -> Any:
    """Two users' transactions committed an hour apart, and a spine that asks about
    them at three moments, with a label column, out of time order."""
    with engine.begin() as conn:
        recording.version(
            conn, "transactions", txn(tenant, 1, 7, t - 3 * HOUR, "10.00"), t - 3 * HOUR
        )
        recording.version(
            conn, "transactions", txn(tenant, 2, 7, t - 2 * HOUR, "30.00"), t - 2 * HOUR
        )
        recording.version(conn, "transactions", txn(tenant, 3, 8, t - 2 * HOUR, "5.00"), t - HOUR)
    return pa.table(
        {
            "tenant_id": [tenant, tenant, tenant, tenant],
            "user_id": pa.array([7, 8, 7, 8], pa.int64()),
            "timestamp": pa.array(
                [t - HOUR, t - HOUR, t - 150 * dt.timedelta(minutes=1), t],
                pa.timestamp("us", tz="UTC"),
            ),
            "label": [True, False, False, True],
        }
    )


def test_a_training_set_is_the_spine_with_typed_feature_columns_in_its_order(
    api: Engine, spine: Any, tenant: str, t: dt.datetime
) -> None:
    got = training_set(FRAUD, spine, ["txn_90d", "geo:distinct_countries_30d"], engine=api)
    names = [f"txn_90d__{f}" for f in REGISTRY["txn_90d"].field_names]
    assert got.column_names == [*spine.column_names, *names, "geo__distinct_countries_30d"]
    assert got.select(spine.column_names).equals(spine)
    assert got.column("txn_90d__txn_count").to_pylist() == [2, 1, 1, 1]
    assert got.column("txn_90d__txn_sum").to_pylist() == [40.0, 5.0, 10.0, 5.0]
    assert got.schema.field("txn_90d__txn_count").type == pa.int64()
    assert got.schema.field("txn_90d__txn_mean").type == pa.float64()
    assert got.schema.field("txn_90d__last_txn_at").type == pa.timestamp("ms", tz="UTC")
    # entries hold timestamps as epoch ms; so does the column
    last = got.column("txn_90d__last_txn_at")[0].as_py()
    assert last == (t - 2 * HOUR).replace(microsecond=123000)
    # each value is what the evaluator gives at that row's moment
    with api.connect() as conn:
        evaluator = Evaluator.on(conn)
        for n, row in enumerate(spine.to_pylist()):
            moment = AtCommitTime(row["timestamp"])
            values = evaluator.evaluate(
                REGISTRY["txn_90d"], {moment: [(tenant, str(row["user_id"]))]}
            )
            assert (
                values[moment][(tenant, str(row["user_id"]))]["txn_count"]
                == got.column("txn_90d__txn_count")[n].as_py()
            )


def test_delay_reads_each_row_as_of_its_moment_minus_the_delay(api: Engine, spine: Any) -> None:
    got = training_set(FRAUD, spine, ["txn_90d:txn_count"], engine=api, delay=HOUR)
    assert got.column("txn_90d__txn_count").to_pylist() == [2, 0, 0, 1]


def test_a_spine_file_and_the_command_line(
    api: Engine, settings: Settings, spine: Any, tmp_path: Path
) -> None:
    pq.write_table(spine, tmp_path / "spine.parquet")
    done = cli(
        "training-set",
        str(tmp_path / "spine.parquet"),
        "--features",
        "txn_90d,geo",
        "--out",
        str(tmp_path / "train.parquet"),
        FRESHLINE_POSTGRES_URL=role_url(settings, "FRESHLINE_STACK_POSTGRES_API_URL"),
    )
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stderr and "4 rows, 11 feature columns" in done.stderr
    written = pq.read_table(tmp_path / "train.parquet")
    assert written.equals(training_set(FRAUD, spine, ["txn_90d", "geo"], engine=api))
    # the same spine as CSV, timestamps with their zone
    import pyarrow.csv as pcsv

    pcsv.write_csv(spine, tmp_path / "spine.csv")
    from_csv = training_set(FRAUD, tmp_path / "spine.csv", ["txn_90d"], engine=api)
    assert from_csv.column("txn_90d__txn_count").to_pylist() == [2, 1, 1, 1]


@pytest.mark.parametrize(
    ("change", "features", "message"),
    [
        (
            "drop:user_id",
            ["txn_90d"],
            "the spine has no column 'user_id' (the key of entity 'user')",
        ),
        ("naive", ["txn_90d"], "spine column 'timestamp' is a timestamp without a time zone"),
        ("float_ids", ["txn_90d"], "spine row 0: invalid entity id 7.5"),
        ("none", ["txn_9d"], "unknown feature set 'txn_9d'"),
        ("none", ["geo:countries"], "feature set 'geo' has no field 'countries'"),
    ],
)
def test_bad_input_is_one_clear_error(
    api: Engine, spine: Any, change: str, features: list[str], message: str
) -> None:
    if change == "drop:user_id":
        spine = spine.drop_columns(["user_id"])
    elif change == "naive":
        spine = spine.set_column(2, "timestamp", spine.column("timestamp").cast(pa.timestamp("us")))
    elif change == "float_ids":
        spine = spine.set_column(1, "user_id", pa.array([7.5, 8.0, 7.0, 8.0]))
    with pytest.raises(SpineError) as caught:
        training_set(FRAUD, spine, features, engine=api)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_command_line_says_bad_input_in_one_line(
    settings: Settings, spine: Any, tmp_path: Path
) -> None:
    pq.write_table(spine.drop_columns(["tenant_id"]), tmp_path / "spine.parquet")
    done = cli(
        "training-set",
        str(tmp_path / "spine.parquet"),
        "--features",
        "txn_90d",
        "--out",
        str(tmp_path / "train.parquet"),
        FRESHLINE_POSTGRES_URL=role_url(settings, "FRESHLINE_STACK_POSTGRES_API_URL"),
    )
    assert "the spine has no column 'tenant_id'" in error_line(done)


def test_the_repository_loads_from_its_directory() -> None:
    assert load(FRAUD).registry.names() == REGISTRY.names()


def test_at_snapshot_reads_each_row_as_its_snapshot_saw(
    engine: Engine, api: Engine, captured: None, tenant: str
) -> None:
    """A spine of entries' snapshots: each row's values are what that snapshot saw, with
    the row's timestamp as ``as_of``; a change committed after it is not there."""
    with engine.begin() as conn:
        recording.record(conn, "transactions")
    try:
        add = sa.text(
            "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, created_at) "
            "VALUES (:t, 7, :a, 'm', now() - interval '1 hour')"
        )
        reads: list[Any] = []
        for amount in ("5.00", "7.00"):
            with engine.begin() as conn:
                conn.execute(add, {"t": tenant, "a": amount})
            with api.connect() as conn:
                reads.append(
                    conn.execute(sa.text("SELECT pg_current_snapshot()::text, now()")).one()
                )
        spine = pa.table(
            {
                "tenant_id": [tenant, tenant],
                "user_id": pa.array([7, 7], pa.int64()),
                "timestamp": pa.array([r[1] for r in reads], pa.timestamp("us", tz="UTC")),
                "snapshot": [r[0] for r in reads],
            }
        )
        got = training_set(FRAUD, spine, ["txn_90d:txn_sum"], engine=api, at="snapshot")
        assert got.column("txn_90d__txn_sum").to_pylist() == [5.0, 12.0]
        with pytest.raises(SpineError, match="delay= goes with at='commit_time'"):
            training_set(FRAUD, spine, ["txn_90d"], engine=api, at="snapshot", delay=HOUR)
    finally:
        with engine.begin() as conn:
            recording.unrecord(conn, "transactions")
