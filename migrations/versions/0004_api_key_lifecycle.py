"""API keys get a lifecycle: a public id, a label, and created, expiry, last-use and
revocation times.

The id names a key in ``freshline apikey list|revoke``, in the audit log and on the
revocation channel, so the key itself (or its hash) never has to be shown again.
Existing keys get an id derived from their hash, which reveals nothing of the key.

Revision ID: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("id", sa.Text, nullable=True))
    op.add_column("api_keys", sa.Column("label", sa.Text, nullable=False, server_default=""))
    op.add_column("api_keys", sa.Column("expires_at", _TIME, nullable=True))
    op.add_column("api_keys", sa.Column("last_used_at", _TIME, nullable=True))
    op.add_column("api_keys", sa.Column("revoked_at", _TIME, nullable=True))
    op.execute("UPDATE api_keys SET id = substr(md5(key_hash), 1, 12)")
    op.alter_column("api_keys", "id", nullable=False)
    op.create_unique_constraint("api_keys_id_key", "api_keys", ["id"])


def downgrade() -> None:
    op.drop_constraint("api_keys_id_key", "api_keys", type_="unique")
    for column in ("revoked_at", "last_used_at", "expires_at", "label", "id"):
        op.drop_column("api_keys", column)
