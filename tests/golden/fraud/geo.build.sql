-- The build of fraud's geo, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

SELECT pg_advisory_xact_lock(hashtext('freshline.agg_geo_2aa57b3f'));

LOCK TABLE public.transactions IN SHARE MODE;

LOCK TABLE public.geoip IN SHARE MODE;

DELETE FROM freshline.agg_geo_2aa57b3f_days;

DELETE FROM freshline.agg_geo_2aa57b3f_d2;

DELETE FROM freshline.agg_geo_2aa57b3f_l2;

DELETE FROM freshline.agg_geo_2aa57b3f_head;

DELETE FROM freshline.agg_geo_2aa57b3f_log;

INSERT INTO freshline.agg_geo_2aa57b3f_days (tenant_id, user_id, day, lt0, lb0, lv0, lt1, lb1, lv1) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, max(x.created_at) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), (array_agg(x.id ORDER BY x.created_at DESC, x.id DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], (array_agg(x.country ORDER BY x.created_at DESC, x.id DESC NULLS LAST, x.country DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], max(x.created_at) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), (array_agg(x.id ORDER BY x.created_at DESC, x.id DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], (array_agg(x.city ORDER BY x.created_at DESC, x.id DESC NULLS LAST, x.city DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1] FROM (SELECT x.*, lk0.country, lk0.city FROM public.transactions x LEFT JOIN LATERAL (SELECT g.country, g.city FROM (
    SELECT country, city, ip_to FROM geoip WHERE ip_from <= x.ip
    ORDER BY ip_from DESC LIMIT 1
) g WHERE x.ip <= g.ip_to) AS lk0(country, city) ON true) x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;

INSERT INTO freshline.agg_geo_2aa57b3f_d2 (tenant_id, user_id, day, value, n) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.country, count(*) FROM (SELECT x.*, lk0.country, lk0.city FROM public.transactions x LEFT JOIN LATERAL (SELECT g.country, g.city FROM (
    SELECT country, city, ip_to FROM geoip WHERE ip_from <= x.ip
    ORDER BY ip_from DESC LIMIT 1
) g WHERE x.ip <= g.ip_to) AS lk0(country, city) ON true) x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true AND x.country IS NOT NULL GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4;

INSERT INTO freshline.agg_geo_2aa57b3f_l2 (tenant_id, user_id, value, latest) SELECT tenant_id, user_id, value, max(day) FROM freshline.agg_geo_2aa57b3f_d2 GROUP BY tenant_id, user_id, value;

UPDATE freshline.agg_geo_2aa57b3f_days d SET lc2 = c.n FROM (SELECT tenant_id, user_id, latest, count(*) AS n FROM freshline.agg_geo_2aa57b3f_l2 GROUP BY tenant_id, user_id, latest) AS c WHERE d.tenant_id = c.tenant_id AND d.user_id = c.user_id AND d.day = c.latest;

ANALYZE freshline.agg_geo_2aa57b3f_days;

ANALYZE freshline.agg_geo_2aa57b3f_d2;

ANALYZE freshline.agg_geo_2aa57b3f_l2;

ANALYZE freshline.agg_geo_2aa57b3f_head;

ANALYZE freshline.agg_geo_2aa57b3f_log;
