"""Online equals offline: what the online path served, the training set gives again.

Hypothesis draws a history for one tenant (inserts, corrections, moves, deletes, late
commits, device and geoip changes, a truncate) on the fraud example and on
``tests/repos/shop``, and runs it as real transactions on a database of the module's own
(a truncate there harms no other test). At drawn moments it computes what the online
path serves, :func:`freshline.pipeline.cache.recompute.compute` as the consumers call it (one
statement, each feature set on its own path: the incremental one where declared), with
the snapshot and ``as_of`` its entries name (``Batch.snapshot``, ``Batch.as_of_us``),
sometimes while a transaction is still open (it commits later: a late commit). At the end, the
evaluator :class:`AtSnapshot` of each read gives every field equal, digit for digit; for
the fraud example so does the independent reference (:mod:`tests.faults.reference`) run
over the history rows that snapshot sees.

History is the history issue's: its tables, its backfill (S0) and its recorder
(:class:`freshline.pipeline.history.recorder.Recorder`, as the consumer role), handed each
committed transaction's changes as Debezium records (images, transaction id, WAL
position, commit time) by a logging trigger that stands in for the connector
(:func:`recording.log`, :func:`recording.drain`).

Budget: ``FRESHLINE_HISTORY_EXAMPLES`` examples per repository: 15 by default (about
15 s for both here, plus the module's database), 60 for a full run (about 60 s); within
4 minutes either way.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.maintenance import install_missing
from freshline.pipeline.core.repository import load
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import FeatureValues
from freshline.pipeline.history import tables
from freshline.pipeline.history.backfill import backfill
from freshline.pipeline.history.evaluator import AtCommitTime, AtSnapshot, Evaluator
from freshline.pipeline.history.recorder import Recorder
from tests.faults import reference
from tests.helpers import REGISTRY, ROOT, drop_database, migrate, recreate_database, role_url
from tests.pipeline.history import recording

EXAMPLES = int(os.environ.get("FRESHLINE_HISTORY_EXAMPLES", "15"))
SHOP = load(ROOT / "tests" / "repos" / "shop")
SHOP_TABLES = """
CREATE TABLE shop_customers (shop_id text NOT NULL, customer_id text NOT NULL,
                             PRIMARY KEY (shop_id, customer_id));
CREATE TABLE shop_orders (id bigserial PRIMARY KEY, shop_id text NOT NULL,
                          customer_id text NOT NULL, amount numeric(12, 2), sku text,
                          status text NOT NULL DEFAULT 'placed', placed_at timestamptz NOT NULL);
CREATE INDEX shop_orders_by_customer ON shop_orders (shop_id, customer_id, placed_at)
"""
FRAUD_TABLES = ("transactions", "users", "user_devices", "devices", "geoip")
CAPTURED = (*FRAUD_TABLES, "shop_customers", "shop_orders")
RANGES = [("10.0.0.0", "10.0.0.255"), ("10.0.1.0", "10.0.1.255"), ("10.0.2.0", "10.0.2.255")]
IPS = ["10.0.0.7", "10.0.1.9", "10.0.2.200", "10.0.9.1"]  # the last in no range
DEVICES = ["d1", "d2", "d3"]
USERS = [1, 2, 3]
CUSTOMERS = ["c1", "c2", "c3"]
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass
class Db:
    owner: Engine
    api: Engine
    recorder: Recorder

    def record(self) -> None:
        """Hand the committed changes to the history recorder, as the stream would."""
        recording.drain(self.owner, self.recorder)


@pytest.fixture(scope="module")
def db(base_settings: Settings) -> Iterator[Db]:
    name = f"freshline_test_{os.getpid()}_history"
    url = recreate_database(base_settings, name)
    migrate(url)
    local = base_settings.model_copy(update={"postgres_url": url})
    owner = make_engine(local)
    with owner.begin() as conn:
        for statement in SHOP_TABLES.split(";"):
            conn.execute(sa.text(statement))
        conn.execute(sa.text("GRANT SELECT ON shop_customers, shop_orders TO freshline_api"))
        install_missing(conn, SHOP.registry.maintenances())
        for n, (start, end) in enumerate(RANGES):
            conn.execute(
                sa.text("INSERT INTO geoip VALUES (:f, :t, :c, :city, 1)"),
                {"f": start, "t": end, "c": f"C{n}", "city": f"city{n}"},
            )
        layouts = [tables.layout(conn, "public", t) for t in CAPTURED]
        for found in layouts:
            tables.create(conn, found, None)
            recording.log(conn, found.table)
    backfill(owner, layouts)  # S0: history's start
    with owner.begin() as conn:  # the recorder's heartbeats would move it; no connector here
        conn.execute(
            sa.text("UPDATE freshline.history_tables SET complete_to = '9999-01-01 00:00+00'")
        )
    api, consumer = (
        make_engine(local.model_copy(update={"postgres_url": role_url(local, role)}))
        for role in ("FRESHLINE_STACK_POSTGRES_API_URL", "FRESHLINE_STACK_POSTGRES_CONSUMER_URL")
    )
    yield Db(owner, api, Recorder(consumer))
    api.dispose()
    consumer.dispose()
    owner.dispose()
    drop_database(base_settings, name)


@dataclass(frozen=True)
class Served:
    """One computation of the online path for a feature set: its values, and the
    snapshot and ``as_of`` its entries name."""

    feature_set: str
    snapshot: str
    as_of: dt.datetime
    values: dict[tuple[str, str], FeatureValues]


def serve(api: Engine, registry: Registry, refs: list[tuple[str, str]]) -> list[Served]:
    """What the online path computes now: :func:`compute` on the engine, one statement
    per feature set on its own path, as the consumers run it; each names the snapshot
    and ``as_of`` it read (``Batch.snapshot``, ``Batch.as_of_us``)."""
    out = []
    for fs in registry:
        batch = compute(api, fs, refs)
        as_of = tables.from_epoch_us(batch.as_of_us)
        out.append(Served(fs.name, batch.snapshot, as_of, batch.values))
    return out


def offline(
    api: Engine, registry: Registry, reads: list[Served], refs: list[tuple[str, str]]
) -> None:
    """Every read's values, again from history AtSnapshot and AtCommitTime of its
    ``as_of``, equal field for field."""
    with api.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        evaluator = Evaluator.on(conn)
        for fs in registry:
            mine = [r for r in reads if r.feature_set == fs.name]
            got = evaluator.evaluate(fs, {AtSnapshot(r.snapshot, r.as_of): refs for r in mine})
            at = evaluator.evaluate(fs, {AtCommitTime(r.as_of): refs for r in mine})
            for read in mine:
                moment = AtSnapshot(read.snapshot, read.as_of)
                assert got[moment] == read.values, (fs.name, read.snapshot, read.as_of)
                # each commit was stamped before the next read and after the reads that
                # saw it open, so the commit-time reading is the same
                assert at[AtCommitTime(read.as_of)] == read.values, (fs.name, read.as_of)
        conn.rollback()


def by_reference(api: Engine, read: Served, refs: list[tuple[str, str]]) -> None:
    """The fraud reference over the history rows the read's snapshot sees (temporary
    views named after the tables shadow them: ``pg_temp`` is searched first)."""
    snap = f"'{read.snapshot}'::pg_snapshot"
    visible = (
        f"pg_visible_in_snapshot(h._fl_xmin, {snap}) AND "
        f"(h._fl_xmax IS NULL OR NOT pg_visible_in_snapshot(h._fl_xmax, {snap}))"
    )
    with api.connect() as conn:
        for table in FRAUD_TABLES:
            columns = _columns(conn, table)
            conn.execute(
                sa.text(
                    f"CREATE TEMP VIEW {table} AS SELECT {columns} FROM "
                    f"freshline.{recording.history_name(table)} h WHERE {visible}"
                )
            )
        expected = reference.values(reference.load(conn, refs), refs, read.as_of)
        conn.rollback()
    assert read.values == expected[read.feature_set], (read.feature_set, read.snapshot)


def _columns(conn: Connection, table: str) -> str:
    names = conn.execute(
        sa.text(
            "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:t) AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum"
        ),
        {"t": f"public.{table}"},
    ).scalars()
    return ", ".join(f"h.{n}" for n in names)


# -- the fraud example ----------------------------------------------------------------

amounts = st.decimals(min_value=Decimal("0.01"), max_value=Decimal("999.99"), places=2)
hours_ago = st.integers(min_value=-2, max_value=100 * 24)
fraud_op = st.one_of(
    st.tuples(
        st.just("insert"),
        st.sampled_from(USERS),
        amounts,
        st.sampled_from(["m1", "m2", "m3"]),
        st.sampled_from([*DEVICES, None]),
        st.sampled_from([*IPS, None]),
        hours_ago,
    ),
    st.tuples(st.just("correct"), st.integers(0, 9), amounts),
    st.tuples(st.just("move"), st.integers(0, 9), st.sampled_from(USERS)),
    st.tuples(st.just("delete"), st.integers(0, 9)),
    st.tuples(st.just("link"), st.sampled_from(USERS), st.sampled_from(DEVICES), hours_ago),
    st.tuples(st.just("unlink"), st.sampled_from(USERS), st.sampled_from(DEVICES)),
    st.tuples(st.just("risk"), st.sampled_from(DEVICES), st.floats(0, 1, width=32)),
    st.tuples(
        st.just("geoip"), st.integers(0, len(RANGES) - 1), st.sampled_from(["C0", "C1", "XX"])
    ),
    st.tuples(st.just("truncate")),
)
# a transaction: its operations, and whether a read happens while it is open (it then
# commits after that read: a late commit)
steps = st.lists(
    st.tuples(st.lists(fraud_op, min_size=1, max_size=3), st.booleans(), st.booleans()),
    min_size=1,
    max_size=8,
)


TENANT = {"transactions": "tenant_id", "shop_orders": "shop_id"}


def _nth(conn: Connection, table: str, tenant: str, n: int) -> int | None:
    ids = (
        conn.execute(
            sa.text(f"SELECT id FROM {table} WHERE {TENANT[table]} = :t ORDER BY id"),
            {"t": tenant},
        )
        .scalars()
        .all()
    )
    return ids[n % len(ids)] if ids else None


def fraud_apply(conn: Connection, tenant: str, op: tuple[Any, ...], now: dt.datetime) -> None:
    kind = op[0]
    if kind == "insert":
        _, user, amount, merchant, device, ip, hours = op
        conn.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, device_id, ip, "
                "created_at) VALUES (:t, :u, :a, :m, :d, CAST(:ip AS inet), :at)"
            ),
            {
                "t": tenant,
                "u": user,
                "a": amount,
                "m": merchant,
                "d": device,
                "ip": ip,
                "at": now - dt.timedelta(hours=hours),
            },
        )
    elif kind in ("correct", "move", "delete"):
        target = _nth(conn, "transactions", tenant, op[1])
        if target is None:
            return
        if kind == "correct":
            conn.execute(
                sa.text("UPDATE transactions SET amount = :a WHERE tenant_id = :t AND id = :i"),
                {"a": op[2], "t": tenant, "i": target},
            )
        elif kind == "move":
            conn.execute(
                sa.text("UPDATE transactions SET user_id = :u WHERE tenant_id = :t AND id = :i"),
                {"u": op[2], "t": tenant, "i": target},
            )
        else:
            conn.execute(
                sa.text("DELETE FROM transactions WHERE tenant_id = :t AND id = :i"),
                {"t": tenant, "i": target},
            )
    elif kind == "link":
        _, user, device, hours = op
        conn.execute(
            sa.text(
                "INSERT INTO devices (tenant_id, id, fingerprint, risk_score, first_seen) "
                "VALUES (:t, :d, 'f', 0.25, :at) ON CONFLICT DO NOTHING"
            ),
            {"t": tenant, "d": device, "at": now - dt.timedelta(hours=hours)},
        )
        conn.execute(
            sa.text("INSERT INTO user_devices VALUES (:t, :u, :d) ON CONFLICT DO NOTHING"),
            {"t": tenant, "u": user, "d": device},
        )
    elif kind == "unlink":
        conn.execute(
            sa.text(
                "DELETE FROM user_devices WHERE tenant_id = :t AND user_id = :u AND device_id = :d"
            ),
            {"t": tenant, "u": op[1], "d": op[2]},
        )
    elif kind == "risk":
        conn.execute(
            sa.text("UPDATE devices SET risk_score = :r WHERE tenant_id = :t AND id = :d"),
            {"r": op[2], "t": tenant, "d": op[1]},
        )
    elif kind == "geoip":
        conn.execute(
            sa.text("UPDATE geoip SET country = :c WHERE ip_from = CAST(:f AS inet)"),
            {"c": op[2], "f": RANGES[op[1]][0]},
        )
    else:
        conn.execute(sa.text("TRUNCATE user_devices"))


def run(
    db: Db,
    registry: Registry,
    tenant: str,
    refs: list[tuple[str, str]],
    steps_: list[Any],
    apply: Any,
    setup: list[str],
) -> list[Served]:
    """Set the tenant up, run the drawn transactions, reading where drawn; the reads."""
    now = dt.datetime.now(dt.UTC)
    with db.owner.begin() as conn:
        for statement in setup:
            conn.execute(sa.text(statement), {"t": tenant})
    db.record()
    reads = serve(db.api, registry, refs)  # before any change: every change is after it
    for ops, read_open, read_after in steps_:
        with db.owner.begin() as conn:
            for op in ops:
                apply(conn, tenant, op, now)
            # a reader waits for an open TRUNCATE's lock: no read while one is open
            if read_open and not any(op[0] == "truncate" for op in ops):
                reads += serve(db.api, registry, refs)
        db.record()
        if read_after:
            reads += serve(db.api, registry, refs)
    reads += serve(db.api, registry, refs)
    return reads


@SETTINGS
@given(history=steps)
def test_fraud_training_values_at_each_served_snapshot_equal_what_was_served(
    db: Db, history: list[Any]
) -> None:
    tenant = f"o{uuid.uuid4().hex[:10]}"
    refs = [(tenant, str(u)) for u in USERS]
    setup = [
        "INSERT INTO freshline.tenants (id, name) VALUES (:t, :t)",
        "INSERT INTO users (tenant_id, id) SELECT :t, unnest(ARRAY[1, 2, 3])",
    ]
    reads = run(db, REGISTRY, tenant, refs, history, fraud_apply, setup)
    offline(db.api, REGISTRY, reads, refs)
    for read in reads:
        by_reference(db.api, read, refs)


# -- the shop -------------------------------------------------------------------------

shop_op = st.one_of(
    st.tuples(
        st.just("insert"),
        st.sampled_from(CUSTOMERS),
        st.one_of(st.none(), amounts),
        st.sampled_from(["s1", "s2", None]),
        st.sampled_from(["placed", "cancelled"]),
        st.integers(min_value=-2, max_value=40 * 24),
    ),
    st.tuples(st.just("correct"), st.integers(0, 9), amounts),
    st.tuples(st.just("cancel"), st.integers(0, 9)),
    st.tuples(st.just("move"), st.integers(0, 9), st.sampled_from(CUSTOMERS)),
    st.tuples(st.just("delete"), st.integers(0, 9)),
    st.tuples(st.just("truncate")),
)
shop_steps = st.lists(
    st.tuples(st.lists(shop_op, min_size=1, max_size=3), st.booleans(), st.booleans()),
    min_size=1,
    max_size=8,
)


def shop_apply(conn: Connection, shop: str, op: tuple[Any, ...], now: dt.datetime) -> None:
    kind = op[0]
    if kind == "insert":
        _, customer, amount, sku, status, hours = op
        conn.execute(
            sa.text(
                "INSERT INTO shop_orders (shop_id, customer_id, amount, sku, status, placed_at) "
                "VALUES (:s, :c, :a, :k, :st, :at)"
            ),
            {
                "s": shop,
                "c": customer,
                "a": amount,
                "k": sku,
                "st": status,
                "at": now - dt.timedelta(hours=hours),
            },
        )
        return
    if kind == "truncate":
        conn.execute(sa.text("TRUNCATE shop_orders"))
        return
    target = _nth(conn, "shop_orders", shop, op[1])
    if target is None:
        return
    if kind == "correct":
        conn.execute(
            sa.text("UPDATE shop_orders SET amount = :a WHERE id = :i"), {"a": op[2], "i": target}
        )
    elif kind == "cancel":
        conn.execute(
            sa.text("UPDATE shop_orders SET status = 'cancelled' WHERE id = :i"), {"i": target}
        )
    elif kind == "move":
        conn.execute(
            sa.text("UPDATE shop_orders SET customer_id = :c WHERE id = :i"),
            {"c": op[2], "i": target},
        )
    else:
        conn.execute(sa.text("DELETE FROM shop_orders WHERE id = :i"), {"i": target})


@SETTINGS
@given(history=shop_steps)
def test_shop_training_values_at_each_served_snapshot_equal_what_was_served(
    db: Db, history: list[Any]
) -> None:
    shop = f"s{uuid.uuid4().hex[:10]}"
    refs = [(shop, c) for c in CUSTOMERS]
    setup = ["INSERT INTO shop_customers SELECT :t, unnest(ARRAY['c1', 'c2', 'c3'])"]
    reads = run(db, SHOP.registry, shop, refs, history, shop_apply, setup)
    offline(db.api, SHOP.registry, reads, refs)
