"""The fault scenarios' workload: seeded, fixed-rate changes to one seeded tenant.

Every change commits in Postgres first (Debezium turns it into CDC records); about half
of those that have a domain event also emit one afterwards, as a service would. Users
are drawn with a Zipf skew (rank ``r`` weighs ``1 / r^1.1``), so a few are hot.

The kinds of change: a transaction inserted, its amount updated, deleted, or moved to
another user; a device's risk score changed; a user-device link added or removed; a
geoip range's country edited. And rows at the windows' edges (``txn_edge``): a
transaction created just inside ``txn_90d``'s 90-day or ``geo``'s 30-day window, so it
ages out while the case runs (between :data:`EDGE_AHEAD_S` seconds of its insert),
one created exactly at an edge, and a late one (created up to 80 days ago, inserted
now); its IP is some geoip range's, so leaving the 30-day window changes
``distinct_countries_30d`` too.

What it records, for the oracle:

* ``touched``: every ``(tenant, user)`` whose features a change can alter (for a device
  or a geoip range, every user of it, found in the change's own transaction);
* ``produced``: the (topic, partition, offset) of every domain event it produced;
* ``cdc_expected``: per table, how many CDC records its committed SQL must yield (an
  insert or an update one per row, a delete two: the delete and its tombstone);
* ``history``: with ``watch``, the raw rows of the watched users
  (:func:`tests.faults.reference.load`) as each change leaves them, with the
  wall-clock moments around it: the workload is the only writer of source rows, so
  those rows are the committed state from that change's commit to the next one's
  (:mod:`tests.faults.readers` builds the truth over time from it). The rows of the
  watched users a change touches are read in its own transaction, after its SQL; the
  others' are the previous observation's, and a geoip edit is applied to the previous
  ranges as its UPDATE was (reading them all again, 2,048 rows, would slow the
  workload below its rate). :meth:`Workload.observe` reads everything afresh.

``random.Random(seed)`` draws every choice in order, so a seed replays the same
sequence of changes over the same seeded data. Progress is a count of committed
changes; the scenarios time their faults by it (:meth:`Workload.wait_for`).
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from ipaddress import ip_interface
from typing import NamedTuple

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from fraud.seed import COUNTRIES
from freshline.consumers.kafka import Delivery, Producer
from tests.faults.reference import Range, Rows, load

log = logging.getLogger("freshline.faults.workload")

Ref = tuple[str, str]
"""(tenant, user id) as the keys spell them."""

Events = list[tuple[str, dict[str, object]]]
"""The domain events a change would emit: (topic, body without tenant and time)."""

MIX: tuple[tuple[str, float], ...] = (
    ("txn_insert", 0.30),
    ("txn_amount", 0.20),
    ("txn_delete", 0.08),
    ("txn_move", 0.08),
    ("device_risk", 0.12),
    ("link_add", 0.07),
    ("link_remove", 0.05),
    ("geoip_edit", 0.10),
    ("txn_edge", 0.06),
)
AFFECTS: dict[str, tuple[str, ...]] = {
    "txn_insert": ("txn_90d", "geo"),
    "txn_amount": ("txn_90d",),
    "txn_delete": ("txn_90d", "geo"),
    "txn_move": ("txn_90d", "geo"),
    "device_risk": ("device_risk",),
    "link_add": ("device_risk",),
    "link_remove": ("device_risk",),
    "geoip_edit": ("geo",),
    "txn_edge": ("txn_90d", "geo"),
}
"""The feature sets whose values each kind of change can alter (for diagnosing a mismatch)."""
DOMAIN_SHARE = 0.5
"""Of the changes that have a domain event, the share that emits one."""
DB_RETRY_S = 120.0
"""How long one change keeps retrying while Postgres is away (a restart scenario)."""
EDGE_AHEAD_S = 20.0
"""A row near an edge leaves its window within this long of its insert."""
EDGES: tuple[tuple[str, float], ...] = (
    ("90 days", 0.3),  # leaves txn_90d during the run
    ("30 days", 0.3),  # leaves geo's distinct countries during the run
    ("at 90 days", 0.1),  # exactly at the edge: never inside
    ("at 30 days", 0.1),
    ("late", 0.2),  # created in the past, inside both windows or txn_90d's
)
"""The kinds of edge row, by ``txn_edge``'s ``pick``, with their shares."""


@dataclass(frozen=True, slots=True)
class Observation:
    """The watched users' rows as one change left them, read in its transaction: the
    committed state from some moment in ``[start, end]`` (wall clock, s) on."""

    start: float
    end: float
    rows: Rows


@dataclass(frozen=True, slots=True)
class Produced:
    topic: str
    partition: int
    offset: int


class Draw(NamedTuple):
    kind: str
    user: int
    other: int
    emit: bool
    pick: float
    value: float


@dataclass
class WorkloadReport:
    changes: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    events: int = 0
    db_retries: int = 0


class Workload:
    """``run(total, rate)`` commits ``total`` changes at ``rate`` per second."""

    def __init__(
        self,
        engine: Engine,
        producer: Producer,
        tenant: str,
        seed: int,
        *,
        topic: Callable[[str], str] = lambda t: t,
        watch: int = 0,
    ) -> None:
        self.engine = engine
        self.producer = producer
        self.tenant = tenant
        self.rng = random.Random(f"workload:{seed}")
        self.topic = topic
        self.touched: set[Ref] = set()
        self.last_change: dict[tuple[str, str, str], tuple[int, str, int]] = {}
        """Per (feature set, tenant, entity): the last change that could alter it (index,
        kind, commit time in ms)."""
        self._pending: set[Ref] = set()
        self._range_edit: tuple[str, str, str] | None = None
        """The geoip range the change being attempted edited: (ip_from, country, city)."""
        self._cdc_pending: Counter[str] = Counter()
        """What the change being attempted must yield; counted once it commits, since
        an attempt that Postgres aborts (a restart) yields nothing."""
        self.cdc_expected: Counter[str] = Counter()
        self.report = WorkloadReport()
        self.error: BaseException | None = None
        self._deliveries: list[Delivery] = []
        self._progress = 0
        self._done = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        with engine.connect() as conn:
            users = [
                int(u)
                for (u,) in conn.execute(
                    sa.text("SELECT id FROM users WHERE tenant_id = :t ORDER BY id"), {"t": tenant}
                )
            ]
            self.devices = [
                d
                for (d,) in conn.execute(
                    sa.text("SELECT id FROM devices WHERE tenant_id = :t ORDER BY id"),
                    {"t": tenant},
                )
            ]
        if not users:
            raise ValueError(f"tenant {tenant!r} has no users: seed it first")
        self.users = users
        order = users[:]
        self.rng.shuffle(order)
        self._hot = order
        self._cum = list(itertools.accumulate(1.0 / (r + 1) ** 1.1 for r in range(len(order))))
        self._start_state = self.rng.getstate()
        self._total = 0
        # The hottest users, and a few of the rest (another stream: the changes' draws
        # do not depend on what is watched).
        pick = random.Random(f"watch:{seed}")
        rest = order[watch:]
        self.watched: list[Ref] = (
            [
                (tenant, str(u))
                for u in order[: watch - watch // 4] + pick.sample(rest, min(len(rest), watch // 4))
            ]
            if watch
            else []
        )
        self.history: list[Observation] = []
        self.unsure: list[tuple[float, float]] = []
        """Wall-clock spans of attempts that failed on a connection error: whether their
        COMMIT took effect is unknown (a reply lost to a crash), so a state the
        history never saw may have existed then (:mod:`tests.faults.readers` says so)."""

    # -- progress -----------------------------------------------------------------

    @property
    def progress(self) -> int:
        return self._progress

    def wait_for(self, changes: int, deadline_s: float = 300.0) -> None:
        """Block until ``changes`` changes have committed (or the workload ended)."""
        end = time.monotonic() + deadline_s
        with self._cond:
            while self._progress < changes and not self._done:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"workload at {self._progress} changes, waited for {changes}"
                    )
                self._cond.wait(left)

    def stop(self) -> None:
        self._stop.set()
        self._go.set()

    def hold(self) -> None:
        """Make no change from the next attempt on (one in flight ends first) until
        :meth:`release`: a scenario observes a state nobody else writes, such as the
        one a crash recovered, before a retried change moves it on."""
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    # -- running ------------------------------------------------------------------

    def observe(self) -> None:
        """Add the watched users' rows as they are now to ``history`` (the state before
        the first change, and after the last one, or after a scenario's own writes)."""
        if not self.watched:
            return
        start = time.time()
        with self.engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            rows = load(conn, self.watched)
            conn.rollback()
        self.history.append(Observation(start, time.time(), rows))

    def run(self, total: int, rate: float) -> None:
        """Commit ``total`` changes at ``rate`` per second, then flush the producer."""
        started = time.monotonic()
        try:
            for i in range(total):
                if self._stop.is_set():
                    break
                self._one(i)
                with self._cond:
                    self._progress = i + 1
                    self._cond.notify_all()
                ahead = started + (i + 1) / rate - time.monotonic()
                if ahead > 0:
                    self._stop.wait(ahead)  # pacing the offered rate
            self.producer.flush(timeout=120)
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def start(self, total: int, rate: float) -> threading.Thread:
        self._total = total
        thread = threading.Thread(
            target=self._run_quietly, args=(total, rate), name="workload", daemon=True
        )
        thread.start()
        return thread

    def _run_quietly(self, total: int, rate: float) -> None:
        try:
            self.run(total, rate)
        except BaseException:
            log.exception("workload failed")

    @property
    def produced(self) -> list[Produced]:
        """Every domain event the broker acknowledged, where it landed."""
        return [
            Produced(d.topic, d.partition, d.offset)
            for d in self._deliveries
            if d.done and d.error is None and d.partition is not None and d.offset is not None
        ]

    def adopt(self, delivery: Delivery) -> None:
        """Count a record a scenario produced on a domain topic as produced (the oracle
        then expects it there, and accounts for it)."""
        self._deliveries.append(delivery)

    def users_drawn(self, start: int, kinds: tuple[str, ...] = tuple(AFFECTS)) -> set[int]:
        """The users that changes ``start`` onwards (of ``kinds``) draw, as user or other.

        The draws depend on nothing but the seed, so they are replayed from the seed's
        random stream without the database.
        """
        rng = random.Random()
        rng.setstate(self._start_state)
        drawn: set[int] = set()
        for index in range(self._total):
            draw = self._draw(rng)
            if index >= start and draw.kind in kinds:
                drawn |= {draw.user, draw.other}
        return drawn

    def spared_transactions(self, start: int) -> list[tuple[int, int]]:
        """Transactions (id, user) inside the feature windows of the users that no change
        from ``start`` on draws: no later event of the workload recomputes their txn_90d."""
        spared = sorted(set(self.users) - self.users_drawn(start))
        with self.engine.connect() as conn:
            return [
                (int(t), int(u))
                for t, u in conn.execute(
                    sa.text(
                        "SELECT id, user_id FROM transactions WHERE tenant_id = :t "
                        "AND user_id = ANY(:users) AND created_at > now() - interval '80 days' "
                        "ORDER BY id"
                    ),
                    {"t": self.tenant, "users": spared},
                )
            ]

    @property
    def unacknowledged(self) -> int:
        return sum(1 for d in self._deliveries if not d.done or d.error is not None)

    # -- one change ---------------------------------------------------------------

    def _draw(self, rng: random.Random) -> Draw:
        """Every random choice of one change, in order."""
        kind = rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX])[0]
        user = rng.choices(self._hot, cum_weights=self._cum)[0]
        other = rng.choices(self._hot, cum_weights=self._cum)[0]
        return Draw(kind, user, other, rng.random() < DOMAIN_SHARE, rng.random(), rng.random())

    def _one(self, index: int) -> None:
        kind, user, other, emit, pick, value = self._draw(self.rng)
        # Every draw is made before the database is asked, so a retried change (after
        # a Postgres outage) makes the same draws, and the stream of draws never
        # depends on what the database answered.
        deadline = time.monotonic() + DB_RETRY_S
        while True:
            self._go.wait()
            self._pending = set()
            self._cdc_pending = Counter()
            rows: Rows | None = None
            self._range_edit = None
            try:
                start = time.time()
                with self.engine.begin() as conn:
                    events = getattr(self, f"_{kind}")(conn, user, other, pick, value)
                    rows = self._observed(conn)
                if rows is not None:
                    self.history.append(Observation(start, time.time(), rows))
                break
            except (sa.exc.OperationalError, sa.exc.InterfaceError):
                self.unsure.append((start, time.time()))
                self.report.db_retries += 1
                if time.monotonic() > deadline:
                    raise
                self._stop.wait(0.2)  # polling Postgres while it restarts
        self.cdc_expected.update(self._cdc_pending)
        committed_ms = time.time_ns() // 1_000_000
        for tenant, entity in self._pending:
            for fs in AFFECTS[kind]:
                self.last_change[(fs, tenant, entity)] = (index, kind, committed_ms)
        self.report.changes += 1
        self.report.by_kind[kind] += 1
        if emit:
            now = datetime.now(UTC).isoformat()
            for topic, body in events:
                event = {"tenant": self.tenant, **body, "occurred_at": now}
                entity = body.get("user_id", body.get("device_id"))
                self._deliveries.append(
                    self.producer.produce(
                        self.topic(topic), orjson.dumps(event), f"{self.tenant}:{entity}".encode()
                    )
                )
                self.report.events += 1

    def _observed(self, conn: Connection) -> Rows | None:
        """The watched users' rows as this change leaves them (see ``history``)."""
        if not self.watched:
            return None
        if not self.history:
            return load(conn, self.watched)
        previous = self.history[-1].rows
        ranges = previous.ranges
        if self._range_edit is not None:
            start, country, city = self._range_edit
            edited = ip_interface(start).ip  # inet's text has its netmask: 11.0.0.0/32
            ranges = [
                Range(r.start, r.end, country, city) if r.start == edited else r for r in ranges
            ]
        mine = [r for r in self.watched if r in self._pending]
        if not mine and ranges is previous.ranges:
            return previous
        fresh = load(conn, mine, ranges)
        return Rows(
            {**{r: v for r, v in previous.txns.items() if r not in mine}, **fresh.txns},
            {**{r: v for r, v in previous.links.items() if r not in mine}, **fresh.links},
            {**previous.linked, **fresh.linked},
            {**previous.devices, **fresh.devices},
            ranges,
        )

    def _touch(self, *users: int) -> None:
        refs = {(self.tenant, str(u)) for u in users}
        self.touched |= refs
        self._pending |= refs

    def _device_users(self, conn: Connection, device: str) -> list[int]:
        return [
            int(u)
            for (u,) in conn.execute(
                sa.text("SELECT user_id FROM user_devices WHERE tenant_id = :t AND device_id = :d"),
                {"t": self.tenant, "d": device},
            )
        ]

    def _some_txn(self, conn: Connection, user: int, pick: float) -> int | None:
        rows = conn.execute(
            sa.text(
                "SELECT id FROM transactions WHERE tenant_id = :t AND user_id = :u "
                "ORDER BY created_at DESC, id DESC LIMIT 8"
            ),
            {"t": self.tenant, "u": user},
        ).all()
        return int(rows[int(pick * len(rows))][0]) if rows else None

    def _some_device(self, conn: Connection, user: int, pick: float) -> str | None:
        devices = [
            d
            for (d,) in conn.execute(
                sa.text(
                    "SELECT device_id FROM user_devices WHERE tenant_id = :t AND user_id = :u "
                    "ORDER BY device_id"
                ),
                {"t": self.tenant, "u": user},
            )
        ]
        return devices[int(pick * len(devices))] if devices else None

    def _txn_insert(
        self, conn: Connection, user: int, _other: int, pick: float, value: float
    ) -> Events:
        txn = conn.execute(
            sa.text(
                """INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, device_id,
                   ip, created_at, updated_at)
               SELECT :t, :u, :amount, :m,
                      (SELECT device_id FROM user_devices
                       WHERE tenant_id = :t AND user_id = :u ORDER BY device_id LIMIT 1),
                      (SELECT ip FROM transactions WHERE tenant_id = :t AND user_id = :u
                       ORDER BY created_at DESC, id DESC LIMIT 1),
                      now(), now()
               RETURNING id"""
            ),
            {
                "t": self.tenant,
                "u": user,
                "amount": round(10 + value * 490, 2),
                "m": f"m{int(pick * 20000)}",
            },
        ).scalar_one()
        self._cdc_pending["transactions"] += 1
        self._touch(user)
        return [("transaction.created", {"user_id": user, "transaction_id": int(txn)})]

    def _txn_edge(
        self, conn: Connection, user: int, _other: int, pick: float, value: float
    ) -> Events:
        """A transaction at a window's edge (:data:`EDGES`), with some range's IP."""
        edge = EDGES[-1][0]
        share = pick
        for name, weight in EDGES:
            if share < weight:
                edge = name
                break
            share -= weight
        created = {
            "90 days": "now() - interval '90 days' + make_interval(secs => :ahead)",
            "30 days": "now() - interval '30 days' + make_interval(secs => :ahead)",
            "at 90 days": "now() - interval '90 days'",
            "at 30 days": "now() - interval '30 days'",
            "late": "now() - make_interval(secs => :late)",
        }[edge]
        txn = conn.execute(
            sa.text(
                f"""INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, device_id,
                   ip, created_at, updated_at)
               SELECT :t, :u, :amount, :m,
                      (SELECT device_id FROM user_devices
                       WHERE tenant_id = :t AND user_id = :u ORDER BY device_id LIMIT 1),
                      (SELECT ip_from FROM geoip ORDER BY ip_from
                       OFFSET floor(:value * (SELECT count(*) FROM geoip)) LIMIT 1),
                      {created}, now()
               RETURNING id"""
            ),
            {
                "t": self.tenant,
                "u": user,
                "amount": round(5 + value * 95, 2),
                "m": f"edge{int(value * 50)}",
                "value": value,
                "ahead": 0.5 + value * (EDGE_AHEAD_S - 0.5),
                "late": 60 + value * 80 * 86_400,
            },
        ).scalar_one()
        self._cdc_pending["transactions"] += 1
        self._touch(user)
        return [("transaction.created", {"user_id": user, "transaction_id": int(txn)})]

    def _txn_amount(
        self, conn: Connection, user: int, _other: int, pick: float, value: float
    ) -> Events:
        txn = self._some_txn(conn, user, pick)
        if txn is None:
            return []
        conn.execute(
            sa.text(
                "UPDATE transactions SET amount = :a, updated_at = now() "
                "WHERE tenant_id = :t AND id = :id"
            ),
            {"a": round(1 + value * 999, 2), "t": self.tenant, "id": txn},
        )
        self._cdc_pending["transactions"] += 1
        self._touch(user)
        return [("transaction.updated", {"user_id": user, "transaction_id": txn})]

    def _txn_delete(
        self, conn: Connection, user: int, _other: int, pick: float, _value: float
    ) -> Events:
        txn = self._some_txn(conn, user, pick)
        if txn is None:
            return []
        conn.execute(
            sa.text("DELETE FROM transactions WHERE tenant_id = :t AND id = :id"),
            {"t": self.tenant, "id": txn},
        )
        self._cdc_pending["transactions"] += 2  # the delete and its tombstone
        self._touch(user)
        return [("transaction.updated", {"user_id": user, "transaction_id": txn})]

    def _txn_move(
        self, conn: Connection, user: int, other: int, pick: float, _value: float
    ) -> Events:
        txn = self._some_txn(conn, user, pick)
        if txn is None or other == user:
            return []
        conn.execute(
            sa.text(
                "UPDATE transactions SET user_id = :o, updated_at = now() "
                "WHERE tenant_id = :t AND id = :id"
            ),
            {"o": other, "t": self.tenant, "id": txn},
        )
        self._cdc_pending["transactions"] += 1
        self._touch(user, other)
        # As the README asks: once with the old user, once with the new.
        return [
            ("transaction.updated", {"user_id": user, "transaction_id": txn}),
            ("transaction.updated", {"user_id": other, "transaction_id": txn}),
        ]

    def _device_risk(
        self, conn: Connection, user: int, _other: int, pick: float, value: float
    ) -> Events:
        device = self._some_device(conn, user, pick)
        if device is None:
            return []
        conn.execute(
            sa.text("UPDATE devices SET risk_score = :r WHERE tenant_id = :t AND id = :d"),
            {"r": round(value, 4), "t": self.tenant, "d": device},
        )
        self._cdc_pending["devices"] += 1
        self._touch(*self._device_users(conn, device))
        return [("device.updated", {"device_id": device})]

    def _link_add(
        self, conn: Connection, user: int, _other: int, pick: float, _value: float
    ) -> Events:
        device = self.devices[int(pick * len(self.devices))]
        added = conn.execute(
            sa.text(
                "INSERT INTO user_devices (tenant_id, user_id, device_id) VALUES (:t, :u, :d) "
                "ON CONFLICT DO NOTHING"
            ),
            {"t": self.tenant, "u": user, "d": device},
        ).rowcount
        if added:
            self._cdc_pending["user_devices"] += added
            self._touch(user, *self._device_users(conn, device))
        return []

    def _link_remove(
        self, conn: Connection, user: int, _other: int, pick: float, _value: float
    ) -> Events:
        device = self._some_device(conn, user, pick)
        if device is None:
            return []
        sharing = self._device_users(conn, device)
        conn.execute(
            sa.text(
                "DELETE FROM user_devices WHERE tenant_id = :t AND user_id = :u AND device_id = :d"
            ),
            {"t": self.tenant, "u": user, "d": device},
        )
        self._cdc_pending["user_devices"] += 2
        self._touch(*sharing)
        return []

    def _geoip_edit(
        self, conn: Connection, user: int, _other: int, pick: float, value: float
    ) -> Events:
        row = conn.execute(
            sa.text(
                """SELECT g.ip_from::text, g.ip_to::text FROM geoip g
               WHERE g.ip_from <= (SELECT ip FROM transactions
                                   WHERE tenant_id = :t AND user_id = :u AND ip IS NOT NULL
                                   ORDER BY created_at DESC, id DESC LIMIT 1)
               ORDER BY g.ip_from DESC LIMIT 1"""
            ),
            {"t": self.tenant, "u": user},
        ).first()
        if row is None:
            return []
        country, cities = COUNTRIES[int(pick * len(COUNTRIES))]
        conn.execute(
            sa.text("UPDATE geoip SET country = :c, city = :city WHERE ip_from = CAST(:f AS inet)"),
            {"c": country, "city": cities[int(value * len(cities))], "f": row[0]},
        )
        self._cdc_pending["geoip"] += 1
        self._range_edit = (row[0], country, cities[int(value * len(cities))])
        self._touch(
            *(
                int(u)
                for (u,) in conn.execute(
                    sa.text(
                        "SELECT DISTINCT user_id FROM transactions WHERE tenant_id = :t "
                        "AND ip BETWEEN CAST(:f AS inet) AND CAST(:to AS inet)"
                    ),
                    {"t": self.tenant, "f": row[0], "to": row[1]},
                )
            )
        )
        return []
