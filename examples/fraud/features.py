"""The fraud example's definitions: one entity (a user of a tenant), five source tables,
three feature sets, four domain-event topics.

``txn_90d`` and ``geo`` are declared (:func:`freshline.Aggregations`): freshline
generates their defining queries, their horizons and incremental paths over per-day
partials (installed by ``freshline apply --alter-tables``); ``geo`` aggregates the
country and city each transaction takes from ``geoip`` (a :func:`freshline.Lookup`).
``device_risk`` is a plain query: a join through ``user_devices`` is more than a
declaration says.
"""

from __future__ import annotations

from freshline import (
    AS_OF,
    Aggregations,
    Entity,
    Event,
    EventField,
    FeatureSet,
    Field,
    Lookup,
    Table,
    agg,
)

user = Entity(
    "user",
    key="user_id",
    type="bigint",
    tenant="tenant_id",
    table="users",
    table_key="id",
    # Warmed before a deploy flips: the users with a transaction in txn_90d's window.
    active="EXISTS (SELECT 1 FROM transactions x WHERE x.tenant_id = e.tenant_id "
    "AND x.user_id = e.id AND x.created_at > now() - interval '90 days')",
)

transactions = Table("transactions", entities={user: "user_id"})
users = Table("users", entities={user: "id"})
# A link added or removed changes shared_device_users for every user of the device.
user_devices = Table(
    "user_devices",
    entities={user: "user_id"},
    reverse={
        user: "SELECT tenant_id, user_id FROM user_devices "
        "WHERE tenant_id = :tenant_id AND device_id = :device_id"
    },
)
devices = Table(
    "devices",
    reverse={
        user: "SELECT tenant_id, user_id FROM user_devices "
        "WHERE tenant_id = :tenant_id AND device_id = :id"
    },
    tenant="tenant_id",
)
transaction_ids = {
    "user_id": EventField("user_id", description="The user the transaction belongs to"),
    "transaction_id": EventField("id", "bigint", "The transaction's id"),
}
transaction_created = Event(
    "transaction.created",
    table=transactions,
    op="c",
    description="A transaction was inserted. Publish after the insert commits.",
    fields=transaction_ids,
)
transaction_updated = Event(
    "transaction.updated",
    table=transactions,
    description="A transaction row changed (status, amount, user, ...). Publish after the "
    "update commits. If the transaction moved to another user, also publish a "
    "transaction.updated naming the old user_id.",
    fields=transaction_ids,
)
device_updated = Event(
    "device.updated",
    table=devices,
    description="A device row changed (risk score, fingerprint). Every user of the device "
    "is refreshed.",
    fields={"device_id": EventField("id", "text", "The device's id")},
)
user_updated = Event(
    "user.updated",
    table=users,
    description="A user row changed. The user's features are refreshed.",
    fields={"user_id": EventField("id", description="The user's id")},
)

# Every user with a transaction from an IP in the changed range: a superset of those
# whose latest or last-30-day countries can change, since ranges are disjoint (an
# exclusion constraint, revision 0009) and a range decides only its own IPs' country.
geoip = Table(
    "geoip",
    reverse={
        user: "SELECT DISTINCT tenant_id, user_id FROM transactions "
        "WHERE ip BETWEEN CAST(:ip_from AS inet) AND CAST(:ip_to AS inet)"
    },
)


TXN_90D = Aggregations(
    "txn_90d",
    entity=user,
    table=transactions,
    time="created_at",
    window="90d",
    description="Spending over the user's transactions created in the last 90 days.",
    ttl=3600,
    sources=[users],
    incremental=True,
    aggs=[
        agg.count(name="txn_count"),
        agg.sum("amount", name="txn_sum"),
        agg.mean("amount", name="txn_mean", default=0, digits=4),
        agg.max("amount", name="txn_max", default=0),
        agg.stddev("amount", name="txn_std", default=0, digits=4),
        agg.count_distinct("merchant_id", name="distinct_merchants"),
        agg.count_distinct("device_id", name="distinct_devices"),
        agg.max("created_at", name="last_txn_at"),
    ],
)
DEVICE_RISK = FeatureSet(
    name="device_risk",
    entity=user,
    description="Risk of the devices the user has used.",
    fields=(
        Field("device_count", "int"),
        Field("max_device_risk", "float"),
        Field("new_device_24h", "bool"),
        Field("shared_device_users", "int"),
    ),
    ttl_s=3600,
    query="""
SELECT k.tenant_id, k.user_id,
       count(d.id) AS device_count,
       round(coalesce(max(d.risk_score), 0)::numeric, 4)::float8 AS max_device_risk,
       coalesce(bool_or(d.first_seen > t.as_of - interval '24 hours'), false) AS new_device_24h,
       coalesce(max(s.users), 0) AS shared_device_users
FROM k CROSS JOIN t
LEFT JOIN user_devices ud ON ud.tenant_id = k.tenant_id AND ud.user_id = k.user_id
LEFT JOIN devices d ON d.tenant_id = ud.tenant_id AND d.id = ud.device_id
LEFT JOIN LATERAL (
    SELECT count(*) AS users FROM user_devices o
    WHERE o.tenant_id = ud.tenant_id AND o.device_id = ud.device_id
) s ON ud.device_id IS NOT NULL
GROUP BY k.tenant_id, k.user_id
""",
    sources=(user_devices, devices, users),
    # new_device_24h stays true until the newest device first seen in the last day is
    # a day old, and a device first seen later makes it true now already.
    horizon=f"""(SELECT max(d.first_seen) + interval '24 hours'
    FROM user_devices ud JOIN devices d ON d.tenant_id = ud.tenant_id AND d.id = ud.device_id
    WHERE ud.tenant_id = f.tenant_id AND ud.user_id = f.user_id
      AND d.first_seen > {AS_OF} - interval '24 hours')""",
)

# The geoip lookup: the range whose start is the greatest at or below the IP, if the
# IP is also at or below its end (ranges are disjoint, so that is the one range that
# holds the IP). The primary key on ip_from serves it.
_GEO_OF = """
SELECT g.country, g.city FROM (
    SELECT country, city, ip_to FROM geoip WHERE ip_from <= {ip}
    ORDER BY ip_from DESC LIMIT 1
) g WHERE {ip} <= g.ip_to
"""

# Each transaction's country and city, by its IP's range. A range decides the IPs in it
# (added, changed or removed), so a change of geoip makes the days of those rows stale.
GEO_OF_IP = Lookup(
    geoip,
    columns=["country", "city"],
    query=_GEO_OF.format(ip="x.ip"),
    rows="x.ip BETWEEN g.ip_from AND g.ip_to",
)
GEO = Aggregations(
    "geo",
    entity=user,
    table=transactions,
    time="created_at",
    window="30d",
    description="Where the user transacts: the latest country and city, and how many.",
    ttl=3600,
    sources=[users],
    incremental=True,
    # the latest transaction is the one with the greatest id among those at the latest
    # created_at, and both its country and city are that row's
    tiebreak="id",
    lookups=[GEO_OF_IP],
    aggs=[
        agg.last("country", window="all", type="str", name="last_country"),
        agg.last("city", window="all", type="str", name="last_city"),
        agg.count_distinct("country", name="distinct_countries_30d"),
    ],
)
