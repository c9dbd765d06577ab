"""Per-user, per-day partial aggregates of ``transactions``, kept by triggers.

What they hold, and why they stay exact, is argued in ``examples/fraud/fraud/incremental.py``.
In short: statement-level triggers with transition tables apply every change of
``transactions`` (INSERT, UPDATE, DELETE, COPY) to the buckets in the same
transaction, so every snapshot sees a source row and its bucket together or neither;
a TRUNCATE of ``transactions`` truncates the buckets too.

* ``txn_buckets``: one row per (tenant, user, UTC day): count, sum, sum of squares,
  max amount, latest ``created_at``, and how many merchants and devices have their
  latest day here (for exact distinct counts over a window of whole days).
* ``txn_bucket_members``: one row per (tenant, user, kind, member, day), ``kind`` 'm'
  for a merchant, 'd' for a device: how many rows of that day name the member.
* ``txn_bucket_latest``: one row per (tenant, user, kind, member): the latest day the
  member occurs on. Every change of a member's rows updates this row, which
  serialises the latest-day bookkeeping per member (a row lock under READ COMMITTED, a
  serialisation failure under REPEATABLE READ).
* ``txn_bucket_build``: how far ``freshline buckets build`` has rebuilt existing rows;
  a database without transactions starts complete.

Revision ID: 0003
"""

from __future__ import annotations

import re

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_DAY = "(({col}) AT TIME ZONE 'UTC')::date"

# The changed rows of one statement, as weighted rows: +1 per new row, -1 per old row.
# An UPDATE's unchanged rows (same user, time, amount, merchant, device) cancel out.
_DELTAS = {
    "insert": "SELECT tenant_id, user_id, created_at, amount, merchant_id, device_id, "
    "ip, 1 AS w FROM new_rows",
    "delete": "SELECT tenant_id, user_id, created_at, amount, merchant_id, device_id, "
    "ip, -1 AS w FROM old_rows",
    "update": "SELECT tenant_id, user_id, created_at, amount, merchant_id, device_id, ip, "
    "sum(w)::int AS w FROM ("
    "SELECT tenant_id, user_id, created_at, amount, merchant_id, device_id, ip, 1 AS w "
    "FROM new_rows UNION ALL "
    "SELECT tenant_id, user_id, created_at, amount, merchant_id, device_id, ip, -1 "
    "FROM old_rows) AS u GROUP BY 1, 2, 3, 4, 5, 6, 7 HAVING sum(w) <> 0",
}

# One statement's changes applied in order; each statement of a VOLATILE function gets
# a fresh snapshot under READ COMMITTED, so the later ones see the earlier ones.
# The changed rows are first collected into arrays, and every statement reads them
# with unnest(): PL/pgSQL caches plans per session, and a plan made for a transition
# table's size at the first call (a 2,000-row COPY: hash joins over whole bucket
# tables) would cost every later one-row INSERT milliseconds, and custom plans would
# be planned again at every call. Generic plans estimate unnest() of a variable at
# 100 rows: index probes, right for one row and linear for a COPY.
_APPLY = """
CREATE FUNCTION freshline_txn_buckets_{op}() RETURNS trigger LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    d_t text[]; d_u bigint[]; d_at timestamptz[]; d_a numeric[]; d_m text[]; d_d text[];
    d_ip inet[]; d_w int[];
BEGIN
    SELECT array_agg(tenant_id), array_agg(user_id), array_agg(created_at), array_agg(amount),
           array_agg(merchant_id), array_agg(device_id), array_agg(ip), array_agg(w)
    INTO d_t, d_u, d_at, d_a, d_m, d_d, d_ip, d_w
    FROM ({source}) AS s;
    IF d_t IS NULL THEN
        RETURN NULL;
    END IF;
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
{step2}    -- 3. member counts per day
    INSERT INTO txn_bucket_members AS m (tenant_id, user_id, kind, member, day, n)
    SELECT tenant_id, user_id, kind, member, day, sum(w) FROM (
        SELECT tenant_id, user_id, 'm' AS kind, merchant_id AS member, {day} AS day, w
        FROM ({delta}) AS d
        UNION ALL
        SELECT tenant_id, user_id, 'd', device_id, {day}, w
        FROM ({delta}) AS d WHERE device_id IS NOT NULL
        UNION ALL
        SELECT tenant_id, user_id, 'c', g.country, {day}, w
        FROM ({delta}) AS d CROSS JOIN LATERAL ({geo}) AS g) AS e
    GROUP BY 1, 2, 3, 4, 5 HAVING sum(w) <> 0
    ON CONFLICT (tenant_id, user_id, kind, member, day) DO UPDATE SET n = m.n + excluded.n;
{step45}    -- 6. move each member's "latest here" mark from its old latest day to its new one
    UPDATE txn_buckets AS b SET
        merchants_latest = b.merchants_latest + t.merchants,
        devices_latest = b.devices_latest + t.devices,
        countries_latest = b.countries_latest + t.countries
    FROM (SELECT tenant_id, user_id, day,
                 coalesce(sum(d) FILTER (WHERE kind = 'm'), 0) AS merchants,
                 coalesce(sum(d) FILTER (WHERE kind = 'd'), 0) AS devices,
                 coalesce(sum(d) FILTER (WHERE kind = 'c'), 0) AS countries
          FROM (SELECT l.tenant_id, l.user_id, l.kind, l.prev AS day, -1 AS d
                FROM txn_bucket_latest l
                JOIN (SELECT DISTINCT tenant_id, user_id, kind, member FROM ({members}) AS c) c
                  USING (tenant_id, user_id, kind, member)
                WHERE l.prev IS DISTINCT FROM l.latest AND l.prev IS NOT NULL
                UNION ALL
                SELECT l.tenant_id, l.user_id, l.kind, l.latest, 1
                FROM txn_bucket_latest l
                JOIN (SELECT DISTINCT tenant_id, user_id, kind, member FROM ({members}) AS c) c
                  USING (tenant_id, user_id, kind, member)
                WHERE l.prev IS DISTINCT FROM l.latest AND l.latest IS NOT NULL) AS moves
          GROUP BY 1, 2, 3) AS t
    WHERE b.tenant_id = t.tenant_id AND b.user_id = t.user_id AND b.day = t.day;
{cleanup}    RETURN NULL;
END
$fn$;
CREATE TRIGGER txn_buckets_{op} AFTER {event} ON transactions
    REFERENCING {refs} FOR EACH STATEMENT EXECUTE FUNCTION freshline_txn_buckets_{op}();
"""

_REMOVALS = {
    "step2": """
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
""",
    "step45": """
    -- 4. lock each changed member's latest-day row (created if new), in key order
    INSERT INTO txn_bucket_latest AS l (tenant_id, user_id, kind, member)
    SELECT DISTINCT tenant_id, user_id, kind, member FROM ({members}) AS c
    ORDER BY 1, 2, 3, 4
    ON CONFLICT (tenant_id, user_id, kind, member) DO UPDATE SET prev = l.latest;
    DELETE FROM txn_bucket_members AS m USING ({members}) AS c
    WHERE m.tenant_id = c.tenant_id AND m.user_id = c.user_id AND m.kind = c.kind
      AND m.member = c.member AND m.day = c.day AND m.n <= 0;
    -- 5. with the lock held, every earlier change of the member is visible: re-derive
    UPDATE txn_bucket_latest AS l SET prev = l.latest,
        latest = (SELECT max(m.day) FROM txn_bucket_members m
                  WHERE m.tenant_id = l.tenant_id AND m.user_id = l.user_id
                    AND m.kind = l.kind AND m.member = l.member AND m.n > 0)
    FROM (SELECT DISTINCT tenant_id, user_id, kind, member FROM ({members}) AS c) AS c
    WHERE l.tenant_id = c.tenant_id AND l.user_id = c.user_id AND l.kind = c.kind
      AND l.member = c.member;
""",
    "cleanup": """
    DELETE FROM txn_bucket_latest AS l USING ({members}) AS c
    WHERE l.tenant_id = c.tenant_id AND l.user_id = c.user_id AND l.kind = c.kind
      AND l.member = c.member AND l.latest IS NULL;
    DELETE FROM txn_buckets AS b USING (SELECT DISTINCT tenant_id, user_id, {day} AS day
                                        FROM ({delta}) AS d) AS c
    WHERE b.tenant_id = c.tenant_id AND b.user_id = c.user_id AND b.day = c.day
      AND b.n = 0;
""",
}
"""The parts only a removal (DELETE, UPDATE) needs: a shrinking max or latest day, and
rows whose count fell to zero."""

_INSERT_LATEST = """
    -- 4-5. an insert only adds days: each changed member's latest day grows to the
    -- newest added one (the row lock orders concurrent writers of the member)
    INSERT INTO txn_bucket_latest AS l (tenant_id, user_id, kind, member, latest, prev)
    SELECT tenant_id, user_id, kind, member, max(day), NULL FROM ({members}) AS c
    GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4
    ON CONFLICT (tenant_id, user_id, kind, member) DO UPDATE
        SET prev = l.latest, latest = greatest(l.latest, excluded.latest);
"""

_MEMBERS = (
    "SELECT tenant_id, user_id, 'm' AS kind, merchant_id AS member, {day} AS day "
    "FROM ({delta}) AS d UNION ALL "
    "SELECT tenant_id, user_id, 'd', device_id, {day} FROM ({delta}) AS d "
    "WHERE device_id IS NOT NULL UNION ALL "
    "SELECT tenant_id, user_id, 'c', g.country, {day} FROM ({delta}) AS d "
    "CROSS JOIN LATERAL ({geo}) AS g"
)

# The country of an IP, as the geo feature set looks it up (features._GEO_OF).
GEO_OF = (
    "SELECT g.country FROM (SELECT country, ip_to FROM geoip WHERE ip_from <= d.ip "
    "ORDER BY ip_from DESC LIMIT 1) g WHERE d.ip <= g.ip_to"
)

_REFS = {
    "insert": ("INSERT", "NEW TABLE AS new_rows"),
    "delete": ("DELETE", "OLD TABLE AS old_rows"),
    "update": ("UPDATE", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
}


_UNNEST = (
    "SELECT * FROM unnest(d_t, d_u, d_at, d_a, d_m, d_d, d_ip, d_w) AS "
    "u(tenant_id, user_id, created_at, amount, merchant_id, device_id, ip, w)"
)


def apply_functions() -> str:
    """The three statement triggers' functions and their triggers, as SQL."""
    parts = []
    day = _DAY.format(col="created_at")
    members = _MEMBERS.format(day=day, delta=_UNNEST, geo=GEO_OF)
    for name, source in _DELTAS.items():
        event, refs = _REFS[name]
        if name == "insert":
            steps = {"step2": "", "step45": _INSERT_LATEST, "cleanup": ""}
        else:
            steps = dict(_REMOVALS)
        body = _APPLY.format(
            op=name,
            event=event,
            refs=refs,
            source=source,
            day="{day}",
            delta="{delta}",
            members="{members}",
            geo="{geo}",
            **steps,
        )
        body = (
            body.replace("{delta}", _UNNEST)
            .replace("{members}", members)
            .replace("{day}", day)
            .replace("{geo}", GEO_OF)
        )
        parts.append(_both_plans(body))
    return "\n".join(parts)


_VARS = ("d_t", "d_u", "d_at", "d_a", "d_m", "d_d", "d_ip", "d_w")
BIG_DELTA = 1000
"""Changed rows above which a statement is planned for its own size (EXECUTE)."""


def _both_plans(body: str) -> str:
    """Each bucket statement twice: as is (a cached generic plan, index probes: right
    for a few rows) and through EXECUTE with the arrays as parameters (planned for
    their real sizes: hash joins for a COPY of a million rows, where probes nested in
    a loop over a misestimated side would go quadratic)."""
    head, rest = body.split("    END IF;\n", 1)
    stmts, tail = rest.split("    RETURN NULL;\nEND", 1)
    out = [head, "    END IF;\n"]
    for stmt in re.split(r";\s*\n", stmts):
        lines = [ln for ln in stmt.splitlines() if ln.strip() and not ln.strip().startswith("--")]
        if not lines:
            continue
        sql = "\n".join(lines)
        dynamic = sql
        for i, var in enumerate(_VARS, 1):
            dynamic = re.sub(rf"\b{var}\b", f"${i}", dynamic)
        out.append(
            f"    IF cardinality(d_t) > {BIG_DELTA} THEN\n"
            f"        EXECUTE $q${dynamic}$q$ USING {', '.join(_VARS)};\n"
            f"    ELSE\n{sql};\n    END IF;\n"
        )
    return "".join(out) + "    RETURN NULL;\nEND" + tail


# geoip decides the country of every IP, so a changed range changes the countries of
# the rows from its IPs: their users' country members are rebuilt, in the same
# transaction, after waiting for writers of transactions to finish (SHARE lock).
_COUNTRIES = f"""
CREATE FUNCTION freshline_rebuild_countries(a_t text[], a_u bigint[]) RETURNS void
LANGUAGE sql AS $fn$
    UPDATE txn_buckets b SET countries_latest = 0 FROM unnest(a_t, a_u) AS k(t, u)
    WHERE b.tenant_id = k.t AND b.user_id = k.u AND b.countries_latest <> 0;
    DELETE FROM txn_bucket_members m USING unnest(a_t, a_u) AS k(t, u)
    WHERE m.tenant_id = k.t AND m.user_id = k.u AND m.kind = 'c';
    DELETE FROM txn_bucket_latest l USING unnest(a_t, a_u) AS k(t, u)
    WHERE l.tenant_id = k.t AND l.user_id = k.u AND l.kind = 'c';
    INSERT INTO txn_bucket_members (tenant_id, user_id, kind, member, day, n)
    SELECT d.tenant_id, d.user_id, 'c', g.country, {_DAY.format(col="d.created_at")}, count(*)
    FROM unnest(a_t, a_u) AS k(t, u)
    JOIN transactions d ON d.tenant_id = k.t AND d.user_id = k.u
    CROSS JOIN LATERAL ({GEO_OF}) AS g
    GROUP BY 1, 2, 3, 4, 5;
    INSERT INTO txn_bucket_latest (tenant_id, user_id, kind, member, latest)
    SELECT m.tenant_id, m.user_id, 'c', m.member, max(m.day)
    FROM unnest(a_t, a_u) AS k(t, u)
    JOIN txn_bucket_members m ON m.tenant_id = k.t AND m.user_id = k.u AND m.kind = 'c'
    GROUP BY 1, 2, 3, 4;
    UPDATE txn_buckets b SET countries_latest = c.n
    FROM (SELECT l.tenant_id, l.user_id, l.latest, count(*) AS n
          FROM unnest(a_t, a_u) AS k(t, u)
          JOIN txn_bucket_latest l ON l.tenant_id = k.t AND l.user_id = k.u AND l.kind = 'c'
          GROUP BY 1, 2, 3) c
    WHERE b.tenant_id = c.tenant_id AND b.user_id = c.user_id AND b.day = c.latest;
$fn$;
CREATE FUNCTION freshline_geoip_truncate() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    LOCK TABLE transactions IN SHARE MODE;
    UPDATE txn_buckets SET countries_latest = 0 WHERE countries_latest <> 0;
    DELETE FROM txn_bucket_members WHERE kind = 'c';
    DELETE FROM txn_bucket_latest WHERE kind = 'c';
    RETURN NULL;
END
$fn$;
CREATE TRIGGER geoip_buckets_truncate AFTER TRUNCATE ON geoip
    FOR EACH STATEMENT EXECUTE FUNCTION freshline_geoip_truncate();
"""
_GEOIP_RANGES = {
    "insert": ("INSERT", "NEW TABLE AS new_rows", "SELECT ip_from, ip_to FROM new_rows"),
    "delete": ("DELETE", "OLD TABLE AS old_rows", "SELECT ip_from, ip_to FROM old_rows"),
    "update": (
        "UPDATE",
        "OLD TABLE AS old_rows NEW TABLE AS new_rows",
        "SELECT ip_from, ip_to FROM new_rows UNION SELECT ip_from, ip_to FROM old_rows",
    ),
}
_GEOIP = """
CREATE FUNCTION freshline_geoip_buckets_{op}() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE a_t text[]; a_u bigint[];
BEGIN
    LOCK TABLE transactions IN SHARE MODE;
    SELECT array_agg(tenant_id), array_agg(user_id) INTO a_t, a_u FROM (
        SELECT DISTINCT x.tenant_id, x.user_id FROM ({ranges}) AS r
        JOIN transactions x ON x.ip BETWEEN r.ip_from AND r.ip_to) AS s;
    IF a_t IS NOT NULL THEN
        PERFORM freshline_rebuild_countries(a_t, a_u);
    END IF;
    RETURN NULL;
END
$fn$;
CREATE TRIGGER geoip_buckets_{op} AFTER {event} ON geoip
    REFERENCING {refs} FOR EACH STATEMENT EXECUTE FUNCTION freshline_geoip_buckets_{op}();
"""


def geoip_functions() -> str:
    """What keeps the country members exact when geoip changes, as SQL."""
    return _COUNTRIES + "".join(
        _GEOIP.format(op=op, event=e, refs=r, ranges=q) for op, (e, r, q) in _GEOIP_RANGES.items()
    )


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE txn_buckets (
            tenant_id        text NOT NULL,
            user_id          bigint NOT NULL,
            day              date NOT NULL,
            n                bigint NOT NULL,
            amount_sum       numeric NOT NULL,
            amount_sq        numeric NOT NULL,
            amount_max       numeric(12, 2),
            last_at          timestamptz,
            merchants_latest integer NOT NULL DEFAULT 0,
            devices_latest   integer NOT NULL DEFAULT 0,
            countries_latest integer NOT NULL DEFAULT 0,
            PRIMARY KEY (tenant_id, user_id, day)
        );
        CREATE TABLE txn_bucket_members (
            tenant_id   text NOT NULL,
            user_id     bigint NOT NULL,
            kind        text NOT NULL,
            member      text NOT NULL,
            day         date NOT NULL,
            n           integer NOT NULL,
            PRIMARY KEY (tenant_id, user_id, kind, member, day)
        );
        CREATE TABLE txn_bucket_latest (
            tenant_id   text NOT NULL,
            user_id     bigint NOT NULL,
            kind        text NOT NULL,
            member      text NOT NULL,
            latest      date,
            prev        date,
            PRIMARY KEY (tenant_id, user_id, kind, member)
        );
        CREATE TABLE txn_bucket_build (
            one         boolean PRIMARY KEY DEFAULT true CHECK (one),
            complete    boolean NOT NULL,
            tenant_id   text,
            user_id     bigint
        );
        INSERT INTO txn_bucket_build (complete)
        SELECT NOT EXISTS (SELECT 1 FROM transactions);
        CREATE FUNCTION freshline_txn_buckets_truncate() RETURNS trigger
        LANGUAGE plpgsql AS $fn$
        BEGIN
            TRUNCATE txn_buckets, txn_bucket_members, txn_bucket_latest;
            UPDATE txn_bucket_build SET complete = true, tenant_id = NULL, user_id = NULL;
            RETURN NULL;
        END
        $fn$;
        CREATE TRIGGER txn_buckets_truncate AFTER TRUNCATE ON transactions
            FOR EACH STATEMENT EXECUTE FUNCTION freshline_txn_buckets_truncate();
        """
    )
    op.execute(apply_functions())
    op.execute(geoip_functions())


def downgrade() -> None:
    for name in _GEOIP_RANGES:
        op.execute(f"DROP TRIGGER IF EXISTS geoip_buckets_{name} ON geoip")
        op.execute(f"DROP FUNCTION IF EXISTS freshline_geoip_buckets_{name}()")
    op.execute("DROP TRIGGER IF EXISTS geoip_buckets_truncate ON geoip")
    op.execute("DROP FUNCTION IF EXISTS freshline_geoip_truncate()")
    op.execute("DROP FUNCTION IF EXISTS freshline_rebuild_countries(text[], bigint[])")
    for name in (*_DELTAS, "truncate"):
        op.execute(f"DROP TRIGGER IF EXISTS txn_buckets_{name} ON transactions")
        op.execute(f"DROP FUNCTION IF EXISTS freshline_txn_buckets_{name}()")
    op.execute("DROP TABLE txn_bucket_build, txn_bucket_latest, txn_bucket_members, txn_buckets")
