"""The served log's files: day-partitioned Parquet, one row per served (request, feature
set, entity), as ``freshline served sink`` (:mod:`freshline.consumers.served`) writes them and
the skew report and training on served values read them.

pyarrow is imported here, never on the read path (the ``training`` extra).
"""

from __future__ import annotations

import shutil
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

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
