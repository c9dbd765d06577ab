"""A user table of every type the recorder converts, its history, and a writer that
makes real transactions on it and hands back the Debezium envelopes they would stream
(JSON without schemas, as the connector is configured): the recorder's unit tier runs
on real Postgres transactions and ids without Kafka; ``test_end_to_end`` uses the real
connector. The evaluator's tests (issue 52) get the fraud tables captured, the API
role's engine, a tenant of their own and a moment in the past."""

from __future__ import annotations

import base64
import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.core.db import make_owner_engine
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.history.backfill import S0, backfill
from freshline.pipeline.history.recorder import UNAVAILABLE, Change, Recorder, parse
from freshline.pipeline.history.tables import EPOCH, Layout, create, layout, qualified
from tests.helpers import role_engine
from tests.pipeline.history import recording

COLUMNS = (
    "id bigint PRIMARY KEY, note text, at_ts timestamp, at_ms timestamp(3), "
    "at_tz timestamptz, day date, blob bytea, amount numeric(12, 2), span interval, "
    "big text"
)
KEEP = object()
"""A value left out of an update's image as Postgres leaves out an unchanged TOASTed one."""


def image(row: dict[str, Any]) -> dict[str, Any]:
    """A row as Debezium's JSON converter sends it (schemas off, the connector's
    ``decimal.handling.mode=string``, ``time.precision.mode=adaptive_time_microseconds``)."""

    def us(moment: dt.datetime) -> int:
        return (moment.replace(tzinfo=dt.UTC) - EPOCH) // dt.timedelta(microseconds=1)

    out: dict[str, Any] = dict(row)
    if row.get("at_ts") is not None:
        out["at_ts"] = us(row["at_ts"])
    if row.get("at_ms") is not None:
        out["at_ms"] = us(row["at_ms"]) // 1000
    if row.get("at_tz") is not None:
        out["at_tz"] = row["at_tz"].astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if row.get("day") is not None:
        out["day"] = (row["day"] - dt.date(1970, 1, 1)).days
    if row.get("blob") is not None:
        out["blob"] = base64.b64encode(row["blob"]).decode()
    if row.get("amount") is not None:
        out["amount"] = str(row["amount"])
    if row.get("span") is not None:
        out["span"] = row["span"] // dt.timedelta(microseconds=1)
    if row.get("big") is KEEP:
        out["big"] = UNAVAILABLE
    return out


def sample(i: int, **changes: Any) -> dict[str, Any]:
    """Row ``i`` with a value in every column."""
    row: dict[str, Any] = {
        "id": i,
        "note": f"note {i}",
        "at_ts": dt.datetime(2026, 11, 30, 12, 0, 0, 123456) + dt.timedelta(hours=i),
        "at_ms": dt.datetime(2026, 11, 30, 12, 0, 0, 123000),
        "at_tz": dt.datetime(2026, 11, 30, 12, 0, 0, 654321, tzinfo=dt.UTC),
        "day": dt.date(2026, 2, 28) + dt.timedelta(days=i),
        "blob": bytes([0, 255, i % 256, 10]),
        "amount": Decimal("1234.50") + i,
        "span": dt.timedelta(days=1, seconds=3, microseconds=7),
        "big": "x" * 5000 + str(i),
    }
    row.update(changes)
    return row


@dataclass
class Txn:
    """One transaction's statements, run by :meth:`Writer.commit`."""

    statements: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = field(
        default_factory=list
    )

    def insert(self, row: dict[str, Any]) -> Txn:
        return self._add("c", row, None)

    def update(self, row: dict[str, Any]) -> Txn:
        return self._add("u", row, None)

    def delete(self, key: int) -> Txn:
        return self._add("d", None, {"id": key})

    def truncate(self) -> Txn:
        return self._add("t", None, None)

    def _add(self, op: str, after: dict[str, Any] | None, before: dict[str, Any] | None) -> Txn:
        self.statements.append((op, after or {}, before))
        return self


@dataclass
class Writer:
    owner: Engine
    table: str

    def commit(self, txn: Txn) -> list[dict[str, Any]]:
        """Run ``txn`` as one transaction; the envelopes Debezium would stream for it."""
        records: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None, int]] = []
        with self.owner.begin() as conn:
            txid = int(conn.execute(sa.text("SELECT pg_current_xact_id()::text")).scalar_one())
            for op, after, before in txn.statements:
                self._run(conn, op, after, before)
                lsn = int(
                    conn.execute(
                        sa.text("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
                    ).scalar_one()
                )
                records.append((op, after, before, lsn))
            commit = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
        commit_us = (commit - EPOCH) // dt.timedelta(microseconds=1)
        return [
            {
                "before": before,
                "after": image(after) if op in ("c", "u") and after else None,
                "source": {
                    "schema": "public",
                    "table": self.table,
                    "txId": txid % (1 << 32),
                    "lsn": lsn,
                    "ts_ms": commit_us // 1000,
                    "ts_us": commit_us,
                },
                "op": op,
            }
            for op, after, before, lsn in records
        ]

    def _run(
        self,
        conn: Connection,
        op: str,
        after: dict[str, Any],
        before: dict[str, Any] | None,
    ) -> None:
        if op == "c":
            names = ", ".join(after)
            values = ", ".join(f":{n}" for n in after)
            conn.execute(sa.text(f"INSERT INTO {self.table} ({names}) VALUES ({values})"), after)
        elif op == "u":
            sets = ", ".join(f"{n} = :{n}" for n in after if n != "id" and after[n] is not KEEP)
            params = {n: v for n, v in after.items() if v is not KEEP}
            conn.execute(sa.text(f"UPDATE {self.table} SET {sets} WHERE id = :id"), params)
        elif op == "d":
            assert before is not None
            conn.execute(sa.text(f"DELETE FROM {self.table} WHERE id = :id"), before)
        else:
            conn.execute(sa.text(f"TRUNCATE {self.table}"))


@dataclass
class History:
    """A user table with history on: its writer, its recorder (the consumer role)."""

    table: str
    owner: Engine
    consumer: Engine
    writer: Writer
    recorder: Recorder
    found: Layout | None = None
    s0: S0 | None = None

    def enable(self) -> S0:
        with self.owner.begin() as conn:
            self.found = layout(conn, "public", self.table)
            create(conn, self.found, None)
        self.s0 = backfill(self.owner, [self.found])
        return self.s0

    def record(self, envelopes: list[dict[str, Any]]) -> None:
        changes = [parse(e) for e in envelopes]
        self.recorder.record(c for c in changes if c is not None)

    def versions(self, key: int | None = None, *, empty: bool = False) -> list[dict[str, Any]]:
        """The versions (of row ``key``) in order; ``empty``: also those no snapshot sees
        (a row born and gone in one transaction, the record of a delete)."""
        assert self.found is not None
        where = "WHERE true" if empty else "WHERE _fl_to IS DISTINCT FROM _fl_from"
        if key is not None:
            where += f" AND id = {int(key)}"
        with self.owner.connect() as conn:
            rows = conn.execute(
                sa.text(
                    f"SELECT id, note, _fl_xmin::text AS xmin, _fl_xmax::text AS xmax, "
                    f"_fl_from, _fl_to FROM {qualified(self.found.history)} {where} "
                    "ORDER BY id, _fl_change"
                )
            ).mappings()
            return [dict(r) for r in rows]


@pytest.fixture
def history_factory(settings: Settings) -> Iterator[Callable[[], History]]:
    owner = make_owner_engine(settings)
    consumer = role_engine(settings, "FRESHLINE_STACK_POSTGRES_CONSUMER_URL")
    made: list[History] = []

    def make() -> History:
        table = f"hist_{uuid.uuid4().hex[:10]}"
        with owner.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {table} ({COLUMNS})"))
            conn.execute(sa.text(f"ALTER TABLE {table} ALTER COLUMN big SET STORAGE EXTERNAL"))
            conn.execute(sa.text(f"CREATE INDEX ON {table} (day, note)"))
        made.append(History(table, owner, consumer, Writer(owner, table), Recorder(consumer)))
        return made[-1]

    yield make
    with owner.begin() as conn:
        for h in made:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {h.table}"))
            if h.found is not None:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {qualified(h.found.history)}"))
            conn.execute(
                sa.text("DELETE FROM freshline.history_tables WHERE source_table = :t"),
                {"t": h.table},
            )
    owner.dispose()
    consumer.dispose()


FRAUD_TABLES = ("transactions", "users", "user_devices", "devices", "geoip")
HOUR = dt.timedelta(hours=1)


@pytest.fixture(scope="module")
def captured(engine: Engine) -> Iterator[None]:
    with engine.begin() as conn:
        for table in FRAUD_TABLES:
            recording.capture(conn, table)
    yield
    with engine.begin() as conn:
        for table in FRAUD_TABLES:
            recording.uncapture(conn, table)


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[Engine]:
    eng = role_engine(settings, "FRESHLINE_STACK_POSTGRES_API_URL")
    yield eng
    eng.dispose()


@pytest.fixture
def tenant() -> str:
    return f"h{uuid.uuid4().hex[:10]}"


@pytest.fixture
def t() -> dt.datetime:
    """The moment asked about: two hours ago, to the microsecond."""
    return (dt.datetime.now(dt.UTC) - 2 * HOUR).replace(microsecond=123456)


__all__ = ["KEEP", "Change", "History", "Txn", "sample"]
