"""Customers (text keys) of many shops (a tenant column) and their orders, as declared
windowed aggregations: the query, the horizon and the incremental path are generated."""

from freshline import Aggregations, Entity, Table, agg

customer = Entity(
    "customer", key="customer_id", type="text", tenant="shop_id", table="shop_customers"
)
customers = Table("shop_customers", entities={customer: "customer_id"})
orders = Table("shop_orders", entities={customer: "customer_id"})

orders_30d = Aggregations(
    "orders_30d",
    entity=customer,
    table=orders,
    time="placed_at",
    window="30d",
    where="x.status <> 'cancelled'",
    ttl="1h",
    sources=[customers],  # a new customer's entry is computed, an empty one
    incremental=True,  # per-day partials kept by triggers (apply --alter-tables)
    aggs=[
        agg.count(),
        agg.sum("amount"),
        agg.mean("amount"),
        agg.min("amount"),
        agg.max("amount"),
        agg.stddev("amount"),
        agg.count_distinct("sku"),
        agg.last("sku", type="str"),
        agg.last("placed_at"),
        agg.count(window="1d", name="orders_1d"),
        agg.sum("amount", where="x.amount >= 100", name="big_spend"),
    ],
)
