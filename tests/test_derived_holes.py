"""Writes a user's ordinary database makes that the derived incremental path must see
(freshline.pipeline.core.maintenance), each on a database of its own: a ``where`` calling the
user's own function, writes addressed to a partition, NaN and infinities corrected
after a fold, an update its collation calls equal, and a time column without a zone.
Each would make the incremental path serve other values than the defining query, or
make ``apply`` break the user's own writes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from freshline import Aggregations, Entity, Table, agg, migrations
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cdc.connect import PUBLICATION
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.features import FeatureSet, Registry
from freshline.pipeline.core.maintenance import DerivedPath
from freshline.pipeline.core.repository import Repository
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.deploy import derived_checks
from freshline.pipeline.deploy.plan import plan
from tests.helpers import drop_database, recreate_database

customer = Entity("customer", key="customer_id", type="text", tenant="shop_id")


def declared(name: str, table: str, **options: object) -> FeatureSet:
    rows = Table(table, entities={customer: "customer_id"})
    options.setdefault("aggs", [agg.count(), agg.sum("amount")])
    return Aggregations(
        name,
        entity=customer,
        table=rows,
        time=str(options.pop("time", "placed_at")),
        window="30d",
        incremental=True,
        **options,  # type: ignore[arg-type]
    )


def path_of(fs: FeatureSet) -> DerivedPath:
    assert isinstance(fs.maintenance, DerivedPath)
    return fs.maintenance


@pytest.fixture
def own(base_settings: Settings) -> Iterator[Engine]:
    """A database of the test's own, as the owner."""
    name = f"freshline_holes_{uuid.uuid4().hex[:8]}"
    url = recreate_database(base_settings, name)
    migrations.upgrade(url)
    engine = make_engine(base_settings.model_copy(update={"postgres_url": url}))
    yield engine
    engine.dispose()
    drop_database(base_settings, name)


def run(engine: Engine, *statements: str, **params: object) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(sa.text(statement), params)


def assert_agree(engine: Engine, fs: FeatureSet, keys: list[tuple[str, str]]) -> None:
    """The incremental path gives the defining query's values, now and a day ago."""
    now = datetime.now(UTC)
    for moment in (now, now - timedelta(days=1)):
        full = compute(engine, fs, keys, as_of=moment, path="full").values
        inc = compute(engine, fs, keys, as_of=moment, path="incremental").values
        for key in keys:
            assert inc[key] == full[key], (moment, key, inc[key], full[key])


def repository(*feature_sets: FeatureSet) -> Repository:
    """A repository of ``feature_sets`` alone, for ``plan``."""
    return Repository(
        path=Path("."),
        name="holes",
        schema_version=1,
        definitions=Path("features.py"),
        lock_path=Path("features.lock.json"),
        registry=Registry(feature_sets),
        migrations=None,
        entities=(customer,),
        tables=(),
    )


def fold_all(engine: Engine, fs: FeatureSet) -> None:
    while path_of(fs).fold(engine, max_keys=1000, wait=True):
        pass


def test_a_where_calling_the_users_own_function_keeps_updates_and_deletes_working(
    own: Engine,
) -> None:
    run(
        own,
        "CREATE TABLE orders (id bigserial PRIMARY KEY, shop_id text NOT NULL, "
        "customer_id text NOT NULL, amount numeric, merchant text, placed_at timestamptz NOT NULL)",
        "CREATE FUNCTION is_test_merchant(m text) RETURNS boolean LANGUAGE sql IMMUTABLE "
        "AS $$ SELECT m LIKE 'test-%' $$",
    )
    fs = declared("mine", "orders", where="NOT is_test_merchant(x.merchant)")
    with own.begin() as conn:
        path_of(fs).install(conn)
    run(
        own,
        "INSERT INTO orders (shop_id, customer_id, amount, merchant, placed_at) VALUES "
        "('s', 'c', 10, 'acme', now()), ('s', 'c', 20, 'test-1', now() - interval '2 days')",
    )
    run(own, "UPDATE orders SET amount = amount + 1")  # failed: function does not exist
    run(own, "DELETE FROM orders WHERE merchant = 'acme'")
    assert_agree(own, fs, [("s", "c")])


def test_writes_addressed_to_a_partition_are_logged(own: Engine) -> None:
    run(
        own,
        "CREATE TABLE orders (id bigint NOT NULL, shop_id text NOT NULL, customer_id text "
        "NOT NULL, amount numeric, placed_at timestamptz NOT NULL) PARTITION BY RANGE (placed_at)",
        "CREATE TABLE orders_old PARTITION OF orders FOR VALUES FROM (MINVALUE) TO "
        "(now() - interval '10 days')",
        "CREATE TABLE orders_new PARTITION OF orders FOR VALUES FROM "
        "(now() - interval '10 days') TO (MAXVALUE)",
    )
    fs = declared("parted", "orders")
    with own.begin() as conn:
        path_of(fs).install(conn)
    run(own, "INSERT INTO orders VALUES (1, 's', 'c', 5, now() - interval '20 days')")
    fold_all(own, fs)
    run(own, "INSERT INTO orders_old VALUES (2, 's', 'c', 7, now() - interval '15 days')")
    run(own, "INSERT INTO orders_new VALUES (3, 's', 'c', 9, now() - interval '1 day')")
    assert_agree(own, fs, [("s", "c")])
    run(own, "UPDATE orders_old SET amount = 70 WHERE id = 2")
    run(own, "DELETE FROM orders_new WHERE id = 3")
    assert_agree(own, fs, [("s", "c")])
    fold_all(own, fs)
    run(own, "TRUNCATE orders_old")
    assert_agree(own, fs, [("s", "c")])


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_amount_corrected_after_a_fold_leaves_the_head_exact(
    own: Engine, bad: str
) -> None:
    run(
        own,
        "CREATE TABLE orders (id bigserial PRIMARY KEY, shop_id text NOT NULL, "
        "customer_id text NOT NULL, amount float8, placed_at timestamptz NOT NULL)",
    )
    fs = declared("spent", "orders", aggs=[agg.count(), agg.sum("amount"), agg.mean("amount")])
    with own.begin() as conn:
        path_of(fs).install(conn)
    run(
        own,
        "INSERT INTO orders (shop_id, customer_id, amount, placed_at) "
        "SELECT 's', 'c', 1.0, now() - interval '1 minute' FROM generate_series(1, 70)",
    )
    run(
        own,
        "INSERT INTO orders (shop_id, customer_id, amount, placed_at) "
        "VALUES ('s', 'c', CAST(:bad AS float8), now() - interval '1 minute')",
        bad=bad,
    )
    # The consumers' fold: the current day's head takes the non-finite amount in.
    assert path_of(fs).fold_settled(own, max_keys=1000, wait=True)
    run(own, "UPDATE orders SET amount = 1.0 WHERE amount = CAST(:bad AS float8)", bad=bad)
    assert_agree(own, fs, [("s", "c")])


def test_an_update_its_collation_calls_equal_is_logged(own: Engine) -> None:
    run(
        own,
        "CREATE COLLATION IF NOT EXISTS ci (provider = icu, locale = 'und-u-ks-level2', "
        "deterministic = false)",
        "CREATE TABLE orders (id bigserial PRIMARY KEY, shop_id text NOT NULL, "
        "customer_id text NOT NULL, amount numeric, status text COLLATE ci NOT NULL, "
        "placed_at timestamptz NOT NULL)",
    )
    fs = declared("open", "orders", where="x.status COLLATE \"C\" = 'open'")
    with own.begin() as conn:
        path_of(fs).install(conn)
    run(
        own,
        "INSERT INTO orders (shop_id, customer_id, amount, status, placed_at) "
        "VALUES ('s', 'c', 5, 'open', now() - interval '3 days')",
    )
    fold_all(own, fs)
    run(own, "UPDATE orders SET status = 'OPEN'")  # equal under ci: was never logged
    assert_agree(own, fs, [("s", "c")])


def test_plan_refuses_what_the_incremental_path_cannot_keep(own: Engine) -> None:
    run(
        own,
        "CREATE COLLATION IF NOT EXISTS ci (provider = icu, locale = 'und-u-ks-level2', "
        "deterministic = false)",
        "CREATE TABLE naive (id bigserial PRIMARY KEY, shop_id text NOT NULL, "
        "customer_id text NOT NULL, amount numeric, placed_at timestamp NOT NULL)",
        "CREATE TABLE cased (id bigserial PRIMARY KEY, shop_id text NOT NULL, "
        "customer_id text NOT NULL, amount numeric, sku text COLLATE ci, "
        "placed_at timestamptz NOT NULL)",
    )
    naive = declared("naive", "naive")
    cased = declared(
        "cased", "cased", aggs=[agg.count_distinct("sku"), agg.last("sku", type="str")]
    )
    problems = plan(repository(naive, cased), own, 1, PUBLICATION).problems
    assert any("'naive'" in p and "timestamp without time zone" in p for p in problems), problems
    assert any("'cased'" in p and "nondeterministic" in p and "sku" in p for p in problems), (
        problems
    )


def superuser(engine: Engine) -> Engine:
    """``engine``'s database as the stack's superuser: only it may set
    ``session_replication_role`` (``pg_restore --disable-triggers`` does)."""
    found = make_url(os.environ["FRESHLINE_STACK_POSTGRES_SUPERUSER_URL"])
    url = engine.url.set(username=found.username, password=found.password)
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


def orders_table(engine: Engine, partitioned: bool = False) -> None:
    by = " PARTITION BY RANGE (placed_at)" if partitioned else ""
    key = "id bigint NOT NULL" if partitioned else "id bigserial PRIMARY KEY"
    run(
        engine,
        f"CREATE TABLE orders ({key}, shop_id text NOT NULL, customer_id text NOT NULL, "
        f"amount numeric, placed_at timestamptz NOT NULL){by}",
    )


def test_a_replica_role_session_still_fires_the_triggers(own: Engine) -> None:
    orders_table(own)
    fs = declared("restored", "orders")
    with own.begin() as conn:
        path_of(fs).install(conn)
    admin = superuser(own)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text("SET LOCAL session_replication_role = replica"))
            conn.execute(
                sa.text(
                    "INSERT INTO orders (shop_id, customer_id, amount, placed_at) "
                    "VALUES ('s', 'c', 3, now() - interval '2 days')"
                )
            )
    finally:
        admin.dispose()
    assert_agree(own, fs, [("s", "c")])


def test_plan_names_a_disabled_trigger_and_a_partition_made_after_apply(own: Engine) -> None:
    orders_table(own, partitioned=True)
    run(own, "CREATE TABLE orders_a PARTITION OF orders FOR VALUES FROM (MINVALUE) TO (now())")
    fs = declared("later", "orders")
    repo = repository(fs)
    with own.begin() as conn:
        path_of(fs).install(conn)
    assert plan(repo, own, 1, PUBLICATION).derived == {}
    run(own, "CREATE TABLE orders_b PARTITION OF orders FOR VALUES FROM (now()) TO (MAXVALUE)")
    run(own, "INSERT INTO orders_b VALUES (1, 's', 'c', 4, now() + interval '1 hour')")
    pending = plan(repo, own, 1, PUBLICATION).derived
    assert "public.orders_b" in pending["later"], pending
    with own.begin() as conn:  # what apply --alter-tables does with it
        path_of(fs).install(conn)
    assert plan(repo, own, 1, PUBLICATION).derived == {}
    later = datetime.now(UTC) + timedelta(hours=2)
    full = compute(own, fs, [("s", "c")], as_of=later, path="full").values
    assert compute(own, fs, [("s", "c")], as_of=later, path="incremental").values == full
    run(own, f"ALTER TABLE orders_a DISABLE TRIGGER {path_of(fs).trigger}_i")
    problems = plan(repo, own, 1, PUBLICATION).problems
    assert any("orders_a" in p and "disabled" in p for p in problems), problems


def test_plans_check_as_the_triggers_run_leaves_the_search_path_as_it_was(own: Engine) -> None:
    orders_table(own)
    fs = declared("pathless", "orders")
    with own.connect() as conn:
        before = conn.execute(sa.text("SHOW search_path")).scalar()
        assert derived_checks.check(conn, fs) == []
        assert conn.execute(sa.text("SHOW search_path")).scalar() == before
        conn.rollback()
