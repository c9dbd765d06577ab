"""The fraud example's declared ``txn_90d`` and ``geo``: their derived incremental paths
give the full path's values, whatever happened to the rows (and, for ``geo``, to the
geoip ranges its countries are looked up in).

All on a private database of this module's own (TRUNCATE and the fold are
database-wide). The property test drives random sequences of inserts, updates,
deletes, moves between users and partial folds through the real triggers, then compares
both paths value by value, at a fixed ``as_of`` whose window edges the generated times
straddle: with changed days logged, and again once all are folded.
(:mod:`tests.test_derived` holds the generator to the same bar over random
declarations.)
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.features import FeatureSet
from freshline.pipeline.core.maintenance import DerivedPath
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import FeatureValues
from freshline.pipeline.observe.reconcile import compare, reconcile
from tests.helpers import REGISTRY, cli, drop_database, examples, migrate, recreate_database

AS_OF = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
EDGE = AS_OF - timedelta(days=90)  # txn_90d's window starts after it
EDGE30 = AS_OF - timedelta(days=30)  # geo's
FS = REGISTRY["txn_90d"]
assert isinstance(FS.maintenance, DerivedPath)
PATH: DerivedPath = FS.maintenance
GEO = REGISTRY["geo"]
assert isinstance(GEO.maintenance, DerivedPath)
GEO_PATH: DerivedPath = GEO.maintenance
PATHS: list[DerivedPath] = [PATH, GEO_PATH]
SETS = [FS, GEO]
IPS = ["11.0.0.5", "11.0.1.7", "11.0.2.9", "11.0.3.3", None]  # US, GB, DE, no range, none
USERS = (1, 2, 3)
REVISION = "head"
_tenants = itertools.count(1)


@pytest.fixture(scope="module")
def db(base_settings: Settings) -> Iterator[Engine]:
    name = f"freshline_incremental_{uuid.uuid4().hex[:8]}"
    url = recreate_database(base_settings, name)
    migrate(url, REVISION)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    reset_geoip(engine)
    yield engine
    engine.dispose()
    drop_database(base_settings, name)


def reset_geoip(engine: Engine) -> None:
    """Three ranges, US, GB and DE (the property test changes them)."""
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM geoip"))
        conn.execute(
            sa.text(
                "INSERT INTO geoip (ip_from, ip_to, country, city, asn) VALUES "
                "('11.0.0.0', '11.0.0.255', 'US', 'Austin', 1), "
                "('11.0.1.0', '11.0.1.255', 'GB', 'Leeds', 2), "
                "('11.0.2.0', '11.0.2.255', 'DE', 'Berlin', 3)"
            )
        )


def new_tenant() -> str:
    return f"inc{next(_tenants)}{uuid.uuid4().hex[:6]}"


def both(
    engine: Engine,
    tenant: str,
    users: tuple[int, ...] = USERS,
    as_of: datetime | None = AS_OF,
    sets: list[FeatureSet] | None = None,
) -> tuple[dict[tuple[str, ...], FeatureValues], dict[tuple[str, ...], FeatureValues]]:
    """Both paths on one snapshot, keyed (tenant, entity) for txn_90d alone, or
    (feature set, tenant, entity) when ``sets`` is given."""
    refs = [(tenant, str(u)) for u in users]
    full: dict[tuple[str, ...], FeatureValues] = {}
    inc: dict[tuple[str, ...], FeatureValues] = {}
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        for fs in sets or [FS]:
            f = compute(conn, fs, refs, as_of=as_of, path="full").values
            i = compute(conn, fs, refs, as_of=as_of, path="incremental").values
            full.update({(fs.name, *k) if sets else k: v for k, v in f.items()})
            inc.update({(fs.name, *k) if sets else k: v for k, v in i.items()})
        conn.rollback()
    return full, inc


def insert(engine: Engine, tenant: str, rows: list[tuple[Any, ...]]) -> list[int]:
    """Rows of (user, created_at, amount, merchant, device[, ip]) in one statement."""
    with engine.begin() as conn:
        return list(
            conn.execute(
                sa.text(
                    "INSERT INTO transactions "
                    "(tenant_id, user_id, created_at, amount, merchant_id, "
                    "device_id, ip) SELECT :t, * FROM unnest(CAST(:u AS bigint[]), "
                    "CAST(:at AS timestamptz[]), CAST(:a AS numeric[]), CAST(:m AS text[]), "
                    "CAST(:d AS text[]), CAST(:ip AS inet[])) RETURNING id"
                ),
                {
                    "t": tenant,
                    "u": [r[0] for r in rows],
                    "at": [r[1] for r in rows],
                    "a": [r[2] for r in rows],
                    "m": [r[3] for r in rows],
                    "d": [r[4] for r in rows],
                    "ip": [r[5] if len(r) > 5 else None for r in rows],
                },
            ).scalars()
        )


def fold_some(engine: Engine, tenant: str, days: int) -> None:
    """Fold ``days`` logged (key, day)s (any tenant's), as the consumers' upkeep does;
    0: none."""
    if days:
        for path in PATHS:
            path.fold(engine, max_keys=days, wait=True)


def fold_all(engine: Engine) -> None:
    for path in PATHS:
        path.fold_all(engine)


def pending_users(engine: Engine, tenant: str, paths: list[DerivedPath] | None = None) -> int:
    """Users of ``tenant`` with a logged day in any of ``paths`` (both by default)."""
    logs = " UNION ".join(
        f"SELECT user_id FROM {p.log} WHERE tenant_id = :t" for p in paths or PATHS
    )
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(f"SELECT count(DISTINCT user_id) FROM ({logs}) AS g"), {"t": tenant}
            ).scalar_one()
        )


# -- the property ---------------------------------------------------------------------

# Times around both ends of both windows and the day boundaries next to them (the edge
# day is where the buckets hand over to source rows), a few in the future.
_times = st.one_of(
    st.integers(-3 * 86400, 100 * 86400).map(lambda s: AS_OF - timedelta(seconds=s)),
    st.integers(-14 * 3600, 14 * 3600).map(lambda s: EDGE + timedelta(seconds=s)),
    st.integers(-14 * 3600, 14 * 3600).map(lambda s: EDGE30 + timedelta(seconds=s)),
    st.sampled_from(
        [
            EDGE,
            EDGE + timedelta(microseconds=1),
            EDGE - timedelta(microseconds=1),
            EDGE30,
            EDGE30 + timedelta(microseconds=1),
            AS_OF,
            AS_OF + timedelta(microseconds=1),
            datetime(2026, 9, 1, tzinfo=UTC),
            datetime(2026, 9, 2, tzinfo=UTC),
            datetime(2026, 11, 30, tzinfo=UTC),
        ]
    ),
)
_amounts = st.decimals(min_value=Decimal("0.01"), max_value=Decimal("999.99"), places=2)
_row = st.tuples(
    st.sampled_from(USERS),
    _times,
    _amounts.map(str),
    st.sampled_from(["m1", "m2", "m3", "m4"]),
    st.sampled_from(["d1", "d2", "d3", None]),
    st.sampled_from(IPS),
)
_op = st.one_of(
    st.tuples(st.just("insert"), st.lists(_row, min_size=1, max_size=4)),
    st.tuples(st.just("amount"), st.integers(0, 50), _amounts.map(str)),
    st.tuples(st.just("time"), st.integers(0, 50), _times),
    st.tuples(st.just("move"), st.integers(0, 50), st.sampled_from(USERS)),
    st.tuples(st.just("merchant"), st.integers(0, 50), st.sampled_from(["m1", "m5"])),
    st.tuples(st.just("device"), st.integers(0, 50), st.sampled_from(["d1", "d4", None])),
    st.tuples(st.just("ip"), st.integers(0, 50), st.sampled_from(IPS)),
    st.tuples(
        st.just("geoip"),
        st.sampled_from(["11.0.0.0", "11.0.1.0", "11.0.3.0"]),
        st.sampled_from(["US", "GB", "FR", None]),
    ),
    st.tuples(st.just("delete"), st.integers(0, 50)),
    st.tuples(st.just("delete_user"), st.sampled_from(USERS)),
    st.tuples(st.just("noop_update"), st.sampled_from(USERS)),
)
# After some changes, fold a few logged days.
_step = st.tuples(_op, st.sampled_from([0, 0, 0, 1, 3]))
_UPDATES = {
    "amount": "amount = CAST(:v AS numeric)",
    "time": "created_at = :v",
    "move": "user_id = :v",
    "merchant": "merchant_id = :v",
    "device": "device_id = :v",
    "ip": "ip = CAST(:v AS inet)",
}


@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(_step, min_size=1, max_size=25))
def test_incremental_equals_full_after_any_sequence_of_changes(
    db: Engine, steps: list[tuple[tuple[Any, ...], int]]
) -> None:
    tenant = new_tenant()
    ids: list[int] = []
    for i, (op, folds) in enumerate(steps):
        change(db, tenant, ids, op)
        fold_some(db, tenant, folds)
        if i == len(steps) // 2:  # and halfway
            full, inc = both(db, tenant, sets=SETS)
            assert inc == full
    event(f"users with logged days: {pending_users(db, tenant)}/3")
    full, inc = both(db, tenant, sets=SETS)
    assert inc == full
    # And with as_of = now.
    full_now, inc_now = both(db, tenant, as_of=None, sets=SETS)
    assert inc_now == full_now
    # And once every logged day is folded.
    fold_all(db)
    assert pending_users(db, tenant) == 0
    full, inc = both(db, tenant, sets=SETS)
    assert inc == full


def change(db: Engine, tenant: str, ids: list[int], op: tuple[Any, ...]) -> None:
    """Apply one generated change; ``ids`` are the rows inserted so far."""
    kind = op[0]
    if kind == "insert":
        ids += insert(db, tenant, op[1])
        return
    with db.begin() as conn:
        if kind == "geoip":  # a range changes country, appears or disappears
            conn.execute(
                sa.text("DELETE FROM geoip WHERE ip_from = CAST(:f AS inet)"), {"f": op[1]}
            )
            if op[2] is not None:
                conn.execute(
                    sa.text(
                        "INSERT INTO geoip (ip_from, ip_to, country, city, asn) VALUES "
                        "(CAST(:f AS inet), CAST(:f AS inet) + 255, :c, 'X', 9)"
                    ),
                    {"f": op[1], "c": op[2]},
                )
        elif kind == "delete_user":
            conn.execute(
                sa.text("DELETE FROM transactions WHERE tenant_id = :t AND user_id = :u"),
                {"t": tenant, "u": op[1]},
            )
        elif kind == "noop_update":
            conn.execute(
                sa.text(
                    "UPDATE transactions SET status = 'reversed' "
                    "WHERE tenant_id = :t AND user_id = :u"
                ),
                {"t": tenant, "u": op[1]},
            )
        elif ids:
            row = ids[op[1] % len(ids)]
            if kind == "delete":
                conn.execute(
                    sa.text("DELETE FROM transactions WHERE tenant_id = :t AND id = :id"),
                    {"t": tenant, "id": row},
                )
            else:
                conn.execute(
                    sa.text(
                        f"UPDATE transactions SET {_UPDATES[kind]} "
                        "WHERE tenant_id = :t AND id = :id"
                    ),
                    {"t": tenant, "id": row, "v": op[2]},
                )


# -- the cases the property relies on, pinned ---------------------------------------


def test_the_window_max_drops_when_the_max_row_leaves_or_is_deleted(db: Engine) -> None:
    tenant = new_tenant()
    day = AS_OF - timedelta(days=10)
    big, *_ = insert(
        db,
        tenant,
        [
            (1, day, "500.00", "m1", None),
            (1, day + timedelta(hours=1), "20.00", "m1", None),
            (1, EDGE + timedelta(hours=1), "900.00", "m2", None),
        ],
    )
    full, inc = both(db, tenant, (1,))
    assert inc == full and inc[(tenant, "1")]["txn_max"] == 900.0
    # The 900 row leaves the window as time moves on by two hours.
    later = AS_OF + timedelta(hours=2)
    full, inc = both(db, tenant, (1,), as_of=later)
    assert inc == full and inc[(tenant, "1")]["txn_max"] == 500.0
    fold_all(db)
    with db.begin() as conn:
        conn.execute(
            sa.text("DELETE FROM transactions WHERE tenant_id = :t AND id = :id"),
            {"t": tenant, "id": big},
        )
    # Logged, that day is read from its source rows; its partial still holds 500.
    assert bucket_max(db, tenant, day) == Decimal("500.00")
    full, inc = both(db, tenant, (1,), as_of=later)
    assert inc == full and inc[(tenant, "1")]["txn_max"] == 20.0
    fold_all(db)
    assert bucket_max(db, tenant, day) == Decimal("20.00")
    full, inc = both(db, tenant, (1,), as_of=later)
    assert inc == full and inc[(tenant, "1")]["txn_max"] == 20.0


def bucket_max(engine: Engine, tenant: str, day: datetime) -> Decimal:
    with engine.connect() as conn:
        return Decimal(
            conn.execute(
                sa.text(f"SELECT mx3 FROM {PATH.days} WHERE tenant_id = :t AND day = :d"),
                {"t": tenant, "d": day.date()},
            ).scalar_one()
        )


def test_a_moved_row_leaves_one_users_buckets_for_the_others(db: Engine) -> None:
    tenant = new_tenant()
    (row,) = insert(db, tenant, [(1, AS_OF - timedelta(days=1), "42.00", "m9", "d9")])
    fold_all(db)
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE transactions SET user_id = 2 WHERE tenant_id = :t AND id = :id"),
            {"t": tenant, "id": row},
        )
    full, inc = both(db, tenant, (1, 2))  # the move logged: the day of user 1 and of 2
    assert inc == full
    fold_all(db)
    with db.begin() as conn:
        left = conn.execute(
            sa.text(f"SELECT count(*) FROM {PATH.days} WHERE tenant_id = :t AND user_id = 1"),
            {"t": tenant},
        ).scalar_one()
    assert left == 0
    full, inc = both(db, tenant, (1, 2))
    assert inc == full
    assert inc[(tenant, "2")]["distinct_merchants"] == 1
    assert inc[(tenant, "1")]["txn_count"] == 0


def test_reconcile_finds_and_repairs_drift(db: Engine) -> None:
    tenant = new_tenant()
    insert(db, tenant, [(u, AS_OF - timedelta(days=u), "10.00", "m1", "d1") for u in USERS])
    fold_all(db)
    with db.begin() as conn:  # drift no fold would make
        conn.execute(
            sa.text(f"UPDATE {PATH.days} SET mx3 = 999 WHERE tenant_id = :t AND user_id = 2"),
            {"t": tenant},
        )
    report = reconcile(db, [(tenant, str(u)) for u in USERS], as_of=AS_OF, registry=REGISTRY)
    assert report.checked == 3
    assert [(m.tenant, m.entity) for m in report.drifted] == [(tenant, "2")]
    assert report.drifted[0].fields == {"txn_max": (999.0, 10.0)}
    assert report.repaired == 1
    again = reconcile(db, [(tenant, str(u)) for u in USERS], as_of=AS_OF, registry=REGISTRY)
    assert again.drifted == []


def test_a_geoip_change_reaches_geo_days_already_folded(db: Engine) -> None:
    """geo's partials hold each row's country as of its fold: a range changed later
    (its country updated, or the range removed) must make those days read from the
    rows again, on the incremental path, with no write to the transactions."""
    reset_geoip(db)
    try:
        _geoip_change(db)
    finally:
        reset_geoip(db)


def _geoip_change(db: Engine) -> None:
    tenant = new_tenant()
    insert(
        db,
        tenant,
        [
            (1, AS_OF - timedelta(days=5), "1.00", "m1", None, "11.0.0.5"),  # US
            (1, AS_OF - timedelta(days=4), "1.00", "m1", None, "11.0.1.7"),  # GB
            (2, AS_OF - timedelta(days=50), "1.00", "m1", None, "11.0.1.9"),  # GB, long ago
        ],
    )
    fold_all(db)

    def geo() -> dict[tuple[str, ...], FeatureValues]:
        full, inc = both(db, tenant, users=(1, 2), sets=[GEO])
        assert inc == full
        return inc

    before = geo()
    assert before[("geo", tenant, "1")]["distinct_countries_30d"] == 2
    assert before[("geo", tenant, "2")]["last_country"] == "GB"
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE geoip SET country = 'US', city = 'Boston' WHERE country = 'GB'")
        )
    after = geo()
    assert after[("geo", tenant, "1")] == {
        "last_country": "US",
        "last_city": "Boston",
        "distinct_countries_30d": 1,
    }
    assert after[("geo", tenant, "2")]["last_country"] == "US"
    with db.begin() as conn:
        conn.execute(sa.text("DELETE FROM geoip WHERE city = 'Boston'"))
    gone = geo()
    assert gone[("geo", tenant, "1")]["last_country"] is None
    assert gone[("geo", tenant, "2")]["last_country"] is None
    fold_all(db)
    assert geo() == gone


def test_a_feature_set_without_an_incremental_query_refuses_that_path() -> None:
    with pytest.raises(ConfigError, match="no incremental path"):
        REGISTRY.with_paths({"device_risk": "incremental"})
    assert REGISTRY.with_paths({"txn_90d": "full"})["txn_90d"].path == "full"
    assert (
        REGISTRY["txn_90d"].fingerprint()
        == REGISTRY.with_paths({"txn_90d": "full"})["txn_90d"].fingerprint()
    )


@pytest.mark.parametrize("first", ["delete", "insert"])
def test_concurrent_writers_of_one_member_do_not_wait_and_stay_exact(
    db: Engine, first: str
) -> None:
    """A delete of a member's latest row and an insert of the same member on another
    day, both open at once under READ COMMITTED: the triggers only append to the log, so
    the second writer does not wait for the first (a 10 s statement_timeout is its
    deadline), and both paths agree before and after the fold."""
    tenant = new_tenant()
    days = [AS_OF - timedelta(days=d) for d in (9, 6, 3)]
    _, _, newest = insert(db, tenant, [(1, day, "10.00", "m1", "d1") for day in days])
    fold_all(db)
    statements = {
        "delete": (
            "DELETE FROM transactions WHERE tenant_id = :t AND id = :id",
            {"t": tenant, "id": newest},
        ),
        "insert": (
            "INSERT INTO transactions (tenant_id, user_id, created_at, amount, "
            "merchant_id, device_id) VALUES (:t, 1, :at, 5, 'm1', 'd1')",
            {"t": tenant, "at": AS_OF - timedelta(days=1)},
        ),
    }
    second = "insert" if first == "delete" else "delete"
    with db.connect() as holder, db.connect() as other:
        tx = holder.begin()
        holder.execute(sa.text(statements[first][0]), statements[first][1])
        with other.begin():
            other.execute(sa.text("SET LOCAL statement_timeout = '10s'"))
            other.execute(sa.text(statements[second][0]), statements[second][1])
        full, inc = both(db, tenant, (1,))  # the second's change alone
        assert inc == full
        tx.commit()
    full, inc = both(db, tenant, (1,))
    assert inc == full
    fold_all(db)
    full, inc = both(db, tenant, (1,))
    assert inc == full
    assert inc[(tenant, "1")]["distinct_merchants"] == 1
    assert compare(db, [(tenant, "1")], as_of=AS_OF, registry=REGISTRY) == []


def test_a_fold_takes_only_committed_deltas(db: Engine) -> None:
    """A fold runs beside an open writer: it folds what is committed, the writer's
    log rows stay, and every snapshot on the way gives the full path's values."""
    tenant = new_tenant()
    insert(db, tenant, [(1, AS_OF - timedelta(days=d), "10.00", f"m{d}", "d1") for d in (2, 4)])
    with db.connect() as holder:
        tx = holder.begin()
        holder.execute(
            sa.text("DELETE FROM transactions WHERE tenant_id = :t AND merchant_id = 'm2'"),
            {"t": tenant},
        )
        holder.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, created_at, amount, merchant_id) "
                "VALUES (:t, 1, :at, 70, 'm7')"
            ),
            {"t": tenant, "at": AS_OF - timedelta(days=1)},
        )
        assert (PATH.fold(db, max_keys=1_000_000, wait=True) or 0) >= 1
        assert pending_users(db, tenant, [PATH]) == 0  # the open writer's log rows are not visible
        full, inc = both(db, tenant, (1,))
        assert inc == full and inc[(tenant, "1")]["txn_count"] == 2
        tx.commit()
    assert pending_users(db, tenant, [PATH]) == 1
    full, inc = both(db, tenant, (1,))
    assert inc == full and inc[(tenant, "1")]["distinct_merchants"] == 2
    fold_all(db)
    full, inc = both(db, tenant, (1,))
    assert inc == full and inc[(tenant, "1")]["txn_max"] == 70.0


def test_a_fold_that_cannot_take_the_lock_returns_at_once(db: Engine) -> None:
    tenant = new_tenant()
    insert(db, tenant, [(1, AS_OF - timedelta(days=1), "1.00", "m1", None)])
    with db.connect() as holder:
        tx = holder.begin()
        holder.execute(sa.text(f"SELECT pg_advisory_xact_lock({PATH.lock})"))  # as a fold
        assert PATH.fold(db, max_keys=1_000_000, wait=False) is None
        assert pending_users(db, tenant, [PATH]) == 1
        tx.rollback()
    assert (PATH.fold(db, max_keys=1_000_000, wait=False) or 0) >= 1
    assert pending_users(db, tenant, [PATH]) == 0


def test_a_fold_holds_no_lock_once_postgres_has_answered(db: Engine) -> None:
    """A consumer cut off from Postgres just after its fold ran (a black hole: no reply
    arrives, nothing is closed) must not leave the fold lock held, or every other fold
    and rebuild waits on it (found by the postgres-blackhole fault scenario). Checked
    from another session at the moment the fold's statement has returned: no advisory
    lock is held."""
    tenant = new_tenant()
    insert(db, tenant, [(1, AS_OF - timedelta(days=1), "1.00", "m1", None)])
    held: list[int] = []

    def after(conn: sa.Connection, cursor: Any, statement: str, *_: Any) -> None:
        if f"{PATH.prefix}_fold(" in statement:
            with db.connect() as other:
                held.append(
                    int(
                        other.execute(
                            sa.text(
                                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                "AND granted AND pid <> pg_backend_pid() AND database = "
                                "(SELECT oid FROM pg_database WHERE datname = current_database())"
                            )
                        ).scalar_one()
                    )
                )

    sa.event.listen(db, "after_cursor_execute", after)
    try:
        assert (PATH.fold(db, max_keys=1_000_000, wait=True) or 0) >= 1
    finally:
        sa.event.remove(db, "after_cursor_execute", after)
    assert held == [0]
    assert pending_users(db, tenant, [PATH]) == 0


def test_freshline_buckets_fold_and_status(db: Engine) -> None:
    tenant = new_tenant()
    insert(db, tenant, [(u, AS_OF - timedelta(days=1), "1.00", "m1", None) for u in USERS])
    url = db.url.render_as_string(hide_password=False)

    def run(*args: str, code: int = 0) -> str:
        r = cli("buckets", *args, FRESHLINE_POSTGRES_URL=url)
        assert r.returncode == code, r.stderr
        return r.stdout + r.stderr  # results on stdout, progress on stderr

    status = run("status")  # every path, each under its feature set's name
    assert "path      txn_90d" in status and "path      geo" in status
    assert "pending   " in status and pending_users(db, tenant) == len(USERS)
    # One path: geo's days stay logged.
    assert "buckets of txn_90d: folded" in run("fold", "--set", "txn_90d")
    assert pending_users(db, tenant, [PATH]) == 0
    assert pending_users(db, tenant, [GEO_PATH]) == len(USERS)
    assert "has no incremental path" in run("fold", "--set", "device_risk", code=2)
    assert "buckets of geo: folded the deltas of" in run("fold", "--entities", "100")
    assert pending_users(db, tenant) == 0
    assert run("status").count("pending   0 deltas of 0 entities") == 2


def test_freshline_buckets_prune_drops_a_path_no_longer_declared(db: Engine) -> None:
    url = db.url.render_as_string(hide_password=False)

    def run(*args: str) -> str:
        r = cli("buckets", "prune", *args, FRESHLINE_POSTGRES_URL=url)
        assert r.returncode == 0, r.stderr
        return r.stdout + r.stderr

    assert "no derived path to prune" in run()
    old = DerivedPath("txn_90d", PATH.entity, PATH.decl, "0ldd1ge5")  # an earlier version's
    with db.begin() as conn:
        old.install(conn)
    listed = run()
    assert old.prefix in listed and "transactions" in listed and "not dropped" in listed
    with db.connect() as conn:
        assert old.installed(conn)
    assert "dropped 1 derived path" in run("--yes")
    with db.connect() as conn:
        assert not old.installed(conn) and PATH.installed(conn) and GEO_PATH.installed(conn)
    assert "no derived path to prune" in run()


def test_a_fold_of_more_than_big_delta_rows_is_exact(db: Engine) -> None:
    """A fold of many logged days at once: the same values, for additions and for
    removals."""
    reset_geoip(db)
    tenant = new_tenant()
    rows = [
        (
            1 + i % 3,
            AS_OF - timedelta(hours=i % 2000),
            f"{1 + i % 997}.{i % 100:02d}",
            f"m{i % 37}",
            f"d{i % 5}" if i % 4 else None,
            IPS[i % len(IPS)],
        )
        for i in range(1500)
    ]
    ids = insert(db, tenant, rows)
    fold_all(db)
    full, inc = both(db, tenant, sets=SETS)
    assert inc == full and inc[("txn_90d", tenant, "1")]["txn_count"] > 0
    with db.begin() as conn:
        conn.execute(
            sa.text("DELETE FROM transactions WHERE tenant_id = :t AND id = ANY(:ids)"),
            {"t": tenant, "ids": ids[:1200]},
        )
    fold_all(db)
    full, inc = both(db, tenant, sets=SETS)
    assert inc == full


def test_a_member_that_leaves_and_comes_back_is_counted_once(db: Engine) -> None:
    """m1's only row is deleted and folded (its latest day must go with it), then m1
    appears on a later day: the day it left keeps m2's count, and both count."""
    tenant = new_tenant()
    day, later = AS_OF - timedelta(days=5), AS_OF - timedelta(days=2)
    first, _ = insert(db, tenant, [(1, day, "1.00", "m1", "d1"), (1, day, "2.00", "m2", "d1")])
    fold_all(db)
    with db.begin() as conn:
        conn.execute(
            sa.text("DELETE FROM transactions WHERE tenant_id = :t AND id = :id"),
            {"t": tenant, "id": first},
        )
    fold_all(db)
    insert(db, tenant, [(1, later, "3.00", "m1", "d2")])
    for _ in range(2):  # logged, then folded
        full, inc = both(db, tenant, (1,))
        assert inc == full and inc[(tenant, "1")]["distinct_merchants"] == 2
        fold_all(db)
