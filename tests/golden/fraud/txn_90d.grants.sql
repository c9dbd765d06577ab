-- The grants of fraud's txn_90d, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

REVOKE ALL ON freshline.agg_txn_90d_a06f2675_days, freshline.agg_txn_90d_a06f2675_d5, freshline.agg_txn_90d_a06f2675_l5, freshline.agg_txn_90d_a06f2675_d6, freshline.agg_txn_90d_a06f2675_l6, freshline.agg_txn_90d_a06f2675_head, freshline.agg_txn_90d_a06f2675_log FROM PUBLIC;

REVOKE ALL ON FUNCTION freshline.agg_txn_90d_a06f2675_i(), freshline.agg_txn_90d_a06f2675_u(), freshline.agg_txn_90d_a06f2675_d(), freshline.agg_txn_90d_a06f2675_t(), freshline.agg_txn_90d_a06f2675_p(), freshline.agg_txn_90d_a06f2675_fold(integer, boolean, boolean) FROM PUBLIC;

GRANT SELECT ON freshline.agg_txn_90d_a06f2675_days, freshline.agg_txn_90d_a06f2675_d5, freshline.agg_txn_90d_a06f2675_l5, freshline.agg_txn_90d_a06f2675_d6, freshline.agg_txn_90d_a06f2675_l6, freshline.agg_txn_90d_a06f2675_head, freshline.agg_txn_90d_a06f2675_log TO freshline_api;

GRANT SELECT ON freshline.agg_txn_90d_a06f2675_days, freshline.agg_txn_90d_a06f2675_d5, freshline.agg_txn_90d_a06f2675_l5, freshline.agg_txn_90d_a06f2675_d6, freshline.agg_txn_90d_a06f2675_l6, freshline.agg_txn_90d_a06f2675_head, freshline.agg_txn_90d_a06f2675_log TO freshline_consumer;

GRANT EXECUTE ON FUNCTION freshline.agg_txn_90d_a06f2675_fold(integer, boolean, boolean) TO freshline_consumer;
