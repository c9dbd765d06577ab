-- The triggers of fraud's txn_90d, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

CREATE OR REPLACE FUNCTION freshline.agg_txn_90d_a06f2675_i() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.transactions'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'INSERT' THEN
        IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.transactions'::pg_catalog.regclass THEN false ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.transactions'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'INSERT' THEN
            RAISE EXCEPTION 'freshline: freshline.agg_txn_90d_a06f2675_i() runs only as the AFTER INSERT statement trigger on % or a partition of it', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
        END IF;
    END IF;
    INSERT INTO freshline.agg_txn_90d_a06f2675_log (tenant_id, user_id, day, at) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM new_rows x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_txn_90d_a06f2675_u() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.transactions'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'UPDATE' THEN
        IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.transactions'::pg_catalog.regclass THEN false ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.transactions'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'UPDATE' THEN
            RAISE EXCEPTION 'freshline: freshline.agg_txn_90d_a06f2675_u() runs only as the AFTER UPDATE statement trigger on % or a partition of it', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
        END IF;
    END IF;
    IF NOT EXISTS (SELECT "tenant_id", "user_id", "created_at", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM (SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM old_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM new_rows) AS x EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM (SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM new_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM old_rows) AS x) AND NOT EXISTS (SELECT "tenant_id", "user_id", "created_at", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM (SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM new_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM old_rows) AS x EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM (SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM old_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM new_rows) AS x) THEN
        INSERT INTO freshline.agg_txn_90d_a06f2675_log (tenant_id, user_id, day, at, till, dn1, ds1, dq1, dn2, ds2, dq2, dmx3, dox3, dn4, ds4, dq4) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, min(x.created_at), max(x.created_at), coalesce(sum(x.fl_sg) FILTER (WHERE true AND x.amount IS NOT NULL), 0), coalesce(sum(x.fl_sg * x.amount::numeric) FILTER (WHERE true), 0), coalesce(sum(x.fl_sg * x.amount::numeric * x.amount::numeric) FILTER (WHERE true), 0), coalesce(sum(x.fl_sg) FILTER (WHERE true AND x.amount IS NOT NULL), 0), coalesce(sum(x.fl_sg * x.amount::numeric) FILTER (WHERE true), 0), coalesce(sum(x.fl_sg * x.amount::numeric * x.amount::numeric) FILTER (WHERE true), 0), max(x.amount) FILTER (WHERE true AND x.fl_sg > 0), max(x.amount) FILTER (WHERE true AND x.fl_sg < 0), coalesce(sum(x.fl_sg) FILTER (WHERE true AND x.amount IS NOT NULL), 0), coalesce(sum(x.fl_sg * x.amount::numeric) FILTER (WHERE true), 0), coalesce(sum(x.fl_sg * x.amount::numeric * x.amount::numeric) FILTER (WHERE true), 0) FROM (SELECT 1 AS fl_sg, x.* FROM (SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM new_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM old_rows) AS x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL UNION ALL SELECT -1, x.* FROM (SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM old_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM new_rows) AS x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x GROUP BY 1, 2, 3;
    ELSE
        INSERT INTO freshline.agg_txn_90d_a06f2675_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM (SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM old_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM new_rows) AS x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL UNION ALL SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM (SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM new_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "amount", "merchant_id", "device_id", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id", "merchant_id"::pg_catalog.text COLLATE "C" AS "fl_c_merchant_id", "device_id"::pg_catalog.text COLLATE "C" AS "fl_c_device_id" FROM old_rows) AS x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day;
    END IF;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_txn_90d_a06f2675_d() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.transactions'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'DELETE' THEN
        IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.transactions'::pg_catalog.regclass THEN false ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.transactions'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'DELETE' THEN
            RAISE EXCEPTION 'freshline: freshline.agg_txn_90d_a06f2675_d() runs only as the AFTER DELETE statement trigger on % or a partition of it', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
        END IF;
    END IF;
    INSERT INTO freshline.agg_txn_90d_a06f2675_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM old_rows x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_txn_90d_a06f2675_t() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.transactions'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'TRUNCATE' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_txn_90d_a06f2675_t() runs only as the AFTER TRUNCATE statement trigger on %', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
    END IF;
    TRUNCATE freshline.agg_txn_90d_a06f2675_days, freshline.agg_txn_90d_a06f2675_d5, freshline.agg_txn_90d_a06f2675_l5, freshline.agg_txn_90d_a06f2675_d6, freshline.agg_txn_90d_a06f2675_l6, freshline.agg_txn_90d_a06f2675_head, freshline.agg_txn_90d_a06f2675_log;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_txn_90d_a06f2675_p() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.transactions'::pg_catalog.regclass THEN true ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.transactions'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'BEFORE' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'TRUNCATE' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_txn_90d_a06f2675_p() runs only as the BEFORE TRUNCATE statement trigger on a partition of %', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
    END IF;
    EXECUTE pg_catalog.format($q$INSERT INTO freshline.agg_txn_90d_a06f2675_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM %s x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day$q$, TG_RELID::pg_catalog.regclass);
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS freshline_agg_txn_90d_a06f2675_i ON public.transactions;

DROP TRIGGER IF EXISTS freshline_agg_txn_90d_a06f2675_u ON public.transactions;

DROP TRIGGER IF EXISTS freshline_agg_txn_90d_a06f2675_d ON public.transactions;

DROP TRIGGER IF EXISTS freshline_agg_txn_90d_a06f2675_t ON public.transactions;

CREATE TRIGGER freshline_agg_txn_90d_a06f2675_i AFTER INSERT ON public.transactions REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_txn_90d_a06f2675_i();

CREATE TRIGGER freshline_agg_txn_90d_a06f2675_u AFTER UPDATE ON public.transactions REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_txn_90d_a06f2675_u();

CREATE TRIGGER freshline_agg_txn_90d_a06f2675_d AFTER DELETE ON public.transactions REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_txn_90d_a06f2675_d();

CREATE TRIGGER freshline_agg_txn_90d_a06f2675_t AFTER TRUNCATE ON public.transactions FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_txn_90d_a06f2675_t();

ALTER TABLE public.transactions ENABLE ALWAYS TRIGGER freshline_agg_txn_90d_a06f2675_i;

ALTER TABLE public.transactions ENABLE ALWAYS TRIGGER freshline_agg_txn_90d_a06f2675_u;

ALTER TABLE public.transactions ENABLE ALWAYS TRIGGER freshline_agg_txn_90d_a06f2675_d;

ALTER TABLE public.transactions ENABLE ALWAYS TRIGGER freshline_agg_txn_90d_a06f2675_t;
