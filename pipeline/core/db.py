"""Postgres access: the engine, the table definitions (SQLAlchemy Core), a ping.

The tables mirror the Alembic migrations under ``migrations/``; a test checks that
the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.engine import Engine

from pipeline.core.errors import ServiceUnavailable
from pipeline.core.settings import Settings

metadata = sa.MetaData()

tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

users = sa.Table(
    "users",
    metadata,
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), primary_key=True),
    sa.Column("id", sa.BigInteger, primary_key=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

transactions = sa.Table(
    "transactions",
    metadata,
    sa.Column("tenant_id", sa.Text, primary_key=True),
    sa.Column("id", sa.BigInteger, primary_key=True),
    sa.Column("user_id", sa.BigInteger, nullable=False),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
    sa.Column("currency", sa.Text, nullable=False),
    sa.Column("merchant_id", sa.Text, nullable=False),
    sa.Column("device_id", sa.Text),
    sa.Column("ip", pg.INET),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)

devices = sa.Table(
    "devices",
    metadata,
    sa.Column("tenant_id", sa.Text, primary_key=True),
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("fingerprint", sa.Text, nullable=False),
    sa.Column("risk_score", sa.REAL, nullable=False),
    sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
)

user_devices = sa.Table(
    "user_devices",
    metadata,
    sa.Column("tenant_id", sa.Text, primary_key=True),
    sa.Column("user_id", sa.BigInteger, primary_key=True),
    sa.Column("device_id", sa.Text, primary_key=True),
)

geoip = sa.Table(
    "geoip",
    metadata,
    sa.Column("ip_from", pg.INET, primary_key=True),
    sa.Column("ip_to", pg.INET, nullable=False),
    sa.Column("country", sa.Text, nullable=False),
    sa.Column("city", sa.Text, nullable=False),
    sa.Column("asn", sa.Integer, nullable=False),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("key_hash", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("id", sa.Text, nullable=False, unique=True),
    sa.Column("label", sa.Text, nullable=False, server_default=""),
    sa.Column("expires_at", sa.DateTime(timezone=True)),
    sa.Column("last_used_at", sa.DateTime(timezone=True)),
    sa.Column("revoked_at", sa.DateTime(timezone=True)),
)


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
def _connect_args() -> dict[str, object]:
    return {
        "connect_timeout": 3,
        "application_name": "freshline",
        "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S * 1000} "
        "-c jit=off",
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


def make_owner_engine(settings: Settings, *, pool_size: int = 5) -> Engine:
    """An engine logged in as the owner, for commands that write: seeding, tenants, API
    keys, the demo's changes. FRESHLINE_POSTGRES_ADMIN_URL where set, else the service URL
    (and a refusal then becomes :class:`~pipeline.core.errors.PermissionDenied`)."""
    return make_engine(settings, pool_size=pool_size, url=settings.migration_url)


def ping(engine: Engine) -> None:
    """Raise :class:`ServiceUnavailable` unless Postgres answers."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError as exc:
        detail = str(exc.orig).strip().splitlines()[0] if exc.orig else "no answer"
        url = engine.url.render_as_string(hide_password=True)
        raise ServiceUnavailable("Postgres", url, detail) from exc
