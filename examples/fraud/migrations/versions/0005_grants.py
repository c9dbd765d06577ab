"""The two freshline roles read the example's tables: ``freshline_api`` for the
read-through's feature queries, ``freshline_consumer`` for the consumers'. Neither
writes them. (freshline's own migrations create the roles and grant them its schema;
what they read of the user's tables is the user's grant to give, as here.)

Revision ID: 0005
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0002"
branch_labels = None
depends_on = None

ROLES = ("freshline_api", "freshline_consumer")


def upgrade() -> None:
    for role in ROLES:
        op.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        op.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {role}")


def downgrade() -> None:
    for role in ROLES:
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE SELECT ON TABLES FROM {role}")
        op.execute(f"REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM {role}")
        op.execute(f"REVOKE USAGE ON SCHEMA public FROM {role}")
