-- The grants of fraud's geo, as freshline.pipeline.core.maintenance writes it.
-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.

REVOKE ALL ON freshline.agg_geo_2aa57b3f_days, freshline.agg_geo_2aa57b3f_d2, freshline.agg_geo_2aa57b3f_l2, freshline.agg_geo_2aa57b3f_head, freshline.agg_geo_2aa57b3f_log FROM PUBLIC;

REVOKE ALL ON FUNCTION freshline.agg_geo_2aa57b3f_i(), freshline.agg_geo_2aa57b3f_u(), freshline.agg_geo_2aa57b3f_d(), freshline.agg_geo_2aa57b3f_t(), freshline.agg_geo_2aa57b3f_p(), freshline.agg_geo_2aa57b3f_l0i(), freshline.agg_geo_2aa57b3f_l0u(), freshline.agg_geo_2aa57b3f_l0d(), freshline.agg_geo_2aa57b3f_l0t(), freshline.agg_geo_2aa57b3f_fold(integer, boolean, boolean) FROM PUBLIC;

GRANT SELECT ON freshline.agg_geo_2aa57b3f_days, freshline.agg_geo_2aa57b3f_d2, freshline.agg_geo_2aa57b3f_l2, freshline.agg_geo_2aa57b3f_head, freshline.agg_geo_2aa57b3f_log TO freshline_api;

GRANT SELECT ON freshline.agg_geo_2aa57b3f_days, freshline.agg_geo_2aa57b3f_d2, freshline.agg_geo_2aa57b3f_l2, freshline.agg_geo_2aa57b3f_head, freshline.agg_geo_2aa57b3f_log TO freshline_consumer;

GRANT EXECUTE ON FUNCTION freshline.agg_geo_2aa57b3f_fold(integer, boolean, boolean) TO freshline_consumer;
