-- The triggers of fraud's geo, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_i() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.transactions'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'INSERT' THEN
        IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.transactions'::pg_catalog.regclass THEN false ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.transactions'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'INSERT' THEN
            RAISE EXCEPTION 'freshline: freshline.agg_geo_2aa57b3f_i() runs only as the AFTER INSERT statement trigger on % or a partition of it', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
        END IF;
    END IF;
    INSERT INTO freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM new_rows x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_u() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.transactions'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'UPDATE' THEN
        IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.transactions'::pg_catalog.regclass THEN false ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.transactions'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'UPDATE' THEN
            RAISE EXCEPTION 'freshline: freshline.agg_geo_2aa57b3f_u() runs only as the AFTER UPDATE statement trigger on % or a partition of it', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
        END IF;
    END IF;
    INSERT INTO freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM (SELECT "tenant_id", "user_id", "created_at", "id", "ip", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id" FROM old_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "id", "ip", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id" FROM new_rows) AS x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL UNION ALL SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM (SELECT "tenant_id", "user_id", "created_at", "id", "ip", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id" FROM new_rows EXCEPT ALL SELECT "tenant_id", "user_id", "created_at", "id", "ip", "tenant_id"::pg_catalog.text COLLATE "C" AS "fl_c_tenant_id" FROM old_rows) AS x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_d() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.transactions'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'DELETE' THEN
        IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.transactions'::pg_catalog.regclass THEN false ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.transactions'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'DELETE' THEN
            RAISE EXCEPTION 'freshline: freshline.agg_geo_2aa57b3f_d() runs only as the AFTER DELETE statement trigger on % or a partition of it', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
        END IF;
    END IF;
    INSERT INTO freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM old_rows x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_t() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.transactions'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'TRUNCATE' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_geo_2aa57b3f_t() runs only as the AFTER TRUNCATE statement trigger on %', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
    END IF;
    TRUNCATE freshline.agg_geo_2aa57b3f_days, freshline.agg_geo_2aa57b3f_d2, freshline.agg_geo_2aa57b3f_l2, freshline.agg_geo_2aa57b3f_head, freshline.agg_geo_2aa57b3f_log;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_p() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF (CASE WHEN TG_RELID OPERATOR(pg_catalog.=) 'public.transactions'::pg_catalog.regclass THEN true ELSE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree('public.transactions'::pg_catalog.regclass) AS p WHERE p.relid OPERATOR(pg_catalog.=) TG_RELID) END) OR TG_WHEN OPERATOR(pg_catalog.<>) 'BEFORE' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'TRUNCATE' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_geo_2aa57b3f_p() runs only as the BEFORE TRUNCATE statement trigger on a partition of %', 'public.transactions' USING ERRCODE = 'triggered_action_exception';
    END IF;
    EXECUTE pg_catalog.format($q$INSERT INTO freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM %s x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day$q$, TG_RELID::pg_catalog.regclass);
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_l0i() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.geoip'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'INSERT' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_geo_2aa57b3f_l0i() runs only as the AFTER INSERT statement trigger on %', 'public.geoip' USING ERRCODE = 'triggered_action_exception';
    END IF;
    INSERT INTO freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM public.transactions x JOIN new_rows g ON (x.ip BETWEEN g.ip_from AND g.ip_to) WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_l0u() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.geoip'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'UPDATE' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_geo_2aa57b3f_l0u() runs only as the AFTER UPDATE statement trigger on %', 'public.geoip' USING ERRCODE = 'triggered_action_exception';
    END IF;
    INSERT INTO freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM public.transactions x JOIN old_rows g ON (x.ip BETWEEN g.ip_from AND g.ip_to) WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL UNION ALL SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM public.transactions x JOIN new_rows g ON (x.ip BETWEEN g.ip_from AND g.ip_to) WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_l0d() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.geoip'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'DELETE' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_geo_2aa57b3f_l0d() runs only as the AFTER DELETE statement trigger on %', 'public.geoip' USING ERRCODE = 'triggered_action_exception';
    END IF;
    INSERT INTO freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM public.transactions x JOIN old_rows g ON (x.ip BETWEEN g.ip_from AND g.ip_to) WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_l0t() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
BEGIN
    IF TG_RELID OPERATOR(pg_catalog.<>) 'public.geoip'::pg_catalog.regclass OR TG_WHEN OPERATOR(pg_catalog.<>) 'AFTER' OR TG_LEVEL OPERATOR(pg_catalog.<>) 'STATEMENT' OR TG_OP OPERATOR(pg_catalog.<>) 'TRUNCATE' THEN
        RAISE EXCEPTION 'freshline: freshline.agg_geo_2aa57b3f_l0t() runs only as the AFTER TRUNCATE statement trigger on %', 'public.geoip' USING ERRCODE = 'triggered_action_exception';
    END IF;
    INSERT INTO freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at) SELECT tenant_id, user_id, day, min(at) FROM (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.created_at FROM public.transactions x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL) AS x(tenant_id, user_id, day, at) GROUP BY tenant_id, user_id, day;
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS freshline_agg_geo_2aa57b3f_i ON public.transactions;

DROP TRIGGER IF EXISTS freshline_agg_geo_2aa57b3f_u ON public.transactions;

DROP TRIGGER IF EXISTS freshline_agg_geo_2aa57b3f_d ON public.transactions;

DROP TRIGGER IF EXISTS freshline_agg_geo_2aa57b3f_t ON public.transactions;

CREATE TRIGGER freshline_agg_geo_2aa57b3f_i AFTER INSERT ON public.transactions REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_geo_2aa57b3f_i();

CREATE TRIGGER freshline_agg_geo_2aa57b3f_u AFTER UPDATE ON public.transactions REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_geo_2aa57b3f_u();

CREATE TRIGGER freshline_agg_geo_2aa57b3f_d AFTER DELETE ON public.transactions REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_geo_2aa57b3f_d();

CREATE TRIGGER freshline_agg_geo_2aa57b3f_t AFTER TRUNCATE ON public.transactions FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_geo_2aa57b3f_t();

ALTER TABLE public.transactions ENABLE ALWAYS TRIGGER freshline_agg_geo_2aa57b3f_i;

ALTER TABLE public.transactions ENABLE ALWAYS TRIGGER freshline_agg_geo_2aa57b3f_u;

ALTER TABLE public.transactions ENABLE ALWAYS TRIGGER freshline_agg_geo_2aa57b3f_d;

ALTER TABLE public.transactions ENABLE ALWAYS TRIGGER freshline_agg_geo_2aa57b3f_t;

DROP TRIGGER IF EXISTS freshline_agg_geo_2aa57b3f_l0i ON public.geoip;

DROP TRIGGER IF EXISTS freshline_agg_geo_2aa57b3f_l0u ON public.geoip;

DROP TRIGGER IF EXISTS freshline_agg_geo_2aa57b3f_l0d ON public.geoip;

DROP TRIGGER IF EXISTS freshline_agg_geo_2aa57b3f_l0t ON public.geoip;

CREATE TRIGGER freshline_agg_geo_2aa57b3f_l0i AFTER INSERT ON public.geoip REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_geo_2aa57b3f_l0i();

CREATE TRIGGER freshline_agg_geo_2aa57b3f_l0u AFTER UPDATE ON public.geoip REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_geo_2aa57b3f_l0u();

CREATE TRIGGER freshline_agg_geo_2aa57b3f_l0d AFTER DELETE ON public.geoip REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_geo_2aa57b3f_l0d();

CREATE TRIGGER freshline_agg_geo_2aa57b3f_l0t AFTER TRUNCATE ON public.geoip FOR EACH STATEMENT EXECUTE FUNCTION freshline.agg_geo_2aa57b3f_l0t();

ALTER TABLE public.geoip ENABLE ALWAYS TRIGGER freshline_agg_geo_2aa57b3f_l0i;

ALTER TABLE public.geoip ENABLE ALWAYS TRIGGER freshline_agg_geo_2aa57b3f_l0u;

ALTER TABLE public.geoip ENABLE ALWAYS TRIGGER freshline_agg_geo_2aa57b3f_l0d;

ALTER TABLE public.geoip ENABLE ALWAYS TRIGGER freshline_agg_geo_2aa57b3f_l0t;
