-- The build of shop's orders_30d, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

SELECT pg_advisory_xact_lock(hashtext('freshline.agg_orders_30d_df904743'));

LOCK TABLE public.shop_orders IN SHARE MODE;

DELETE FROM freshline.agg_orders_30d_df904743_days;

DELETE FROM freshline.agg_orders_30d_df904743_d6;

DELETE FROM freshline.agg_orders_30d_df904743_l6;

DELETE FROM freshline.agg_orders_30d_df904743_head;

DELETE FROM freshline.agg_orders_30d_df904743_log;

INSERT INTO freshline.agg_orders_30d_df904743_days (shop_id, customer_id, day, c0, n1, s1, q1, n2, s2, q2, mn3, mx4, n5, s5, q5, lt7, lv7, lt8, lv8, c9, n10, s10, q10) SELECT x.shop_id, x.customer_id, ((x.placed_at) AT TIME ZONE 'UTC')::pg_catalog.date, count(*) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), count(x.amount) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), coalesce(sum(x.amount::numeric) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), 0), coalesce(sum(x.amount::numeric * x.amount::numeric) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), 0), count(x.amount) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), coalesce(sum(x.amount::numeric) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), 0), coalesce(sum(x.amount::numeric * x.amount::numeric) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), 0), min(x.amount) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), max(x.amount) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), count(x.amount) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), coalesce(sum(x.amount::numeric) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), 0), coalesce(sum(x.amount::numeric * x.amount::numeric) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), 0), max(x.placed_at) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), (array_agg(x.sku ORDER BY x.placed_at DESC, x.sku DESC NULLS LAST) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)))[1], max(x.placed_at) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), (array_agg(x.placed_at ORDER BY x.placed_at DESC, x.placed_at DESC NULLS LAST) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)))[1], count(*) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true)), count(x.amount) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND (x.amount >= 100))), coalesce(sum(x.amount::numeric) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND (x.amount >= 100))), 0), coalesce(sum(x.amount::numeric * x.amount::numeric) FILTER (WHERE (x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND (x.amount >= 100))), 0) FROM public.shop_orders x WHERE x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;

INSERT INTO freshline.agg_orders_30d_df904743_d6 (shop_id, customer_id, day, value, n) SELECT x.shop_id, x.customer_id, ((x.placed_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.sku, count(*) FROM public.shop_orders x WHERE x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') AND true AND x.sku IS NOT NULL GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4;

INSERT INTO freshline.agg_orders_30d_df904743_l6 (shop_id, customer_id, value, latest) SELECT shop_id, customer_id, value, max(day) FROM freshline.agg_orders_30d_df904743_d6 GROUP BY shop_id, customer_id, value;

UPDATE freshline.agg_orders_30d_df904743_days d SET lc6 = c.n FROM (SELECT shop_id, customer_id, latest, count(*) AS n FROM freshline.agg_orders_30d_df904743_l6 GROUP BY shop_id, customer_id, latest) AS c WHERE d.shop_id = c.shop_id AND d.customer_id = c.customer_id AND d.day = c.latest;

ANALYZE freshline.agg_orders_30d_df904743_days;

ANALYZE freshline.agg_orders_30d_df904743_d6;

ANALYZE freshline.agg_orders_30d_df904743_l6;

ANALYZE freshline.agg_orders_30d_df904743_head;

ANALYZE freshline.agg_orders_30d_df904743_log;
