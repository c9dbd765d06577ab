"""The fraud example's incremental path: features from per-day partial aggregates, not
the whole history. It is this repository's own code, registered through freshline's
extension point (:class:`freshline.IncrementalPath`): ``txn_90d`` and ``geo`` name
:data:`BUCKETS` as their ``maintenance``; the tables and triggers are this repository's
migrations 0003-0008.

A full recompute of ``txn_90d`` reads every row of the user's last 90 days, so its
cost grows with the user's history: the busiest user of the 1M-row Zipf data set
owns 135k rows. The incremental path reads at most 91 rows of ``txn_buckets`` per
user (one per UTC day wholly inside the window), the source rows of the one day the
window's old edge cuts through, and the user's deltas not yet folded into the buckets,
whatever the user's history.

What the buckets hold
---------------------
Per (tenant, user, UTC day) of ``created_at``: the row count, the sum and the sum of
squares of ``amount`` (numerics, so exact), the max amount and the latest time. The
distinct merchants and devices are exact too, without sets per day: every member
(merchant or device) has one *latest day* (``txn_bucket_latest``, derived from its
per-day counts in ``txn_bucket_members``), and each bucket counts the members whose
latest day it is. Given no row after ``as_of``, a member has a row in the window
``(c, as_of]`` exactly when its latest day is after ``c``'s day ``dc``, or is ``dc``
and one of its rows that day is after ``c``. So the distinct count is the sum of the
buckets' counts for days ``dc+1 .. as_of's day`` plus the members of the edge rows
whose latest day is ``dc``.

Max over a sliding window: the window's max is the max of its whole days' maxima and
of the edge rows, so a row leaving the window simply stops being read (its day falls
out of the range, or it is before ``c`` on the edge day). A deleted or changed row
can lower its own day's max or latest time: the fold then reads that one day of that
user again from the source (an index range of one day).

How the buckets stay in step: a delta log, folded later
-------------------------------------------------------
Statement-level triggers on ``transactions`` (AFTER INSERT / UPDATE / DELETE, with
transition tables; migration 0007) append each statement's changed rows, once, to
``txn_bucket_deltas``, *in the source transaction*: +1 for a row added, -1 for a row
removed (an UPDATE is both, and one that leaves user, time, amount, merchant, device
and ip alone cancels out). COPY fires them too. That is all a writer pays: one
appended row per changed row, where maintaining the buckets themselves cost about five
upserts per row (migration 0003's triggers, five times the cost of the write). A
statement-level AFTER TRUNCATE trigger empties the bucket tables and the log.

A *fold* (:func:`fold`, ``freshline_fold_bucket_deltas``) takes every pending delta
of some users out of the log and applies them to the buckets with 0003's statements,
in one transaction. The consumers fold every ``FRESHLINE_BUCKET_FOLD_INTERVAL_MS``
(after a batch's commit), and ``freshline buckets fold`` does it by hand. Folds run
one at a time (an advisory lock, which builds and geoip changes take too), and a fold
takes *all* of a user's visible deltas: a row's removal is committed after its
addition, so it is never folded first, and folded counts are never negative.

Why values stay exact in every snapshot. Each source row and its delta commit
together, and each fold removes deltas from the log and adds them to the buckets
together; so every snapshot sees, for every user, the folded buckets of some set of
rows plus exactly the deltas not in that set. The incremental queries read both in
the one snapshot of the feature statement:

* count, sum and sum of squares: the buckets' plus the pending deltas' (signed);
* max and latest time of a whole day: the bucket's and those of the rows the pending
  deltas add, unless the day has a pending removal, whose row may be the bucket's
  max: then that day's rows are read from the source. (A fold may re-read a day's max
  from the source with a later snapshot than the deltas it took, so a bucket's max
  can include a row whose delta is still pending, or miss one whose removal is; both
  cases are covered: the first by the row itself, the second by the read from the
  source.)
* distinct members: for a member with no pending delta on day ``dc`` or later, its
  folded latest day is its true one from ``dc`` on, so the buckets' counts hold.
  Each member with pending deltas there is worked out on its own: ``was`` (its folded
  latest day is after ``dc``: what the buckets counted) and ``now`` (some day after
  ``dc`` where its folded count plus its pending deltas is positive); the count is
  corrected by ``now - was``, and on the edge day such a member counts unless ``now``.
  The countries of pending deltas are looked up in ``geoip`` as it is in that snapshot;
  a geoip change folds the deltas of every user with a row or a pending delta in the
  changed ranges and rebuilds their countries, in the geoip writer's transaction.

So the recompute's watermark argument (:mod:`pipeline.cache.recompute`) is unchanged:
it is about what one snapshot sees, and what a snapshot sees of the buckets and the
log is exactly the aggregates of the source rows it sees. The cost moves: a read
also reads the user's pending deltas (an index on the log's user), which a consumer
recomputing a user it was just told about usually finds (the write it heard of is
still pending); a fold costs what the triggers used to, off the writer's path.

Keys the buckets cannot answer are computed in full *by the same statement*: a user
not yet covered by ``freshline buckets build`` (``txn_bucket_build``), or with a row
or a pending delta after ``as_of`` (a future-dated row, or an ``as_of`` in the past),
where "latest day" would look past the window.

Concurrency. Writers no longer touch the bucket tables, so they never wait on each
other for them (0003's writers serialised on each member's latest-day row, and could
deadlock). Every writer of the bucket tables takes a lock on ``transactions`` first
(a fold ACCESS SHARE, a build or geoip change SHARE, TRUNCATE ACCESS EXCLUSIVE) and
the advisory lock second, so they cannot deadlock on each other either. The fold's
statements run under READ COMMITTED, each with a fresh snapshot, as 0003's did.

Building the buckets for existing rows
--------------------------------------
:func:`build` rebuilds users in key order, a batch per transaction, each under
``LOCK TABLE transactions IN SHARE MODE`` and the advisory lock (writers and folds
wait for the batch), dropping the users' pending deltas (the rows are read as they
are), and saves its cursor with the batch: interrupted, it resumes after the last
committed batch. Until it completes, users past the cursor are computed in full.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline import BuildState, FeatureSet, IncrementalPath

# A key goes to the bucket query when the build covers its user and it has no row
# after as_of; the others (k) go to the full query, in the same statement. The build
# row is read by a scalar subquery: joined, a table without statistics is estimated
# at a thousand rows, and the inflated cost of the whole statement crossed
# jit_above_cost (nearly a second of JIT compilation per batch).
_ANSWERABLE = """
    coalesce((SELECT bb.complete OR (k0.tenant_id, k0.user_id) <= (bb.tenant_id, bb.user_id)
              FROM txn_bucket_build bb), false)
    AND NOT EXISTS (
        SELECT 1 FROM txn_buckets b
        WHERE b.tenant_id = k0.tenant_id AND b.user_id = k0.user_id
          AND b.day >= (t.as_of AT TIME ZONE 'UTC')::date
          AND (b.day > (t.as_of AT TIME ZONE 'UTC')::date OR b.last_at > t.as_of))
    AND NOT EXISTS (
        SELECT 1 FROM txn_bucket_deltas p
        WHERE p.tenant_id = k0.tenant_id AND p.user_id = k0.user_id AND p.created_at > t.as_of)
"""
_K0 = """
WITH k0(tenant_id, user_id) AS (
    SELECT * FROM unnest(CAST(:tenants AS text[]), CAST(:ids AS bigint[]))
), t(as_of) AS (
    SELECT coalesce(CAST(:as_of AS timestamptz), now())
)"""
_KEYS = f"""{_K0}, e AS (
    SELECT k0.tenant_id, k0.user_id, {_ANSWERABLE} AS ok
    FROM k0 CROSS JOIN t
), ki AS (
    SELECT tenant_id, user_id FROM e WHERE ok
), k AS (
    SELECT tenant_id, user_id FROM e WHERE NOT ok
)
"""
_ANSWERED = sa.text(f"""{_K0}
SELECT k0.tenant_id, k0.user_id FROM k0 CROSS JOIN t
WHERE {_ANSWERABLE}""")


def answered(
    conn: Connection, keys: Sequence[tuple[str, int]], as_of: dt.datetime | None = None
) -> set[tuple[str, int]]:
    """Which of ``keys`` (tenant, user id) the buckets answer; the rest are full."""
    rows = conn.execute(
        _ANSWERED,
        {"tenants": [t for t, _ in keys], "ids": [int(u) for _, u in keys], "as_of": as_of},
    )
    return {(t, int(u)) for t, u in rows}


def query_text(fs: FeatureSet) -> str:
    """The SQL of ``fs`` on the incremental path: keys in ``:tenants``/``:ids``,
    ``:as_of``. The keys the buckets can answer go to the incremental query and the rest
    to the full one, in one statement (``UNION ALL``)."""
    return f"{_KEYS}({fs.incremental})\nUNION ALL\n({fs.query})"


# -- building and repairing the buckets -------------------------------------------------

_KEYS_OF = "SELECT * FROM unnest(CAST(:tenants AS text[]), CAST(:ids AS bigint[]))"
_DAY = "(x.created_at AT TIME ZONE 'UTC')::date"
_REBUILD = [
    f"DELETE FROM txn_bucket_deltas WHERE (tenant_id, user_id) IN ({_KEYS_OF})",
    f"DELETE FROM txn_buckets WHERE (tenant_id, user_id) IN ({_KEYS_OF})",
    f"DELETE FROM txn_bucket_members WHERE (tenant_id, user_id) IN ({_KEYS_OF})",
    f"DELETE FROM txn_bucket_latest WHERE (tenant_id, user_id) IN ({_KEYS_OF})",
    f"""INSERT INTO txn_bucket_members (tenant_id, user_id, kind, member, day, n)
    SELECT x.tenant_id, x.user_id, 'm', x.merchant_id, {_DAY}, count(*)
    FROM transactions x WHERE (x.tenant_id, x.user_id) IN ({_KEYS_OF}) GROUP BY 1, 2, 3, 4, 5
    UNION ALL
    SELECT x.tenant_id, x.user_id, 'd', x.device_id, {_DAY}, count(*)
    FROM transactions x WHERE (x.tenant_id, x.user_id) IN ({_KEYS_OF})
      AND x.device_id IS NOT NULL GROUP BY 1, 2, 3, 4, 5
    UNION ALL
    SELECT x.tenant_id, x.user_id, 'c', g.country, {_DAY}, count(*)
    FROM transactions x CROSS JOIN LATERAL (
        SELECT g.country FROM (SELECT country, ip_to FROM geoip WHERE ip_from <= x.ip
                               ORDER BY ip_from DESC LIMIT 1) g WHERE x.ip <= g.ip_to) g
    WHERE (x.tenant_id, x.user_id) IN ({_KEYS_OF}) GROUP BY 1, 2, 3, 4, 5""",
    f"""INSERT INTO txn_bucket_latest (tenant_id, user_id, kind, member, latest)
    SELECT tenant_id, user_id, kind, member, max(day) FROM txn_bucket_members
    WHERE (tenant_id, user_id) IN ({_KEYS_OF}) GROUP BY 1, 2, 3, 4""",
    # Each day with its latest-day marks, in one insert (an update after it would leave
    # a dead version of every bucket row behind).
    f"""INSERT INTO txn_buckets (tenant_id, user_id, day, n, amount_sum, amount_sq, amount_max,
                             last_at, merchants_latest, devices_latest, countries_latest)
    SELECT g.tenant_id, g.user_id, g.day, g.n, g.s, g.q, g.mx, g.la,
           coalesce(c.m, 0), coalesce(c.d, 0), coalesce(c.c, 0)
    FROM (SELECT x.tenant_id, x.user_id, {_DAY} AS day, count(*) AS n, sum(x.amount) AS s,
                 sum(x.amount * x.amount) AS q, max(x.amount) AS mx, max(x.created_at) AS la
          FROM transactions x WHERE (x.tenant_id, x.user_id) IN ({_KEYS_OF})
          GROUP BY 1, 2, 3) g
    LEFT JOIN (SELECT tenant_id, user_id, latest AS day,
                      count(*) FILTER (WHERE kind = 'm') AS m,
                      count(*) FILTER (WHERE kind = 'd') AS d,
                      count(*) FILTER (WHERE kind = 'c') AS c
               FROM txn_bucket_latest WHERE (tenant_id, user_id) IN ({_KEYS_OF})
               GROUP BY 1, 2, 3) c
      ON c.tenant_id = g.tenant_id AND c.user_id = g.user_id AND c.day = g.day""",
]
_LOCK = sa.text("LOCK TABLE transactions IN SHARE MODE")
_BUCKET_LOCK = sa.text("SELECT freshline_bucket_lock()")


def rebuild(conn: Connection, keys: Sequence[tuple[str, int]]) -> None:
    """Rebuild the buckets of ``keys`` (tenant, user id) from ``transactions``, and drop
    their pending deltas (the rows they describe are read as they are now).

    Takes ``LOCK TABLE transactions IN SHARE MODE`` (writers wait, so no delta of
    these users appears meanwhile) and the buckets' advisory lock (no fold runs) for
    the rest of the caller's transaction.
    """
    if not keys:
        return
    params = {"tenants": [t for t, _ in keys], "ids": [int(u) for _, u in keys]}
    conn.execute(_LOCK)
    conn.execute(_BUCKET_LOCK)
    for sql in _REBUILD:
        conn.execute(sa.text(sql), params)


def state(db: Engine | Connection, *, count: bool = False) -> BuildState:
    """The build state; with ``count``, also how many users remain (a full scan)."""

    def read(conn: Connection) -> BuildState:
        row = conn.execute(
            sa.text("SELECT complete, tenant_id, user_id FROM txn_bucket_build")
        ).one()
        cursor = None if row.tenant_id is None else (row.tenant_id, int(row.user_id))
        remaining = None
        if count and not row.complete:
            remaining = int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM "
                        "(SELECT DISTINCT tenant_id, user_id FROM transactions "
                        "WHERE CAST(:t AS text) IS NULL "
                        "OR (tenant_id, user_id) > (CAST(:t AS text), CAST(:u AS bigint))) s"
                    ),
                    {"t": cursor[0] if cursor else None, "u": cursor[1] if cursor else None},
                ).scalar_one()
            )
        return BuildState(bool(row.complete), cursor, remaining)

    if isinstance(db, Connection):
        return read(db)
    with db.connect() as conn:
        return read(conn)


def restart(engine: Engine) -> None:
    """Mark every user unbuilt: the next :func:`build` rebuilds all buckets."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE txn_bucket_build SET complete = false, tenant_id = NULL, user_id = NULL"
            )
        )


_NEXT = sa.text("""
SELECT DISTINCT tenant_id, user_id FROM transactions
WHERE CAST(:t AS text) IS NULL OR (tenant_id, user_id) > (CAST(:t AS text), CAST(:u AS bigint))
ORDER BY tenant_id, user_id LIMIT :n
""")


def build_batch(engine: Engine, batch: int) -> tuple[int, BuildState]:
    """Rebuild the next ``batch`` users after the cursor, in one transaction.

    Returns how many users it rebuilt and the state after it; 0 users means the
    build is complete.
    """
    with engine.begin() as conn:
        conn.execute(_LOCK)
        conn.execute(_BUCKET_LOCK)
        row = conn.execute(
            sa.text("SELECT complete, tenant_id, user_id FROM txn_bucket_build FOR UPDATE")
        ).one()
        if row.complete:
            return 0, BuildState(True, None)
        keys = [
            (t, int(u))
            for t, u in conn.execute(
                _NEXT, {"t": row.tenant_id, "u": row.user_id, "n": batch}
            ).all()
        ]
        if not keys:
            conn.execute(
                sa.text(
                    "UPDATE txn_bucket_build SET complete = true, tenant_id = NULL, user_id = NULL"
                )
            )
            return 0, BuildState(True, None)
        rebuild(conn, keys)
        conn.execute(
            sa.text("UPDATE txn_bucket_build SET tenant_id = :t, user_id = :u"),
            {"t": keys[-1][0], "u": keys[-1][1]},
        )
        return len(keys), BuildState(False, keys[-1])


def build(
    engine: Engine, *, batch: int = 2000, progress: Callable[[int], None] | None = None
) -> int:
    """Build the buckets of every user not yet covered, batch by batch; resumable.

    ``progress(users)`` is called after each committed batch. Returns the users built.
    """
    done = 0
    while True:
        n, _ = build_batch(engine, batch)
        if n == 0:
            return done
        done += n
        if progress is not None:
            progress(n)


# -- folding the pending deltas ---------------------------------------------------------

_FOLD = sa.text("SELECT freshline_fold_bucket_deltas(:n, :wait)")


def fold(db: Engine | Connection, *, max_users: int = 1000, wait: bool = True) -> int | None:
    """Fold every pending delta of up to ``max_users`` users into the buckets, in one
    transaction; returns how many users it folded (0: nothing was pending).

    With ``wait=False`` it returns None at once when another fold, a build batch or a
    TRUNCATE holds the buckets, instead of queueing behind it. With a Connection, the
    fold is part of the caller's transaction.

    With an Engine the fold is one statement in autocommit: Postgres commits it, and
    lets go of the fold lock, before the reply leaves. In an explicit transaction the
    lock would be held across a round trip to the client, and a consumer whose link to
    Postgres went silent there (a partition that closes nothing) would hold it until
    the session died, with every ``geoip`` write and every other fold waiting on it.
    """
    params = {"n": max_users, "wait": wait}
    if isinstance(db, Connection):
        n = db.execute(_FOLD, params).scalar_one()
    else:
        try:
            with db.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                n = conn.execute(_FOLD, params).scalar_one()
        except sa.exc.OperationalError as exc:
            if wait or getattr(exc.orig, "sqlstate", None) != "55P03":
                raise
            return None  # TRUNCATE or DDL holds transactions (LOCK ... NOWAIT)
    return None if n is None else int(n)


def fold_all(
    engine: Engine, *, max_users: int = 1000, progress: Callable[[int], None] | None = None
) -> int:
    """Fold every pending delta, ``max_users`` users per transaction; returns the users
    folded. ``progress(users)`` is called after each committed transaction."""
    done = 0
    while n := fold(engine, max_users=max_users):
        done += n
        if progress is not None:
            progress(n)
    return done


def pending(db: Engine | Connection) -> tuple[int, int]:
    """(pending deltas, users they belong to): a full scan of the delta log."""
    sql = sa.text("SELECT count(*), count(DISTINCT (tenant_id, user_id)) FROM txn_bucket_deltas")
    if isinstance(db, Connection):
        row = db.execute(sql).one()
    else:
        with db.connect() as conn:
            row = conn.execute(sql).one()
    return int(row[0]), int(row[1])


# -- the extension point ------------------------------------------------------------------


class Buckets(IncrementalPath):
    """This module's functions, as the hooks freshline calls (see
    :mod:`pipeline.core.incremental`)."""

    name = "buckets"

    def statement(self, fs: Any) -> str:
        return query_text(fs)

    def rebuild(self, conn: Connection, keys: Sequence[tuple[str, Any]]) -> None:
        rebuild(conn, [(t, int(u)) for t, u in keys])

    def fold(self, db: Engine | Connection, *, max_keys: int, wait: bool) -> int | None:
        return fold(db, max_users=max_keys, wait=wait)

    def pending(self, db: Engine | Connection) -> tuple[int, int]:
        return pending(db)

    def state(self, db: Engine | Connection, *, count: bool = False) -> BuildState:
        return state(db, count=count)

    def build(
        self, engine: Engine, *, batch: int = 2000, progress: Callable[[int], None] | None = None
    ) -> int:
        return build(engine, batch=batch, progress=progress)

    def restart(self, engine: Engine) -> None:
        restart(engine)

    def summary(self, db: Engine | Connection) -> str:
        sql = sa.text(
            "SELECT (SELECT count(*) FROM txn_buckets), (SELECT count(*) FROM "
            "txn_bucket_members), pg_size_pretty(pg_total_relation_size('txn_buckets') "
            "+ pg_total_relation_size('txn_bucket_members') "
            "+ pg_total_relation_size('txn_bucket_latest') "
            "+ pg_total_relation_size('txn_bucket_deltas'))"
        )
        if isinstance(db, Connection):
            row = db.execute(sql).one()
        else:
            with db.connect() as conn:
                row = conn.execute(sql).one()
        return f"{row[0]:,} day rows, {row[1]:,} member rows, {row[2]}"


BUCKETS = Buckets()
"""The one instance ``txn_90d`` and ``geo`` name as their maintenance."""
