"""The fraud example's features by hand: a plain Python reference over the raw rows.

The oracle's second opinion (the first is the defining full query): what
``examples/fraud/features.py`` says ``txn_90d``, ``device_risk`` and ``geo`` are, written
again from its words. It shares no code with the path under test: it reads rows with
plain SELECTs (no feature SQL, no aggregate), and imports nothing from freshline
(:mod:`freshline.pipeline.cache.recompute`, :mod:`freshline.pipeline.core.aggregations`,
:mod:`freshline.pipeline.core.maintenance`, the codec). Values come out as a served entry holds
them: timestamps as epoch milliseconds, ``numeric`` as ``float``, ``NULL`` as None.

The definitions, at the moment ``as_of``:

* ``txn_90d``: the user's transactions with ``as_of - 90 days < created_at <= as_of``
  (90 days of 86,400 s: the declared window is exact seconds), whatever their status.
  ``txn_sum`` is 0 over none; ``txn_mean`` and ``txn_std`` (population) are 0 over none
  and rounded to 4 places, half away from zero, as Postgres rounds ``numeric``;
  ``txn_max`` is 0 over none; ``last_txn_at`` is the latest ``created_at``, None over
  none. Sums are exact decimals.
* ``device_risk``: the user's ``user_devices`` links and the ``devices`` rows they name.
  ``device_count`` counts the links whose device exists; ``max_device_risk`` is the
  greatest ``risk_score`` (0 if none) rounded to 4 places through ``numeric``, which
  Postgres reaches from a ``real`` by its 6 significant digits; ``new_device_24h``:
  some such device was first seen after ``as_of - 24 hours`` (later than ``as_of``
  too); ``shared_device_users``: the most users linked to one of the user's linked
  devices (a link whose device row is missing counts too), 0 with no link.
* ``geo``: the latest of the user's transactions created at or before ``as_of`` (ties:
  the greatest id) gives ``last_country`` and ``last_city`` by its IP's range, None if
  it has no IP or the IP no range; ``distinct_countries_30d`` counts the countries of
  the IPs of the user's transactions with ``as_of - 30 days < created_at <= as_of``.
  An IP's range is the one with the greatest ``ip_from`` at or below it, if the IP is
  at or below that range's ``ip_to``. ``30 days`` is 30 * 86,400 s (the declared
  window is exact seconds, as ``txn_90d``'s).

The rows must be read in one snapshot, the one a compared recompute reads: run
:func:`load` in the same REPEATABLE READ transaction (:func:`tests.faults.oracle.truth`
does).

**Over a span of time.** With the rows fixed, each value is a step function of
``as_of``: it can change only where a row enters the data (its ``created_at``) or
leaves a window (``created_at + 90 days``, ``+ 30 days``, a device's
``first_seen + 24 hours``). :func:`breakpoints` lists those moments for one user, and
:func:`pieces` cuts a span ``[lo, hi]`` at them, so evaluating at the start of each
piece gives every value the user had during the span, and from when to when
(:mod:`tests.faults.readers` judges readers' answers by it).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal, localcontext
from ipaddress import IPv4Address, IPv6Address

import sqlalchemy as sa
from sqlalchemy.engine import Connection

Ref = tuple[str, str]
"""(tenant, user id) as the keys spell them."""
Value = int | float | str | bool | None
Values = dict[str, Value]
Address = IPv4Address | IPv6Address

FEATURE_SETS = ("txn_90d", "device_risk", "geo")
TXN_WINDOW = timedelta(days=90)
DEVICE_WINDOW = timedelta(hours=24)
GEO_WINDOW = timedelta(days=30)
PLACES = Decimal("0.0001")
FLOAT4_DIGITS = 6
"""Significant digits Postgres keeps converting a ``real`` to ``numeric`` (FLT_DIG)."""
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Txn:
    id: int
    amount: Decimal
    merchant: str
    device: str | None
    ip: Address | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Device:
    risk: float
    """The ``real`` exactly, as a float8."""
    first_seen: datetime


@dataclass(frozen=True, slots=True)
class Range:
    start: Address
    end: Address
    country: str
    city: str


@dataclass(frozen=True)
class Rows:
    """The raw rows the three feature sets read, for some users."""

    txns: dict[Ref, list[Txn]] = field(default_factory=dict)
    links: dict[Ref, list[str]] = field(default_factory=dict)
    """Per user, the ids of the devices linked to it."""
    linked: dict[tuple[str, str], int] = field(default_factory=dict)
    """Per (tenant, device) linked to one of the users: how many users it is linked to."""
    devices: dict[tuple[str, str], Device] = field(default_factory=dict)
    ranges: list[Range] = field(default_factory=list)
    """Every geoip range, by ``ip_from``."""


def _address(value: object) -> Address:
    """An ``inet`` that holds a host address. Postgres orders ``inet`` by family, then
    by the bits of the shorter netmask, then by netmask; for host addresses that is
    this key's order (``_key``). A value with a netmask would need the rest."""
    if not isinstance(value, IPv4Address | IPv6Address):
        raise ValueError(f"the reference orders host addresses only, not {value!r}")
    return value


def _key(ip: Address) -> tuple[int, int]:
    return ip.version, int(ip)


def load(conn: Connection, refs: Iterable[Ref], ranges: list[Range] | None = None) -> Rows:
    """The rows of ``refs``' users, their links and devices, and every geoip range
    (``ranges``, if given: the caller knows they are still the table's)."""
    users: dict[str, list[int]] = defaultdict(list)
    for tenant, user in dict.fromkeys(refs):
        users[tenant].append(int(user))
    rows = Rows()
    for tenant, ids in sorted(users.items()):
        params = {"t": tenant, "users": ids}
        for user, txn_id, amount, merchant, device, ip, created_at in conn.execute(
            sa.text(
                "SELECT user_id, id, amount, merchant_id, device_id, ip, created_at "
                "FROM transactions WHERE tenant_id = :t AND user_id = ANY(CAST(:users AS bigint[]))"
            ),
            params,
        ):
            rows.txns.setdefault((tenant, str(user)), []).append(
                Txn(
                    int(txn_id),
                    Decimal(amount),
                    merchant,
                    device,
                    None if ip is None else _address(ip),
                    created_at,
                )
            )
        for user, device in conn.execute(
            sa.text(
                "SELECT user_id, device_id FROM user_devices "
                "WHERE tenant_id = :t AND user_id = ANY(CAST(:users AS bigint[]))"
            ),
            params,
        ):
            rows.links.setdefault((tenant, str(user)), []).append(device)
        devices = sorted({d for (t, _), ds in rows.links.items() if t == tenant for d in ds})
        mine = {"t": tenant, "d": devices}
        for (device,) in conn.execute(
            sa.text(
                "SELECT device_id FROM user_devices "
                "WHERE tenant_id = :t AND device_id = ANY(CAST(:d AS text[]))"
            ),
            mine,
        ):
            rows.linked[(tenant, device)] = rows.linked.get((tenant, device), 0) + 1
        for device, risk, first_seen in conn.execute(
            sa.text(
                "SELECT id, CAST(risk_score AS float8), first_seen FROM devices "
                "WHERE tenant_id = :t AND id = ANY(CAST(:d AS text[]))"
            ),
            mine,
        ):
            rows.devices[(tenant, device)] = Device(float(risk), first_seen)
    if ranges is not None:
        rows.ranges.extend(ranges)
        return rows
    rows.ranges.extend(
        Range(_address(start), _address(end), country, city)
        for start, end, country, city in conn.execute(
            sa.text("SELECT ip_from, ip_to, country, city FROM geoip")
        )
    )
    rows.ranges.sort(key=lambda r: _key(r.start))
    return rows


# -- the feature sets ------------------------------------------------------------------


def _rounded(value: Decimal) -> float:
    """``round(value::numeric, 4)`` as a float: half away from zero."""
    return float(value.quantize(PLACES, rounding=ROUND_HALF_UP))


def _ms(at: datetime) -> int:
    return (at - EPOCH) // timedelta(milliseconds=1)


def txn_90d(txns: Iterable[Txn], as_of: datetime) -> Values:
    window = [x for x in txns if as_of - TXN_WINDOW < x.created_at <= as_of]
    amounts = [x.amount for x in window]
    n = len(amounts)
    s = sum(amounts, Decimal(0))
    q = sum((a * a for a in amounts), Decimal(0))
    with localcontext() as ctx:
        ctx.prec = 40  # well past the 4 places kept: no second rounding shows
        mean = s / n if n else Decimal(0)
        std = (max(n * q - s * s, Decimal(0)) / (n * n)).sqrt() if n else Decimal(0)
    return {
        "txn_count": n,
        "txn_sum": float(s),
        "txn_mean": _rounded(mean),
        "txn_max": float(max(amounts)) if amounts else 0.0,
        "txn_std": _rounded(std),
        "distinct_merchants": len({x.merchant for x in window}),
        "distinct_devices": len({x.device for x in window if x.device is not None}),
        "last_txn_at": _ms(max(x.created_at for x in window)) if window else None,
    }


def device_risk(rows: Rows, ref: Ref, as_of: datetime) -> Values:
    tenant = ref[0]
    links = rows.links.get(ref, [])
    present = [rows.devices[(tenant, d)] for d in links if (tenant, d) in rows.devices]
    risk = max((d.risk for d in present), default=0.0)
    return {
        "device_count": len(present),
        "max_device_risk": _rounded(Decimal(f"{risk:.{FLOAT4_DIGITS}g}")),
        "new_device_24h": any(d.first_seen > as_of - DEVICE_WINDOW for d in present),
        "shared_device_users": max((rows.linked[(tenant, d)] for d in links), default=0),
    }


def range_of(ranges: list[Range], ip: Address) -> Range | None:
    """The range with the greatest start at or below ``ip``, if ``ip`` is within it."""
    at = bisect.bisect_right(ranges, _key(ip), key=lambda r: _key(r.start))
    if at == 0:
        return None
    found = ranges[at - 1]
    return found if _key(ip) <= _key(found.end) else None


def geo(rows: Rows, ref: Ref, as_of: datetime) -> Values:
    seen = [x for x in rows.txns.get(ref, []) if x.created_at <= as_of]
    latest = max(seen, key=lambda x: (x.created_at, x.id), default=None)
    where = None if latest is None or latest.ip is None else range_of(rows.ranges, latest.ip)
    since = as_of - GEO_WINDOW
    countries = {
        r.country
        for x in seen
        if x.created_at > since and x.ip is not None
        if (r := range_of(rows.ranges, x.ip)) is not None
    }
    return {
        "last_country": where.country if where else None,
        "last_city": where.city if where else None,
        "distinct_countries_30d": len(countries),
    }


def values(rows: Rows, refs: Iterable[Ref], as_of: datetime) -> dict[str, dict[Ref, Values]]:
    """Per feature set, every ref's values at ``as_of`` (a user without rows has them too,
    as the defining queries give a row for every key)."""
    if as_of.tzinfo is None:
        raise ValueError(f"as_of must be an aware datetime, not {as_of!r}")
    as_of = as_of.astimezone(UTC)  # the windows of exact seconds subtract in UTC
    out: dict[str, dict[Ref, Values]] = {name: {} for name in FEATURE_SETS}
    for ref in dict.fromkeys(refs):
        out["txn_90d"][ref] = txn_90d(rows.txns.get(ref, []), as_of)
        out["device_risk"][ref] = device_risk(rows, ref, as_of)
        out["geo"][ref] = geo(rows, ref, as_of)
    return out


def reference(
    conn: Connection, refs: Iterable[Ref], as_of: datetime
) -> dict[str, dict[Ref, Values]]:
    """Load the rows of ``refs`` on ``conn`` and compute every feature set at ``as_of``."""
    refs = list(dict.fromkeys(refs))
    return values(load(conn, refs), refs, as_of)


# -- values over a span of time ----------------------------------------------------------


def breakpoints(rows: Rows, ref: Ref) -> list[datetime]:
    """Every moment at which ``ref``'s values may change with its rows fixed, sorted.

    A value at ``as_of = b`` is already the value after the change: each window is
    ``edge < created_at <= as_of``, so a row is in from its ``created_at`` and out from
    its edge's moment on, both included.
    """
    tenant = ref[0]
    moments: set[datetime] = set()
    for x in rows.txns.get(ref, []):
        moments |= {x.created_at, x.created_at + TXN_WINDOW, x.created_at + GEO_WINDOW}
    for d in rows.links.get(ref, []):
        device = rows.devices.get((tenant, d))
        if device is not None:
            moments.add(device.first_seen + DEVICE_WINDOW)
    return sorted(m.astimezone(UTC) for m in moments)


def pieces(rows: Rows, ref: Ref, lo: datetime, hi: datetime) -> list[tuple[datetime, datetime]]:
    """``[lo, hi]`` cut where ``ref``'s values may change: ``(start, end)`` pieces over
    each of which every value is constant (``lo == hi``: one piece of one moment)."""
    cuts = [b for b in breakpoints(rows, ref) if lo < b <= hi]
    starts = [lo, *cuts]
    return list(zip(starts, [*cuts, hi], strict=True))


def fingerprint(rows: Rows, ref: Ref) -> tuple[object, ...]:
    """Everything of ``rows`` that ``ref``'s values depend on: two states with the same
    fingerprint give ``ref`` the same values at every ``as_of``."""
    tenant = ref[0]
    txns = tuple(sorted(rows.txns.get(ref, []), key=lambda x: x.id))
    links = tuple(sorted(rows.links.get(ref, [])))
    return (
        txns,
        tuple((d, rows.devices.get((tenant, d)), rows.linked.get((tenant, d))) for d in links),
        tuple(None if x.ip is None else range_of(rows.ranges, x.ip) for x in txns),
    )


def one(rows: Rows, ref: Ref, as_of: datetime) -> dict[str, Values]:
    """:func:`values` of one ref."""
    return {name: got[ref] for name, got in values(rows, [ref], as_of).items()}
