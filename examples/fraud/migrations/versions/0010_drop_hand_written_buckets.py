"""Drop the hand-written incremental path of ``txn_90d`` and ``geo``.

Revisions 0003 and 0006-0008 (removed from the chain) made per-day bucket tables, a
delta log, their triggers on ``transactions`` and ``geoip`` and a fold, written by hand
for this example. ``txn_90d`` is now declared (``freshline.Aggregations``), and freshline
derives its incremental path (``freshline apply --alter-tables`` installs it, in
freshline's schema); ``geo`` is a plain query. A database that ran those revisions loses
their objects here; a new one never had them, so every drop is ``IF EXISTS``.

Revision ID: 0010
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Triggers and functions by name pattern: the old revisions made one per operation.
    op.execute(
        """
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT t.tgname, c.relname FROM pg_trigger t
             JOIN pg_class c ON c.oid = t.tgrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'public' AND NOT t.tgisinternal
               AND c.relname IN ('transactions', 'geoip')
               AND (t.tgname LIKE 'txn\\_buckets\\_%' OR t.tgname LIKE 'geoip\\_buckets\\_%')
    LOOP
        EXECUTE format('DROP TRIGGER %I ON public.%I', r.tgname, r.relname);
    END LOOP;
    FOR r IN SELECT p.oid::regprocedure AS fn FROM pg_proc p
             JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = 'public'
               AND (p.proname LIKE 'freshline\\_txn\\_buckets\\_%'
                    OR p.proname LIKE 'freshline\\_geoip\\_buckets\\_%'
                    OR p.proname IN ('freshline_geoip_truncate', 'freshline_rebuild_countries',
                                     'freshline_fold_bucket_deltas', 'freshline_fold_bucket_users',
                                     'freshline_bucket_lock'))
    LOOP
        EXECUTE format('DROP FUNCTION %s', r.fn);
    END LOOP;
END
$$"""
    )
    op.execute(
        "DROP TABLE IF EXISTS txn_bucket_deltas, txn_bucket_build, txn_bucket_latest, "
        "txn_bucket_members, txn_buckets"
    )


def downgrade() -> None:
    """Nothing comes back: the hand-written path is gone from the example's code too."""
