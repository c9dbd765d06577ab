-- The triggers of shop's orders_30d, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

CREATE OR REPLACE FUNCTION freshline.agg_orders_30d_df904743_i() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.shop_orders'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'INSERT' THEN
        IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.shop_orders'::pg_catalog.regclass THEN false ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.shop_orders'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'INSERT' THEN
            RAISE EXCEPTION 'freshline: freshline.agg_orders_30d_df904743_i() runs only as the AFTER INSERT statement trigger on % or a partition of it', 'public.shop_orders' USING ERRCODE = 'triggered_action_exception';
        END IF;
    END IF;
    INSERT INTO freshline.agg_orders_30d_df904743_log (shop_id, customer_id, day, at) SELECT x.shop_id, x.customer_id, ((x.placed_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.placed_at FROM new_rows x WHERE x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_orders_30d_df904743_u() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.shop_orders'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'UPDATE' THEN
        IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.shop_orders'::pg_catalog.regclass THEN false ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.shop_orders'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'UPDATE' THEN
            RAISE EXCEPTION 'freshline: freshline.agg_orders_30d_df904743_u() runs only as the AFTER UPDATE statement trigger on % or a partition of it', 'public.shop_orders' USING ERRCODE = 'triggered_action_exception';
        END IF;
    END IF;
    IF NOT EXISTS (SELECT "shop_id", "customer_id", "placed_at", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM (SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM old_rows EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM new_rows) AS x EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM (SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM new_rows EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM old_rows) AS x) AND NOT EXISTS (SELECT "shop_id", "customer_id", "placed_at", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM (SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM new_rows EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM old_rows) AS x EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM (SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM old_rows EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM new_rows) AS x) THEN
        INSERT INTO freshline.agg_orders_30d_df904743_log (shop_id, customer_id, day, at, till, dn1, ds1, dq1, dn2, ds2, dq2, dmn3, don3, dmx4, dox4, dn5, ds5, dq5, dn10, ds10, dq10) SELECT x.shop_id, x.customer_id, ((x.placed_at) AT TIME ZONE 'UTC')::pg_catalog.date, min(x.placed_at), max(x.placed_at), coalesce(sum(x.fl_sg) FILTER (WHERE true AND x.amount IS NOT NULL), 0), coalesce(sum(x.fl_sg * x.amount::numeric) FILTER (WHERE true), 0), coalesce(sum(x.fl_sg * x.amount::numeric * x.amount::numeric) FILTER (WHERE true), 0), coalesce(sum(x.fl_sg) FILTER (WHERE true AND x.amount IS NOT NULL), 0), coalesce(sum(x.fl_sg * x.amount::numeric) FILTER (WHERE true), 0), coalesce(sum(x.fl_sg * x.amount::numeric * x.amount::numeric) FILTER (WHERE true), 0), min(x.amount) FILTER (WHERE true AND x.fl_sg > 0), min(x.amount) FILTER (WHERE true AND x.fl_sg < 0), max(x.amount) FILTER (WHERE true AND x.fl_sg > 0), max(x.amount) FILTER (WHERE true AND x.fl_sg < 0), coalesce(sum(x.fl_sg) FILTER (WHERE true AND x.amount IS NOT NULL), 0), coalesce(sum(x.fl_sg * x.amount::numeric) FILTER (WHERE true), 0), coalesce(sum(x.fl_sg * x.amount::numeric * x.amount::numeric) FILTER (WHERE true), 0), coalesce(sum(x.fl_sg) FILTER (WHERE (x.amount >= 100) AND x.amount IS NOT NULL), 0), coalesce(sum(x.fl_sg * x.amount::numeric) FILTER (WHERE (x.amount >= 100)), 0), coalesce(sum(x.fl_sg * x.amount::numeric * x.amount::numeric) FILTER (WHERE (x.amount >= 100)), 0) FROM (SELECT 1 AS fl_sg, x.* FROM (SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM new_rows EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM old_rows) AS x WHERE x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') UNION ALL SELECT -1, x.* FROM (SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM old_rows EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM new_rows) AS x WHERE x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled')) AS x GROUP BY 1, 2, 3;
    ELSE
        INSERT INTO freshline.agg_orders_30d_df904743_log (shop_id, customer_id, day, at) SELECT shop_id, customer_id, day, min(at) FROM (SELECT x.shop_id, x.customer_id, ((x.placed_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.placed_at FROM (SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM old_rows EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM new_rows) AS x WHERE x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled') UNION ALL SELECT x.shop_id, x.customer_id, ((x.placed_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.placed_at FROM (SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM new_rows EXCEPT ALL SELECT "shop_id", "customer_id", "placed_at", "amount", "sku", "status", "shop_id"::pg_catalog.text COLLATE "C" AS "fl_c_shop_id", "customer_id"::pg_catalog.text COLLATE "C" AS "fl_c_customer_id", "sku"::pg_catalog.text COLLATE "C" AS "fl_c_sku", "status"::pg_catalog.text COLLATE "C" AS "fl_c_status" FROM old_rows) AS x WHERE x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled')) AS x(shop_id, customer_id, day, at) GROUP BY shop_id, customer_id, day;
    END IF;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_orders_30d_df904743_d() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.shop_orders'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'DELETE' THEN
        IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.shop_orders'::pg_catalog.regclass THEN false ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.shop_orders'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'DELETE' THEN
            RAISE EXCEPTION 'freshline: freshline.agg_orders_30d_df904743_d() runs only as the AFTER DELETE statement trigger on % or a partition of it', 'public.shop_orders' USING ERRCODE = 'triggered_action_exception';
        END IF;
    END IF;
    INSERT INTO freshline.agg_orders_30d_df904743_log (shop_id, customer_id, day, at) SELECT shop_id, customer_id, day, min(at) FROM (SELECT x.shop_id, x.customer_id, ((x.placed_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.placed_at FROM old_rows x WHERE x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled')) AS x(shop_id, customer_id, day, at) GROUP BY shop_id, customer_id, day;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_orders_30d_df904743_t() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.shop_orders'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'TRUNCATE' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_orders_30d_df904743_t() runs only as the AFTER TRUNCATE statement trigger on %', 'public.shop_orders' USING ERRCODE = 'triggered_action_exception';
    END IF;
    TRUNCATE freshline.agg_orders_30d_df904743_days, freshline.agg_orders_30d_df904743_d6, freshline.agg_orders_30d_df904743_l6, freshline.agg_orders_30d_df904743_head, freshline.agg_orders_30d_df904743_log;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_orders_30d_df904743_p() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.shop_orders'::pg_catalog.regclass THEN true ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.shop_orders'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'BEFORE' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'TRUNCATE' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_orders_30d_df904743_p() runs only as the BEFORE TRUNCATE statement trigger on a partition of %', 'public.shop_orders' USING ERRCODE = 'triggered_action_exception';
    END IF;
    EXECUTE pg_catalog.format($q$INSERT INTO freshline.agg_orders_30d_df904743_log (shop_id, customer_id, day, at) SELECT shop_id, customer_id, day, min(at) FROM (SELECT x.shop_id, x.customer_id, ((x.placed_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.placed_at FROM %s x WHERE x.shop_id IS NOT NULL AND x.customer_id IS NOT NULL AND x.placed_at IS NOT NULL AND (x.status <> 'cancelled')) AS x(shop_id, customer_id, day, at) GROUP BY shop_id, customer_id, day$q$, TG_RELID::pg_catalog.regclass);
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS freshline_agg_orders_30d_df904743_i ON public.shop_orders;

DROP TRIGGER IF EXISTS freshline_agg_orders_30d_df904743_u ON public.shop_orders;

DROP TRIGGER IF EXISTS freshline_agg_orders_30d_df904743_d ON public.shop_orders;

DROP TRIGGER IF EXISTS freshline_agg_orders_30d_df904743_t ON public.shop_orders;

CREATE TRIGGER freshline_agg_orders_30d_df904743_i AFTER INSERT ON public.shop_orders REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_orders_30d_df904743_i();

CREATE TRIGGER freshline_agg_orders_30d_df904743_u AFTER UPDATE ON public.shop_orders REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_orders_30d_df904743_u();

CREATE TRIGGER freshline_agg_orders_30d_df904743_d AFTER DELETE ON public.shop_orders REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_orders_30d_df904743_d();

CREATE TRIGGER freshline_agg_orders_30d_df904743_t AFTER TRUNCATE ON public.shop_orders FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_orders_30d_df904743_t();

ALTER TABLE public.shop_orders ENABLE ALWAYS TRIGGER freshline_agg_orders_30d_df904743_i;

ALTER TABLE public.shop_orders ENABLE ALWAYS TRIGGER freshline_agg_orders_30d_df904743_u;

ALTER TABLE public.shop_orders ENABLE ALWAYS TRIGGER freshline_agg_orders_30d_df904743_d;

ALTER TABLE public.shop_orders ENABLE ALWAYS TRIGGER freshline_agg_orders_30d_df904743_t;
