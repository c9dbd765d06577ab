"""The skew report on logged reads: an entry corrupted by hand is an exact mismatch; a
correct entry that the rows have since moved past is stale, not a mismatch.

The reads go through the API with the served log on, through Kafka and the sink into
Parquet; history is the fraud tables captured with the recording triggers
(:mod:`tests.pipeline.history.recording`), as the evaluator's own tests do."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.demo import check_served
from freshline.consumers.kafka import admin_client
from freshline.consumers.served import ServedSink
from freshline.consumers.topics import ensure
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_tenant
from freshline.pipeline.core.codec import HEADER
from freshline.pipeline.core.keys import feature_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import SERVED, qualified
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.observe.served_files import ParquetLog
from freshline.pipeline.observe.skew import check
from tests.helpers import REGISTRY, Api, cli, fresh_version, running
from tests.pipeline.history import recording

LOG = {"Freshline-Log": "1"}


@pytest.fixture
def logged(settings: Settings) -> Settings:
    prefixed = settings.model_copy(
        update={
            "topic_prefix": f"t{uuid.uuid4().hex[:8]}.",
            "schema_version": fresh_version(),
            "local_cache_size": 0,
        }
    )
    ensure(admin_client(prefixed), 1, topics=[qualified(prefixed, SERVED)])
    return prefixed


@pytest.fixture
def key(engine: Engine, tenant: str) -> str:
    """A tenant with user 7 (made before history is captured, so history has them)."""
    made = create_tenant(engine, tenant)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO users (tenant_id, id) VALUES (:t, 7)"), {"t": tenant})
    return made


@pytest.fixture
def recorded(engine: Engine, key: str, captured: None) -> Iterator[None]:
    with engine.begin() as conn:
        recording.record(conn, "transactions")
    yield
    with engine.begin() as conn:
        recording.unrecord(conn, "transactions")


@pytest.fixture
def api(
    logged: Settings, engine: Engine, redis_client: redis.Redis, key: str, recorded: None
) -> Iterator[Api]:
    app = create_app(
        logged,
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        keep_snapshots=True,
        registry=REGISTRY,
    )
    with running(app, key) as client:
        yield client


def add_transaction(engine: Engine, tenant: str, amount: str) -> None:
    """One committed transaction of user 7, stamped with its commit time in history."""
    with engine.begin() as conn:
        xid = int(conn.execute(sa.text("SELECT pg_current_xact_id()::text")).scalar_one())
        conn.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, created_at) "
                "VALUES (:t, 7, :a, 'm', now() - interval '1 hour')"
            ),
            {"t": tenant, "a": amount},
        )
    with engine.begin() as conn:
        recording.stamp(conn, ["transactions"], xid)


def corrupt(client: redis.Redis, key: str) -> None:
    """Change one value of the entry at ``key``, keeping its watermark and TTL."""
    raw = client.get(key)
    assert isinstance(raw, bytes)
    version, computed, values = orjson.loads(raw[HEADER:])
    values[1] = values[1] + 1000  # txn_sum, the second field
    body = orjson.dumps([version, computed, values])
    assert client.set(key, raw[:HEADER] + body, keepttl=True, xx=True)


def logged_rows(settings: Settings, directory: Path, n: int) -> list[dict[str, Any]]:
    sink = ServedSink(settings, REGISTRY, directory, poll_s=0.2)
    try:
        sink.run(max_rows=n, timeout=60)
    finally:
        sink.close()
    assert sink.written == n
    return list(ParquetLog(directory).read().to_pylist())


def test_a_corrupted_entry_is_a_mismatch_and_a_stale_one_is_stale(
    api: Api,
    logged: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    tmp_path: Path,
) -> None:
    assert REGISTRY["txn_90d"].field_names[1] == "txn_sum"
    url = "/v1/features/txn_90d/7"
    add_transaction(engine, tenant, "5.00")
    computed = api.get(url, headers=LOG)  # the read-through computes it, keeps its snapshot
    assert computed.json()["source"] == "computed", computed.text
    fresh = api.get(url, headers=LOG)
    assert fresh.json()["source"] == "hit"
    add_transaction(engine, tenant, "7.00")  # no consumer runs: the entry stays as it was
    stale = api.get(url, headers=LOG)
    assert stale.json()["values"] == fresh.json()["values"]
    corrupt(redis_client, feature_key(logged.schema_version, EntityRef("txn_90d", tenant, "7")))
    wrong = api.get(url, headers=LOG)
    assert wrong.json()["values"]["txn_sum"] == fresh.json()["values"]["txn_sum"] + 1000

    rows = logged_rows(logged, tmp_path, 4)
    with engine.connect() as conn, conn.begin():
        report = check(conn, REGISTRY, rows)
    skew = report.sets["txn_90d"]
    assert skew.reads == 4 and not skew.unchecked, skew.as_json()
    assert skew.checked == 4
    assert skew.mismatched == 1 and report.mismatched == 1
    assert skew.fields["txn_sum"].mismatched == 1
    assert skew.fields["txn_count"].mismatched == 0
    assert skew.missing == 0
    # The stale read was right for its snapshot: stale, not wrong. The two reads before
    # the second transaction were fresh.
    assert skew.compared == 3 and skew.stale == 1
    assert skew.fields["txn_sum"].stale == 1 and skew.fields["txn_count"].stale == 1
    smape = skew.fields["txn_sum"].smape
    assert smape is not None and smape == pytest.approx((7 / 8.5) / 3)
    assert len(skew.stale_ages_ms) == 1
    out = orjson.loads(orjson.dumps(report.as_json()))
    assert out["mismatched"] == 1

    # The command line says the same, and fails on the mismatch.
    done = cli(
        "skew",
        "--dir",
        str(tmp_path),
        "--since",
        "1h",
        "--json",
        FRESHLINE_POSTGRES_URL=logged.postgres_url,
    )
    assert done.returncode == 1, done.stderr
    [printed] = orjson.loads(done.stdout)["feature_sets"]
    assert (printed["mismatched"], printed["stale"], printed["checked"]) == (1, 1, 4)
    table = cli(
        "skew", "--dir", str(tmp_path), FRESHLINE_POSTGRES_URL=logged.postgres_url, COLUMNS="120"
    )
    assert "txn_sum" in table.stdout and "txn_90d" in table.stdout, table.stderr


def test_reads_whose_snapshot_was_not_kept_are_counted_unchecked(
    logged: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    key: str,
    recorded: None,
    tmp_path: Path,
) -> None:
    add_transaction(engine, tenant, "3.00")
    app = create_app(
        logged,
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        keep_snapshots=False,
        registry=REGISTRY,
    )
    with running(app, key) as client:
        assert client.get("/v1/features/txn_90d/7", headers=LOG).status_code == 200
    rows = logged_rows(logged, tmp_path, 1)
    with engine.connect() as conn, conn.begin():
        skew = check(conn, REGISTRY, rows).sets["txn_90d"]
    assert skew.checked == 0 and skew.mismatched == 0
    assert skew.unchecked == {"snapshot not kept": 1}


def test_the_demo_ends_with_its_training_set_and_a_skew_report_of_no_mismatch(
    api: Api,
    logged: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "/v1/features/txn_90d/7"
    add_transaction(engine, tenant, "5.00")
    assert api.get(url, headers=LOG).json()["source"] == "computed"
    assert api.get(url, headers=LOG).json()["source"] == "hit"
    add_transaction(engine, tenant, "7.00")  # no consumer runs: the entry goes stale
    assert api.get(url, headers=LOG).status_code == 200

    assert check_served(logged, 3, tmp_path, tenant) == []
    said = capsys.readouterr().out
    assert "the served log: 3 logged requests, 3 reads written" in said
    assert f"training set: 2 {tenant} transactions since history started" in said
    assert "skew: served values against the training set's" in said
    assert "txn_90d         3 reads: 3 checked, 0 wrong, 1 stale" in said
    assert "exact mismatches: 0 of 3 reads checked at their entry's snapshot" in said

    # Not vacuous: an entry changed by hand and served fails the demo, saying why.
    corrupt(redis_client, feature_key(logged.schema_version, EntityRef("txn_90d", tenant, "7")))
    assert api.get(url, headers=LOG).status_code == 200
    assert check_served(logged, 1, tmp_path, tenant) == [
        "1 exact mismatches: served values unlike their snapshot's"
    ]
    assert "txn_90d         4 reads: 4 checked, 1 wrong" in capsys.readouterr().out
