"""Index the bucket delta log by user id alone, and fold its users in that order.

Revision 0007 indexed ``txn_bucket_deltas`` on ``(tenant_id, user_id)``. Measured
(bench ``buckets``), that index made a seed COPY cost 1.21-1.30x a COPY without
maintenance, against 1.04-1.10x for an index on ``user_id`` alone, the same as no
index: a text column in every index entry is what costs. A user's pending rows are
few, so filtering them by tenant after the index is cheap. The fold now takes users
in ``user_id, tenant_id`` order, which that index answers without a sort.

Revision ID: 0008
"""

from __future__ import annotations

from alembic import op

from migrations import sibling_revision

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_DELTAS = "0007_bucket_deltas.py"


def _schema() -> str:
    return str(op.get_bind().exec_driver_sql("SELECT current_schema()").scalar_one())


def _swap(columns: str, order: str) -> None:
    op.execute("DROP INDEX txn_bucket_deltas_user")
    op.execute(f"CREATE INDEX txn_bucket_deltas_user ON txn_bucket_deltas ({columns})")
    deltas = sibling_revision(__file__, _DELTAS)
    op.execute(deltas._fold_deltas(_schema(), order=order, create="CREATE OR REPLACE"))


def upgrade() -> None:
    _swap("user_id", "user_id, tenant_id")


def downgrade() -> None:
    _swap("tenant_id, user_id", "1, 2")
