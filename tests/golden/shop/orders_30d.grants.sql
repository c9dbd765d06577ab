-- The grants of shop's orders_30d, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

REVOKE ALL ON freshline.agg_orders_30d_df904743_days, freshline.agg_orders_30d_df904743_d6, freshline.agg_orders_30d_df904743_l6, freshline.agg_orders_30d_df904743_head, freshline.agg_orders_30d_df904743_log FROM PUBLIC;

REVOKE ALL ON FUNCTION freshline.agg_orders_30d_df904743_i(), freshline.agg_orders_30d_df904743_u(), freshline.agg_orders_30d_df904743_d(), freshline.agg_orders_30d_df904743_t(), freshline.agg_orders_30d_df904743_p(), freshline.agg_orders_30d_df904743_fold(integer, boolean, boolean) FROM PUBLIC;

GRANT SELECT ON freshline.agg_orders_30d_df904743_days, freshline.agg_orders_30d_df904743_d6, freshline.agg_orders_30d_df904743_l6, freshline.agg_orders_30d_df904743_head, freshline.agg_orders_30d_df904743_log TO freshline_api;

GRANT SELECT ON freshline.agg_orders_30d_df904743_days, freshline.agg_orders_30d_df904743_d6, freshline.agg_orders_30d_df904743_l6, freshline.agg_orders_30d_df904743_head, freshline.agg_orders_30d_df904743_log TO freshline_consumer;

GRANT EXECUTE ON FUNCTION freshline.agg_orders_30d_df904743_fold(integer, boolean, boolean) TO freshline_consumer;
