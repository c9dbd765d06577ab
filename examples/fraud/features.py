"""The fraud example's definitions: one entity (a user of a tenant), five source tables,
three feature sets, four domain-event topics.

``txn_90d`` and ``geo`` also carry an incremental path over per-day partial aggregates,
the hand-written extension of this example, registered through freshline's extension
point (``migrations`` 0003 and 0007 make its bucket tables and triggers;
``fraud/incremental.py`` maintains them and argues why it is exact).
"""

from __future__ import annotations

from fraud.incremental import BUCKETS
from freshline import AS_OF, Entity, Event, EventField, FeatureSet, Field, Table

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


def rows_horizon(table: str, days: int) -> str:
    """The horizon of features over a user's ``table`` rows created in the last ``days``
    (and none created after the moment computed for): the first moment a row leaves
    that window, or a row created later enters it. ``f.tenant_id``/``f.user_id`` is
    the key; the ``(tenant_id, user_id, created_at)`` index answers both probes."""
    mine = "x.tenant_id = f.tenant_id AND x.user_id = f.user_id"
    return f"""least(
    (SELECT min(x.created_at) FROM {table} x WHERE {mine}
       AND x.created_at > {AS_OF} - interval '{days} days' AND x.created_at <= {AS_OF})
    + interval '{days} days',
    (SELECT min(x.created_at) FROM {table} x WHERE {mine} AND x.created_at > {AS_OF}))"""


# The incremental queries' reading of the deltas not yet folded into the buckets
# (txn_bucket_deltas: +1 per row added, -1 per row removed), for one key ``ki`` and a
# window whose whole days are dc+1 .. da (lateral ``w1``); fraud/incremental.py
# argues why buckets plus pending deltas are exact.
#
# Per whole day: the deltas' count, sum and sum of squares, and the max and latest
# time of the rows they add. A day with a pending removal ("neg") may keep the removed
# row's max or latest time in its bucket, so that day's max and latest time are read
# from its source rows instead (nd): one day of one user, an index range.
_PENDING_DAYS = """
CROSS JOIN LATERAL (
    SELECT coalesce(sum(p.n), 0) AS n, coalesce(sum(p.s), 0) AS s, coalesce(sum(p.q), 0) AS q,
           max(p.mx) FILTER (WHERE NOT p.neg) AS mx, max(p.la) FILTER (WHERE NOT p.neg) AS la,
           coalesce(array_agg(p.day) FILTER (WHERE p.neg), '{}') AS neg
    FROM (SELECT (p.created_at AT TIME ZONE 'UTC')::date AS day, sum(p.w) AS n,
                 sum(p.w * p.amount) AS s, sum(p.w * p.amount * p.amount) AS q,
                 bool_or(p.w < 0) AS neg, max(p.amount) FILTER (WHERE p.w > 0) AS mx,
                 max(p.created_at) FILTER (WHERE p.w > 0) AS la
          FROM txn_bucket_deltas p
          WHERE p.tenant_id = ki.tenant_id AND p.user_id = ki.user_id
            AND p.created_at >= (w1.dc + 1)::timestamp AT TIME ZONE 'UTC'
          GROUP BY 1) AS p
) pd
CROSS JOIN LATERAL (
    SELECT max(x.amount) AS mx, max(x.created_at) AS la
    FROM unnest(pd.neg) AS nd(day)
    JOIN transactions x ON x.tenant_id = ki.tenant_id AND x.user_id = ki.user_id
     AND x.created_at >= nd.day::timestamp AT TIME ZONE 'UTC'
     AND x.created_at < (nd.day + 1)::timestamp AT TIME ZONE 'UTC'
) nd
"""

# The members (kind 'm' merchant, 'd' device, 'c' country) with pending deltas on day
# dc or later: their folded latest day may be wrong, so each one's presence in the
# whole days is worked out. ``was``: its folded latest day is after dc (what the
# buckets' *_latest counted); ``now``: on some day after dc its folded count plus its
# pending deltas is positive (at once where the deltas add rows, as folded counts are
# never negative). A query corrects the buckets' count by now - was, and takes
# ``now`` for such a member on the edge day. ``{kinds}``: the (kind, member) pairs of
# a delta ``p``.
_PENDING_MEMBERS = """
CROSS JOIN LATERAL (
    SELECT coalesce(sum((g.kind = 'm' AND g.was)::int), 0) AS m_was,
           coalesce(sum((g.kind = 'm' AND g.now)::int), 0) AS m_now,
           coalesce(sum((g.kind = 'd' AND g.was)::int), 0) AS d_was,
           coalesce(sum((g.kind = 'd' AND g.now)::int), 0) AS d_now,
           coalesce(sum((g.kind = 'c' AND g.was)::int), 0) AS c_was,
           coalesce(sum((g.kind = 'c' AND g.now)::int), 0) AS c_now,
           array_agg(g.member) FILTER (WHERE g.kind = 'm') AS mm,
           array_agg(g.now) FILTER (WHERE g.kind = 'm') AS mn,
           array_agg(g.member) FILTER (WHERE g.kind = 'd') AS dm,
           array_agg(g.now) FILTER (WHERE g.kind = 'd') AS dn,
           array_agg(g.member) FILTER (WHERE g.kind = 'c') AS cm,
           array_agg(g.now) FILTER (WHERE g.kind = 'c') AS cn
    FROM (
        SELECT e.kind, e.member,
               coalesce((SELECT l.latest > w1.dc FROM txn_bucket_latest l
                         WHERE l.tenant_id = ki.tenant_id AND l.user_id = ki.user_id
                           AND l.kind = e.kind AND l.member = e.member), false) AS was,
               e.pos OR EXISTS (
                   SELECT 1 FROM txn_bucket_members mb
                   WHERE mb.tenant_id = ki.tenant_id AND mb.user_id = ki.user_id
                     AND mb.kind = e.kind AND mb.member = e.member
                     AND mb.day > w1.dc AND mb.day <= w1.da
                     AND mb.n + coalesce(e.negsums[array_position(e.negdays, mb.day)], 0) > 0
               ) AS now
        FROM (SELECT v.kind, v.member, bool_or(v.sw > 0 AND v.day > w1.dc) AS pos,
                     array_agg(v.day) FILTER (WHERE v.sw < 0 AND v.day > w1.dc) AS negdays,
                     array_agg(v.sw) FILTER (WHERE v.sw < 0 AND v.day > w1.dc) AS negsums
              FROM (SELECT v.kind, v.member, (p.created_at AT TIME ZONE 'UTC')::date AS day,
                           sum(p.w) AS sw
                    FROM txn_bucket_deltas p
                    CROSS JOIN LATERAL (VALUES {kinds}) AS v(kind, member)
                    WHERE p.tenant_id = ki.tenant_id AND p.user_id = ki.user_id
                      AND p.created_at >= w1.dc::timestamp AT TIME ZONE 'UTC'
                      AND v.member IS NOT NULL
                    GROUP BY 1, 2, 3) AS v
              GROUP BY 1, 2) AS e
    ) AS g
) pm
"""

TXN_90D = FeatureSet(
    name="txn_90d",
    entity=user,
    description="Spending over the user's transactions created in the last 90 days.",
    fields=(
        Field("txn_count", "int"),
        Field("txn_sum", "float"),
        Field("txn_mean", "float"),
        Field("txn_max", "float"),
        Field("txn_std", "float"),
        Field("distinct_merchants", "int"),
        Field("distinct_devices", "int"),
        Field("last_txn_at", "timestamp"),
    ),
    ttl_s=3600,
    query="""
SELECT k.tenant_id, k.user_id,
       count(x.amount) AS txn_count,
       coalesce(sum(x.amount), 0)::float8 AS txn_sum,
       round(coalesce(avg(x.amount), 0), 4)::float8 AS txn_mean,
       coalesce(max(x.amount), 0)::float8 AS txn_max,
       round(coalesce(stddev_pop(x.amount), 0), 4)::float8 AS txn_std,
       count(DISTINCT x.merchant_id) AS distinct_merchants,
       count(DISTINCT x.device_id) AS distinct_devices,
       max(x.created_at) AS last_txn_at
FROM k CROSS JOIN t
LEFT JOIN transactions x
       ON x.tenant_id = k.tenant_id AND x.user_id = k.user_id
      AND x.created_at > t.as_of - interval '90 days' AND x.created_at <= t.as_of
GROUP BY k.tenant_id, k.user_id
""",
    sources=(transactions, users),
    # The window (c, as_of] is the whole UTC days dc+1 .. da, plus the rows of day dc
    # after c read from the source (the edge). The whole days are the folded buckets
    # plus the user's pending deltas (txn_bucket_deltas, not yet folded): sums add; the
    # max and latest time of a day with a pending removal are read from the source
    # rows of that day (_PENDING_DAYS). A merchant (device) is in the whole days when
    # its folded latest day is after dc, except the members with pending deltas from
    # dc on, whose presence is worked out from their day counts plus the deltas
    # (_PENDING_MEMBERS); an edge member counts when it is not in the whole days. Sums
    # of numerics are exact, and mean and variance are the same numeric divisions
    # Postgres's avg and stddev_pop do on (n, sum, sum of squares); stddev_pop takes
    # the root at the division's scale, sqrt() at its own (never fewer digits), so
    # after round(, 4) they could differ only if the root's digits past the 4th were
    # 5000...0 to 16 places. Keys with rows or deltas after as_of never reach this
    # query (see incremental.py).
    maintenance=BUCKETS,
    incremental=f"""
SELECT ki.tenant_id, ki.user_id,
       a.n::bigint AS txn_count,
       a.s::float8 AS txn_sum,
       round(CASE WHEN a.n > 0 THEN a.s / a.n ELSE 0 END, 4)::float8 AS txn_mean,
       coalesce(greatest(bk.mx, pd.mx, nd.mx, ed.mx), 0)::float8 AS txn_max,
       round(CASE WHEN a.n = 0 OR a.n * a.q - a.s * a.s <= 0 THEN 0
                  ELSE sqrt((a.n * a.q - a.s * a.s) / (a.n * a.n)) END, 4)::float8 AS txn_std,
       (coalesce(bk.ml, 0) - pm.m_was + pm.m_now + ed.m)::bigint AS distinct_merchants,
       (coalesce(bk.dl, 0) - pm.d_was + pm.d_now + ed.d)::bigint AS distinct_devices,
       greatest(bk.la, pd.la, nd.la, ed.la) AS last_txn_at
FROM ki CROSS JOIN t
CROSS JOIN LATERAL (SELECT t.as_of - interval '90 days' AS c) w0
CROSS JOIN LATERAL (SELECT (w0.c AT TIME ZONE 'UTC')::date AS dc,
                           (t.as_of AT TIME ZONE 'UTC')::date AS da) w1
{_PENDING_DAYS}
CROSS JOIN LATERAL (
    SELECT sum(b.n) AS n, sum(b.amount_sum) AS s, sum(b.amount_sq) AS q,
           max(b.amount_max) FILTER (WHERE b.day <> ALL(pd.neg)) AS mx,
           max(b.last_at) FILTER (WHERE b.day <> ALL(pd.neg)) AS la,
           sum(b.merchants_latest) AS ml, sum(b.devices_latest) AS dl
    FROM txn_buckets b
    WHERE b.tenant_id = ki.tenant_id AND b.user_id = ki.user_id
      AND b.day > w1.dc AND b.day <= w1.da
) bk
{_PENDING_MEMBERS.replace("{kinds}", "('m', p.merchant_id), ('d', p.device_id)")}
CROSS JOIN LATERAL (
    SELECT count(*) AS n, sum(x.amount) AS s, sum(x.amount * x.amount) AS q,
           max(x.amount) AS mx, max(x.created_at) AS la,
           count(DISTINCT x.merchant_id) FILTER (WHERE NOT coalesce(
               (SELECT g.now FROM unnest(pm.mm, pm.mn) AS g(member, now)
                WHERE g.member = x.merchant_id),
               (SELECT l.latest > w1.dc FROM txn_bucket_latest l
                WHERE l.tenant_id = x.tenant_id AND l.user_id = x.user_id AND l.kind = 'm'
                  AND l.member = x.merchant_id), false)) AS m,
           count(DISTINCT x.device_id) FILTER (WHERE NOT coalesce(
               (SELECT g.now FROM unnest(pm.dm, pm.dn) AS g(member, now)
                WHERE g.member = x.device_id),
               (SELECT l.latest > w1.dc FROM txn_bucket_latest l
                WHERE l.tenant_id = x.tenant_id AND l.user_id = x.user_id AND l.kind = 'd'
                  AND l.member = x.device_id), false)) AS d
    FROM transactions x
    WHERE x.tenant_id = ki.tenant_id AND x.user_id = ki.user_id
      AND x.created_at > w0.c AND x.created_at < (w1.dc + 1)::timestamp AT TIME ZONE 'UTC'
) ed
CROSS JOIN LATERAL (
    SELECT coalesce(bk.n, 0) + pd.n + ed.n AS n,
           coalesce(bk.s, 0) + pd.s + coalesce(ed.s, 0) AS s,
           coalesce(bk.q, 0) + pd.q + coalesce(ed.q, 0) AS q
) a
""",
    path="incremental",
    horizon=rows_horizon("transactions", 90),
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

# The country alone, as a scalar subquery.
_COUNTRY_OF = """
SELECT gr.country FROM (SELECT country, ip_to FROM geoip WHERE ip_from <= {ip}
                        ORDER BY ip_from DESC LIMIT 1) gr WHERE {ip} <= gr.ip_to
"""
# A source row of key ``ki`` on the edge day dc, after c, from country ``{member}``.
_EDGE_COUNTRY = f"""
SELECT 1 FROM transactions x
CROSS JOIN LATERAL ({_COUNTRY_OF.format(ip="x.ip")}) xg
WHERE x.tenant_id = ki.tenant_id AND x.user_id = ki.user_id
  AND x.created_at > w0.c AND x.created_at < (w1.dc + 1)::timestamp AT TIME ZONE 'UTC'
  AND xg.country = {{member}}
"""

GEO = FeatureSet(
    name="geo",
    entity=user,
    description="Where the user transacts: the latest country and city, and how many.",
    fields=(
        Field("last_country", "str"),
        Field("last_city", "str"),
        Field("distinct_countries_30d", "int"),
    ),
    ttl_s=3600,
    query=f"""
SELECT k.tenant_id, k.user_id,
       lg.country AS last_country,
       lg.city AS last_city,
       coalesce(c.n, 0) AS distinct_countries_30d
FROM k CROSS JOIN t
LEFT JOIN LATERAL (
    SELECT x.ip FROM transactions x
    WHERE x.tenant_id = k.tenant_id AND x.user_id = k.user_id AND x.created_at <= t.as_of
    ORDER BY x.created_at DESC, x.id DESC LIMIT 1
) lt ON true
LEFT JOIN LATERAL ({_GEO_OF.format(ip="lt.ip")}) lg ON true
LEFT JOIN LATERAL (
    SELECT count(DISTINCT xg.country) AS n
    FROM transactions x
    CROSS JOIN LATERAL ({_GEO_OF.format(ip="x.ip")}) xg
    WHERE x.tenant_id = k.tenant_id AND x.user_id = k.user_id
      AND x.created_at > t.as_of - interval '30 days' AND x.created_at <= t.as_of
) c ON true
""",
    sources=(transactions, geoip, users),
    # As txn_90d's: the 30-day window is the whole days after dc (the countries whose
    # folded latest day is there, corrected for the countries with pending deltas,
    # whose own country is looked up now) plus the countries of the edge rows (after c
    # on day dc) that are not in the whole days: for a country without pending deltas,
    # those whose latest day is dc. The latest row is the same one (latest time, then
    # greatest id), found by the index's max() first: a planner without statistics
    # would otherwise sort all of a head user's rows for it.
    maintenance=BUCKETS,
    incremental=f"""
SELECT ki.tenant_id, ki.user_id,
       lg.country AS last_country,
       lg.city AS last_city,
       (coalesce(bk.n, 0) - pm.c_was + pm.c_now + ed.n)::bigint AS distinct_countries_30d
FROM ki CROSS JOIN t
CROSS JOIN LATERAL (SELECT t.as_of - interval '30 days' AS c) w0
CROSS JOIN LATERAL (SELECT (w0.c AT TIME ZONE 'UTC')::date AS dc,
                           (t.as_of AT TIME ZONE 'UTC')::date AS da) w1
LEFT JOIN LATERAL (
    SELECT x.ip FROM transactions x
    WHERE x.tenant_id = ki.tenant_id AND x.user_id = ki.user_id
      AND x.created_at = (SELECT max(y.created_at) FROM transactions y
                          WHERE y.tenant_id = ki.tenant_id AND y.user_id = ki.user_id
                            AND y.created_at <= t.as_of)
    ORDER BY x.id DESC LIMIT 1
) lt ON true
LEFT JOIN LATERAL ({_GEO_OF.format(ip="lt.ip")}) lg ON true
CROSS JOIN LATERAL (
    SELECT sum(b.countries_latest) AS n FROM txn_buckets b
    WHERE b.tenant_id = ki.tenant_id AND b.user_id = ki.user_id
      AND b.day > w1.dc AND b.day <= w1.da
) bk
{_PENDING_MEMBERS.replace("{kinds}", "('c', (" + _COUNTRY_OF.format(ip="p.ip") + "))")}
CROSS JOIN LATERAL (
    SELECT (SELECT count(*) FROM txn_bucket_latest l
            WHERE l.tenant_id = ki.tenant_id AND l.user_id = ki.user_id AND l.kind = 'c'
              AND l.latest = w1.dc AND l.member <> ALL(coalesce(pm.cm, '{{}}'))
              AND EXISTS ({_EDGE_COUNTRY.format(member="l.member")}))
         + (SELECT count(*) FROM unnest(pm.cm, pm.cn) AS g(member, now)
            WHERE NOT g.now AND EXISTS ({_EDGE_COUNTRY.format(member="g.member")})) AS n
) ed
""",
    path="incremental",
    # the 30-day window; and a later row, once created, is the latest
    horizon=rows_horizon("transactions", 30),
)
