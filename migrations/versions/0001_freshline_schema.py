"""freshline's own state, in its own schema ``freshline``: tenants and API keys, and the
two least-privilege roles.

freshline runs against a database it did not create. Its migrations create this schema
and nothing outside it; the user's tables are the user's (a repository may carry
migrations of its own for them: ``[project] migrations`` in ``freshline.toml``).

- ``freshline.tenants``: the tenants API keys are scoped to. A single-tenant repository
  has one, made on first use.
- ``freshline.api_keys``: hashed keys with a lifecycle. The public ``id`` names a key in
  ``freshline apikey list|revoke``, in the audit log and on the revocation channel, so
  the key itself (or its hash) never has to be shown again.

The roles are cluster-wide, so they are created here only when missing, without LOGIN
or a password: whoever runs the cluster gives them those (``scripts/stack up`` does).

- ``freshline_api``: the feature queries of the read-through and the API's key
  lookups. It reads freshline's tables and may write one column,
  ``api_keys.last_used_at``.
- ``freshline_consumer``: the consumers' feature queries. It reads freshline's tables
  and writes none.

Neither can create objects or replicate. Reading the user's tables is the user's grant
to give (``freshline plan`` lists what is missing); the fraud example's migrations give
it for theirs.

Revision ID: 0001
"""

from __future__ import annotations

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SCHEMA = "freshline"
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
    # The schema itself exists already: migrations/env.py makes it for the version table.
    op.execute(
        f"""
        CREATE TABLE {SCHEMA}.tenants (
            id          text PRIMARY KEY,
            name        text NOT NULL,
            created_at  timestamptz NOT NULL DEFAULT now()
        );
        CREATE TABLE {SCHEMA}.api_keys (
            key_hash     text PRIMARY KEY,
            tenant_id    text NOT NULL REFERENCES {SCHEMA}.tenants(id),
            created_at   timestamptz NOT NULL DEFAULT now(),
            id           text NOT NULL UNIQUE,
            label        text NOT NULL DEFAULT '',
            expires_at   timestamptz,
            last_used_at timestamptz,
            revoked_at   timestamptz
        );
        CREATE INDEX api_keys_tenant ON {SCHEMA}.api_keys (tenant_id);
        """
    )
    for role in ROLES:
        _create_role(role)
        op.execute(f"GRANT CONNECT ON DATABASE {_database()} TO {role}")
        op.execute(f"GRANT USAGE ON SCHEMA {SCHEMA} TO {role}")
        op.execute(f"GRANT SELECT ON {SCHEMA}.tenants, {SCHEMA}.api_keys TO {role}")
    op.execute(f"GRANT UPDATE (last_used_at) ON {SCHEMA}.api_keys TO freshline_api")


def downgrade() -> None:
    for role in ROLES:
        op.execute(f"REVOKE ALL ON {SCHEMA}.tenants, {SCHEMA}.api_keys FROM {role}")
        op.execute(f"REVOKE USAGE ON SCHEMA {SCHEMA} FROM {role}")
        op.execute(f"REVOKE CONNECT ON DATABASE {_database()} FROM {role}")
    op.execute(f"DROP TABLE {SCHEMA}.api_keys, {SCHEMA}.tenants")


def _database() -> str:
    name = op.get_bind().exec_driver_sql("SELECT current_database()").scalar_one()
    return '"' + str(name).replace('"', '""') + '"'
