# The demo's harness, not code a user's repository needs (it may use freshline's internals).
"""A source of realistic change: writes to Postgres and emits the matching domain events.

``freshline fraud simulate --rate R`` drives it, so the demo (and the benchmarks) can
show features changing. Each change commits first, then its event is produced with
``occurred_at`` set to the commit time, keyed ``<tenant>:<user_id>`` (or
``<tenant>:<device_id>``) as the README asks producers to key.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fraud.seed import GEO_BASE, GEO_RANGE_SIZE, GEO_RANGES
from freshline import FreshlineError
from freshline.consumers.kafka import Producer


@dataclass(slots=True)
class SimTotals:
    created: int = 0
    updated: int = 0
    devices: int = 0


class Simulator:
    """Commits one change at a time and emits its event (topics via ``topic``)."""

    def __init__(
        self,
        engine: Engine,
        producer: Producer,
        *,
        topic: Callable[[str], str] = lambda t: t,
        seed: int = 7,
        tenants: list[str] | None = None,
    ) -> None:
        self.engine = engine
        self.producer = producer
        self.topic = topic
        self.rng = random.Random(seed)
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT tenant_id, max(id) FROM users GROUP BY tenant_id")
            ).all()
        self.users = {t: int(n) for t, n in rows if tenants is None or t in tenants}
        if not self.users:
            raise FreshlineError("no users to change: seed first (freshline fraud seed)")
        self.totals = SimTotals()

    def _user(self) -> tuple[str, int]:
        tenant = self.rng.choice(sorted(self.users))
        # Skewed: a tenth of the users get most of the changes.
        top = max(1, self.users[tenant] // 10)
        hot = self.rng.random() < 0.7
        return tenant, self.rng.randint(1, top if hot else self.users[tenant])

    def step(self) -> None:
        """One change: a new transaction (60%), an update of one (30%), a device (10%)."""
        draw = self.rng.random()
        tenant, user = self._user()
        now = datetime.now(UTC)
        with self.engine.begin() as conn:
            if draw < 0.6:
                ip = GEO_BASE + self.rng.randrange(GEO_RANGES) * GEO_RANGE_SIZE + 7
                txn = conn.execute(
                    sa.text(
                        """INSERT INTO transactions (tenant_id, user_id, amount, merchant_id,
                           device_id, ip, created_at, updated_at)
                       SELECT :t, :u, :amount, :m,
                              (SELECT device_id FROM user_devices
                               WHERE tenant_id = :t AND user_id = :u LIMIT 1),
                              CAST(:ip AS inet), :now, :now
                       RETURNING id"""
                    ),
                    {
                        "t": tenant,
                        "u": user,
                        "amount": round(self.rng.lognormvariate(3.6, 1.1), 2),
                        "m": f"m{self.rng.randrange(20000)}",
                        "ip": _ip(ip),
                        "now": now,
                    },
                ).scalar_one()
                topic, body = "transaction.created", {"user_id": user, "transaction_id": txn}
                self.totals.created += 1
            elif draw < 0.9:
                found = conn.execute(
                    sa.text(
                        """UPDATE transactions SET status = 'reversed', amount = amount * 1.5,
                              updated_at = :now
                       WHERE (tenant_id, id) = (SELECT tenant_id, id FROM transactions
                              WHERE tenant_id = :t AND user_id = :u
                              ORDER BY created_at DESC LIMIT 1)
                       RETURNING id"""
                    ),
                    {"t": tenant, "u": user, "now": now},
                ).first()
                if found is None:
                    return
                topic, body = "transaction.updated", {"user_id": user, "transaction_id": found[0]}
                self.totals.updated += 1
            else:
                device = conn.execute(
                    sa.text(
                        """UPDATE devices SET risk_score = :r
                       WHERE (tenant_id, id) = (SELECT tenant_id, device_id FROM user_devices
                              WHERE tenant_id = :t AND user_id = :u LIMIT 1)
                       RETURNING id"""
                    ),
                    {"t": tenant, "u": user, "r": round(self.rng.random(), 4)},
                ).first()
                if device is None:
                    return
                topic, body = "device.updated", {"device_id": device[0]}
                self.totals.devices += 1
        event = {"tenant": tenant, **body, "occurred_at": now.isoformat()}
        key = f"{tenant}:{body.get('user_id', body.get('device_id'))}".encode()
        self.producer.produce(self.topic(topic), orjson.dumps(event), key)

    def run(
        self,
        rate: float,
        *,
        count: int | None = None,
        duration: float | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> SimTotals:
        """Emit ``rate`` changes per second until ``count`` or ``duration`` is reached."""
        started = time.monotonic()
        done = 0
        while not should_stop():
            if count is not None and done >= count:
                break
            if duration is not None and time.monotonic() - started >= duration:
                break
            self.step()
            done += 1
            ahead = started + done / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)  # pacing the offered rate
        self.producer.flush()
        return self.totals


def _ip(value: int) -> str:
    return ".".join(str((value >> s) & 0xFF) for s in (24, 16, 8, 0))
