"""Who may change what a derived incremental path serves (freshline.pipeline.core.maintenance):
freshline's owner alone, through the triggers on the user's tables and the fold. Another
login on the same database, one with no grant at all or one of freshline's own (the
API's, the consumers', Debezium's), can neither write the path's log or partials nor
attach its trigger functions to a table of its own; a trigger function refuses to run
as any trigger but the one it was made for; and a writer of the user's table with no
grant in freshline's schema still has every write logged.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, make_url

from freshline import migrations
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.features import FeatureSet
from freshline.pipeline.core.maintenance import DerivedPath
from freshline.pipeline.core.repository import load
from freshline.pipeline.core.settings import Settings
from tests.helpers import ROOT, cli, drop_database, recreate_database

TABLES = """
CREATE TABLE orders (id bigserial PRIMARY KEY, shop_id text NOT NULL,
                     customer_id text NOT NULL, amount numeric(12, 2), sku text,
                     placed_at timestamptz NOT NULL);
CREATE TABLE skus (sku text PRIMARY KEY, category text)
"""
REPO = load(ROOT / "tests" / "repos" / "orders")
SPEND = REPO.registry["spend"]
"""Windows of a day or more, and a sum an UPDATE moves: heads, and deltas the reads add."""
CATEGORIES = REPO.registry["categories"]
"""With a lookup: trigger functions on a second table too."""
PATHS = (SPEND, CATEGORIES)
OTHERS = ("no grants", "api")
"""The logins the holes were shown with: a new role, and the read API's."""


def path_of(fs: FeatureSet) -> DerivedPath:
    assert isinstance(fs.maintenance, DerivedPath)
    return fs.maintenance


def superuser_engine(url: sa.URL, superuser: str = "") -> Engine:
    """``url``'s database as the stack's superuser (roles are made by it: the stack's
    owner may not), whose login ``superuser`` (a URL) or the environment names."""
    found = make_url(superuser or os.environ.get("FRESHLINE_STACK_POSTGRES_SUPERUSER_URL") or url)
    return sa.create_engine(
        url.set(username=found.username, password=found.password), poolclass=sa.pool.NullPool
    )


@pytest.fixture(scope="module")
def db(base_settings: Settings) -> Iterator[Engine]:
    """A database of the module's own, as the owner: its tables and both paths."""
    name = f"freshline_roles_{uuid.uuid4().hex[:8]}"
    url = recreate_database(base_settings, name)
    migrations.upgrade(url)
    engine = make_engine(base_settings.model_copy(update={"postgres_url": url}))
    with engine.begin() as conn:
        for statement in TABLES.split(";"):
            conn.execute(sa.text(statement))
        for fs in PATHS:
            path_of(fs).install(conn)
    yield engine
    engine.dispose()
    drop_database(base_settings, name)


@contextmanager
def new_role(db: Engine, *grants: str, superuser_url: str = "") -> Iterator[Engine]:
    """A new login role, granted ``grants`` (``{role}`` in them is its name) by the
    owner; its engine on ``db``'s database. Dropped afterwards."""
    role, password = f"freshline_test_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    superuser = superuser_engine(db.url, superuser_url)
    with superuser.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'"))
    with db.begin() as conn:
        for grant in grants:
            conn.execute(sa.text(grant.format(role=role)))
    engine = sa.create_engine(
        db.url.set(username=role, password=password), poolclass=sa.pool.NullPool
    )
    try:
        yield engine
    finally:
        engine.dispose()
        with superuser.begin() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))
        superuser.dispose()


def freshline_logins(database: str, api: str, consumer: str, cdc: str = "") -> dict[str, Engine]:
    """The logins of freshline's roles on ``database``: the read API's and the
    consumers' (URLs), and Debezium's when ``cdc`` names Connect's secrets file."""
    urls = {"api": api, "consumer": consumer}
    if cdc:
        found = dict(
            line.split("=", 1) for line in Path(cdc).read_text().splitlines() if "=" in line
        )
        urls["cdc"] = (
            make_url(api)
            .set(username=found["database.user"], password=found["database.password"])
            .render_as_string(hide_password=False)
        )
    return {
        name: sa.create_engine(make_url(url).set(database=database), poolclass=sa.pool.NullPool)
        for name, url in urls.items()
    }


@pytest.fixture(scope="module")
def logins(db: Engine) -> Iterator[dict[str, Engine]]:
    """A new role with no grant at all, and each of freshline's roles' logins (the
    stack's: ``.stack/env`` and Connect's secrets file)."""
    env = os.environ
    api = env.get("FRESHLINE_STACK_POSTGRES_API_URL", "")
    consumer = env.get("FRESHLINE_STACK_POSTGRES_CONSUMER_URL", "")
    cdc = env.get("FRESHLINE_CONNECT_SECRETS_FILE", "")
    if not (api and consumer and cdc and Path(cdc).is_file()):
        pytest.skip("the stack names no API, consumer or Debezium login (scripts/stack up)")
    theirs = freshline_logins(str(db.url.database), api, consumer, cdc)
    with new_role(db) as nobody:
        yield {"no grants": nobody, **theirs}
    for engine in theirs.values():
        engine.dispose()


def served(db: Engine, fs: FeatureSet, shop: str) -> dict[str, Any]:
    """What a read of ``shop``'s customer c1 at now serves (the incremental path)."""
    return dict(compute(db, fs, [(shop, "c1")], path="incremental").values[(shop, "c1")])


def place(db: Engine, ago: str, *amounts: int) -> str:
    """A new shop whose customer c1 placed an order of each of ``amounts`` ``ago``
    (an interval) before now, in one statement; the shop."""
    shop = f"s{uuid.uuid4().hex[:10]}"
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO orders (shop_id, customer_id, amount, sku, placed_at) "
                "SELECT :s, 'c1', a, 'k1', now() - CAST(:ago AS interval) "
                "FROM unnest(CAST(:a AS numeric[])) AS a"
            ),
            {"s": shop, "a": list(amounts), "ago": ago},
        )
    return shop


def refused(engine: Engine, *statements: str) -> str:
    """Run ``statements`` in one transaction as ``engine``'s login; the error that
    refused them (empty if none did)."""
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(sa.text(statement))
    except sa.exc.DBAPIError as exc:
        return str(exc.orig).splitlines()[0]
    return ""


def test_no_other_login_can_forge_a_served_aggregate(db: Engine, logins: dict[str, Engine]) -> None:
    """The read adds the deltas in the log to the customer's head: a log row that no
    write made, inserted by a login that is not freshline's owner, would change the
    served sum. Every such insert is refused and the value stays."""
    since_midnight = sa.text("SELECT extract(epoch FROM now() - date_trunc('day', now(), 'UTC'))")
    with db.connect() as conn:
        if conn.execute(since_midnight).scalar_one() < 120:
            pytest.skip("too close to the start of the UTC day for a head of orders in it")
    shop = place(db, "1 minute", 300, 400)
    path = path_of(SPEND)
    with db.begin() as conn:
        conn.execute(sa.text("SET LOCAL freshline.head_rows = 1"))
        assert path.fold_settled(conn, max_keys=1000, wait=True)
    before = served(db, SPEND, shop)
    assert (before["count"], before["sum_amount"]) == (2, 700)
    (moved,) = path.moving
    with db.connect() as conn:
        day, cut = conn.execute(
            sa.text(f"SELECT day, cut FROM {path.head} WHERE shop_id = :s"), {"s": shop}
        ).one()
    before_cut = f"'{cut.isoformat()}'::timestamptz - interval '1 second'"
    forged = (
        f"INSERT INTO {path.log} (shop_id, customer_id, day, at, till, ds{moved.index}) "
        f"VALUES ('{shop}', 'c1', '{day}', {before_cut}, {before_cut}, 3000000)"
    )
    for name in OTHERS:
        error = refused(logins[name], forged)
        assert served(db, SPEND, shop) == before, name
        assert "permission denied" in error, name


def test_no_other_login_can_empty_the_partials_with_a_trigger_of_its_own(
    db: Engine, logins: dict[str, Engine]
) -> None:
    """A TEMP table of the login's own with an AFTER TRUNCATE trigger calling the path's
    truncate trigger function, truncated, would empty every tenant's partials (and the
    log, so no fold repairs them). The trigger is refused; partials and values stay."""
    shop = place(db, "3 days", 1, 2, 3)
    path = path_of(SPEND)
    path.fold_all(db)
    count = sa.text(f"SELECT count(*) FROM {path.days}")
    with db.connect() as conn:
        rows = conn.execute(count).scalar_one()
    before = served(db, SPEND, shop)
    assert rows and before["count"] == 3
    for name in OTHERS:
        error = refused(
            logins[name],
            "CREATE TEMP TABLE fl_bait (x int) ON COMMIT DROP",
            "CREATE TRIGGER fl_bait AFTER TRUNCATE ON fl_bait FOR EACH STATEMENT "
            f"EXECUTE FUNCTION freshline.{path.prefix}_t()",
            "TRUNCATE fl_bait",
        )
        with db.connect() as conn:
            assert conn.execute(count).scalar_one() == rows, name
        assert served(db, SPEND, shop) == before, name
        assert "permission denied" in error, name


# (function, the trigger that attaches it, the statement that fires it): each a trigger
# it was not made for, on another table or at another time, level or operation.
MISUSES = [
    ("t", "AFTER TRUNCATE ON fl_bait FOR EACH STATEMENT", "TRUNCATE fl_bait"),
    ("t", "BEFORE TRUNCATE ON orders FOR EACH STATEMENT", "TRUNCATE orders"),
    ("d", "AFTER UPDATE ON orders REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT", "U"),
    ("i", "AFTER INSERT ON orders REFERENCING NEW TABLE AS new_rows FOR EACH ROW", "I"),
    ("i", "AFTER INSERT ON fl_bait REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT", "B"),
    ("l0t", "AFTER TRUNCATE ON orders FOR EACH STATEMENT", "TRUNCATE orders"),
]
FIRES = {
    "U": "UPDATE orders SET amount = amount",
    "I": "INSERT INTO orders (shop_id, customer_id, amount, placed_at) VALUES ('s', 'c', 1, now())",
    "B": "INSERT INTO fl_bait VALUES (1)",
}


@pytest.mark.parametrize(("function", "trigger", "fire"), MISUSES)
def test_a_trigger_function_runs_only_as_the_trigger_it_was_made_for(
    db: Engine, function: str, trigger: str, fire: str
) -> None:
    """Even as the owner, who may attach the path's trigger functions anywhere, each
    refuses to run as any trigger but its own (TG_RELID, TG_WHEN, TG_LEVEL, TG_OP), and
    the statement that fired it fails."""
    fs = CATEGORIES if function.startswith("l") else SPEND
    name = f"freshline.{path_of(fs).prefix}_{function}()"
    with db.connect() as conn, conn.begin():
        conn.execute(sa.text("CREATE TEMP TABLE fl_bait (x int, shop_id text) ON COMMIT DROP"))
        conn.execute(sa.text(f"CREATE TRIGGER fl_misuse {trigger} EXECUTE FUNCTION {name}"))
        with pytest.raises(sa.exc.DBAPIError, match="runs only as") as raised:
            conn.execute(sa.text(FIRES.get(fire, fire)))
        assert getattr(raised.value.orig, "sqlstate", "") == "09000"  # triggered_action_exception


def test_a_writer_with_no_grant_on_freshline_has_its_writes_logged(db: Engine) -> None:
    """The trigger functions are revoked from PUBLIC, but EXECUTE is checked when a
    trigger is made, not when it fires: a login that may only write the user's table
    has its INSERT, UPDATE and DELETE logged (the triggers run as freshline's owner),
    and the values stay exact; it can touch neither the log nor the partials."""
    path = path_of(SPEND)
    with new_role(
        db,
        "GRANT SELECT, INSERT, UPDATE, DELETE ON orders TO {role}",
        "GRANT USAGE ON SEQUENCE orders_id_seq TO {role}",
    ) as writer:
        shop = place(writer, "2 days", 5, 6)
        key = [(shop, "c1")]
        logged = sa.text(f"SELECT count(*) FROM {path.log} WHERE shop_id = :s")
        for write in (
            "UPDATE orders SET amount = amount + 1 WHERE shop_id = :s",
            "DELETE FROM orders WHERE shop_id = :s AND amount = 7",
            None,
        ):
            with db.connect() as conn:
                assert conn.execute(logged, {"s": shop}).scalar_one() > 0, write
            for fs in PATHS:
                inc = compute(db, fs, key, path="incremental").values
                assert inc == compute(db, fs, key, path="full").values, write
            path.fold_all(db)
            if write is not None:
                with writer.begin() as conn:
                    conn.execute(sa.text(write), {"s": shop})
        assert served(db, SPEND, shop) == {"count": 1, "sum_amount": 6.0}
        for statement in (f"DELETE FROM {path.log}", f"DELETE FROM {path.days}"):
            assert "permission denied" in refused(writer, statement)


# A schema of the writer's own, with operators and functions named as those the insert
# trigger's function uses (its check's <> and =, AT TIME ZONE's timezone(), the cast to
# date), open to every role: each raises, naming the role it ran as.
LENT = "LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'lent to %', current_user; END$$"
LURE = [
    "CREATE SCHEMA lure",
    "GRANT USAGE ON SCHEMA lure TO PUBLIC",  # else the owner, whom it would lure, sees none
    f"CREATE FUNCTION lure.lent(text, text) RETURNS boolean {LENT}",
    f"CREATE FUNCTION lure.lent(oid, regclass) RETURNS boolean {LENT}",
    f"CREATE FUNCTION lure.lent(regclass, oid) RETURNS boolean {LENT}",
    *(
        f"CREATE OPERATOR lure.{op} (LEFTARG = {a}, RIGHTARG = {b}, FUNCTION = lure.lent)"
        for op in ("<>", "=")
        for a, b in (("text", "text"), ("oid", "regclass"), ("regclass", "oid"))
    ),
    f"CREATE FUNCTION lure.timezone(text, timestamptz) RETURNS timestamp {LENT}",
    f"CREATE FUNCTION lure.date(timestamp) RETURNS date {LENT}",
]


def test_a_writers_search_path_lends_the_insert_trigger_nothing(db: Engine) -> None:
    """The insert trigger's function runs as the owner with no ``search_path`` of its
    own (every INSERT would pay to set and restore one), so under the writer's: a writer
    that puts a schema of its own before pg_catalog, with operators and functions named
    as those the function uses, has none of them run, as the owner or at all. Its
    INSERT is logged and the values stay exact."""
    database = db.url.database
    with new_role(
        db,
        "GRANT SELECT, INSERT ON orders TO {role}",
        "GRANT USAGE ON SEQUENCE orders_id_seq TO {role}",
        f'GRANT CREATE ON DATABASE "{database}" TO {{role}}',
    ) as writer:
        assert refused(writer, *LURE) == ""
        shop = f"s{uuid.uuid4().hex[:10]}"
        error = refused(
            writer,
            "SET search_path = lure, pg_catalog, public",
            "SELECT CASE WHEN 'a' = 'a' THEN 1 END",  # the lure works on the writer itself
        )
        assert "lent to freshline_test_" in error
        error = refused(
            writer,
            "SET search_path = lure, pg_catalog, public",
            "INSERT INTO orders (shop_id, customer_id, amount, sku, placed_at) "
            f"VALUES ('{shop}', 'c1', 5, 'k1', now() - interval '2 days')",
        )
        assert error == ""
    for fs in PATHS:
        with db.connect() as conn:
            logged = conn.execute(
                sa.text(f"SELECT count(*) FROM {path_of(fs).log} WHERE shop_id = :s"), {"s": shop}
            ).scalar_one()
        assert logged == 1, fs.name
        inc = compute(db, fs, [(shop, "c1")], path="incremental").values
        assert inc == compute(db, fs, [(shop, "c1")], path="full").values


def attempts(conn: Connection) -> list[tuple[str, list[str]]]:
    """Every write of every table of freshline's schema and every use of its functions,
    as (what, statements): INSERT and UPDATE of each column, DELETE, TRUNCATE, a trigger
    of one's own on it; EXECUTE of each function, and attaching each trigger function
    to a TEMP table (``fl_bait``, made before)."""
    out: list[tuple[str, list[str]]] = []
    columns = conn.execute(
        sa.text(
            "SELECT c.oid::regclass::text, a.attname FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
            "WHERE n.nspname = 'freshline' AND c.relkind IN ('r', 'p') ORDER BY 1, a.attnum"
        )
    ).all()
    tables = list(dict.fromkeys(t for t, _ in columns))
    for table, column in columns:
        out += [
            (f"INSERT {table}.{column}", [f'INSERT INTO {table} ("{column}") VALUES (DEFAULT)']),
            (f"UPDATE {table}.{column}", [f'UPDATE {table} SET "{column}" = DEFAULT WHERE false']),
        ]
    for table in tables:
        out += [
            (f"DELETE {table}", [f"DELETE FROM {table} WHERE false"]),
            (f"TRUNCATE {table}", [f"TRUNCATE {table}"]),
            (
                f"TRIGGER {table}",
                [
                    f"CREATE TRIGGER fl_probe AFTER INSERT ON {table} "
                    "FOR EACH STATEMENT EXECUTE FUNCTION pg_temp.fl_probe()"
                ],
            ),
        ]
    functions = conn.execute(
        sa.text(
            "SELECT p.oid::regprocedure::text, p.oid::regproc::text, p.prorettype = "
            "'trigger'::regtype, coalesce((SELECT string_agg('NULL::' || t::regtype::text, "
            "', ' ORDER BY i) FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY AS a(t, i)), '') "
            "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'freshline' ORDER BY 1"
        )
    ).all()
    for signature, name, trigger, nulls in functions:
        out.append((f"EXECUTE {signature}", [f"SELECT {name}({nulls})"]))
        if trigger:
            attach = (
                f"CREATE TRIGGER fl_attach AFTER TRUNCATE ON pg_temp.fl_bait "
                f"FOR EACH STATEMENT EXECUTE FUNCTION {name}()"
            )
            out.append((f"ATTACH {signature}", [attach]))
    return out


def allowed(engine: Engine, tried: list[tuple[str, list[str]]]) -> set[str]:
    """Which of ``tried`` ``engine``'s login may do: every attempt but those Postgres
    refuses for want of a privilege (SQLSTATE 42501), each in a savepoint of one
    transaction that is rolled back."""
    done = set()
    with engine.connect() as conn, conn.begin():
        conn.execute(sa.text("CREATE TEMP TABLE fl_bait (x int) ON COMMIT DROP"))
        conn.execute(
            sa.text(
                "CREATE FUNCTION pg_temp.fl_probe() RETURNS trigger LANGUAGE plpgsql "
                "AS $$BEGIN RETURN NULL; END$$"
            )
        )
        for what, statements in tried:
            try:
                with conn.begin_nested():
                    for statement in statements:
                        conn.execute(sa.text(statement))
            except sa.exc.DBAPIError as exc:
                if getattr(exc.orig, "sqlstate", "") == "42501":
                    continue
            done.add(what)
        conn.rollback()
    return done


def assert_only_the_owner_may_write(
    owner: Engine, logins: dict[str, Engine], paths: list[DerivedPath]
) -> None:
    """Each of ``logins`` may do none of :func:`attempts` but what freshline means it
    to: the consumers run the folds of ``paths``, the API stamps a key's last use, and
    anyone takes a freshness token (``freshline.token()``, of their own transaction)."""
    with owner.connect() as conn:
        tried = attempts(conn)
    assert any(what.startswith("ATTACH") for what, _ in tried)
    folds = {f"EXECUTE freshline.{p.prefix}_fold(integer,boolean,boolean)" for p in paths}
    # Both record each computation's snapshot (freshline.snapshots: what an entry was
    # computed from, for history's AtSnapshot); the consumers prune it. A forged row
    # there could mislead a skew report, never change a served value.
    snapshots = {
        f"INSERT freshline.snapshots.{c}"
        for c in ("watermark", "snapshot", "as_of_us", "recorded_at")
    }
    # The history recorder runs as the consumers' login: its bookkeeping.
    recorder = {
        *(
            f"INSERT freshline.history_truncates.{c}"
            for c in ("history_table", "txid", "lsn", "committed_at")
        ),
        "DELETE freshline.history_truncates",
        *(
            f"UPDATE freshline.history_tables.{c}"
            for c in ("complete_to", "broken_from", "broken_reason")
        ),
    }
    meant = {
        "api": {"UPDATE freshline.api_keys.last_used_at", *snapshots},
        "consumer": {*folds, *snapshots, "DELETE freshline.snapshots", *recorder},
    }
    for name, engine in logins.items():
        expected = {"EXECUTE freshline.token()", *meant.get(name, set())}
        assert allowed(engine, tried) == expected, name


def test_no_login_but_the_owner_may_write_freshlines_schema(
    db: Engine, logins: dict[str, Engine]
) -> None:
    """As a new role with no grant and as each of freshline's roles, try every write of
    every table of freshline's schema, every function, and attaching every trigger
    function to a TEMP table: all are refused but the rights freshline means them to
    have (on the cluster topology's primary: tests/cluster/test_cluster_security.py)."""
    assert_only_the_owner_may_write(db, logins, [path_of(fs) for fs in PATHS])


GUARD = re.compile(r"    IF \(?(?:CASE WHEN )?TG_RELID .*?\n    END IF;\n", re.S)


def as_main_made_it(conn: Connection, path: DerivedPath) -> None:
    """Make the installed ``path``'s functions and privileges what freshline made
    before these checks (main at ce4c3f6; the catalogs compared equal): the trigger
    functions without their guard, executable by PUBLIC (CREATE FUNCTION's default:
    only the fold was revoked), the insert trigger with the writer's rights and no
    search_path of its own, and INSERT on the log granted to PUBLIC."""
    mine = {"p": f"{path.prefix}_"}
    functions = conn.execute(
        sa.text(
            "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p "
            "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'freshline' "
            "AND p.prorettype = 'trigger'::regtype AND left(p.proname, length(:p)) = :p"
        ),
        mine,
    ).all()
    for signature, definition in functions:
        conn.exec_driver_sql(GUARD.sub("", definition))
        conn.exec_driver_sql(f"GRANT EXECUTE ON FUNCTION {signature} TO PUBLIC")
    conn.exec_driver_sql(
        f"ALTER FUNCTION freshline.{path.prefix}_i() SECURITY INVOKER RESET search_path"
    )
    conn.exec_driver_sql(f"GRANT INSERT ON {path.log} TO PUBLIC")


@pytest.fixture
def earlier(base_settings: Settings) -> Iterator[str]:
    """A database whose paths an earlier freshline installed (:func:`as_main_made_it`),
    with orders folded into their partials: its URL."""
    name = f"freshline_earlier_{uuid.uuid4().hex[:8]}"
    url = recreate_database(base_settings, name)
    migrations.upgrade(url)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        for statement in TABLES.split(";"):
            conn.execute(sa.text(statement))
        conn.execute(sa.text("ALTER TABLE orders REPLICA IDENTITY FULL"))
        for fs in PATHS:
            path_of(fs).install(conn)
            as_main_made_it(conn, path_of(fs))
    place(engine, "3 days", 1, 2, 3)
    for fs in PATHS:
        path_of(fs).fold_all(engine)
    engine.dispose()
    yield url
    drop_database(base_settings, name)


def partials(engine: Engine) -> dict[str, list[Any]]:
    """Every row of every table of the paths, by table."""
    with engine.connect() as conn:
        return {
            t: sorted(map(tuple, conn.execute(sa.text(f"SELECT * FROM {t}")).all()), key=repr)
            for fs in PATHS
            for t in path_of(fs).tables
        }


def test_an_install_made_before_the_checks_is_fixed_in_place(
    earlier: str, settings: Settings, tmp_path: Path
) -> None:
    """On a database an earlier freshline installed the paths in, ``plan`` shows a
    security fix pending and every grant apply makes; ``apply`` (without
    --alter-tables: no user table changes) replaces the functions and grants in place,
    leaving every partial and log row as it was; then plan shows nothing pending and
    the holes are closed there too."""
    repo = tmp_path / "orders"
    shutil.copytree(REPO.path, repo)  # apply writes its lock there
    env = {
        "FRESHLINE_REPO": str(repo),
        "FRESHLINE_POSTGRES_URL": earlier,
        "FRESHLINE_POSTGRES_ADMIN_URL": earlier,
        "FRESHLINE_TOPIC_PREFIX": f"earlier{uuid.uuid4().hex[:6]}.",
    }
    engine = sa.create_engine(earlier, poolclass=sa.pool.NullPool)
    before = partials(engine)
    planned = cli("plan", **env)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    shown = " ".join(planned.stdout.split())  # as one line: rich wraps it at 80 columns
    for fs in PATHS:
        path = path_of(fs)
        pending = f"{fs.name}'s incremental path: security fix pending"
        assert pending in shown
        with engine.connect() as conn:
            for grant in path.grants(conn):
                assert f"{fs.name}'s incremental path: apply runs: {grant}" in shown
    assert f"PUBLIC may use {path_of(SPEND).log}" in shown
    spend = path_of(SPEND).prefix
    assert f"not SECURITY DEFINER as made now: freshline.{spend}_i()" in shown
    assert f"running as any trigger it is attached to: freshline.{spend}_{{i,u,d,t,p}}()" in shown
    assert f"executable by PUBLIC: freshline.{spend}_{{i,u,d,t,p}}()" in shown
    applied = cli("apply", "--no-cdc", **env)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    ran = " ".join(applied.stderr.split())
    assert "fixed the derived incremental path of spend in place" in ran
    with engine.connect() as conn:
        for fs in PATHS:  # every grant apply made, the plan listed
            for grant in path_of(fs).grants(conn):
                assert f"ran: {grant}" in ran
                assert f"{fs.name}'s incremental path: apply runs: {grant}" in shown
    assert partials(engine) == before
    again = cli("plan", **env)
    assert "security fix pending" not in again.stdout, again.stdout
    with engine.connect() as conn:
        for fs in PATHS:
            assert path_of(fs).unsecured(conn) == []
    with new_role(engine) as nobody:
        path = path_of(SPEND)
        assert "permission denied" in refused(
            nobody,
            f"INSERT INTO {path.log} (shop_id, customer_id, day, at) "
            "VALUES ('s', 'c', current_date, now())",
        )
        assert "permission denied" in refused(
            nobody,
            "CREATE TEMP TABLE fl_bait (x int) ON COMMIT DROP",
            "CREATE TRIGGER fl_bait AFTER TRUNCATE ON fl_bait FOR EACH STATEMENT "
            f"EXECUTE FUNCTION freshline.{path.prefix}_t()",
        )
    with engine.connect() as conn, conn.begin():  # the owner's misuse, refused
        conn.execute(sa.text("CREATE TEMP TABLE fl_bait (x int) ON COMMIT DROP"))
        conn.execute(
            sa.text(
                "CREATE TRIGGER fl_bait AFTER TRUNCATE ON fl_bait FOR EACH STATEMENT "
                f"EXECUTE FUNCTION freshline.{path_of(SPEND).prefix}_t()"
            )
        )
        with pytest.raises(sa.exc.DBAPIError, match="runs only as"):
            conn.execute(sa.text("TRUNCATE fl_bait"))
    engine.dispose()
