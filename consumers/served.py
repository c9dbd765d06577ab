"""The served log's sink: ``freshline served sink``.

A consumer group of its own (``freshline-served-sink``) reads ``freshline.served``
(:mod:`freshline.pipeline.observe.served`), decodes each logged entry with the repository's field
names, and writes one row per (request, feature set, entity) to day-partitioned Parquet
files under ``FRESHLINE_SERVED_LOG_DIR`` (``day=YYYY-MM-DD/<n>.parquet``, by the
request's UTC day), deleting days older than ``FRESHLINE_SERVED_LOG_RETENTION_DAYS``.

Order of side effects, per batch: write the files, then commit the offsets. A crash
between the two writes a batch again (rows carry their ``request_id``: readers drop
the repeats, as :meth:`freshline.pipeline.observe.served_files.ParquetLog.read` does). See
``docs/observability.md``.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import orjson

from freshline.consumers.kafka import Consumer, check_message
from freshline.pipeline.core.codec import HEADER, TOMBSTONE_TAG
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import SERVED, qualified
from freshline.pipeline.observe.served_files import ParquetLog

log = logging.getLogger(__name__)

EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)

GROUP: Final = "freshline-served-sink"


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
