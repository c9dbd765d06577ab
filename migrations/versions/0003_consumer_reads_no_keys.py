"""The consumer's role no longer reads API keys.

``freshline_consumer`` runs the consumers and ``freshline warm``: it needs the tenants
(``warm`` lists them) and never the API keys, whose hashes would let whoever holds the
consumer's login try to match them offline. Only ``freshline_api``, which checks keys,
and the owner read ``freshline.api_keys`` from here on.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

SCHEMA = "freshline"


def upgrade() -> None:
    op.execute(f"REVOKE ALL ON {SCHEMA}.api_keys FROM freshline_consumer")


def downgrade() -> None:
    op.execute(f"GRANT SELECT ON {SCHEMA}.api_keys TO freshline_consumer")
