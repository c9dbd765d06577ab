"""The recorder: every change record of a captured table, as versions of its rows.

It reads Debezium's envelopes as they come (JSON without schemas), so each value's type
comes from the catalog: the history table has the user table's columns and types, and
:func:`typed` turns what the connector sends into that type (``timestamp`` and
``date`` arrive as integers, ``bytea`` as base64, ``interval`` as µs, ``numeric`` as
text under ``decimal.handling.mode=string``). A column Postgres did not send because
its TOASTed value did not change arrives as ``__debezium_unavailable_value`` and keeps
the previous version's value.

A record is one change of transaction ``T`` at LSN ``L``; applying it
(:meth:`Recorder.record`) is idempotent and order-free per row, so a redelivered,
duplicated or reordered record never makes a second version or a gap (the rules, and
why they hold: docs/training.md, "How a record becomes a version").

Changes whose transaction the backfill's snapshot S0 sees are skipped
(:mod:`freshline.pipeline.history.backfill`). A record whose columns are not the history
table's (DDL the recorder cannot follow) marks the table's history broken from its
commit, loudly (``freshline.history_tables.broken_from``; plan, audit and the logs say
so); its matching columns are still recorded.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.core.db import SCHEMA
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.history.tables import (
    EPOCH,
    Column,
    Registered,
    from_epoch_us,
    history_table_name,
    qualified,
    quote,
    registered,
)

logger = logging.getLogger("freshline.history")

UNAVAILABLE = "__debezium_unavailable_value"
"""Debezium's placeholder for an unchanged TOASTed value Postgres did not send."""
UNAVAILABLE_B64 = base64.b64encode(UNAVAILABLE.encode()).decode()
"""The same placeholder in a ``bytea`` column (base64 of its bytes)."""
HistoryOp = Literal["c", "u", "d", "r", "t"]
_OPS = frozenset({"c", "u", "d", "r", "t"})
_WIDE = 1 << 32


class MalformedChange(FreshlineError):
    """A record the recorder cannot read as a change; it is skipped with this reason."""


class HistoryBehind(FreshlineError):
    """A change has columns its history table lacks: ``ALTER TABLE ... ADD COLUMN`` on
    the user's table that ``freshline apply`` has not followed yet. Transient: the
    recorder waits (its offsets stay) until apply adds them, with the default the
    earlier versions then hold."""

    def __init__(self, table: str, columns: Sequence[str]) -> None:
        self.table = table
        self.columns = tuple(columns)
        super().__init__(
            f"{table} has new column(s) {', '.join(columns)} that its history lacks: "
            "run freshline apply (history waits for it)"
        )


class NotBackfilled(FreshlineError):
    """A registered table whose backfill has not run yet: its changes cannot be placed
    before S0 exists. Transient: ``freshline apply`` runs the backfill."""


@dataclass(frozen=True, slots=True)
class Change:
    """One Debezium change record, as the recorder reads it."""

    schema: str
    table: str
    op: HistoryOp
    txid: int
    lsn: int
    commit_us: int
    before: Mapping[str, Any] | None = None
    after: Mapping[str, Any] | None = None


def parse(value: bytes | Mapping[str, Any] | None) -> Change | None:
    """A Debezium envelope (bare or in the JSON converter's schema wrapper) as a
    :class:`Change`; ``None`` for a tombstone. Raises :class:`MalformedChange`."""
    if value is None:
        return None
    try:
        obj = orjson.loads(value) if isinstance(value, bytes | bytearray) else value
    except orjson.JSONDecodeError as exc:
        raise MalformedChange(f"not JSON: {exc}") from exc
    if not isinstance(obj, Mapping):
        raise MalformedChange("not a JSON object")
    if "op" not in obj and "payload" in obj:
        obj = obj["payload"]
        if obj is None:
            return None
    if not isinstance(obj, Mapping):
        raise MalformedChange("'payload' is not a JSON object")
    op, source = obj.get("op"), obj.get("source")
    if op not in _OPS or not isinstance(source, Mapping):
        raise MalformedChange(f"no op or source (op {op!r})")
    txid, lsn = source.get("txId"), source.get("lsn")
    commit_us = source.get("ts_us")
    if commit_us is None and isinstance(source.get("ts_ms"), int):
        commit_us = source["ts_ms"] * 1000  # a connector before ts_us: ms only
    for name, got in (("txId", txid), ("lsn", lsn), ("ts_us", commit_us)):
        if isinstance(got, bool) or not isinstance(got, int) or got < 0:
            raise MalformedChange(f"source.{name} is {got!r}, not a non-negative integer")
    schema, table = source.get("schema"), source.get("table")
    if not isinstance(schema, str) or not isinstance(table, str):
        raise MalformedChange("source names no schema and table")
    before, after = obj.get("before"), obj.get("after")
    if (op == "d" and not isinstance(before, Mapping)) or (
        op in ("c", "u", "r") and not isinstance(after, Mapping)
    ):
        raise MalformedChange(f"op {op!r} without its row image")
    return Change(schema, table, op, txid, lsn, commit_us, before, after)  # type: ignore[arg-type]


def widen(txid: int, xmax: int) -> int:
    """A 32-bit transaction id as the ``xid8`` with those low bits that lies in
    ``[xmax - 3 * 2**30, xmax + 2**30)`` (as ``_SNAPSHOT_SELECT`` does): ``xmax`` is a
    snapshot's, taken after the transaction committed."""
    if txid >= _WIDE:
        return txid
    return xmax - 3 * (1 << 30) + ((txid - xmax + 3 * (1 << 30)) & (_WIDE - 1))


def typed(value: Any, column: Column) -> Any:
    """A value as the connector sends it, as ``column``'s type (module docstring)."""
    if value is None:
        return None
    kind = column.typname
    if kind == "timestamp" and isinstance(value, int):
        precision = column.typmod if column.typmod >= 0 else 6
        unit = dt.timedelta(milliseconds=1) if precision <= 3 else dt.timedelta(microseconds=1)
        return (EPOCH + value * unit).replace(tzinfo=None)
    if kind == "timestamptz" and isinstance(value, str):
        try:  # as a moment, so a key compares equal to one read back from Postgres
            return dt.datetime.fromisoformat(value)
        except ValueError:
            return value  # infinity and the like: Postgres reads the text
    if kind == "date" and isinstance(value, int):
        return (EPOCH + dt.timedelta(days=value)).date()
    if kind == "time" and isinstance(value, int):
        return (dt.datetime.min + dt.timedelta(microseconds=value)).time()
    if kind == "interval" and isinstance(value, int):
        return dt.timedelta(microseconds=value)
    if kind == "bytea" and isinstance(value, str):
        return base64.b64decode(value)
    if kind == "numeric" and isinstance(value, str | int | float):
        return Decimal(str(value))
    if isinstance(value, dict) or (isinstance(value, list) and kind in ("json", "jsonb")):
        return orjson.dumps(value).decode()
    return value


def _unavailable(value: Any, column: Column) -> bool:
    placeholder = UNAVAILABLE_B64 if column.typname == "bytea" else UNAVAILABLE
    return isinstance(value, str) and value == placeholder


@dataclass(frozen=True, slots=True)
class Target:
    """A registered table as the recorder writes it: its history table's user columns
    (name and type, from the catalog) and the columns naming a row."""

    registered: Registered
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Each column's default, as a value: what a change made before the column was
    added holds (as Postgres gave the rows then)."""

    @property
    def table(self) -> str:
        return qualified(self.registered.history)


@dataclass
class Outcome:
    """What one :meth:`Recorder.record` call did."""

    versions: int = 0
    """Versions created or changed."""
    duplicates: int = 0
    skipped_s0: int = 0
    """Changes the backfill's snapshot already held."""
    unregistered: int = 0
    broken: list[str] = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)
    """Per table (``schema.table``): versions, duplicates, skipped as S0's."""

    def count(self, table: str, kind: int) -> None:
        self.tables.setdefault(table, [0, 0, 0])[kind] += 1


_HISTORY_COLUMNS = sa.text(
    "SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typname, a.atttypmod "
    "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
    "WHERE a.attrelid = to_regclass(:rel) AND a.attnum > 0 AND NOT a.attisdropped "
    "AND a.attname NOT LIKE '\\_fl\\_%' ORDER BY a.attnum"
)
# The key: the columns of the unique (key, _fl_xmin) index tables.history_ddl makes.
_HISTORY_KEY = sa.text(
    "SELECT a.attname FROM pg_index i "
    "JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) ON true "
    "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
    "WHERE i.indrelid = to_regclass(:rel) AND i.indisunique AND a.attname <> '_fl_xmin' "
    "ORDER BY i.indexrelid, k.n"
)
_HISTORY_DEFAULTS = sa.text(
    "SELECT a.attname, pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d "
    "JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum "
    "WHERE d.adrelid = to_regclass(:rel)"
)
_USER_COLUMNS = sa.text(
    "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:rel) "
    "AND attnum > 0 AND NOT attisdropped"
)
_XMAX = sa.text("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
_SEEN_BY_S0 = sa.text(
    "SELECT t FROM unnest(CAST(:txids AS bigint[])) AS t "
    "WHERE pg_visible_in_snapshot(CAST(CAST(t AS text) AS xid8), CAST(:s0 AS pg_snapshot))"
)


def _lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


class Recorder:
    """Writes change records into the history tables, one transaction per batch.

    Run it as the consumer role (``GRANT`` by ``freshline apply``); its caller commits
    the batch's Kafka offsets only after :meth:`record` returns.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._targets: dict[tuple[str, str], Target | None] = {}

    def refresh(self) -> None:
        """Forget what the registry and catalog said (a table registered since)."""
        self._targets.clear()

    def _target(self, conn: Connection, schema: str, table: str) -> Target | None:
        key = (schema, table)
        if key not in self._targets:
            found = registered(conn).get(key)
            if found is None:
                self._targets[key] = None
            else:
                rel = qualified(history_table_name(schema, table))
                columns = tuple(
                    Column(n, k, t, int(m))
                    for n, k, t, m in conn.execute(_HISTORY_COLUMNS, {"rel": rel})
                )
                names = list(dict.fromkeys(conn.execute(_HISTORY_KEY, {"rel": rel}).scalars()))
                types = {c.name: c.type for c in columns}
                defaults = {
                    name: conn.execute(sa.text(f"SELECT CAST(({expr}) AS {types[name]})")).scalar()
                    for name, expr in conn.execute(_HISTORY_DEFAULTS, {"rel": rel})
                    if name in types
                }
                self._targets[key] = Target(found, columns, tuple(names), defaults)
        return self._targets[key]

    def record(self, changes: Iterable[Change]) -> Outcome:
        """Apply ``changes`` (any order, any repeats) in one transaction."""
        batch = list(changes)
        outcome = Outcome()
        if not batch:
            return outcome
        # A table not registered is looked up again each batch: apply may register it
        # at any time, and every change committed after that must be recorded.
        self._targets = {k: v for k, v in self._targets.items() if v is not None}
        with self.engine.begin() as conn:
            xmax = int(conn.execute(_XMAX).scalar_one())
            targets: dict[tuple[str, str], Target] = {}
            for change in batch:
                target = self._target(conn, change.schema, change.table)
                if target is None:
                    outcome.unregistered += 1
                    continue
                if target.registered.s0_snapshot is None:
                    self._targets.pop((change.schema, change.table), None)
                    raise NotBackfilled(
                        f"history of {change.schema}.{change.table} is registered but not "
                        "backfilled yet: freshline apply does it"
                    )
                targets[(change.schema, change.table)] = target
            seen = self._seen_by_s0(conn, batch, targets, xmax)
            by_table: dict[tuple[str, str], list[tuple[Change, int]]] = {}
            for change in batch:
                target = targets.get((change.schema, change.table))
                if target is None:
                    continue
                txid = widen(change.txid, xmax)
                if (target.registered.s0_snapshot, txid) in seen:
                    outcome.skipped_s0 += 1
                    outcome.count(f"{change.schema}.{change.table}", 2)
                    continue
                self._check_columns(conn, target, change, outcome)
                by_table.setdefault((change.schema, change.table), []).append((change, txid))
            for key, run in by_table.items():
                _apply_table(conn, targets[key], run, outcome)
        return outcome

    def _seen_by_s0(
        self,
        conn: Connection,
        batch: Sequence[Change],
        targets: Mapping[tuple[str, str], Target],
        xmax: int,
    ) -> set[tuple[str | None, int]]:
        by_s0: dict[str, set[int]] = {}
        for change in batch:
            target = targets.get((change.schema, change.table))
            if target is not None and target.registered.s0_snapshot:
                by_s0.setdefault(target.registered.s0_snapshot, set()).add(widen(change.txid, xmax))
        seen: set[tuple[str | None, int]] = set()
        for s0, txids in by_s0.items():
            rows = conn.execute(_SEEN_BY_S0, {"txids": sorted(txids), "s0": s0}).scalars()
            seen |= {(s0, int(t)) for t in rows}
        return seen

    def _check_columns(
        self, conn: Connection, target: Target, change: Change, outcome: Outcome
    ) -> None:
        image = change.after if change.after is not None else change.before
        if image is None or change.op == "d":  # a delete's image may be the key alone
            return
        have = {c.name for c in target.columns}
        if set(image) == have:
            return
        added = sorted(set(image) - have)
        if added:
            raise HistoryBehind(f"{change.schema}.{change.table}", added)
        now = set(
            conn.execute(
                _USER_COLUMNS, {"rel": f"{quote(change.schema)}.{quote(change.table)}"}
            ).scalars()
        )
        # A column the record lacks but the table has was added after it: its default.
        dropped = sorted((have - set(image)) - now)
        if not dropped:
            return
        reason = (
            f"the change at {_lsn(change.lsn)} lacks column(s) {', '.join(dropped)} that "
            "the table no longer has: DDL on the table that history does not follow"
        )
        updated = conn.execute(
            sa.text(
                f"UPDATE {SCHEMA}.history_tables SET broken_from = :at, broken_reason = :why "
                "WHERE source_schema = :schema AND source_table = :table "
                "AND (broken_from IS NULL OR broken_from > :at)"
            ),
            {
                "at": from_epoch_us(change.commit_us),
                "why": reason,
                "schema": change.schema,
                "table": change.table,
            },
        ).rowcount
        if updated:
            logger.error("history of %s.%s is BROKEN: %s", change.schema, change.table, reason)
            outcome.broken.append(f"{change.schema}.{change.table}")


def _apply_table(
    conn: Connection, target: Target, changes: Sequence[tuple[Change, int]], outcome: Outcome
) -> None:
    """Apply one table's changes, in arrival order: each run of row changes as one
    :class:`_Rows` (one read, one write), each truncate by itself between them.

    Recorders of one table take turns (a transaction-scoped advisory lock on its
    history table): a truncate another one applies must see every version made before
    it, and a run must see every truncate recorded before it."""
    conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:h))"), {"h": target.table})
    run: list[tuple[Change, int]] = []
    for change, txid in changes:
        if change.op != "t":
            run.append((change, txid))
            continue
        if run:
            _Rows.load(conn, target, run).apply(run, outcome).save(conn)
            run = []
        at = from_epoch_us(change.commit_us)
        ended = _truncate(conn, target, txid, change.lsn, at)
        outcome.count(f"{change.schema}.{change.table}", 0 if ended else 1)
        if ended:
            outcome.versions += 1
        else:
            outcome.duplicates += 1
    if run:
        _Rows.load(conn, target, run).apply(run, outcome).save(conn)


def _values(
    image: Mapping[str, Any],
    columns: Mapping[str, Column],
    previous: Mapping[str, Any] | None,
    defaults: Mapping[str, Any],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, column in columns.items():
        if name not in image:  # added to the table after this change: its default
            out[name] = defaults.get(name)
            continue
        value = image[name]
        if _unavailable(value, column):
            out[name] = previous.get(name) if previous is not None else None
        else:
            out[name] = typed(value, column)
    return out


def _row_key(values: Mapping[str, Any], key: Sequence[str]) -> tuple[str, ...]:
    # As text: a key typed from the connector's JSON and one read back from Postgres
    # (a uuid.UUID, a Decimal) compare equal.
    return tuple(str(values[k]) for k in key)


_FL_COLUMNS = "_fl_xmin::text::bigint, _fl_xmax::text::bigint, _fl_change - '0/0'::pg_lsn, " + (
    "_fl_to_lsn - '0/0'::pg_lsn, _fl_from, _fl_to, _fl_from_lsn - '0/0'::pg_lsn"
)


@dataclass
class _Version:
    """A version of a row, read or made by the recorder; ``dirty`` once changed."""

    xmin: int
    xmax: int | None
    change: int
    to_lsn: int | None
    start: dt.datetime
    end: dt.datetime | None
    from_lsn: int
    values: dict[str, Any]
    dirty: bool = False

    @property
    def end_fields(self) -> tuple[int | None, int | None, dt.datetime | None]:
        return self.to_lsn, self.xmax, self.end

    def end_at(self, to_lsn: int | None, xmax: int | None, end: dt.datetime | None) -> None:
        self.to_lsn, self.xmax, self.end = to_lsn, xmax, end
        self.dirty = True


@dataclass
class _Rows:
    """The versions of the rows a run of changes touches, read in one statement: every
    version still open, or ended at or after the run's first LSN, or made by one of its
    transactions (the ones a change can end or replace); and the table's truncates
    after that LSN. Changes are applied to them in memory, then written in one
    statement."""

    target: Target
    chains: dict[tuple[str, ...], list[_Version]]
    truncates: list[tuple[int, int, dt.datetime]]

    @classmethod
    def load(cls, conn: Connection, target: Target, run: Sequence[tuple[Change, int]]) -> _Rows:
        columns = {c.name: c for c in target.columns}
        keys: dict[tuple[str, ...], dict[str, Any]] = {}
        for change, _ in run:
            image = change.before if change.op == "d" else change.after
            assert image is not None  # parse() checked it
            try:
                typed_key = {k: typed(image[k], columns[k]) for k in target.key}
            except KeyError as exc:
                raise MalformedChange(f"the row image lacks key column {exc}") from None
            keys.setdefault(_row_key(typed_key, target.key), typed_key)
        first = min(change.lsn for change, _ in run)
        names = ", ".join(quote(c.name) for c in target.columns)
        key_cols = ", ".join(quote(k) for k in target.key)
        arrays = ", ".join(f"CAST(:a{n} AS {columns[k].type}[])" for n, k in enumerate(target.key))
        params: dict[str, Any] = {
            f"a{n}": [v[k] for v in keys.values()] for n, k in enumerate(target.key)
        }
        rows = conn.execute(
            sa.text(
                f"SELECT {_FL_COLUMNS}, {names} FROM {target.table} "
                f"WHERE ({key_cols}) IN (SELECT * FROM unnest({arrays})) "
                "AND (_fl_to_lsn IS NULL OR _fl_to_lsn >= CAST(:first AS pg_lsn) "
                "OR _fl_xmin::text::bigint = ANY(CAST(:txids AS bigint[]))) "
                "ORDER BY _fl_change FOR UPDATE"
            ),
            {**params, "first": _lsn(first), "txids": sorted({t for _, t in run})},
        ).all()
        chains: dict[tuple[str, ...], list[_Version]] = {k: [] for k in keys}
        for row in rows:
            values = {c.name: v for c, v in zip(target.columns, row[7:], strict=True)}
            version = _Version(
                int(row[0]),
                None if row[1] is None else int(row[1]),
                int(row[2]),
                None if row[3] is None else int(row[3]),
                row[4],
                row[5],
                int(row[6]),
                values,
            )
            chains.setdefault(_row_key(values, target.key), []).append(version)
        truncates = [
            (int(lsn), int(txid), at)
            for lsn, txid, at in conn.execute(
                sa.text(
                    f"SELECT lsn, txid, committed_at FROM {SCHEMA}.history_truncates "
                    "WHERE history_table = :h AND lsn > :lsn ORDER BY lsn"
                ),
                {"h": target.registered.history, "lsn": first},
            )
        ]
        return cls(target, chains, truncates)

    def apply(self, run: Sequence[tuple[Change, int]], outcome: Outcome) -> _Rows:
        columns = {c.name: c for c in self.target.columns}
        for change, txid in run:
            image = change.before if change.op == "d" else change.after
            assert image is not None
            key = {k: typed(image[k], columns[k]) for k in self.target.key}
            chain = self.chains.setdefault(_row_key(key, self.target.key), [])
            made = self._one(chain, change, txid, image, columns)
            outcome.count(f"{change.schema}.{change.table}", 0 if made else 1)
            if made:
                outcome.versions += 1
            else:
                outcome.duplicates += 1
        return self

    def _one(
        self,
        chain: list[_Version],
        change: Change,
        txid: int,
        image: Mapping[str, Any],
        columns: Mapping[str, Column],
    ) -> bool:
        lsn, at = change.lsn, from_epoch_us(change.commit_us)
        own = next((v for v in chain if v.xmin == txid), None)
        if own is not None:
            if lsn <= own.change:
                return False
            if change.op == "d":
                own.end_at(lsn, txid, own.start)
            else:
                own.values = _values(image, columns, own.values, self.target.defaults)
                own.end_at(*self._end_after(chain, txid, own.change, None))
            own.change = lsn
            own.dirty = True
            return True
        others = [v for v in chain if v.xmin != txid]
        prev = max((v for v in others if v.change < lsn), key=lambda v: v.change, default=None)
        ends_prev = prev is not None and (prev.to_lsn is None or prev.to_lsn > lsn)
        made = _Version(
            txid,
            None,
            lsn,
            None,
            at,
            None,
            lsn,
            _values(image, columns, prev.values if prev else None, self.target.defaults),
            dirty=True,
        )
        if change.op == "d":  # an empty version of T: the delete, for records that come later
            made.end_at(lsn, txid, at)
        else:
            made.end_at(*self._end_after(chain, txid, lsn, prev))
        chain.append(made)
        chain.sort(key=lambda v: v.change)
        if ends_prev:
            assert prev is not None
            prev.end_at(lsn, txid, at)
        return True

    def _end_after(
        self, chain: Sequence[_Version], txid: int, lsn: int, prev: _Version | None
    ) -> tuple[int | None, int | None, dt.datetime | None]:
        """Where a version of ``txid`` at ``lsn`` ends: where the row's chain went on
        after it (the end ``prev`` had if that came after ``lsn``, else the next
        version's start), or the table's first truncate after ``lsn`` if that came
        first (a truncate has no key, so it may reach another partition, and the
        recorder, before this record)."""
        ends: list[tuple[int, int | None, dt.datetime | None]] = []
        if prev is not None and prev.to_lsn is not None and prev.to_lsn > lsn:
            ends.append((prev.to_lsn, prev.xmax, prev.end))
        else:
            after = min(
                (v for v in chain if v.xmin != txid and v.change > lsn),
                key=lambda v: v.change,
                default=None,
            )
            if after is not None:
                ends.append((after.change, after.xmin, after.start))
        truncate = next((t for t in self.truncates if t[0] > lsn), None)
        if truncate is not None:
            ends.append(truncate)
        if not ends:
            return None, None, None
        return min(ends, key=lambda e: e[0])

    def save(self, conn: Connection) -> None:
        """Write every changed version in one statement (an upsert on the unique
        (key, ``_fl_xmin``) index)."""
        dirty = [v for chain in self.chains.values() for v in chain if v.dirty]
        if not dirty:
            return
        target = self.target
        user = [c.name for c in target.columns]
        names = [
            *user,
            "_fl_xmin",
            "_fl_xmax",
            "_fl_from_lsn",
            "_fl_to_lsn",
            "_fl_from",
            "_fl_to",
            "_fl_change",
        ]
        casts = [*(c.type for c in target.columns), *(_CASTS[n] for n in names[len(user) :])]
        exprs = []
        for n, cast in enumerate(casts):
            if cast == "xid8":
                exprs.append(f"CAST(CAST(:p{n} AS text) AS xid8)")
            else:
                exprs.append(f"CAST(:p{n} AS {cast})")
        conflict = ", ".join(quote(k) for k in target.key)
        updates = ", ".join(f"{quote(n)} = excluded.{quote(n)}" for n in names)
        statement = sa.text(
            f"INSERT INTO {target.table} ({', '.join(quote(n) for n in names)}) "
            f"VALUES ({', '.join(exprs)}) "
            f"ON CONFLICT ({conflict}, _fl_xmin) DO UPDATE SET {updates}"
        )
        params = []
        for v in dirty:
            row = [_storable(v.values[c.name], c) for c in target.columns]
            row += [
                v.xmin,
                v.xmax,
                _lsn(v.from_lsn),
                None if v.to_lsn is None else _lsn(v.to_lsn),
                v.start,
                v.end,
                _lsn(v.change),
            ]
            params.append({f"p{n}": value for n, value in enumerate(row)})
        conn.execute(statement, params)


def _storable(value: Any, column: Column) -> Any:
    """A value read back from Postgres, as a parameter again (psycopg reads ``jsonb`` as
    Python objects but takes only text for it here)."""
    if column.typname in ("json", "jsonb") and value is not None and not isinstance(value, str):
        return orjson.dumps(value).decode()
    return value


_CASTS = {
    "_fl_xmin": "xid8",
    "_fl_xmax": "xid8",
    "_fl_from_lsn": "pg_lsn",
    "_fl_to_lsn": "pg_lsn",
    "_fl_change": "pg_lsn",
    "_fl_from": "timestamptz",
    "_fl_to": "timestamptz",
}


def _truncate(conn: Connection, target: Target, txid: int, lsn: int, at: dt.datetime) -> bool:
    """End every version open at ``lsn``: of ``txid`` itself (made before the truncate
    in the same transaction) as empty, every other at ``txid``; and remember it, for
    versions before it whose records come later."""
    remembered = conn.execute(
        sa.text(
            f"INSERT INTO {SCHEMA}.history_truncates (history_table, lsn, txid, committed_at) "
            "VALUES (:h, :lsn, :txid, :at) ON CONFLICT DO NOTHING"
        ),
        {"h": target.registered.history, "lsn": lsn, "txid": txid, "at": at},
    ).rowcount
    ended = conn.execute(
        sa.text(
            f"UPDATE {target.table} SET _fl_xmax = CAST(CAST(:txid AS text) AS xid8), "
            "_fl_to_lsn = CAST(:lsn AS pg_lsn), "
            "_fl_to = CASE WHEN _fl_xmin = CAST(CAST(:txid AS text) AS xid8) "
            "THEN _fl_from ELSE :at END "
            "WHERE _fl_change < CAST(:lsn AS pg_lsn) "
            "AND (_fl_to_lsn IS NULL OR _fl_to_lsn > CAST(:lsn AS pg_lsn))"
        ),
        {"txid": txid, "lsn": _lsn(lsn), "at": at},
    ).rowcount
    return bool(ended or remembered)
