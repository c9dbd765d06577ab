-- The tables of fraud's txn_90d, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

CREATE TABLE IF NOT EXISTS freshline.agg_txn_90d_a06f2675_days (tenant_id text NOT NULL, user_id bigint NOT NULL, day date NOT NULL, c0 bigint, n1 bigint, s1 numeric, q1 numeric, n2 bigint, s2 numeric, q2 numeric, mx3 numeric(12,2), n4 bigint, s4 numeric, q4 numeric, mx7 timestamp with time zone, lc5 bigint NOT NULL DEFAULT 0, lc6 bigint NOT NULL DEFAULT 0, PRIMARY KEY (tenant_id, user_id, day));

CREATE TABLE IF NOT EXISTS freshline.agg_txn_90d_a06f2675_d5 (tenant_id text NOT NULL, user_id bigint NOT NULL, day date NOT NULL, value text NOT NULL, n bigint NOT NULL, PRIMARY KEY (tenant_id, user_id, value, day));

CREATE TABLE IF NOT EXISTS freshline.agg_txn_90d_a06f2675_l5 (tenant_id text NOT NULL, user_id bigint NOT NULL, value text NOT NULL, latest date NOT NULL, PRIMARY KEY (tenant_id, user_id, value));

CREATE INDEX IF NOT EXISTS agg_txn_90d_a06f2675_l5_by_day ON freshline.agg_txn_90d_a06f2675_l5 (tenant_id, user_id, latest);

CREATE TABLE IF NOT EXISTS freshline.agg_txn_90d_a06f2675_d6 (tenant_id text NOT NULL, user_id bigint NOT NULL, day date NOT NULL, value text NOT NULL, n bigint NOT NULL, PRIMARY KEY (tenant_id, user_id, value, day));

CREATE TABLE IF NOT EXISTS freshline.agg_txn_90d_a06f2675_l6 (tenant_id text NOT NULL, user_id bigint NOT NULL, value text NOT NULL, latest date NOT NULL, PRIMARY KEY (tenant_id, user_id, value));

CREATE INDEX IF NOT EXISTS agg_txn_90d_a06f2675_l6_by_day ON freshline.agg_txn_90d_a06f2675_l6 (tenant_id, user_id, latest);

CREATE TABLE IF NOT EXISTS freshline.agg_txn_90d_a06f2675_head (tenant_id text NOT NULL, user_id bigint NOT NULL, day date NOT NULL, cut timestamptz NOT NULL, c0 bigint, n1 bigint, s1 numeric, q1 numeric, n2 bigint, s2 numeric, q2 numeric, mx3 numeric(12,2), n4 bigint, s4 numeric, q4 numeric, mx7 timestamp with time zone, hv5 text[], hv6 text[], PRIMARY KEY (tenant_id, user_id));

CREATE TABLE IF NOT EXISTS freshline.agg_txn_90d_a06f2675_log (tenant_id text NOT NULL, user_id bigint NOT NULL, day date NOT NULL, at timestamptz NOT NULL, till timestamptz, dn1 bigint, ds1 numeric, dq1 numeric, dn2 bigint, ds2 numeric, dq2 numeric, dmx3 numeric(12,2), dox3 numeric(12,2), dn4 bigint, ds4 numeric, dq4 numeric);

CREATE INDEX IF NOT EXISTS agg_txn_90d_a06f2675_log_by_key ON freshline.agg_txn_90d_a06f2675_log (tenant_id, user_id, day, at);
