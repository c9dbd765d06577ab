"""Declared windowed aggregations (``freshline.Aggregations``) on a repository shaped
unlike the fraud example (tests/repos/shop: text keys, a tenant column, orders): the
generated query, its derived incremental path (installed as apply --alter-tables does)
and the horizon against a plain Python reference over the raw rows, on the real
Postgres; the consumer's path through inserts, updates, moves and deletes; and the
declaration's errors, named with their file and line.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from freshline import Aggregations, Entity, Table, agg
from freshline.consumers.processor import Processor
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cdc.connect import PUBLICATION
from freshline.pipeline.core.declarations import Declaration
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.maintenance import DerivedPath
from freshline.pipeline.core.repository import DefinitionError, Repository, load
from freshline.pipeline.core.types import ChangeEvent, EntityRef, Op
from freshline.pipeline.deploy.plan import plan
from tests.helpers import examples, fresh_version

ROOT = Path(__file__).resolve().parents[1]
SHOP = ROOT / "tests" / "repos" / "shop"
AS_OF = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)

TABLES = """
CREATE TABLE IF NOT EXISTS shop_customers (shop_id text NOT NULL, customer_id text NOT NULL,
                                           PRIMARY KEY (shop_id, customer_id));
CREATE TABLE IF NOT EXISTS shop_orders (id bigserial PRIMARY KEY, shop_id text NOT NULL,
                                        customer_id text NOT NULL, amount numeric(12, 2),
                                        sku text, status text NOT NULL DEFAULT 'placed',
                                        placed_at timestamptz NOT NULL);
CREATE INDEX IF NOT EXISTS shop_orders_by_customer
    ON shop_orders (shop_id, customer_id, placed_at);
"""


@pytest.fixture(scope="module")
def shop(engine: Engine) -> Repository:
    with engine.begin() as conn:
        for statement in TABLES.split(";"):
            if statement.strip():
                conn.execute(sa.text(statement))
    repo = load(SHOP)
    # What apply --alter-tables does with the plan's derived paths: triggers on
    # shop_orders, partials and a log in freshline's schema, filled from the rows.
    result = plan(repo, engine, repo.schema_version, PUBLICATION)
    with engine.begin() as conn:
        for name in result.derived:
            path = repo.registry[name].maintenance
            assert isinstance(path, DerivedPath)
            path.install(conn)
    return repo


@dataclass(frozen=True)
class Order:
    customer: str
    amount: Decimal | None
    sku: str | None
    status: str
    placed_at: datetime


def insert(engine: Engine, shop_id: str, orders: list[Order]) -> list[int]:
    with engine.begin() as conn:
        return [
            conn.execute(
                sa.text(
                    "INSERT INTO shop_orders (shop_id, customer_id, amount, sku, status, "
                    "placed_at) VALUES (:s, :c, :a, :k, :st, :at) RETURNING id"
                ),
                {
                    "s": shop_id,
                    "c": o.customer,
                    "a": o.amount,
                    "k": o.sku,
                    "st": o.status,
                    "at": o.placed_at,
                },
            ).scalar_one()
            for o in orders
        ]


def ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


def reference(orders: list[Order], customer: str, as_of: datetime) -> dict[str, Any]:
    """orders_30d by hand, from the definitions' words, sharing no code with freshline."""
    mine = [o for o in orders if o.customer == customer and o.status != "cancelled"]
    month = [o for o in mine if as_of - 30 * DAY < o.placed_at <= as_of]
    day = [o for o in mine if as_of - DAY < o.placed_at <= as_of]
    amounts = [o.amount for o in month if o.amount is not None]
    n, s, q = len(amounts), sum(amounts, Decimal(0)), sum((a * a for a in amounts), Decimal(0))
    latest = max(month, key=lambda o: (o.placed_at, o.sku is not None, o.sku or ""), default=None)
    return {
        "count": len(month),
        "sum_amount": float(s),
        "mean_amount": float(s / n) if n else None,
        "min_amount": float(min(amounts)) if amounts else None,
        "max_amount": float(max(amounts)) if amounts else None,
        "stddev_amount": math.sqrt(max(n * q - s * s, Decimal(0)) / (n * n)) if n else None,
        "distinct_sku": len({o.sku for o in month if o.sku is not None}),
        "last_sku": latest.sku if latest else None,
        "last_placed_at": ms(latest.placed_at) if latest else None,
        "orders_1d": len(day),
        "big_spend": float(sum((a for a in amounts if a >= 100), Decimal(0))),
    }


def reference_horizon(orders: list[Order], customer: str, as_of: datetime) -> int | None:
    """When the values may next change with time alone: a row (any status: the horizon
    ignores filters, which only makes it earlier) leaves a window, or one enters."""
    mine = [o.placed_at for o in orders if o.customer == customer]
    moments = [
        min(t for t in mine if as_of - w < t <= as_of) + w
        for w in (30 * DAY, DAY)
        if any(as_of - w < t <= as_of for t in mine)
    ]
    moments += [min(t for t in mine if t > as_of)] if any(t > as_of for t in mine) else []
    return ms(min(moments)) if moments else None


def assert_same(got: dict[str, Any] | None, want: dict[str, Any]) -> None:
    assert got is not None
    assert list(got) == list(want)  # the declared fields, in order
    for name, value in want.items():
        if isinstance(value, float) and got[name] is not None:
            assert math.isclose(got[name], value, rel_tol=1e-12, abs_tol=1e-9), (name, got)
        else:
            assert got[name] == value, (name, got[name], value)


# -- the generated query and horizon against the reference ---------------------------

EDGES = [-30 * 86400, -30 * 86400 + 1, -86400, -86400 + 1, 0, 1, -1]
orders_strategy = st.lists(
    st.builds(
        Order,
        customer=st.sampled_from(["c1", "c2", "c3"]),
        amount=st.one_of(
            st.none(),
            st.decimals(min_value=-50, max_value=500, places=2, allow_nan=False),
        ),
        sku=st.sampled_from([None, "a", "b", "c"]),
        status=st.sampled_from(["placed", "placed", "cancelled"]),
        placed_at=st.one_of(st.sampled_from(EDGES), st.integers(-40 * 86400, 2 * 86400)).map(
            lambda s: AS_OF + timedelta(seconds=s)
        ),
    ),
    max_size=14,
)


@settings(
    max_examples=examples(200),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(orders=orders_strategy)
def test_the_generated_query_and_horizon_equal_a_reference_over_the_rows(
    shop: Repository, engine: Engine, orders: list[Order]
) -> None:
    fs = shop.registry["orders_30d"]
    shop_id = f"s{uuid.uuid4().hex[:10]}"
    insert(engine, shop_id, orders)
    keys = [(shop_id, c) for c in ("c1", "c2", "c3", "nobody")]
    derived = fs.maintenance
    assert isinstance(derived, DerivedPath)
    for folded in (False, True):  # the new rows' days logged, then folded into partials
        if folded:
            derived.fold_all(engine)
        for path in ("full", "incremental"):
            batch = compute(engine, fs, keys, as_of=AS_OF, path=path)
            for _, customer in keys:
                got = batch.values[(shop_id, customer)]
                assert_same(got, reference(orders, customer, AS_OF))
                assert batch.valid_until_ms.get((shop_id, customer)) == reference_horizon(
                    orders, customer, AS_OF
                )


# -- the consumer's path -------------------------------------------------------------


@pytest.fixture
def now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        at: datetime = conn.execute(sa.text("SELECT date_trunc('second', now())")).scalar_one()
        return at


def test_inserts_updates_moves_and_deletes_reach_the_served_values(
    shop: Repository, engine: Engine, redis_client: redis.Redis, now: datetime
) -> None:
    """Each change through the consumer's processor: the served entry is the
    reference's at the moment the processor computed, for the old and new customer."""
    fs = shop.registry["orders_30d"]
    shop_id = f"s{uuid.uuid4().hex[:10]}"
    version = fresh_version()
    store = EntryStore(redis_client, version, registry=shop.registry)
    processor = Processor(engine, redis_client, versions=lambda: [version], registry=shop.registry)
    orders = [
        Order("ada", Decimal("120.00"), "a", "placed", now - 2 * DAY),
        Order("ada", Decimal("30.50"), "b", "placed", now - timedelta(hours=3)),
        Order("bob", Decimal("7.25"), "a", "placed", now - 10 * DAY),
    ]
    ids = insert(engine, shop_id, orders)

    def change(op: Op, row: dict[str, Any], before: dict[str, Any] | None = None) -> None:
        event = ChangeEvent(
            table="shop_orders", op=op, tenant=shop_id, row=row, before=before or {}
        )
        processor.apply([event])

    def served(customer: str) -> dict[str, Any] | None:
        (entry,) = store.read([EntityRef(fs.name, shop_id, customer)])
        return None if entry is None else dict(entry.values)

    for order_id, order in zip(ids, orders, strict=True):
        change("c", {"id": order_id, "shop_id": shop_id, "customer_id": order.customer})
    # The values move only with rows here, so the reference at the test's "now" holds.
    assert_same(served("ada"), reference(orders, "ada", now))
    assert_same(served("bob"), reference(orders, "bob", now))
    path = fs.maintenance
    assert isinstance(path, DerivedPath) and fs.path == "incremental"
    path.fold_all(engine)  # the changes below meet folded partials

    # An update of the amount, then a move from ada to bob: both are refreshed.
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE shop_orders SET amount = 99.99 WHERE id = :i"), {"i": ids[0]})
    orders[0] = dataclasses.replace(orders[0], amount=Decimal("99.99"))
    change("u", {"id": ids[0], "shop_id": shop_id, "customer_id": "ada"})
    assert_same(served("ada"), reference(orders, "ada", now))
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE shop_orders SET customer_id = 'bob' WHERE id = :i"), {"i": ids[1]}
        )
    orders[1] = dataclasses.replace(orders[1], customer="bob")
    change(
        "u",
        {"id": ids[1], "shop_id": shop_id, "customer_id": "bob"},
        {"id": ids[1], "shop_id": shop_id, "customer_id": "ada"},
    )
    assert_same(served("ada"), reference(orders, "ada", now))
    assert_same(served("bob"), reference(orders, "bob", now))

    # A cancellation leaves the filter; a delete leaves the table.
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE shop_orders SET status = 'cancelled' WHERE id = :i"), {"i": ids[2]}
        )
        conn.execute(sa.text("DELETE FROM shop_orders WHERE id = :i"), {"i": ids[0]})
    orders[2] = dataclasses.replace(orders[2], status="cancelled")
    del orders[0]
    change("u", {"id": ids[2], "shop_id": shop_id, "customer_id": "bob"})
    change("d", {}, {"id": ids[0], "shop_id": shop_id, "customer_id": "ada"})
    assert_same(served("ada"), reference(orders, "ada", now))
    assert_same(served("bob"), reference(orders, "bob", now))
    assert served("ada")["count"] == 0  # type: ignore[index]


def test_time_passing_moves_rows_out_of_the_windows_at_the_horizon(
    shop: Repository, engine: Engine
) -> None:
    """With no row changing, the values change exactly when the horizon said: computed
    just before it they are the old ones, at it the new ones."""
    fs = shop.registry["orders_30d"]
    shop_id = f"s{uuid.uuid4().hex[:10]}"
    orders = [
        Order("ada", Decimal("10.00"), "a", "placed", AS_OF - 29 * DAY),
        Order("ada", Decimal("20.00"), "b", "placed", AS_OF - timedelta(hours=1)),
    ]
    insert(engine, shop_id, orders)
    key = (shop_id, "ada")
    at = AS_OF
    seen = []
    for _ in range(3):  # the 1d window's row leaves, then the 30d window's row leaves
        batch = compute(engine, fs, [key], as_of=at)
        assert_same(batch.values[key], reference(orders, "ada", at))
        until = batch.valid_until_ms[key]
        assert until == reference_horizon(orders, "ada", at)
        before = datetime.fromtimestamp((until - 1) / 1000, UTC)
        assert_same(compute(engine, fs, [key], as_of=before).values[key], batch.values[key])
        at = datetime.fromtimestamp(until / 1000, UTC)
        seen.append(reference(orders, "ada", at)["count"])
    assert seen == [2, 1, 0]


# -- plan and the declaration's errors ----------------------------------------------


def test_plan_checks_a_declaration_against_the_database(
    shop: Repository, engine: Engine, tmp_path: Path
) -> None:
    result = plan(shop, engine, shop.schema_version, PUBLICATION)
    assert result.problems == []
    assert result.tables == ["shop_customers", "shop_orders"]
    fs = shop.registry["orders_30d"]
    assert isinstance(fs.declared, Declaration) and fs.declared.time == "placed_at"
    assert fs.horizon is not None and "interval '86400 seconds'" in fs.horizon
    # A declared type the generated query does not return: named at its line.
    (tmp_path / "freshline.toml").write_text('[project]\nname = "typo"\n')
    (tmp_path / "features.py").write_text(
        (SHOP / "definitions.py")
        .read_text()
        .replace('agg.last("sku", type="str")', 'agg.last("sku")')
        .replace('"orders_30d"', '"orders_typo"', 1)
    )
    wrong = load(tmp_path)
    problems = plan(wrong, engine, 1, PUBLICATION).problems
    assert any(
        str(tmp_path / "features.py") in p and "last_sku" in p and "text" in p for p in problems
    ), problems


customer = Entity("customer", key="customer_id", type="text", tenant="shop_id")
orders_table = Table("shop_orders", entities={customer: "customer_id"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"aggs": [agg.count()]}, "has no window"),
        ({"window": "30d", "aggs": []}, "declares no aggregation"),
        ({"window": "30d", "aggs": [agg.count(), agg.count()]}, "two aggregations are named"),
        ({"window": "30 days", "aggs": [agg.count()]}, "expected a duration"),
        ({"window": "30d", "aggs": [agg.sum("Amount")]}, "not a lower-case identifier"),
        ({"window": "30d", "aggs": ["count"]}, "is not an aggregation"),
        ({"window": "30d", "aggs": [agg.sum("amount", default=0)]}, "takes no default"),
        # A str default, which the annotations refuse too: the check at declaration time.
        (
            {"window": "30d", "aggs": [agg.mean("amount", default="0")]},  # type: ignore[arg-type]
            "takes no default",
        ),
        ({"window": "30d", "aggs": [agg.mean("amount", digits=-1)]}, "digits= is 0..15"),
        (
            {"window": "30d", "aggs": [agg.count()], "table": Table("shop_customers")},
            "names no column for entity",
        ),
    ],
)
def test_a_bad_declaration_is_refused_with_what_is_wrong(
    kwargs: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {"entity": customer, "table": orders_table, "time": "placed_at"}
    with pytest.raises(ConfigError, match=message):
        Aggregations("bad", **{**args, **kwargs})


def test_a_bad_declaration_in_a_repository_names_its_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "freshline.toml").write_text('[project]\nname = "bad"\n')
    (tmp_path / "features.py").write_text(
        "from freshline import Aggregations, Entity, Table, agg\n"
        "c = Entity('c', key='c_id', type='text')\n"
        "t = Table('t', entities={c: 'c_id'})\n"
        "a = Aggregations('a', entity=c, table=t, time='at', aggs=[agg.count()])\n"
    )
    with pytest.raises(DefinitionError, match=r"features\.py:4: .*has no window"):
        load(tmp_path)


def test_the_generated_sql_names_only_declared_identifiers() -> None:
    fs = Aggregations(
        "q",
        entity=customer,
        table=orders_table,
        time="placed_at",
        window="7d",
        aggs=[agg.max("amount", window="1h"), agg.count()],
    )
    assert "x.placed_at > t.as_of - interval '3600 seconds'" in fs.query  # the 1h FILTER
    assert "x.placed_at > t.as_of - interval '604800 seconds'" in fs.query  # the join
    assert [(f.name, f.type) for f in fs.fields] == [("max_amount", "float"), ("count", "int")]
