"""The bucket triggers append to a delta log; a fold moves the deltas into the buckets.

Revision 0003's triggers kept the buckets exact by doing all of the bucket work in the
writer's statement: about five upserts per changed row (the day, its merchant, device
and country counts, their latest days, the latest-day marks), which made a COPY five
times slower and a one-row INSERT five times slower. Here the triggers only append
each changed row, once, to ``txn_bucket_deltas`` (+1 for a row added, -1 for a row
removed; an UPDATE's unchanged rows cancel out), in the writer's transaction as
before. :func:`freshline_fold_bucket_deltas` later takes the deltas of some users out
of the log and applies them to the buckets with 0003's statements, in one transaction;
the feature queries read the buckets plus the deltas not yet folded
(``examples/fraud/fraud/incremental.py`` argues why that is exact in every snapshot).

* ``txn_bucket_deltas``: the changed rows not yet folded, indexed by user.
* ``freshline_fold_bucket_deltas(max_users, wait)``: folds every pending delta of up to
  ``max_users`` users (in key order) and returns how many users it folded; NULL when
  ``wait`` is false and another fold holds the lock. SECURITY DEFINER, executable by
  ``freshline_consumer``: the consumers fold between batches. It can only move deltas
  into the buckets, which changes no value any query returns.
* ``freshline_fold_bucket_users(tenants, users)``: the same for the given users (the
  geoip triggers and ``freshline buckets build`` use it).
* ``freshline_bucket_lock()``: the transaction-level advisory lock that folds, builds
  and the geoip triggers take, so only one of them changes the buckets at a time.

Every writer of the bucket tables takes a lock on ``transactions`` first (a fold ACCESS
SHARE, a build or a geoip change SHARE, TRUNCATE ACCESS EXCLUSIVE) and the advisory
lock second, so they cannot deadlock on each other.

Revision ID: 0007
"""

from __future__ import annotations

import re

from alembic import op

from migrations import sibling_revision

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

FOLD_LOCK = 7_301_627_118_004_317
"""The advisory lock key of folds and builds (``freshline_bucket_lock()``)."""
BIG_DELTA = 1000
"""Deltas above which a fold statement is planned for its own size (EXECUTE)."""

_COLS = "tenant_id, user_id, created_at, amount, merchant_id, device_id, ip"
_DAY = "(({col}) AT TIME ZONE 'UTC')::date"

# The country of an IP, as the geo feature set looks it up (features._GEO_OF).
_GEO_OF = (
    "SELECT g.country FROM (SELECT country, ip_to FROM geoip WHERE ip_from <= d.ip "
    "ORDER BY ip_from DESC LIMIT 1) g WHERE d.ip <= g.ip_to"
)

# -- the triggers: append the changed rows ----------------------------------------------

_APPEND = {
    "insert": f"INSERT INTO txn_bucket_deltas ({_COLS}, w) SELECT {_COLS}, 1 FROM new_rows",
    "delete": f"INSERT INTO txn_bucket_deltas ({_COLS}, w) SELECT {_COLS}, -1 FROM old_rows",
    # An UPDATE that leaves user, time, amount, merchant, device and ip alone cancels out.
    "update": f"INSERT INTO txn_bucket_deltas ({_COLS}, w) "
    f"SELECT {_COLS}, sum(w) FROM ("
    f"SELECT {_COLS}, 1 AS w FROM new_rows UNION ALL "
    f"SELECT {_COLS}, -1 FROM old_rows) AS u "
    "GROUP BY 1, 2, 3, 4, 5, 6, 7 HAVING sum(w) <> 0",
}


def _append_functions() -> str:
    return "".join(
        f"""
CREATE OR REPLACE FUNCTION freshline_txn_buckets_{name}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    {sql};
    RETURN NULL;
END
$fn$;
"""
        for name, sql in _APPEND.items()
    )


_TRUNCATE = """
CREATE OR REPLACE FUNCTION freshline_txn_buckets_truncate() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    TRUNCATE txn_buckets, txn_bucket_members, txn_bucket_latest, txn_bucket_deltas;
    UPDATE txn_bucket_build SET complete = true, tenant_id = NULL, user_id = NULL;
    RETURN NULL;
END
$fn$;
"""

# -- the fold: the deltas taken from the log, applied to the buckets ---------------------

# One fold's changes applied in order; each statement of a VOLATILE function gets a
# fresh snapshot under READ COMMITTED, so the later ones see the earlier ones. Folds
# run one at a time (the advisory lock), so unlike 0003's triggers they need no row
# lock per member to order concurrent writers of its latest day. The deltas are
# collected into arrays (d_*), and their (member, day) counts once more (m_*, with
# each IP's country looked up once); the statements read them with unnest(): a
# generic plan estimates 100 rows (index probes), and a fold of more than BIG_DELTA
# rows runs each statement through EXECUTE, planned for its real size.
_MEMBER_COUNTS = """
    SELECT array_agg(tenant_id), array_agg(user_id), array_agg(kind), array_agg(member),
           array_agg(day), array_agg(w)
    INTO m_t, m_u, m_k, m_m, m_day, m_w
    FROM (SELECT tenant_id, user_id, kind, member, day, sum(w)::int AS w FROM (
              SELECT tenant_id, user_id, 'm' AS kind, merchant_id AS member, {day} AS day, w
              FROM ({delta}) AS d
              UNION ALL
              SELECT tenant_id, user_id, 'd', device_id, {day}, w
              FROM ({delta}) AS d WHERE device_id IS NOT NULL
              UNION ALL
              SELECT tenant_id, user_id, 'c', g.country, {day}, w
              FROM ({delta}) AS d CROSS JOIN LATERAL ({geo}) AS g) AS e
          GROUP BY 1, 2, 3, 4, 5 HAVING sum(w) <> 0) AS s;
"""
_STEPS = """
    -- 1. bucket sums; max and latest time only grow here (shrinking is step 2)
    INSERT INTO txn_buckets AS b (tenant_id, user_id, day, n, amount_sum, amount_sq,
                                  amount_max, last_at)
    SELECT tenant_id, user_id, {day}, sum(w), sum(amount * w), sum(amount * amount * w),
           max(amount) FILTER (WHERE w > 0), max(created_at) FILTER (WHERE w > 0)
    FROM ({delta}) AS d GROUP BY 1, 2, 3
    ON CONFLICT (tenant_id, user_id, day) DO UPDATE SET
        n = b.n + excluded.n,
        amount_sum = b.amount_sum + excluded.amount_sum,
        amount_sq = b.amount_sq + excluded.amount_sq,
        amount_max = greatest(b.amount_max, excluded.amount_max),
        last_at = greatest(b.last_at, excluded.last_at);
    -- 2. a removed row that may have been its day's max or latest: read the day again
    UPDATE txn_buckets AS b SET
        amount_max = (SELECT max(x.amount) FROM transactions x
                      WHERE x.tenant_id = b.tenant_id AND x.user_id = b.user_id
                        AND x.created_at >= b.day::timestamp AT TIME ZONE 'UTC'
                        AND x.created_at < (b.day + 1)::timestamp AT TIME ZONE 'UTC'),
        last_at = (SELECT max(x.created_at) FROM transactions x
                   WHERE x.tenant_id = b.tenant_id AND x.user_id = b.user_id
                     AND x.created_at >= b.day::timestamp AT TIME ZONE 'UTC'
                     AND x.created_at < (b.day + 1)::timestamp AT TIME ZONE 'UTC')
    FROM (SELECT tenant_id, user_id, {day} AS day, max(amount) AS amount,
                 max(created_at) AS at
          FROM ({delta}) AS d WHERE w < 0 GROUP BY 1, 2, 3) AS r
    WHERE b.tenant_id = r.tenant_id AND b.user_id = r.user_id AND b.day = r.day
      AND (r.amount >= b.amount_max OR r.at >= b.last_at);
    -- 3. member counts per day; a count that reaches zero goes
    INSERT INTO txn_bucket_members AS m (tenant_id, user_id, kind, member, day, n)
    SELECT * FROM unnest(m_t, m_u, m_k, m_m, m_day, m_w)
    ON CONFLICT (tenant_id, user_id, kind, member, day) DO UPDATE SET n = m.n + excluded.n;
    DELETE FROM txn_bucket_members AS m
    USING unnest(m_t, m_u, m_k, m_m, m_day) AS c(t, u, k, mb, day)
    WHERE m.tenant_id = c.t AND m.user_id = c.u AND m.kind = c.k AND m.member = c.mb
      AND m.day = c.day AND m.n <= 0;
    -- 4. each changed member's latest day from its day counts, and its "latest here"
    -- mark moved from the old day's bucket to the new one's
    WITH c AS (
        SELECT DISTINCT t, u, k, mb FROM unnest(m_t, m_u, m_k, m_m) AS c(t, u, k, mb)
    ), x AS (
        SELECT c.t, c.u, c.k, c.mb, l.latest AS old,
               (SELECT m.day FROM txn_bucket_members m
                WHERE m.tenant_id = c.t AND m.user_id = c.u AND m.kind = c.k
                  AND m.member = c.mb AND m.n > 0
                ORDER BY m.day DESC LIMIT 1) AS new
        FROM c LEFT JOIN txn_bucket_latest l
          ON l.tenant_id = c.t AND l.user_id = c.u AND l.kind = c.k AND l.member = c.mb
    ), set_latest AS (
        INSERT INTO txn_bucket_latest AS l (tenant_id, user_id, kind, member, latest)
        SELECT t, u, k, mb, new FROM x WHERE new IS NOT NULL AND new IS DISTINCT FROM old
        ON CONFLICT (tenant_id, user_id, kind, member) DO UPDATE SET latest = excluded.latest
    ), drop_latest AS (
        DELETE FROM txn_bucket_latest AS l USING x
        WHERE x.new IS NULL AND l.tenant_id = x.t AND l.user_id = x.u AND l.kind = x.k
          AND l.member = x.mb
    )
    UPDATE txn_buckets AS b SET
        merchants_latest = b.merchants_latest + mv.merchants,
        devices_latest = b.devices_latest + mv.devices,
        countries_latest = b.countries_latest + mv.countries
    FROM (SELECT t, u, day,
                 coalesce(sum(d) FILTER (WHERE k = 'm'), 0) AS merchants,
                 coalesce(sum(d) FILTER (WHERE k = 'd'), 0) AS devices,
                 coalesce(sum(d) FILTER (WHERE k = 'c'), 0) AS countries
          FROM (SELECT t, u, k, old AS day, -1 AS d FROM x
                WHERE old IS NOT NULL AND old IS DISTINCT FROM new
                UNION ALL
                SELECT t, u, k, new, 1 FROM x
                WHERE new IS NOT NULL AND new IS DISTINCT FROM old) AS moves
          GROUP BY 1, 2, 3) AS mv
    WHERE b.tenant_id = mv.t AND b.user_id = mv.u AND b.day = mv.day;
    -- 5. days whose count fell to zero
    DELETE FROM txn_buckets AS b USING (SELECT DISTINCT tenant_id, user_id, {day} AS day
                                        FROM ({delta}) AS d) AS c
    WHERE b.tenant_id = c.tenant_id AND b.user_id = c.user_id AND b.day = c.day
      AND b.n = 0;
"""

_UNNEST = (
    "SELECT * FROM unnest(d_t, d_u, d_at, d_a, d_m, d_d, d_ip, d_w) AS "
    "u(tenant_id, user_id, created_at, amount, merchant_id, device_id, ip, w)"
)
_VARS = (
    "d_t",
    "d_u",
    "d_at",
    "d_a",
    "d_m",
    "d_d",
    "d_ip",
    "d_w",
    "m_t",
    "m_u",
    "m_k",
    "m_m",
    "m_day",
    "m_w",
)


def _both_plans(steps: str) -> str:
    """Each statement twice: as is (a cached generic plan, index probes: right for a
    few rows) and through EXECUTE with the arrays as parameters (planned for their
    real sizes: hash joins for the fold of a bulk load). A SELECT ... INTO is run as
    EXECUTE ... INTO."""
    out = []
    for stmt in re.split(r";\s*\n", steps):
        lines = [ln for ln in stmt.splitlines() if ln.strip() and not ln.strip().startswith("--")]
        if not lines:
            continue
        sql = "\n".join(lines)
        into = re.search(r"\n\s*INTO ([^\n]+)\n", sql)
        dynamic = sql if into is None else sql.replace(into.group(0), "\n")
        for i, var in enumerate(_VARS, 1):
            dynamic = re.sub(rf"\b{var}\b", f"${i}", dynamic)
        target = "" if into is None else f" INTO {into.group(1)}"
        out.append(
            f"    IF cardinality(d_t) > {BIG_DELTA} THEN\n"
            f"        EXECUTE $q${dynamic}$q${target} USING {', '.join(_VARS)};\n"
            f"    ELSE\n{sql};\n    END IF;\n"
        )
    return "".join(out)


def _fold_functions(schema: str) -> str:
    day = _DAY.format(col="created_at")
    steps = _both_plans(
        (_MEMBER_COUNTS + _STEPS)
        .replace("{delta}", _UNNEST)
        .replace("{day}", day)
        .replace("{geo}", _GEO_OF)
    )
    # Both are SECURITY DEFINER with a fixed search_path, so that the consumer role
    # may fold; the callers hold the lock on transactions and the advisory lock.
    return f"""
CREATE FUNCTION freshline_bucket_lock() RETURNS void LANGUAGE sql AS $fn$
    SELECT pg_advisory_xact_lock({FOLD_LOCK});
$fn$;
CREATE FUNCTION freshline_fold_bucket_users(k_t text[], k_u bigint[]) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp
SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    d_t text[]; d_u bigint[]; d_at timestamptz[]; d_a numeric[]; d_m text[]; d_d text[];
    d_ip inet[]; d_w int[];
    m_t text[]; m_u bigint[]; m_k text[]; m_m text[]; m_day date[]; m_w int[];
BEGIN
    LOCK TABLE transactions IN ACCESS SHARE MODE;
    PERFORM freshline_bucket_lock();
    -- Every pending delta of these users (all of a user's, so a row's removal is never
    -- folded before its addition), netted: a row added and removed cancels out.
    WITH gone AS (
        DELETE FROM txn_bucket_deltas p USING unnest(k_t, k_u) AS k(t, u)
        WHERE p.tenant_id = k.t AND p.user_id = k.u
        RETURNING p.tenant_id, p.user_id, p.created_at, p.amount, p.merchant_id,
                  p.device_id, p.ip, p.w)
    SELECT array_agg(tenant_id), array_agg(user_id), array_agg(created_at), array_agg(amount),
           array_agg(merchant_id), array_agg(device_id), array_agg(ip), array_agg(w)
    INTO d_t, d_u, d_at, d_a, d_m, d_d, d_ip, d_w
    FROM (SELECT {_COLS}, sum(w)::int AS w FROM gone
          GROUP BY 1, 2, 3, 4, 5, 6, 7 HAVING sum(w) <> 0) AS s;
    IF d_t IS NULL THEN
        RETURN;
    END IF;
{steps}END
$fn$;
{_fold_deltas(schema)}
REVOKE EXECUTE ON FUNCTION freshline_fold_bucket_users(text[], bigint[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION freshline_fold_bucket_deltas(integer, boolean) FROM PUBLIC;
DO $$ BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'freshline_consumer') THEN
        GRANT EXECUTE ON FUNCTION freshline_fold_bucket_deltas(integer, boolean)
            TO freshline_consumer;
    END IF;
END $$;
"""


def _fold_deltas(schema: str, order: str = "1, 2", create: str = "CREATE") -> str:
    """``freshline_fold_bucket_deltas``: folds the pending deltas of up to ``max_users``
    users, taken in ``order`` (revision 0008 takes them by user id, its index's order)."""
    return f"""{create} FUNCTION freshline_fold_bucket_deltas(
    max_users integer, wait boolean DEFAULT true)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
DECLARE
    k_t text[]; k_u bigint[];
BEGIN
    IF wait THEN
        LOCK TABLE transactions IN ACCESS SHARE MODE;
        PERFORM freshline_bucket_lock();
    ELSE
        LOCK TABLE transactions IN ACCESS SHARE MODE NOWAIT;
        IF NOT pg_try_advisory_xact_lock({FOLD_LOCK}) THEN
            RETURN NULL;
        END IF;
    END IF;
    SELECT array_agg(tenant_id), array_agg(user_id) INTO k_t, k_u FROM (
        SELECT tenant_id, user_id FROM txn_bucket_deltas
        GROUP BY {order} ORDER BY {order} LIMIT max_users) AS s;
    IF k_t IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM freshline_fold_bucket_users(k_t, k_u);
    RETURN cardinality(k_t);
END
$fn$;
"""


# -- geoip: fold the affected users' deltas before their countries are rebuilt ----------

_GEOIP_RANGES = {
    "insert": "SELECT ip_from, ip_to FROM new_rows",
    "delete": "SELECT ip_from, ip_to FROM old_rows",
    "update": "SELECT ip_from, ip_to FROM new_rows UNION SELECT ip_from, ip_to FROM old_rows",
}
_GEOIP = """
CREATE OR REPLACE FUNCTION freshline_geoip_buckets_{op}() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE a_t text[]; a_u bigint[];
BEGIN
    LOCK TABLE transactions IN SHARE MODE;
    -- The users with a row from the changed ranges, and those with a pending delta
    -- from them (a removed row's delta would otherwise be folded under the new country).
    SELECT array_agg(tenant_id), array_agg(user_id) INTO a_t, a_u FROM (
        SELECT x.tenant_id, x.user_id FROM ({ranges}) AS r
        JOIN transactions x ON x.ip BETWEEN r.ip_from AND r.ip_to
        UNION
        SELECT p.tenant_id, p.user_id FROM ({ranges}) AS r
        JOIN txn_bucket_deltas p ON p.ip BETWEEN r.ip_from AND r.ip_to) AS s;
    IF a_t IS NOT NULL THEN
        PERFORM freshline_fold_bucket_users(a_t, a_u);
        PERFORM freshline_rebuild_countries(a_t, a_u);
    END IF;
    RETURN NULL;
END
$fn$;
"""
_GEOIP_TRUNCATE = """
CREATE OR REPLACE FUNCTION freshline_geoip_truncate() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    LOCK TABLE transactions IN SHARE MODE;
    WHILE freshline_fold_bucket_deltas(10000) > 0 LOOP
    END LOOP;
    UPDATE txn_buckets SET countries_latest = 0 WHERE countries_latest <> 0;
    DELETE FROM txn_bucket_members WHERE kind = 'c';
    DELETE FROM txn_bucket_latest WHERE kind = 'c';
    RETURN NULL;
END
$fn$;
"""


def _schema() -> str:
    return str(op.get_bind().exec_driver_sql("SELECT current_schema()").scalar_one())


def upgrade() -> None:
    op.execute("""
        CREATE TABLE txn_bucket_deltas (
            tenant_id   text NOT NULL,
            user_id     bigint NOT NULL,
            created_at  timestamptz NOT NULL,
            amount      numeric(12, 2) NOT NULL,
            merchant_id text NOT NULL,
            device_id   text,
            ip          inet,
            w           smallint NOT NULL
        );
        CREATE INDEX txn_bucket_deltas_user ON txn_bucket_deltas (tenant_id, user_id);
    """)
    op.execute(_fold_functions(_schema()))
    op.execute(_append_functions())
    op.execute(_TRUNCATE)
    op.execute("".join(_GEOIP.format(op=name, ranges=q) for name, q in _GEOIP_RANGES.items()))
    op.execute(_GEOIP_TRUNCATE)


def downgrade() -> None:
    """Fold every pending delta, then put 0003's triggers back."""
    op.execute("""
        DO $$ BEGIN
            WHILE freshline_fold_bucket_deltas(10000) > 0 LOOP
            END LOOP;
        END $$;
    """)
    first = sibling_revision(__file__, "0003_txn_buckets.py")
    for name in _GEOIP_RANGES:
        op.execute(f"DROP TRIGGER geoip_buckets_{name} ON geoip")
        op.execute(f"DROP FUNCTION freshline_geoip_buckets_{name}()")
    op.execute("DROP TRIGGER geoip_buckets_truncate ON geoip")
    op.execute("DROP FUNCTION freshline_geoip_truncate()")
    op.execute("DROP FUNCTION freshline_rebuild_countries(text[], bigint[])")
    for name in _APPEND:
        op.execute(f"DROP TRIGGER txn_buckets_{name} ON transactions")
        op.execute(f"DROP FUNCTION freshline_txn_buckets_{name}()")
    op.execute(first.apply_functions())
    op.execute(first.geoip_functions())
    op.execute(_TRUNCATE.replace(", txn_bucket_deltas", ""))
    op.execute("DROP FUNCTION freshline_fold_bucket_deltas(integer, boolean)")
    op.execute("DROP FUNCTION freshline_fold_bucket_users(text[], bigint[])")
    op.execute("DROP FUNCTION freshline_bucket_lock()")
    op.execute("DROP TABLE txn_bucket_deltas")
