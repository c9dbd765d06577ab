"""Postgres access: the engine, freshline's own tables (SQLAlchemy Core), a ping.

The tables, in the ``freshline`` schema, mirror the Alembic migrations under
``migrations/``; a test checks that the two agree. The user's tables are never
defined here: feature sets reach them through their own SQL.
"""

from __future__ import annotations

import functools

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.core.errors import ServiceUnavailable
from freshline.pipeline.core.settings import Settings, redact

metadata = sa.MetaData()

SCHEMA = "freshline"
"""freshline's own Postgres schema: its tables, and nothing of the user's."""

tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    # The tenant's own API limits (migration 0004): NULL is the server's setting.
    sa.Column("rate_per_s", sa.Float),
    sa.Column("rate_burst", sa.Integer),
    sa.Column("concurrency", sa.Integer),
    sa.Column("pool_share", sa.Float),
    sa.Column("rows_per_s", sa.Float),  # migration 0005
    sa.Column("rows_burst", sa.Integer),
    schema=SCHEMA,
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("key_hash", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("freshline.tenants.id"), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("id", sa.Text, nullable=False, unique=True),
    sa.Column("label", sa.Text, nullable=False, server_default=""),
    sa.Column("expires_at", sa.DateTime(timezone=True)),
    sa.Column("last_used_at", sa.DateTime(timezone=True)),
    sa.Column("revoked_at", sa.DateTime(timezone=True)),
    schema=SCHEMA,
)

token_key = sa.Table(
    "token_key",
    metadata,
    sa.Column("id", sa.SmallInteger, primary_key=True),
    sa.Column("key", sa.LargeBinary, nullable=False),
    sa.Column("inner_pad", sa.LargeBinary, nullable=False),
    sa.Column("outer_pad", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    schema=SCHEMA,
)
"""The key freshness tokens are signed with (one row; :mod:`freshline.pipeline.cache.tokens`)."""

history_tables = sa.Table(
    "history_tables",
    metadata,
    sa.Column("source_schema", sa.Text, primary_key=True),
    sa.Column("source_table", sa.Text, primary_key=True),
    sa.Column("history_table", sa.Text, nullable=False, unique=True),
    sa.Column("s0_snapshot", sa.Text),  # a pg_snapshot as text
    sa.Column("s0_at", sa.DateTime(timezone=True)),
    sa.Column("s0_lsn", sa.Text),  # a pg_lsn as text
    sa.Column("complete_to", sa.DateTime(timezone=True)),
    sa.Column("broken_from", sa.DateTime(timezone=True)),
    sa.Column("broken_reason", sa.Text),
    sa.Column("retention_s", sa.BigInteger),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    schema=SCHEMA,
)
"""The user tables whose history freshline records (migration 0006;
:mod:`freshline.pipeline.history`)."""

history_truncates = sa.Table(
    "history_truncates",
    metadata,
    sa.Column("history_table", sa.Text, primary_key=True),
    sa.Column("lsn", sa.BigInteger, primary_key=True),
    sa.Column("txid", sa.BigInteger, nullable=False),  # an xid8's value
    sa.Column("committed_at", sa.DateTime(timezone=True), nullable=False),
    schema=SCHEMA,
)
"""Each TRUNCATE the history recorder read (:mod:`freshline.pipeline.history.recorder`)."""

snapshots = sa.Table(
    "snapshots",
    metadata,
    sa.Column("watermark", sa.Numeric(40, 0), primary_key=True),
    sa.Column("snapshot", sa.Text, nullable=False),  # a pg_snapshot as text
    sa.Column("as_of_us", sa.BigInteger, nullable=False),
    sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
    schema=SCHEMA,
)
"""The snapshot and ``as_of`` each entry's watermark names
(:mod:`freshline.pipeline.history.snapshots`)."""


IDLE_IN_TRANSACTION_S = 60
"""Postgres ends a freshline session left idle inside a transaction this long: none of
ours idles there for more than a round trip to Redis, and a process stopped or cut off
mid-transaction must not hold its snapshot and locks for good."""


# No JIT in freshline's sessions: its statements are index lookups for a batch of keys,
# tens of milliseconds of work, and JIT compiling one (inlining and optimising about 250
# functions) takes 1.5-2.5 s. The planner compiles once a statement's estimated cost
# passes jit_above_cost, which a batch's feature query does whenever a table's
# statistics are missing or stale: a new delta log, a bulk load, until autovacuum's
# first ANALYZE. A consumer then ran at a fiftieth of its rate; measured, it fell
# 67,000 events behind in the first minute of a 2,000 events/s load (issue 13).
def own_pool(engine: Engine, size: int = 1) -> Engine:
    """An engine on ``engine``'s database and login with a pool of its own of ``size``
    connections, for work a caller does on every batch while it holds a connection of
    ``engine``'s (:func:`own_connections` for rare work). Its owner disposes of it."""
    return sa.create_engine(
        engine.url,
        pool_size=size,
        max_overflow=0,
        pool_pre_ping=True,
        connect_args=_connect_args(),
    )


def own_connections(engine: Engine) -> Engine:
    """An engine on ``engine``'s database and login that opens a connection of its own
    for each use and closes it after (no pool): for the rare work a caller does while it
    holds a connection of ``engine``'s, where a second one from the same pool may never
    come (every connection held by a caller waiting for one more)."""
    return sa.create_engine(engine.url, poolclass=sa.pool.NullPool, connect_args=_connect_args())


def _connect_args() -> dict[str, object]:
    return {
        "connect_timeout": 3,
        "application_name": "freshline",
        # TimeZone=UTC: a timestamp without zone read from a timestamptz, now()::date,
        # date_trunc('day', ...) and the text of every timestamptz would otherwise follow
        # the database's (or role's) default zone, and differ between a feature query
        # run here and the same query replayed over history.
        "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S * 1000} "
        "-c jit=off -c TimeZone=UTC",
        # A peer that vanished without closing (a partition) is found within about
        # 30 s, where the kernel's defaults take over two hours.
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": 30_000,
    }


def make_engine(settings: Settings, *, pool_size: int = 5, url: str | None = None) -> Engine:
    """An engine on psycopg 3 with a small pool; nothing connects until first use.

    ``url`` replaces ``settings.postgres_url`` (e.g. the read replica's).
    """
    return sa.create_engine(
        url or settings.postgres_url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        connect_args=_connect_args(),
    )


@functools.lru_cache(maxsize=1024)
def sql_text(statement: str) -> sa.TextClause:
    """``sa.text(statement)``, made once per statement text: making one scans the text
    for its parameters, which took 0.8 ms for a feature query, as long as running it
    on an indexed miss. Statements built from definitions, not from values."""
    return sa.text(statement)


def autocommit(engine: Engine) -> Connection:
    """A connection from ``engine``'s pool for statements that each stand alone (a
    feature query, a lookup): in autocommit, a statement costs its own round trip, with
    no ``BEGIN`` before it and no ``ROLLBACK`` when the connection goes back. Use it as
    a context manager, like ``engine.connect()``.

    Each round trip waits for a Postgres backend to get a CPU: a read-through's
    recompute on a busy 2-core host spent about a quarter of its time in the ``BEGIN``,
    ``ROLLBACK`` and pool ping of three connections taken one after the other
    (``py-spy`` of an API worker, 2026-12-07)."""
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def make_owner_engine(settings: Settings, *, pool_size: int = 5) -> Engine:
    """An engine logged in as the owner, for commands that write: seeding, tenants, API
    keys, the demo's changes. FRESHLINE_POSTGRES_ADMIN_URL where set, else the service URL
    (and a refusal then becomes :class:`~freshline.pipeline.core.errors.PermissionDenied`)."""
    return make_engine(settings, pool_size=pool_size, url=settings.migration_url)


def ping(engine: Engine) -> None:
    """Raise :class:`ServiceUnavailable` unless Postgres answers."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError as exc:
        detail = str(exc.orig).strip().splitlines()[0] if exc.orig else "no answer"
        url = redact(engine.url.render_as_string(hide_password=False))
        raise ServiceUnavailable("Postgres", url, detail) from exc
