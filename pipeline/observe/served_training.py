"""Training on served values: a spine joined to the served log, not recomputed.

``from_logs(repo, spine, features, log)`` gives each spine row the values the API
actually served: by ``request_id`` where the spine has that column and the row a value
(exact: the read of that request), else by (entity, time): the latest logged read of
the entity at or before the row's moment and no older than ``tolerance``. A row with
no such read gets nulls and ``<feature set>__logged`` false. Columns are named and
typed as :func:`freshline.pipeline.history.training.training_set` names them
(``feature_set__field``), so a model can train on either and compare.
See ``docs/training.md``.
"""

from __future__ import annotations

import bisect
import datetime as dt
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import orjson
import pyarrow as pa

from freshline.pipeline.core.features import IMPLICIT_TENANT, FeatureSet
from freshline.pipeline.core.frames import arrow_column
from freshline.pipeline.core.repository import Repository
from freshline.pipeline.history.training import SpineError, read_spine, requested
from freshline.pipeline.observe.served_files import ParquetLog

DEFAULT_TOLERANCE = dt.timedelta(minutes=5)

Key = tuple[str, str, str]
"""(feature set, tenant, entity)."""


def _key_of(fs: FeatureSet, table: pa.Table) -> list[Key]:
    entity = fs.entity
    if entity.key not in table.column_names:
        raise SpineError(f"the spine has no column {entity.key!r} (the key of {entity.name!r})")
    ids = [None if v is None else str(v) for v in table.column(entity.key).to_pylist()]
    if entity.tenant:
        if entity.tenant not in table.column_names:
            raise SpineError(f"the spine has no column {entity.tenant!r} (the tenant)")
        tenants = [str(t) for t in table.column(entity.tenant).to_pylist()]
    else:
        tenants = [IMPLICIT_TENANT] * len(ids)
    return [(fs.name, t, str(i)) for t, i in zip(tenants, ids, strict=True)]


def from_logs(
    repo: Repository,
    spine: Any,
    features: Sequence[str],
    log: ParquetLog,
    *,
    timestamp: str = "timestamp",
    request_id: str = "request_id",
    tolerance: dt.timedelta = DEFAULT_TOLERANCE,
) -> pa.Table:
    """The spine with the served values of ``features`` (see the module docstring)."""
    table = read_spine(spine)
    wanted = requested(repo, features)
    sets = list(dict.fromkeys(r.feature_set for r in wanted))
    times: list[dt.datetime | None] = (
        table.column(timestamp).to_pylist()
        if timestamp in table.column_names
        else [None] * table.num_rows
    )
    ids: list[str | None] = (
        table.column(request_id).to_pylist()
        if request_id in table.column_names
        else [None] * table.num_rows
    )
    if any(t is None and i is None for t, i in zip(times, ids, strict=True)):
        raise SpineError(f"each spine row needs a {request_id!r} or a {timestamp!r}")
    known = [t for t in times if t is not None]
    since = min(known) - tolerance if known and all(i is None for i in ids) else None
    until = max(known) + dt.timedelta(microseconds=1) if known and since is not None else None
    logged = log.read(since=since, until=until).to_pylist()
    by_request: dict[tuple[str, Key], Any] = {}
    by_key: dict[Key, list[tuple[dt.datetime, Any]]] = defaultdict(list)
    for row in logged:
        if row["values"] is None:
            continue
        key = (row["feature_set"], row["tenant"], row["entity"])
        by_request[row["request_id"], key] = row["values"]
        by_key[key].append((row["requested_at"], row["values"]))
    for reads in by_key.values():
        reads.sort(key=lambda r: r[0])
    for fs in sets:
        keys = _key_of(fs, table)
        found: list[dict[str, Any] | None] = []
        for key, at, rid in zip(keys, times, ids, strict=True):
            text = by_request.get((rid, key)) if rid is not None else None
            if text is None and rid is None and at is not None:
                text = _latest(by_key.get(key, []), at, tolerance)
            found.append(None if text is None else orjson.loads(text))
        for r in (r for r in wanted if r.feature_set is fs):
            column = [None if v is None else v.get(r.field.name) for v in found]
            array = arrow_column(r.field.type, column)
            table = table.append_column(pa.field(r.column, array.type), array)
        table = table.append_column(
            f"{fs.name}__logged", pa.array([v is not None for v in found], pa.bool_())
        )
    return table


def _latest(reads: list[tuple[dt.datetime, Any]], at: dt.datetime, tolerance: dt.timedelta) -> Any:
    """The values of the latest read at or before ``at``, within ``tolerance``."""
    i = bisect.bisect_right(reads, at, key=lambda r: r[0])
    if i == 0 or at - reads[i - 1][0] > tolerance:
        return None
    return reads[i - 1][1]
