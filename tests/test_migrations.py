from __future__ import annotations

import pytest
import sqlalchemy as sa

import migrations
from fraud import incremental
from pipeline.core.db import metadata
from pipeline.core.errors import ConfigError
from pipeline.core.settings import Settings
from tests.conftest import (
    FRAUD_MIGRATIONS,
    drop_database,
    migrate,
    recreate_database,
)


def _columns(engine: sa.Engine, schema: str | None = None) -> dict[str, set[str]]:
    inspector = sa.inspect(engine)
    return {
        t: {c["name"] for c in inspector.get_columns(t, schema=schema)}
        for t in inspector.get_table_names(schema=schema)
    }


def _token_function(engine: sa.Engine) -> bool:
    """Whether ``freshline.token()`` exists (migration 0002)."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text("SELECT to_regprocedure('freshline.token()') IS NOT NULL")
            ).scalar()
        )


def _fraud_downgrade(url: str, revision: str) -> None:
    migrations.downgrade(url, None, repo=FRAUD_MIGRATIONS, repo_revision=revision)


def test_migrations_run_forward_and_back_on_an_empty_database(base_settings: Settings) -> None:
    name = "freshline_migrations_test"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        assert _columns(engine) == {}
        migrations.upgrade(url)
        # freshline's own chain creates its schema and nothing outside it
        assert _columns(engine) == {}
        own = _columns(engine, "freshline")
        for table in metadata.sorted_tables:
            assert table.schema == "freshline", table.name
            assert table.name in own, table.name
            assert {c.name for c in table.columns} <= own[table.name], table.name
        migrate(url)  # then the fraud example's, in public
        columns = _columns(engine)
        assert {"amount", "merchant_id", "device_id", "ip", "status", "updated_at"} <= columns[
            "transactions"
        ]
        indexes = {ix["name"] for ix in sa.inspect(engine).get_indexes("transactions")}
        assert "transactions_user_recent" in indexes
        assert set(_columns(engine, "freshline")) == {
            "alembic_version",
            "alembic_version_fraud",
            "api_keys",
            "tenants",
            "token_key",
        }
        assert _token_function(engine)
        migrations.downgrade(url, "base", repo=FRAUD_MIGRATIONS)
        assert _columns(engine) == {}
        assert set(_columns(engine, "freshline")) == {"alembic_version", "alembic_version_fraud"}
        assert not _token_function(engine)
    finally:
        engine.dispose()
        drop_database(base_settings, name)


def test_a_login_that_would_see_freshlines_schema_first_is_refused(
    base_settings: Settings,
) -> None:
    """Postgres's default search_path begins with "$user": a role named like the schema
    would resolve the user's unqualified tables in freshline's. Refused before any DDL."""
    name = "freshline_migrations_path_test"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    f'ALTER ROLE CURRENT_USER IN DATABASE "{name}" '
                    'SET search_path = "$user", freshline, public'
                )
            )
        with pytest.raises(ConfigError, match="finds freshline's schema first"):
            migrations.upgrade(url)
        assert sa.inspect(engine).get_schema_names().count("freshline") == 0
    finally:
        engine.dispose()
        drop_database(base_settings, name)


def test_a_database_that_ran_the_first_0003_gets_its_buckets_rebuilt(
    base_settings: Settings,
) -> None:
    """Revision 0003 changed after databases had run it; 0006 rebuilds theirs."""
    name = "freshline_migrations_0006_test"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        migrate(url, "0005")
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
                    "VALUES ('t1', 1, 10, 'm1', '10.0.0.1')"
                )
            )
            # what the first 0003 left: no per-country marks
            conn.execute(sa.text("ALTER TABLE txn_buckets DROP COLUMN countries_latest"))
        migrate(url)
        assert "countries_latest" in _columns(engine)["txn_buckets"]
        with engine.begin() as conn:
            # the rebuilt triggers run, and the existing rows wait for a bucket build
            conn.execute(
                sa.text(
                    "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
                    "VALUES ('t1', 1, 20, 'm2', '10.0.0.2')"
                )
            )
            assert conn.execute(sa.text("SELECT complete FROM txn_bucket_build")).scalar() is False
        migrate(url)  # at head already: nothing is rebuilt again
        with engine.begin() as conn:  # the row is a pending delta (revision 0007)
            assert (
                conn.execute(
                    sa.text(
                        "SELECT (SELECT coalesce(sum(n), 0) FROM txn_buckets) "
                        "+ (SELECT coalesce(sum(w), 0) FROM txn_bucket_deltas)"
                    )
                ).scalar()
                == 1
            )
    finally:
        engine.dispose()
        drop_database(base_settings, name)


def test_0007_keeps_the_buckets_of_a_database_at_0006_and_folds_them_on_the_way_back(
    base_settings: Settings,
) -> None:
    """0006's triggers built buckets; under 0007 writes become deltas, and a downgrade
    folds them and puts the direct triggers back, with the same values throughout."""

    name = "freshline_migrations_0007_test"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    insert = sa.text(
        "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, "
        "created_at) VALUES ('t1', 1, :a, :m, now() - interval '1 day')"
    )
    totals = sa.text(
        "SELECT (SELECT coalesce(sum(n), 0) FROM txn_buckets), "
        "(SELECT count(*) FROM txn_bucket_members WHERE kind = 'm')"
    )
    try:
        migrate(url, "0006")
        with engine.begin() as conn:
            conn.execute(insert, {"a": 10, "m": "m1"})
            assert tuple(conn.execute(totals).one()) == (1, 1)  # direct triggers
        migrate(url, "0007")
        with engine.begin() as conn:
            conn.execute(insert, {"a": 20, "m": "m2"})
            assert tuple(conn.execute(totals).one()) == (1, 1)  # the new row is a delta
            assert incremental.pending(conn) == (1, 1)
        _fraud_downgrade(url, "0006")
        with engine.begin() as conn:
            assert tuple(conn.execute(totals).one()) == (2, 2)  # folded on the way back
            assert "txn_bucket_deltas" not in sa.inspect(conn).get_table_names()
            conn.execute(insert, {"a": 30, "m": "m3"})
            assert tuple(conn.execute(totals).one()) == (3, 3)  # direct triggers again
        migrate(url)
        with engine.begin() as conn:
            conn.execute(insert, {"a": 40, "m": "m4"})
            assert incremental.pending(conn) == (1, 1)
        assert incremental.fold_all(engine) == 1
        with engine.begin() as conn:
            assert tuple(conn.execute(totals).one()) == (4, 4)
            assert incremental.pending(conn) == (0, 0)
    finally:
        engine.dispose()
        drop_database(base_settings, name)


def test_0008_indexes_the_delta_log_by_user_id_and_folds_in_that_order(
    base_settings: Settings,
) -> None:
    """A database that ran 0007 (index on tenant and user) gets the user-id index, and
    its fold function takes users by id; downgrading puts 0007's back. The fold runs."""

    name = "freshline_migrations_0008_test"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)

    def index_columns() -> list[str]:
        (index,) = [
            ix
            for ix in sa.inspect(engine).get_indexes("txn_bucket_deltas")
            if ix["name"] == "txn_bucket_deltas_user"
        ]
        return list(index["column_names"])

    def fold_source() -> str:
        with engine.connect() as conn:
            return str(
                conn.execute(
                    sa.text(
                        "SELECT prosrc FROM pg_proc WHERE proname = 'freshline_fold_bucket_deltas'"
                    )
                ).scalar_one()
            )

    try:
        migrate(url, "0007")
        assert index_columns() == ["tenant_id", "user_id"]
        migrate(url, "0008")
        assert index_columns() == ["user_id"]
        assert "ORDER BY user_id, tenant_id" in fold_source()
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id) "
                    "VALUES ('t1', 2, 10, 'm1'), ('t0', 3, 10, 'm1'), ('t1', 1, 10, 'm1')"
                )
            )
        assert incremental.fold_all(engine) == 3
        _fraud_downgrade(url, "0007")
        assert index_columns() == ["tenant_id", "user_id"]
        assert "ORDER BY 1, 2" in fold_source()
    finally:
        engine.dispose()
        drop_database(base_settings, name)


def test_0009_refuses_a_geoip_range_that_overlaps_another(base_settings: Settings) -> None:
    """The country of an IP is the range with the greatest ``ip_from`` at or below it,
    if the IP is within that range's ``ip_to``. A range inside another would change the
    country of IPs outside it (after its end, within the outer range) that no geoip
    trigger reaches; ranges must be disjoint. A database with overlapping ranges is
    refused an upgrade that names them."""
    name = "freshline_migrations_0009_test"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    insert = sa.text(
        "INSERT INTO geoip (ip_from, ip_to, country, city, asn) "
        "VALUES (CAST(:f AS inet), CAST(:t AS inet), 'FR', 'Paris', 1)"
    )
    try:
        migrate(url, "0008")
        with engine.begin() as conn:
            conn.execute(insert, {"f": "11.0.0.0", "t": "11.0.0.255"})
            conn.execute(insert, {"f": "11.0.0.16", "t": "11.0.0.31"})
        with pytest.raises(ConfigError, match=r"11\.0\.0\.0-11\.0\.0\.255 and 11\.0\.0\.16"):
            migrate(url)
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM geoip WHERE ip_from = '11.0.0.16'"))
        migrate(url)
        for f, t in [
            ("11.0.0.16", "11.0.0.31"),  # nested
            ("10.255.255.0", "11.0.0.0"),  # shares the outer range's first address
            ("11.0.0.255", "11.0.1.255"),  # shares its last
            ("10.0.0.0", "12.0.0.0"),  # encloses it
        ]:
            with (
                pytest.raises(sa.exc.IntegrityError, match="geoip_ranges_disjoint"),
                engine.begin() as conn,
            ):
                conn.execute(insert, {"f": f, "t": t})
        with engine.begin() as conn:  # adjacent ranges, and IPv6, are disjoint
            conn.execute(insert, {"f": "10.255.255.0", "t": "10.255.255.255"})
            conn.execute(insert, {"f": "11.0.1.0", "t": "11.0.1.255"})
            conn.execute(insert, {"f": "2001:db8::", "t": "2001:db8::ffff"})
        with (
            pytest.raises(sa.exc.IntegrityError, match="geoip_ranges_disjoint"),
            engine.begin() as conn,  # nor can an update make an overlap
        ):
            conn.execute(sa.text("UPDATE geoip SET ip_to = '11.0.1.0' WHERE ip_from = '11.0.0.0'"))
        _fraud_downgrade(url, "0008")
        with engine.begin() as conn:
            conn.execute(insert, {"f": "11.0.0.16", "t": "11.0.0.31"})
    finally:
        engine.dispose()
        drop_database(base_settings, name)
