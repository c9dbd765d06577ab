-- The fold of fraud's geo, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

CREATE OR REPLACE FUNCTION freshline.agg_geo_2aa57b3f_fold(integer, boolean, boolean) RETURNS integer LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $fn$
DECLARE
    fl_k0 text[];
    fl_k1 bigint[];
    fl_k2 date[];
    fl_h integer := 0;
    fl_hk0 text[];
    fl_hk1 bigint[];
    fl_da date := ((now()) AT TIME ZONE 'UTC')::pg_catalog.date;
    fl_cut timestamptz := now();
    fl_v2_0 text[];
    fl_v2_1 bigint[];
    fl_v2_2 text[];
    fl_o2_0 text[];
    fl_o2_1 bigint[];
    fl_o2_2 date[];
BEGIN
    IF $2 THEN PERFORM pg_advisory_xact_lock(hashtext('freshline.agg_geo_2aa57b3f')); ELSIF NOT pg_try_advisory_xact_lock(hashtext('freshline.agg_geo_2aa57b3f')) THEN RETURN NULL; END IF;
    IF $3 THEN
        SELECT array_agg(g.tenant_id), array_agg(g.user_id) INTO fl_hk0, fl_hk1 FROM (SELECT l.tenant_id, l.user_id FROM freshline.agg_geo_2aa57b3f_log l LEFT JOIN freshline.agg_geo_2aa57b3f_head h ON h.tenant_id = l.tenant_id AND h.user_id = l.user_id AND h.day = l.day WHERE l.day = fl_da AND l.at < fl_cut GROUP BY l.tenant_id, l.user_id, h.cut HAVING count(*) >= coalesce(nullif(current_setting('freshline.head_rows', true), '')::integer, 64) OR coalesce(bool_or((l.at < h.cut AND NOT coalesce(l.till < h.cut, false))), false) LIMIT $1) AS g;
        IF fl_hk0 IS NOT NULL THEN
            WITH gone AS (DELETE FROM freshline.agg_geo_2aa57b3f_log WHERE (tenant_id, user_id) IN (SELECT * FROM unnest(fl_hk0, fl_hk1)) AND day = fl_da AND at < fl_cut RETURNING *), h0 AS (SELECT h.* FROM freshline.agg_geo_2aa57b3f_head h WHERE (tenant_id, user_id) IN (SELECT * FROM unnest(fl_hk0, fl_hk1)) AND h.day = fl_da), k AS (SELECT tenant_id, user_id, coalesce(bool_or((g.at < h0.cut AND NOT coalesce(g.till < h0.cut, false))), false) AS fl_stale FROM gone g LEFT JOIN h0 USING (tenant_id, user_id) GROUP BY tenant_id, user_id), o AS (SELECT tenant_id, user_id, h0.cut, h0.lt0, h0.lb0, h0.lv0, h0.lt1, h0.lb1, h0.lv1, h0.hv2 FROM h0 JOIN k USING (tenant_id, user_id) WHERE NOT k.fl_stale), t AS (SELECT tenant_id, user_id, coalesce(o.cut, (fl_da)::timestamp AT TIME ZONE 'UTC') AS lo FROM k LEFT JOIN o USING (tenant_id, user_id)), n(tenant_id, user_id, day, lt0, lb0, lv0, lt1, lb1, lv1, hv2) AS (SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, max(x.created_at) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), (array_agg(x.id ORDER BY x.created_at DESC, x.id DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], (array_agg(x.country ORDER BY x.created_at DESC, x.id DESC NULLS LAST, x.country DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], max(x.created_at) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), (array_agg(x.id ORDER BY x.created_at DESC, x.id DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], (array_agg(x.city ORDER BY x.created_at DESC, x.id DESC NULLS LAST, x.city DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], array_agg(DISTINCT x.country) FILTER (WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true AND x.country IS NOT NULL) FROM (SELECT x.*, lk0.country, lk0.city FROM t JOIN public.transactions x ON x.tenant_id = t.tenant_id AND x.user_id = t.user_id AND x.created_at >= t.lo AND x.created_at < fl_cut LEFT JOIN LATERAL (SELECT g.country, g.city FROM (
    SELECT country, city, ip_to FROM geoip WHERE ip_from <= x.ip
    ORDER BY ip_from DESC LIMIT 1
) g WHERE x.ip <= g.ip_to) AS lk0(country, city) ON true) x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL GROUP BY 1, 2, 3 ORDER BY 1, 2, 3) INSERT INTO freshline.agg_geo_2aa57b3f_head (tenant_id, user_id, day, cut, lt0, lb0, lv0, lt1, lb1, lv1, hv2) SELECT k.tenant_id, k.user_id, fl_da, fl_cut, CASE WHEN n.lt0 IS NOT NULL THEN n.lt0 ELSE o.lt0 END, CASE WHEN n.lt0 IS NOT NULL THEN n.lb0 ELSE o.lb0 END, CASE WHEN n.lt0 IS NOT NULL THEN n.lv0 ELSE o.lv0 END, CASE WHEN n.lt1 IS NOT NULL THEN n.lt1 ELSE o.lt1 END, CASE WHEN n.lt1 IS NOT NULL THEN n.lb1 ELSE o.lb1 END, CASE WHEN n.lt1 IS NOT NULL THEN n.lv1 ELSE o.lv1 END, ARRAY(SELECT DISTINCT v FROM unnest(o.hv2 || n.hv2) AS v) FROM k LEFT JOIN o USING (tenant_id, user_id) LEFT JOIN n USING (tenant_id, user_id) ON CONFLICT (tenant_id, user_id) DO UPDATE SET day = EXCLUDED.day, cut = EXCLUDED.cut, lt0 = EXCLUDED.lt0, lb0 = EXCLUDED.lb0, lv0 = EXCLUDED.lv0, lt1 = EXCLUDED.lt1, lb1 = EXCLUDED.lb1, lv1 = EXCLUDED.lv1, hv2 = EXCLUDED.hv2;
            INSERT INTO freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at) SELECT k.*, fl_da, 'infinity' FROM unnest(fl_hk0, fl_hk1) AS k(tenant_id, user_id) WHERE NOT EXISTS (SELECT 1 FROM freshline.agg_geo_2aa57b3f_log l WHERE l.tenant_id = k.tenant_id AND l.user_id = k.user_id AND l.day = fl_da AND l.at = 'infinity');
            fl_h := coalesce(cardinality(fl_hk0), 0);
        END IF;
    END IF;
    SELECT array_agg(g.tenant_id), array_agg(g.user_id), array_agg(g.day) INTO fl_k0, fl_k1, fl_k2 FROM (SELECT DISTINCT tenant_id, user_id, day FROM freshline.agg_geo_2aa57b3f_log WHERE NOT $3 OR day < ((now()) AT TIME ZONE 'UTC')::pg_catalog.date LIMIT $1) AS g;
    IF fl_k0 IS NULL THEN RETURN fl_h; END IF;
    DELETE FROM freshline.agg_geo_2aa57b3f_log WHERE (tenant_id, user_id, day) IN (SELECT * FROM unnest(fl_k0, fl_k1, fl_k2));
    SELECT array_agg(g.tenant_id), array_agg(g.user_id), array_agg(g.value) INTO fl_v2_0, fl_v2_1, fl_v2_2 FROM (SELECT tenant_id, user_id, value FROM freshline.agg_geo_2aa57b3f_d2 WHERE (tenant_id, user_id, day) IN (SELECT * FROM unnest(fl_k0, fl_k1, fl_k2)) UNION SELECT x.tenant_id, x.user_id, x.country FROM (SELECT x.*, lk0.country, lk0.city FROM (SELECT * FROM unnest(fl_k0, fl_k1, fl_k2)) AS t(tenant_id, user_id, day) JOIN public.transactions x ON x.tenant_id = t.tenant_id AND x.user_id = t.user_id AND x.created_at >= (t.day)::timestamp AT TIME ZONE 'UTC' AND x.created_at < (t.day + 1)::timestamp AT TIME ZONE 'UTC' LEFT JOIN LATERAL (SELECT g.country, g.city FROM (
    SELECT country, city, ip_to FROM geoip WHERE ip_from <= x.ip
    ORDER BY ip_from DESC LIMIT 1
) g WHERE x.ip <= g.ip_to) AS lk0(country, city) ON true) x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true AND x.country IS NOT NULL) AS g(tenant_id, user_id, value);
    SELECT array_agg(g.tenant_id), array_agg(g.user_id), array_agg(g.day) INTO fl_o2_0, fl_o2_1, fl_o2_2 FROM (SELECT tenant_id, user_id, latest FROM freshline.agg_geo_2aa57b3f_l2 WHERE (tenant_id, user_id, value) IN (SELECT * FROM unnest(fl_v2_0, fl_v2_1, fl_v2_2))) AS g(tenant_id, user_id, day);
    DELETE FROM freshline.agg_geo_2aa57b3f_days WHERE (tenant_id, user_id, day) IN (SELECT * FROM unnest(fl_k0, fl_k1, fl_k2));
    DELETE FROM freshline.agg_geo_2aa57b3f_head WHERE (tenant_id, user_id, day) IN (SELECT * FROM unnest(fl_k0, fl_k1, fl_k2));
    INSERT INTO freshline.agg_geo_2aa57b3f_days (tenant_id, user_id, day, lt0, lb0, lv0, lt1, lb1, lv1) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, max(x.created_at) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), (array_agg(x.id ORDER BY x.created_at DESC, x.id DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], (array_agg(x.country ORDER BY x.created_at DESC, x.id DESC NULLS LAST, x.country DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], max(x.created_at) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)), (array_agg(x.id ORDER BY x.created_at DESC, x.id DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1], (array_agg(x.city ORDER BY x.created_at DESC, x.id DESC NULLS LAST, x.city DESC NULLS LAST) FILTER (WHERE (x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true)))[1] FROM (SELECT x.*, lk0.country, lk0.city FROM (SELECT * FROM unnest(fl_k0, fl_k1, fl_k2)) AS t(tenant_id, user_id, day) JOIN public.transactions x ON x.tenant_id = t.tenant_id AND x.user_id = t.user_id AND x.created_at >= (t.day)::timestamp AT TIME ZONE 'UTC' AND x.created_at < (t.day + 1)::timestamp AT TIME ZONE 'UTC' LEFT JOIN LATERAL (SELECT g.country, g.city FROM (
    SELECT country, city, ip_to FROM geoip WHERE ip_from <= x.ip
    ORDER BY ip_from DESC LIMIT 1
) g WHERE x.ip <= g.ip_to) AS lk0(country, city) ON true) x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;
    DELETE FROM freshline.agg_geo_2aa57b3f_d2 WHERE (tenant_id, user_id, day) IN (SELECT * FROM unnest(fl_k0, fl_k1, fl_k2));
    INSERT INTO freshline.agg_geo_2aa57b3f_d2 (tenant_id, user_id, day, value, n) SELECT x.tenant_id, x.user_id, ((x.created_at) AT TIME ZONE 'UTC')::pg_catalog.date, x.country, count(*) FROM (SELECT x.*, lk0.country, lk0.city FROM (SELECT * FROM unnest(fl_k0, fl_k1, fl_k2)) AS t(tenant_id, user_id, day) JOIN public.transactions x ON x.tenant_id = t.tenant_id AND x.user_id = t.user_id AND x.created_at >= (t.day)::timestamp AT TIME ZONE 'UTC' AND x.created_at < (t.day + 1)::timestamp AT TIME ZONE 'UTC' LEFT JOIN LATERAL (SELECT g.country, g.city FROM (
    SELECT country, city, ip_to FROM geoip WHERE ip_from <= x.ip
    ORDER BY ip_from DESC LIMIT 1
) g WHERE x.ip <= g.ip_to) AS lk0(country, city) ON true) x WHERE x.tenant_id IS NOT NULL AND x.user_id IS NOT NULL AND x.created_at IS NOT NULL AND true AND x.country IS NOT NULL GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4;
    DELETE FROM freshline.agg_geo_2aa57b3f_l2 WHERE (tenant_id, user_id, value) IN (SELECT * FROM unnest(fl_v2_0, fl_v2_1, fl_v2_2));
    INSERT INTO freshline.agg_geo_2aa57b3f_l2 (tenant_id, user_id, value, latest) SELECT tenant_id, user_id, value, max(day) FROM freshline.agg_geo_2aa57b3f_d2 WHERE (tenant_id, user_id, value) IN (SELECT * FROM unnest(fl_v2_0, fl_v2_1, fl_v2_2)) GROUP BY tenant_id, user_id, value;
    UPDATE freshline.agg_geo_2aa57b3f_days d SET lc2 = (SELECT count(*) FROM freshline.agg_geo_2aa57b3f_l2 l WHERE l.tenant_id = d.tenant_id AND l.user_id = d.user_id AND l.latest = d.day) WHERE (d.tenant_id, d.user_id, d.day) IN (SELECT * FROM unnest(fl_k0, fl_k1, fl_k2) UNION SELECT * FROM unnest(fl_o2_0, fl_o2_1, fl_o2_2) UNION SELECT tenant_id, user_id, latest FROM freshline.agg_geo_2aa57b3f_l2 WHERE (tenant_id, user_id, value) IN (SELECT * FROM unnest(fl_v2_0, fl_v2_1, fl_v2_2)));
    RETURN cardinality(fl_k0) + fl_h;
END
$fn$;
