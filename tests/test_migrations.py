from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa

from freshline import migrations
from freshline.pipeline.api.accounts import TenantLimits, create_tenant, set_tenant_limits
from freshline.pipeline.api.auth import Authenticator
from freshline.pipeline.core.db import metadata
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.settings import Settings
from tests.helpers import (
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
        # then the fraud example's, in public (not the derived path apply installs)
        migrations.upgrade(url, repo=FRAUD_MIGRATIONS)
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
            "history_tables",
            "history_truncates",
            "snapshots",
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


def test_0010_drops_the_hand_written_buckets_of_a_database_that_had_them(
    base_settings: Settings,
) -> None:
    """A database that ran the removed revisions 0003 and 0006-0008 has their tables,
    triggers and functions (made here as they named them); 0010 drops them and nothing
    else, and a new database, which never had them, upgrades the same."""
    name = "freshline_migrations_0010_test"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        migrate(url, "0009")
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE txn_buckets (day date)"))
            conn.execute(sa.text("CREATE TABLE txn_bucket_deltas (w int)"))
            conn.execute(
                sa.text(
                    "CREATE FUNCTION freshline_txn_buckets_insert() RETURNS trigger "
                    "LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$"
                )
            )
            conn.execute(
                sa.text(
                    "CREATE FUNCTION freshline_fold_bucket_deltas(integer, boolean) "
                    "RETURNS integer LANGUAGE sql AS 'SELECT 0'"
                )
            )
            conn.execute(
                sa.text(
                    "CREATE TRIGGER txn_buckets_insert AFTER INSERT ON transactions "
                    "FOR EACH STATEMENT EXECUTE FUNCTION freshline_txn_buckets_insert()"
                )
            )
        migrate(url)
        with engine.connect() as conn:
            left = conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM pg_class WHERE relname LIKE 'txn\\_bucket%') "
                    "+ (SELECT count(*) FROM pg_proc WHERE proname LIKE 'freshline\\_%bucket%') "
                    "+ (SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'txn\\_buckets%')"
                )
            ).scalar_one()
        assert left == 0
        assert "transactions" in _columns(engine)
    finally:
        engine.dispose()
        drop_database(base_settings, name)


def test_0009_refuses_a_geoip_range_that_overlaps_another(base_settings: Settings) -> None:
    """The country of an IP is the range with the greatest ``ip_from`` at or below it,
    if the IP is within that range's ``ip_to``. A range inside another would change the
    country of IPs outside it (after its end, within the outer range) that no reverse
    lookup reaches; ranges must be disjoint. A database with overlapping ranges is
    refused an upgrade that names them."""
    name = "freshline_migrations_0009_test"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    insert = sa.text(
        "INSERT INTO geoip (ip_from, ip_to, country, city, asn) "
        "VALUES (CAST(:f AS inet), CAST(:t AS inet), 'FR', 'Paris', 1)"
    )
    try:
        migrate(url, "0005")
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
        _fraud_downgrade(url, "0005")
        with engine.begin() as conn:
            conn.execute(insert, {"f": "11.0.0.16", "t": "11.0.0.31"})
    finally:
        engine.dispose()
        drop_database(base_settings, name)


def test_an_api_on_a_schema_before_tenant_limits_serves_keys_at_the_settings(
    base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """An API upgraded before ``freshline db upgrade`` ran (revision 0003) still
    serves every key, with the settings' limits, and says what to run; the limits
    command says it too; once upgraded, a tenant's own limits are read."""
    name = "freshline_limits_before_0004"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        migrations.upgrade(url, "0003")
        key = create_tenant(engine, "acme")
        auth = Authenticator(engine)
        with caplog.at_level(logging.WARNING, logger="freshline.pipeline.api.auth"):
            assert auth.principal(key).limits == TenantLimits()
            auth.clear()
            assert auth.principal(key).tenant == "acme"
        assert caplog.text.count("run freshline db upgrade") == 1  # said once
        with pytest.raises(ConfigError, match="run freshline db upgrade"):
            set_tenant_limits(engine, None, "acme", {"rate_per_s": 5.0})
        migrations.upgrade(url)
        set_tenant_limits(engine, None, "acme", {"rate_per_s": 5.0})
        assert Authenticator(engine).principal(key).limits == TenantLimits(rate_per_s=5.0)
    finally:
        engine.dispose()
        drop_database(base_settings, name)
