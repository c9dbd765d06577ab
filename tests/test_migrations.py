from __future__ import annotations

import sqlalchemy as sa

import migrations
from pipeline.core.db import metadata
from pipeline.core.settings import Settings
from tests.conftest import drop_database, recreate_database


def _columns(engine: sa.Engine) -> dict[str, set[str]]:
    inspector = sa.inspect(engine)
    return {t: {c["name"] for c in inspector.get_columns(t)} for t in inspector.get_table_names()}


def test_migrations_run_forward_and_back_on_an_empty_database(base_settings: Settings) -> None:
    name = "freshline_migrations_test"
    url = recreate_database(base_settings, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        assert _columns(engine) == {}
        migrations.upgrade(url)
        columns = _columns(engine)
        for table in metadata.sorted_tables:
            assert table.name in columns, table.name
            assert {c.name for c in table.columns} <= columns[table.name], table.name
        assert {"amount", "merchant_id", "device_id", "ip", "status", "updated_at"} <= columns[
            "transactions"
        ]
        indexes = {ix["name"] for ix in sa.inspect(engine).get_indexes("transactions")}
        assert "transactions_user_recent" in indexes
        migrations.downgrade(url, "base")
        assert set(_columns(engine)) == {"alembic_version"}
    finally:
        engine.dispose()
        drop_database(base_settings, name)
