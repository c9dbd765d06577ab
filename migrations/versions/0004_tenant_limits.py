"""Each tenant's own limits on the read API, over the servers' defaults.

``freshline.tenants`` gets four nullable columns, set by ``freshline tenants limits``:
``rate_per_s`` and ``rate_burst`` (each of the tenant's keys, per worker), ``concurrency``
(its thread-pool jobs at once, per worker) and ``pool_share`` (its seconds of pool work a
second, per worker). NULL means the server's setting (``FRESHLINE_API_RATE_PER_S``,
``_RATE_BURST``, ``FRESHLINE_API_TENANT_CONCURRENCY``, ``_POOL_SHARE``); 0 means no limit,
as it does for the settings. A platform can so give a trusted scoring service more
than the default and a tenant it does not trust less, on the same servers. The API's
role reads them with the key (it already reads ``tenants``); only the owner writes them.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

SCHEMA = "freshline"


def upgrade() -> None:
    op.execute(
        f"""
        ALTER TABLE {SCHEMA}.tenants
            ADD COLUMN rate_per_s  double precision CHECK (rate_per_s >= 0),
            ADD COLUMN rate_burst  integer CHECK (rate_burst >= 1),
            ADD COLUMN concurrency integer CHECK (concurrency >= 0),
            ADD COLUMN pool_share  double precision CHECK (pool_share >= 0)
        """
    )


def downgrade() -> None:
    op.execute(
        f"""
        ALTER TABLE {SCHEMA}.tenants
            DROP COLUMN rate_per_s, DROP COLUMN rate_burst,
            DROP COLUMN concurrency, DROP COLUMN pool_share
        """
    )
