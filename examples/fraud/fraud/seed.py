"""A deterministic generator of realistic fraud-scoring data, bulk-loaded with COPY.

The same ``seed`` gives the same rows; timestamps are offsets from ``anchor``
(default: now), spread over the last 120 days. The shape is what feature queries
meet in production: a few users own many transactions (Zipf activity), amounts are
log-normal, merchants are many and skewed, some devices are shared between users (the
device-farm pattern fraud models look for), and every IP falls in a geoip range, most
of a user's from their home range.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from ipaddress import IPv4Address

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud import own_store
from freshline import FreshlineError, IncrementalPath, validate_id

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``, called as rows are loaded."""

HISTORY_DAYS = 120
GEO_BASE = int(IPv4Address("11.0.0.0"))
GEO_RANGE_SIZE = 4096
GEO_RANGES = 2048
CHUNK = 50_000

TENANT_NAMES = ["acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "tyrell"]
COUNTRIES = [
    ("US", ["New York", "Chicago", "Austin"]),
    ("GB", ["London", "Leeds", "Glasgow"]),
    ("DE", ["Berlin", "Munich", "Hamburg"]),
    ("FR", ["Paris", "Lyon", "Lille"]),
    ("BR", ["Sao Paulo", "Recife", "Curitiba"]),
    ("IN", ["Mumbai", "Pune", "Delhi"]),
    ("NG", ["Lagos", "Abuja", "Ibadan"]),
    ("JP", ["Tokyo", "Osaka", "Sapporo"]),
    ("CA", ["Toronto", "Montreal", "Calgary"]),
    ("MX", ["Mexico City", "Monterrey", "Puebla"]),
    ("ES", ["Madrid", "Valencia", "Seville"]),
    ("PL", ["Warsaw", "Krakow", "Gdansk"]),
]


class TenantsExist(FreshlineError):
    """Seeding would create tenants that are already there; nothing was written."""

    def __init__(self, tenants: list[str]) -> None:
        self.tenants = tenants
        super().__init__(
            f"already seeded: tenant(s) {', '.join(tenants)}; nothing was "
            "written. To seed more, give the new tenants a prefix: "
            "--tenant-prefix PREFIX"
        )


@dataclass(frozen=True, slots=True)
class SeedSummary:
    tenants: list[str]
    users: int
    devices: int
    transactions: int
    geoip_ranges: int


def tenant_ids(count: int, prefix: str = "") -> list[str]:
    """Stable tenant ids: ``acme``, ``globex``, ... then ``tenant9``..., with a prefix."""
    names = [TENANT_NAMES[i] if i < len(TENANT_NAMES) else f"tenant{i + 1}" for i in range(count)]
    return [validate_id("tenant", f"{prefix}{name}") for name in names]


def _ip_text(values: np.ndarray) -> list[str]:
    octets = [(values >> shift) & 0xFF for shift in (24, 16, 8, 0)]
    parts = [o.astype(str) for o in octets]
    joined = np.char.add(np.char.add(np.char.add(parts[0], "."), parts[1]), ".")
    joined = np.char.add(np.char.add(np.char.add(joined, parts[2]), "."), parts[3])
    return list(joined)


def _copy(
    conn: sa.Connection,
    sql: str,
    lines: Iterator[str],
    total: int,
    stage: str,
    progress: Progress | None,
) -> None:
    """Stream tab-separated lines through COPY in chunks, reporting progress."""
    raw = conn.connection.driver_connection
    done = 0
    with raw.cursor() as cur, cur.copy(sql) as copy:  # type: ignore[union-attr]
        buf = io.StringIO()
        pending = 0
        for line in lines:
            buf.write(line)
            pending += 1
            if pending == CHUNK:
                copy.write(buf.getvalue())
                done += pending
                if progress:
                    progress(stage, done, total)
                buf = io.StringIO()
                pending = 0
        if pending:
            copy.write(buf.getvalue())
            done += pending
    if progress:
        progress(stage, done, total)


def ensure_geoip(conn: sa.Connection, progress: Progress | None = None) -> int:
    """Load the synthetic geoip ranges once (they are global, not per tenant)."""
    have = conn.execute(sa.text("SELECT count(*) FROM geoip")).scalar_one()
    if have:
        return int(have)
    rng = np.random.default_rng(7)
    starts = GEO_BASE + np.arange(GEO_RANGES, dtype=np.int64) * GEO_RANGE_SIZE
    ends = starts + GEO_RANGE_SIZE - 1
    countries = rng.integers(0, len(COUNTRIES), GEO_RANGES)
    cities = rng.integers(0, 3, GEO_RANGES)
    asns = rng.integers(1000, 65000, GEO_RANGES)
    froms, tos = _ip_text(starts), _ip_text(ends)

    def lines() -> Iterator[str]:
        for i in range(GEO_RANGES):
            country, city_names = COUNTRIES[countries[i]]
            yield f"{froms[i]}\t{tos[i]}\t{country}\t{city_names[cities[i]]}\t{asns[i]}\n"

    _copy(
        conn,
        "COPY geoip (ip_from, ip_to, country, city, asn) FROM STDIN",
        lines(),
        GEO_RANGES,
        "geoip",
        progress,
    )
    return GEO_RANGES


def seed(
    engine: Engine,
    *,
    users: int,
    transactions: int,
    tenants: int = 1,
    seed: int = 42,
    tenant_prefix: str = "",
    anchor: datetime | None = None,
    progress: Progress | None = None,
) -> SeedSummary:
    """Create ``tenants`` tenants sharing ``users`` users and ``transactions`` rows.

    Raises :class:`TenantsExist`, having written nothing, if any of the tenants is
    already there: seed new ones with a ``tenant_prefix``. Everything commits in one
    transaction.
    """
    if users < 1 or transactions < 0 or tenants < 1:
        raise ValueError("users and tenants must be at least 1, transactions at least 0")
    now = anchor or datetime.now(UTC)
    rng = np.random.default_rng(seed)
    ids = tenant_ids(tenants, tenant_prefix)
    per_tenant_users = np.array_split(np.arange(users), tenants)
    per_tenant_txns = np.array_split(np.arange(transactions), tenants)
    total_devices = 0
    with engine.begin() as conn:
        existing = list(
            conn.execute(
                sa.text("SELECT id FROM freshline.tenants WHERE id = ANY(:ids) ORDER BY id"),
                {"ids": ids},
            ).scalars()
        )
        if existing:
            raise TenantsExist(existing)
        geo = ensure_geoip(conn, progress)
        conn.execute(
            sa.text("INSERT INTO freshline.tenants (id, name) VALUES (:id, :name)"),
            [{"id": t, "name": t.title()} for t in ids],
        )
        # The derived incremental paths' logs would take a row per user and day of the
        # load, for a fold to recompute one by one: their insert triggers are off for the
        # load (until commit other writers of transactions wait for the seed), and the
        # new tenants' partials are built from their rows at the end instead.
        with own_store().bulk_load(conn, "transactions") as paths:
            for tenant, u_idx, t_idx in zip(ids, per_tenant_users, per_tenant_txns, strict=True):
                total_devices += _seed_tenant(
                    conn, rng, tenant, len(u_idx), len(t_idx), now, progress
                )
        _build_partials(conn, paths, ids, progress)
    return SeedSummary(ids, users, total_devices, transactions, geo)


def _build_partials(
    conn: sa.Connection,
    paths: list[IncrementalPath],
    tenants: list[str],
    progress: Progress | None,
) -> None:
    """Build the new tenants' partials from their rows (a build from the rows is about
    twice as fast as folding a bulk load day by day)."""
    if not paths:
        return
    keys = [
        (t, int(u))
        for t, u in conn.execute(
            sa.text(
                "SELECT DISTINCT tenant_id, user_id FROM transactions WHERE tenant_id = ANY(:t)"
            ),
            {"t": tenants},
        )
    ]
    if progress is not None:
        progress("partials", 0, len(keys))
    for path in paths:
        path.rebuild(conn, keys)
    if progress is not None:
        progress("partials", len(keys), len(keys))


def _seed_tenant(
    conn: sa.Connection,
    rng: np.random.Generator,
    tenant: str,
    n_users: int,
    n_txns: int,
    now: datetime,
    progress: Progress | None,
) -> int:
    user_ids = np.arange(1, n_users + 1)
    signup = rng.uniform(HISTORY_DAYS, 720, n_users)
    _copy(
        conn,
        "COPY users (tenant_id, id, created_at) FROM STDIN",
        (
            f"{tenant}\t{uid}\t{(now - timedelta(days=float(d))).isoformat()}\n"
            for uid, d in zip(user_ids, signup, strict=True)
        ),
        n_users,
        f"{tenant} users",
        progress,
    )

    # Devices: each user one to three of their own; about 5% of users also use a
    # shared device (a farm of a few phones behind many accounts).
    own = rng.integers(1, 4, n_users)
    n_own = int(own.sum())
    n_shared = max(1, n_users // 50)
    n_devices = n_own + n_shared
    device_owner = np.repeat(user_ids, own)
    first_seen = rng.exponential(30.0, n_devices)
    risk = np.clip(rng.beta(1.2, 8.0, n_devices), 0, 1)
    risk[n_own:] = np.clip(risk[n_own:] + 0.5, 0, 1)
    fingerprints = rng.integers(0, 2**62, n_devices)
    _copy(
        conn,
        "COPY devices (tenant_id, id, fingerprint, risk_score, first_seen) FROM STDIN",
        (
            f"{tenant}\td{i}\t{fingerprints[i]:016x}\t{risk[i]:.4f}\t"
            f"{(now - timedelta(days=float(first_seen[i]))).isoformat()}\n"
            for i in range(n_devices)
        ),
        n_devices,
        f"{tenant} devices",
        progress,
    )
    shared_users = rng.choice(user_ids, size=max(1, n_users // 20), replace=n_users < 20)
    shared_device = n_own + rng.integers(0, n_shared, len(shared_users))
    links = {(int(u), f"d{i}") for i, u in enumerate(device_owner)}
    links |= {(int(u), f"d{d}") for u, d in zip(shared_users, shared_device, strict=True)}
    _copy(
        conn,
        "COPY user_devices (tenant_id, user_id, device_id) FROM STDIN",
        (f"{tenant}\t{u}\t{d}\n" for u, d in sorted(links)),
        len(links),
        f"{tenant} user devices",
        progress,
    )

    if n_txns:
        _seed_transactions(conn, rng, tenant, user_ids, links, n_txns, now, progress)
    return n_devices


def _seed_transactions(
    conn: sa.Connection,
    rng: np.random.Generator,
    tenant: str,
    user_ids: np.ndarray,
    links: set[tuple[int, str]],
    n_txns: int,
    now: datetime,
    progress: Progress | None,
) -> None:
    n_users = len(user_ids)
    # Zipf-like activity: user at rank r is picked with weight 1 / r^1.1.
    weights = 1.0 / np.arange(1, n_users + 1) ** 1.1
    rng.shuffle(weights)
    weights /= weights.sum()
    who = rng.choice(n_users, size=n_txns, p=weights)
    amounts = np.minimum(np.round(rng.lognormal(3.6, 1.1, n_txns), 2), 9_999_999.99)
    merchant_weights = 1.0 / np.arange(1, 20_001) ** 0.9
    merchant_weights /= merchant_weights.sum()
    merchants = rng.choice(20_000, size=n_txns, p=merchant_weights)
    # A user's devices, as a flat table: pick one of theirs, sometimes a shared one.
    device_lists: dict[int, list[str]] = {}
    for u, d in sorted(links):
        device_lists.setdefault(u, []).append(d)
    pick = rng.random(n_txns)
    home = rng.integers(0, GEO_RANGES, n_users)
    travel = rng.random(n_txns) < 0.1
    ranges = np.where(travel, rng.integers(0, GEO_RANGES, n_txns), home[who])
    ips = _ip_text(
        GEO_BASE
        + ranges.astype(np.int64) * GEO_RANGE_SIZE
        + rng.integers(1, GEO_RANGE_SIZE - 1, n_txns)
    )
    age_s = rng.uniform(0, HISTORY_DAYS * 86400.0, n_txns)
    status_draw = rng.random(n_txns)
    currencies = np.array(["USD", "EUR", "GBP", "BRL", "INR"])[rng.integers(0, 5, n_txns)]
    base = now.timestamp()

    def lines() -> Iterator[str]:
        for i in range(n_txns):
            uid = int(user_ids[who[i]])
            devs = device_lists[uid]
            device = devs[min(int(pick[i] * len(devs) * 1.5), len(devs) - 1)]
            created = datetime.fromtimestamp(base - age_s[i], UTC).isoformat()
            s = status_draw[i]
            status = "approved" if s < 0.96 else ("declined" if s < 0.99 else "reversed")
            yield (
                f"{tenant}\t{uid}\t{amounts[i]:.2f}\t{currencies[i]}\tm{merchants[i]}\t"
                f"{device}\t{ips[i]}\t{status}\t{created}\t{created}\n"
            )

    _copy(
        conn,
        "COPY transactions (tenant_id, user_id, amount, currency, merchant_id, "
        "device_id, ip, status, created_at, updated_at) FROM STDIN",
        lines(),
        n_txns,
        f"{tenant} transactions",
        progress,
    )
