-- The build of fraud's txn_90d, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

SELECT pg_advisory_xact_lock(hashtext('freshline.agg_txn_90d_a06f2675'));

LOCK TABLE public.transactions IN SHARE MODE;

DELETE FROM freshline.agg_txn_90d_a06f2675_days;

DELETE FROM freshline.agg_txn_90d_a06f2675_d5;

DELETE FROM freshline.agg_txn_90d_a06f2675_l5;

DELETE FROM freshline.agg_txn_90d_a06f2675_d6;

DELETE FROM freshline.agg_txn_90d_a06f2675_l6;

DELETE FROM freshline.agg_txn_90d_a06f2675_head;

DELETE FROM freshline.agg_txn_90d_a06f2675_log;

INSERT INTO freshline.agg_txn_90d_a06f2675_days (tenant_id, user_id, day, c0, n1, s1, q1, n2, s2, q2, mx3, n4, s4, q4, mx7) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, count(*) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), count(x.amount) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), coalesce(sum(x.amount::numeric) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), 0), coalesce(sum(x.amount::numeric * x.amount::numeric) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), 0), count(x.amount) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), coalesce(sum(x.amount::numeric) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), 0), coalesce(sum(x.amount::numeric * x.amount::numeric) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), 0), max(x.amount) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), count(x.amount) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), coalesce(sum(x.amount::numeric) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), 0), coalesce(sum(x.amount::numeric * x.amount::numeric) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), 0), max(x.created_at) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)) FROM public.transactions x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;

INSERT INTO freshline.agg_txn_90d_a06f2675_d5 (tenant_id, user_id, day, value, n) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.merchant_id, count(*) FROM public.transactions x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true AND x.merchant_id IS NOT NULL GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4;

INSERT INTO freshline.agg_txn_90d_a06f2675_l5 (tenant_id, user_id, value, latest) SELECT tenant_id, user_id, value, max(day) FROM freshline.agg_txn_90d_a06f2675_d5 GROUP BY tenant_id, user_id, value;

UPDATE freshline.agg_txn_90d_a06f2675_days d SET lc5 = c.n FROM (SELECT tenant_id, user_id, latest, count(*) AS n FROM freshline.agg_txn_90d_a06f2675_l5 GROUP BY tenant_id, user_id, latest) AS c WHERE d.tenant_id = c.tenant_id AND d.user_id = c.user_id AND d.day = c.latest;

INSERT INTO freshline.agg_txn_90d_a06f2675_d6 (tenant_id, user_id, day, value, n) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.device_id, count(*) FROM public.transactions x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true AND x.device_id IS NOT NULL GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4;

INSERT INTO freshline.agg_txn_90d_a06f2675_l6 (tenant_id, user_id, value, latest) SELECT tenant_id, user_id, value, max(day) FROM freshline.agg_txn_90d_a06f2675_d6 GROUP BY tenant_id, user_id, value;

UPDATE freshline.agg_txn_90d_a06f2675_days d SET lc6 = c.n FROM (SELECT tenant_id, user_id, latest, count(*) AS n FROM freshline.agg_txn_90d_a06f2675_l6 GROUP BY tenant_id, user_id, latest) AS c WHERE d.tenant_id = c.tenant_id AND d.user_id = c.user_id AND d.day = c.latest;

ANALYZE freshline.agg_txn_90d_a06f2675_days;

ANALYZE freshline.agg_txn_90d_a06f2675_d5;

ANALYZE freshline.agg_txn_90d_a06f2675_l5;

ANALYZE freshline.agg_txn_90d_a06f2675_d6;

ANALYZE freshline.agg_txn_90d_a06f2675_l6;

ANALYZE freshline.agg_txn_90d_a06f2675_head;

ANALYZE freshline.agg_txn_90d_a06f2675_log;
