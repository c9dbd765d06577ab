"""History: the registry of recorded tables, and the snapshots entries name.

- ``freshline.history_tables``: one row per captured user table whose history freshline
  records (``[history] enabled = true`` in ``freshline.toml``; ``freshline apply`` adds
  the rows and creates each history table, ``freshline.h_<schema>__<table>``, with the
  user's columns and types). ``s0_*`` is the exact backfill's snapshot: history holds
  the rows S0 saw, and every change S0 does not see. ``complete_to``: every change
  committed up to then is recorded. ``broken_from``: from that commit on, history of
  the table is not to be trusted (DDL it could not follow), with ``broken_reason``.
- ``freshline.snapshots``: the full snapshot (``pg_current_snapshot()``) and ``as_of``
  (µs) each computation read, keyed by the watermark its entries carry, so an entry
  names exactly the rows it was computed from (:mod:`freshline.pipeline.history.snapshots`).
- ``freshline.history_truncates``: each TRUNCATE the recorder read, so a version whose
  record arrives after it (a truncate has no key: another partition) still ends there.

Snapshots and LSNs are kept as their text (``CAST(s0_snapshot AS pg_snapshot)`` to use
one), which any client library reads.

The consumer role runs the recorder and writes both; the API role writes snapshots
(read-through fills) and reads the rest. The history tables themselves are granted
by ``apply`` as it creates them.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

SCHEMA = "freshline"


def upgrade() -> None:
    op.execute(
        f"""
        CREATE TABLE {SCHEMA}.history_tables (
            source_schema text NOT NULL,
            source_table text NOT NULL,
            history_table text NOT NULL UNIQUE,
            s0_snapshot text,
            s0_at timestamptz,
            s0_lsn text,
            complete_to timestamptz,
            broken_from timestamptz,
            broken_reason text,
            retention_s bigint CHECK (retention_s > 0),
            created_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (source_schema, source_table)
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {SCHEMA}.snapshots (
            watermark numeric(40, 0) PRIMARY KEY,
            snapshot text NOT NULL,
            as_of_us bigint NOT NULL,
            recorded_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {SCHEMA}.history_truncates (
            history_table text NOT NULL,
            lsn bigint NOT NULL,
            txid bigint NOT NULL,
            committed_at timestamptz NOT NULL,
            PRIMARY KEY (history_table, lsn)
        )
        """
    )
    op.execute(f"CREATE INDEX snapshots_recorded_at ON {SCHEMA}.snapshots (recorded_at)")
    op.execute(f"GRANT SELECT ON {SCHEMA}.history_tables TO freshline_api, freshline_consumer")
    op.execute(
        f"GRANT UPDATE (complete_to, broken_from, broken_reason) ON {SCHEMA}.history_tables "
        "TO freshline_consumer"
    )
    op.execute(f"GRANT SELECT, INSERT ON {SCHEMA}.snapshots TO freshline_api, freshline_consumer")
    op.execute(f"GRANT DELETE ON {SCHEMA}.snapshots TO freshline_consumer")
    op.execute(f"GRANT SELECT, INSERT, DELETE ON {SCHEMA}.history_truncates TO freshline_consumer")
    op.execute(f"GRANT SELECT ON {SCHEMA}.history_truncates TO freshline_api")


def downgrade() -> None:
    op.execute(f"DROP TABLE {SCHEMA}.history_truncates")
    op.execute(f"DROP TABLE {SCHEMA}.snapshots")
    op.execute(f"DROP TABLE {SCHEMA}.history_tables")
