"""Least-privilege roles: ``freshline_api`` and ``freshline_consumer``.

The owner (the role that runs the migrations) keeps every right. The two roles are
cluster-wide, so they are created here only when missing, without LOGIN or a
password: whoever runs the cluster gives them those (``scripts/stack up`` does).

- ``freshline_api``: the feature queries of the read-through and the API's key
  lookups. It reads every table, and may write one column: ``api_keys.last_used_at``.
- ``freshline_consumer``: the consumers' feature queries. It reads every table and
  writes none.

Neither can write the source tables, create objects, or replicate.

Revision ID: 0005
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

ROLES = ("freshline_api", "freshline_consumer")


def _create_role(role: str) -> None:
    # Two sessions migrating side by side may both find the role missing.
    op.execute(f"""
        DO $$ BEGIN
          IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
            CREATE ROLE {role} NOLOGIN;
          END IF;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
        END $$""")


def upgrade() -> None:
    for role in ROLES:
        _create_role(role)
        op.execute(f"GRANT CONNECT ON DATABASE {_database()} TO {role}")
        op.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        op.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {role}")
    op.execute("GRANT UPDATE (last_used_at) ON api_keys TO freshline_api")


def downgrade() -> None:
    op.execute("REVOKE UPDATE (last_used_at) ON api_keys FROM freshline_api")
    for role in ROLES:
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE SELECT ON TABLES FROM {role}")
        op.execute(f"REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM {role}")
        op.execute(f"REVOKE USAGE ON SCHEMA public FROM {role}")
        op.execute(f"REVOKE CONNECT ON DATABASE {_database()} FROM {role}")


def _database() -> str:
    name = op.get_bind().exec_driver_sql("SELECT current_database()").scalar_one()
    return '"' + str(name).replace('"', '""') + '"'
