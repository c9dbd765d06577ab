"""The served log's sink: ``freshline served sink``.

A consumer group of its own (``freshline-served-sink``) reads ``freshline.served``
(:mod:`pipeline.observe.served`), decodes each logged entry with the repository's field
names, and writes one row per (request, feature set, entity) to day-partitioned Parquet
files under ``FRESHLINE_SERVED_LOG_DIR`` (``day=YYYY-MM-DD/<n>.parquet``, by the
request's UTC day), deleting days older than ``FRESHLINE_SERVED_LOG_RETENTION_DAYS``.

Order of side effects, per batch: write the files, then commit the offsets. A crash
between the two writes a batch again (rows carry their ``request_id``: readers drop
the repeats, as :func:`read_log` does). See ``docs/observability.md``.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from consumers.kafka import Consumer, check_message
from pipeline.core.codec import HEADER, TOMBSTONE_TAG
from pipeline.core.features import Registry
from pipeline.core.settings import Settings
from pipeline.core.topics import SERVED, qualified

log = logging.getLogger(__name__)

EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)

GROUP: Final = "freshline-served-sink"

SCHEMA: Final = pa.schema(
    [
        ("request_id", pa.string()),
        ("tenant", pa.string()),
        ("route", pa.string()),
        ("requested_at", pa.timestamp("us", tz="UTC")),
        ("feature_set", pa.string()),
        ("entity", pa.string()),
        ("source", pa.string()),
        ("schema_version", pa.int32()),
        ("watermark", pa.string()),
        ("computed_at", pa.timestamp("ms", tz="UTC")),
        ("values", pa.string()),
        ("entry", pa.binary()),
        ("model", pa.string()),
        ("model_version", pa.string()),
        ("prediction", pa.string()),
    ]
)
"""One row per served (request, feature set, entity). ``watermark`` is the entry's, in
decimal (the key of ``freshline.snapshots``); ``values`` and ``prediction`` are JSON;
``entry`` the bytes as served (``None`` for a miss)."""


def rows(message: bytes, registry: Registry) -> list[dict[str, Any]]:
    """The rows of one log message, its entries decoded."""
    record = orjson.loads(message)
    at = EPOCH + timedelta(microseconds=record["at_us"])
    out = []
    for item in record["items"]:
        text: str | None = item["entry"]
        raw = None if text is None else text.encode()
        row: dict[str, Any] = {
            "request_id": record["request_id"],
            "tenant": record["tenant"],
            "route": record["route"],
            "requested_at": at,
            "feature_set": item["feature_set"],
            "entity": item["entity"],
            "source": item["source"],
            "schema_version": None,
            "watermark": None,
            "computed_at": None,
            "values": None if item.get("values") is None else orjson.dumps(item["values"]).decode(),
            "entry": raw,
            "model": record.get("model"),
            "model_version": record.get("model_version"),
            "prediction": None
            if item.get("prediction") is None
            else orjson.dumps(item["prediction"]).decode(),
        }
        if raw is not None and len(raw) >= HEADER:
            row["watermark"] = str(int(raw[1:HEADER], 16))
            if raw[:1] != TOMBSTONE_TAG:
                version, computed_ms, values = orjson.loads(raw[HEADER:])
                fields = registry[item["feature_set"]].field_names
                named = (
                    dict(zip(fields, values, strict=True)) if len(fields) == len(values) else values
                )
                row["schema_version"] = version
                row["computed_at"] = datetime.fromtimestamp(computed_ms / 1000, UTC)
                row["values"] = orjson.dumps(named).decode()
        out.append(row)
    return out


class ParquetLog:
    """The log's files: ``<directory>/day=YYYY-MM-DD/<name>.parquet``."""

    def __init__(self, directory: str | Path, retention_days: int = 30) -> None:
        self.directory = Path(directory)
        self.retention_days = retention_days

    def write(self, batch: Iterable[dict[str, Any]]) -> list[Path]:
        """One new file per UTC day the rows fall on."""
        by_day: dict[date, list[dict[str, Any]]] = defaultdict(list)
        for row in batch:
            by_day[row["requested_at"].date()].append(row)
        written = []
        for day, day_rows in sorted(by_day.items()):
            folder = self.directory / f"day={day.isoformat()}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{uuid.uuid4().hex}.parquet"
            part = path.with_suffix(".part")  # readers never see half a file
            pq.write_table(pa.Table.from_pylist(day_rows, schema=SCHEMA), part)
            part.rename(path)
            written.append(path)
        return written

    def expire(self, today: date | None = None) -> list[Path]:
        """Delete the days older than the retention; the folders deleted."""
        oldest = (today or datetime.now(UTC).date()) - timedelta(days=self.retention_days - 1)
        gone = []
        for folder in self.days():
            if date.fromisoformat(folder.name.removeprefix("day=")) < oldest:
                shutil.rmtree(folder)
                gone.append(folder)
        return gone

    def days(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("day=*") if p.is_dir())

    def read(self, since: datetime | None = None, until: datetime | None = None) -> pa.Table:
        """The rows requested in ``[since, until)``, each (request, feature set, entity)
        once."""
        files = [str(f) for day in self._days_between(since, until) for f in day.glob("*.parquet")]
        if not files:
            return SCHEMA.empty_table()
        table = ds.dataset(files, schema=SCHEMA, format="parquet").to_table()
        if since is not None:
            table = table.filter(
                ds.field("requested_at") >= pa.scalar(since, SCHEMA.field("requested_at").type)
            )
        if until is not None:
            table = table.filter(
                ds.field("requested_at") < pa.scalar(until, SCHEMA.field("requested_at").type)
            )
        return _unique(table)

    def _days_between(self, since: datetime | None, until: datetime | None) -> Iterator[Path]:
        for folder in self.days():
            day = date.fromisoformat(folder.name.removeprefix("day="))
            if since is not None and day < since.astimezone(UTC).date():
                continue
            if until is not None and day > until.astimezone(UTC).date():
                continue
            yield folder


def _unique(table: pa.Table) -> pa.Table:
    """Rows of a batch written twice (a crash before its commit) kept once."""
    keys = ["request_id", "feature_set", "entity"]
    if table.num_rows == 0:
        return table
    index = pa.array(range(table.num_rows))
    first = (
        table.select(keys)
        .append_column("i", index)
        .group_by(keys, use_threads=False)
        .aggregate([("i", "min")])
        .column("i_min")
    )
    return table.take(pc.sort_indices(first))


class ServedSink:
    """``freshline served sink``: ``run()`` until stopped; ``step()`` is one batch."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        directory: str | Path | None = None,
        *,
        batch: int = 5000,
        poll_s: float = 1.0,
    ) -> None:
        self.registry = registry
        self.log = ParquetLog(
            directory or settings.served_log_dir, settings.served_log_retention_days
        )
        self.topic = qualified(settings, SERVED)
        self.consumer = Consumer(settings, **{"group.id": settings.topic_prefix + GROUP})
        self.batch = batch
        self.poll_s = poll_s
        self.written = 0
        self._subscribed = False
        self._stop = False

    def step(self) -> int:
        """One batch: read, write its files, then commit; the rows written."""
        if not self._subscribed:
            self.consumer.subscribe([self.topic])
            self._subscribed = True
        messages = self.consumer.consume(self.batch, timeout=self.poll_s)
        batch: list[dict[str, Any]] = []
        for msg in messages:
            value = None if check_message(msg) is None else msg.value()
            if value is None:
                continue
            try:
                batch.extend(rows(value, self.registry))
            except (ValueError, KeyError, TypeError) as exc:  # a record no decoder takes
                log.warning("served sink: skipped a record at offset %s: %s", msg.offset(), exc)
        if batch:
            self.log.write(batch)
        if messages:
            self.consumer.commit(messages)
        self.written += len(batch)
        return len(batch)

    def run(self, max_rows: int | None = None, timeout: float | None = None) -> int:
        """Batches until :meth:`stop`, ``max_rows`` written, or ``timeout`` seconds;
        the days past retention are deleted at the start and as each day begins."""
        deadline = None if timeout is None else time.monotonic() + timeout
        expired: date | None = None
        while not self._stop:
            if expired != (today := datetime.now(UTC).date()):
                self.log.expire(today)
                expired = today
            self.step()
            if max_rows is not None and self.written >= max_rows:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
        return self.written

    def stop(self) -> None:
        self._stop = True

    def close(self) -> None:
        self.consumer.close()
