from __future__ import annotations

import sqlalchemy as sa
from alembic import context

config = context.config

# Both chains keep their version table in freshline's schema: freshline's own as
# ``freshline.alembic_version``, a repository's as ``freshline.alembic_version_<name>``.
SCHEMA = "freshline"
VERSION_TABLE = config.get_main_option("version_table") or "alembic_version"


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url, "migrations.alembic_config sets sqlalchemy.url"
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        connection.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        connection.commit()
        context.configure(
            connection=connection,
            transaction_per_migration=True,
            version_table=VERSION_TABLE,
            version_table_schema=SCHEMA,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        literal_binds=True,
        version_table=VERSION_TABLE,
        version_table_schema=SCHEMA,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
