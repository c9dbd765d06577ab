"""Rebuild the bucket tables of a database that ran revision 0003 as first written.

Revision 0003 was changed after some databases had applied it: the buckets gained
the ``ip`` of each change, per-country member counts (``kind`` 'c') and the column
``txn_buckets.countries_latest``, and the triggers their generic plans. A database
that ran the first 0003 has none of these, and Alembic will not run 0003 again: it
would answer the ``geo`` feature set with an error. This revision finds such a
database by the missing column, drops the bucket objects and creates them again with
0003's current code. The new ``txn_bucket_build`` row starts the rebuild over, so
``freshline buckets build`` (or the full path until it finishes) keeps values exact.
A database that ran the current 0003 is left as it is.

Revision ID: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations import sibling_revision

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _outdated() -> bool:
    found = op.get_bind().execute(
        sa.text(
            "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = 'txn_buckets' AND column_name = 'countries_latest'"
        )
    )
    return found.first() is None


def upgrade() -> None:
    if _outdated():
        first = sibling_revision(__file__, "0003_txn_buckets.py")
        first.downgrade()
        first.upgrade()


def downgrade() -> None:
    """Nothing to undo: the rebuilt objects are the ones revision 0003 makes."""
