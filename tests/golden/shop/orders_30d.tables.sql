-- The tables of shop's orders_30d, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

CREATE TABLE IF NOT EXISTS freshline.agg_orders_30d_df904743_days (shop_id text NOT NULL, customer_id text NOT NULL, day date NOT NULL, c0 bigint, n1 bigint, s1 numeric, q1 numeric, n2 bigint, s2 numeric, q2 numeric, mn3 numeric(12,2), mx4 numeric(12,2), n5 bigint, s5 numeric, q5 numeric, lt7 timestamptz, lv7 text, lt8 timestamptz, lv8 timestamp with time zone, c9 bigint, n10 bigint, s10 numeric, q10 numeric, lc6 bigint NOT NULL DEFAULT 0, PRIMARY KEY (shop_id, customer_id, day));

CREATE TABLE IF NOT EXISTS freshline.agg_orders_30d_df904743_d6 (shop_id text NOT NULL, customer_id text NOT NULL, day date NOT NULL, value text NOT NULL, n bigint NOT NULL, PRIMARY KEY (shop_id, customer_id, value, day));

CREATE TABLE IF NOT EXISTS freshline.agg_orders_30d_df904743_l6 (shop_id text NOT NULL, customer_id text NOT NULL, value text NOT NULL, latest date NOT NULL, PRIMARY KEY (shop_id, customer_id, value));

CREATE INDEX IF NOT EXISTS agg_orders_30d_df904743_l6_by_day ON freshline.agg_orders_30d_df904743_l6 (shop_id, customer_id, latest);

CREATE TABLE IF NOT EXISTS freshline.agg_orders_30d_df904743_head (shop_id text NOT NULL, customer_id text NOT NULL, day date NOT NULL, cut timestamptz NOT NULL, c0 bigint, n1 bigint, s1 numeric, q1 numeric, n2 bigint, s2 numeric, q2 numeric, mn3 numeric(12,2), mx4 numeric(12,2), n5 bigint, s5 numeric, q5 numeric, lt7 timestamptz, lv7 text, lt8 timestamptz, lv8 timestamp with time zone, c9 bigint, n10 bigint, s10 numeric, q10 numeric, hv6 text[], PRIMARY KEY (shop_id, customer_id));

CREATE TABLE IF NOT EXISTS freshline.agg_orders_30d_df904743_log (shop_id text NOT NULL, customer_id text NOT NULL, day date NOT NULL, at timestamptz NOT NULL, till timestamptz, dn1 bigint, ds1 numeric, dq1 numeric, dn2 bigint, ds2 numeric, dq2 numeric, dmn3 numeric(12,2), don3 numeric(12,2), dmx4 numeric(12,2), dox4 numeric(12,2), dn5 bigint, ds5 numeric, dq5 numeric, dn10 bigint, ds10 numeric, dq10 numeric);

CREATE INDEX IF NOT EXISTS agg_orders_30d_df904743_log_by_key ON freshline.agg_orders_30d_df904743_log (shop_id, customer_id, day, at);
