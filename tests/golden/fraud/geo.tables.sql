-- The tables of fraud's geo, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

CREATE TABLE IF NOT EXISTS freshline.agg_geo_2aa57b3f_days (tenant_id text NOT NULL, user_id bigint NOT NULL, day date NOT NULL, lt0 timestamptz, lb0 bigint, lv0 text, lt1 timestamptz, lb1 bigint, lv1 text, lc2 bigint NOT NULL DEFAULT 0, PRIMARY KEY (tenant_id, user_id, day));

CREATE TABLE IF NOT EXISTS freshline.agg_geo_2aa57b3f_d2 (tenant_id text NOT NULL, user_id bigint NOT NULL, day date NOT NULL, value text NOT NULL, n bigint NOT NULL, PRIMARY KEY (tenant_id, user_id, value, day));

CREATE TABLE IF NOT EXISTS freshline.agg_geo_2aa57b3f_l2 (tenant_id text NOT NULL, user_id bigint NOT NULL, value text NOT NULL, latest date NOT NULL, PRIMARY KEY (tenant_id, user_id, value));

CREATE INDEX IF NOT EXISTS agg_geo_2aa57b3f_l2_by_day ON freshline.agg_geo_2aa57b3f_l2 (tenant_id, user_id, latest);

CREATE TABLE IF NOT EXISTS freshline.agg_geo_2aa57b3f_head (tenant_id text NOT NULL, user_id bigint NOT NULL, day date NOT NULL, cut timestamptz NOT NULL, lt0 timestamptz, lb0 bigint, lv0 text, lt1 timestamptz, lb1 bigint, lv1 text, hv2 text[], PRIMARY KEY (tenant_id, user_id));

CREATE TABLE IF NOT EXISTS freshline.agg_geo_2aa57b3f_log (tenant_id text NOT NULL, user_id bigint NOT NULL, day date NOT NULL, at timestamptz NOT NULL, till timestamptz);

CREATE INDEX IF NOT EXISTS agg_geo_2aa57b3f_log_by_key ON freshline.agg_geo_2aa57b3f_log (tenant_id, user_id, day, at);
