"""Customers of many shops and their orders; each order's category looked up by its
sku. Tables: tests/test_derived_roles.py's TABLES."""

from freshline import Aggregations, Entity, Lookup, Table, agg

customer = Entity("customer", key="customer_id", type="text", tenant="shop_id")
orders = Table("orders", entities={customer: "customer_id"})
skus = Table(
    "skus",
    reverse={customer: "SELECT DISTINCT shop_id, customer_id FROM orders WHERE sku = :sku"},
)
# Windows of a day or more, and a sum an UPDATE moves: heads, and deltas the reads add.
SPEND = Aggregations(
    "spend",
    entity=customer,
    table=orders,
    time="placed_at",
    window="30d",
    incremental=True,
    aggs=[agg.count(), agg.sum("amount")],
)
# A lookup: trigger functions on a second table.
CATEGORIES = Aggregations(
    "categories",
    entity=customer,
    table=orders,
    time="placed_at",
    window="30d",
    incremental=True,
    lookups=[
        Lookup(
            skus,
            columns=["category"],
            query="SELECT s.category FROM skus s WHERE s.sku = x.sku",
            rows="g.sku = x.sku",
        )
    ],
    aggs=[agg.count_distinct("category")],
)
