"""Change data capture: replica identities and the publication Debezium reads.

Replica identity decides what an UPDATE or DELETE writes to the WAL about the old row,
and so what Debezium can put in an envelope's ``before``. Per table:

* ``transactions`` FULL: routing needs the *old* ``user_id`` (a row moved between
  users affects both) and, for geo, the old ``ip``. Under DEFAULT an UPDATE has no
  ``before`` at all and a DELETE's ``before`` holds only the key, with placeholders
  (``user_id: 0``) for the other NOT NULL columns: the affected user would be lost.
* ``geoip`` FULL: a changed or deleted range affects the users with transactions in
  the *old* range; DEFAULT would give only ``ip_from`` (the key) and a placeholder
  ``ip_to``.
* ``user_devices`` DEFAULT: its primary key is every column, so the old key DEFAULT
  writes already is the whole old row; FULL would add nothing.
* ``devices``, ``users`` DEFAULT: routing needs only the key (``tenant_id, id``), and a
  key change arrives from Debezium as a DELETE (old key) plus a CREATE (new row).

The publication ``freshline`` lists the tables some feature set reads, and nothing
else: ``tenants`` and ``api_keys`` affect no feature. ``freshline cdc register``
points the connector at it (and checks it exists).

Revision ID: 0002
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

PUBLICATION = "freshline"
CAPTURED = ("users", "transactions", "devices", "user_devices", "geoip")
FULL = ("transactions", "geoip")


def upgrade() -> None:
    for table in FULL:
        op.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
    op.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {', '.join(CAPTURED)}")


def downgrade() -> None:
    op.execute(f"DROP PUBLICATION IF EXISTS {PUBLICATION}")
    for table in FULL:
        op.execute(f"ALTER TABLE {table} REPLICA IDENTITY DEFAULT")
