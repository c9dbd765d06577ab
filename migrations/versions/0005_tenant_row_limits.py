"""Each tenant's own limit on the rows its requests ask for, over the servers' default.

``freshline.tenants`` gets two nullable columns, set by ``freshline tenants limits``:
``rows_per_s`` and ``rows_burst``, the entities (times feature sets) of its reads and the
rows of its predictions it may ask for per second, per worker. A request's rate counts it
once whatever it asks for; a batch of 100 ids with no source row or a prediction of 100
new rows costs the servers about 100 times one. NULL means the server's setting
(``FRESHLINE_API_ROWS_PER_S``, ``_ROWS_BURST``); 0 means no limit, as it does for the
settings.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

SCHEMA = "freshline"


def upgrade() -> None:
    op.execute(
        f"""
        ALTER TABLE {SCHEMA}.tenants
            ADD COLUMN rows_per_s double precision CHECK (rows_per_s >= 0),
            ADD COLUMN rows_burst integer CHECK (rows_burst >= 1)
        """
    )


def downgrade() -> None:
    op.execute(f"ALTER TABLE {SCHEMA}.tenants DROP COLUMN rows_per_s, DROP COLUMN rows_burst")
