"""The served log's files: day folders, retention, and repeats read once (no services)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from freshline.pipeline.observe.served_files import ParquetLog


def row(request_id: str, at: datetime, entity: str = "1") -> dict[str, Any]:
    return {
        "request_id": request_id,
        "tenant": "t",
        "route": "features",
        "requested_at": at,
        "feature_set": "txn_90d",
        "entity": entity,
        "source": "redis",
        "values": '{"txn_count":1}',
    }


def test_days_retention_and_repeats(tmp_path: Path) -> None:
    log = ParquetLog(tmp_path, retention_days=2)
    today = datetime(2026, 12, 7, 10, tzinfo=UTC)
    rows = [
        row("a", today),
        row("b", today - timedelta(days=1)),
        row("c", today - timedelta(days=2)),
    ]
    log.write(rows)
    log.write(rows[:1])  # a batch written again (a crash before its commit)
    assert [d.name for d in log.days()] == ["day=2026-12-05", "day=2026-12-06", "day=2026-12-07"]
    assert sorted(log.read().column("request_id").to_pylist()) == ["a", "b", "c"]
    assert log.read(since=today - timedelta(hours=1)).column("request_id").to_pylist() == ["a"]
    gone = log.expire(date(2026, 12, 7))
    assert [d.name for d in gone] == ["day=2026-12-05"]
    assert sorted(log.read().column("request_id").to_pylist()) == ["a", "b"]
    assert not list(tmp_path.rglob("*.part"))
