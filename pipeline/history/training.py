"""Training sets: for each row of a spine, the features freshline would have served.

``training_set(repo, spine, features=[...])`` takes a spine (the entity's tenant column
where it has one, its key column, a timestamp with a zone, any label columns; an Arrow
or pandas frame, or a Parquet or CSV file) and returns it as an Arrow table with one
column per requested field, ``feature_set__field``, typed as declared: the value the
online path would have served at each row's moment had it been perfectly fresh
(:class:`~freshline.pipeline.history.evaluator.AtCommitTime`), or, with ``at="snapshot"``, as of
the snapshot a ``snapshot`` column names
(:class:`~freshline.pipeline.history.evaluator.AtSnapshot`).
The spine's own columns pass through unchanged, in its order. docs/training.md says
what the moments mean and how to turn history on.

Rows are evaluated in chunks on one connection a core, all reading one snapshot; a
declared aggregation is evaluated once for the rows of a key whose moments it cannot
tell apart (:mod:`freshline.pipeline.history.intervals`).

pyarrow is imported only when a training set is asked for (the ``training`` extra);
the columns' names and types are :mod:`freshline.pipeline.core.frames`'s, which batch
reads share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import os
import queue
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.features import IMPLICIT_TENANT, FeatureSet
from freshline.pipeline.core.frames import (
    FrameError,
    Requested,
    arrow,
    arrow_column,
    arrow_type,
)
from freshline.pipeline.core.frames import requested as frames_requested
from freshline.pipeline.core.keys import validate_id
from freshline.pipeline.core.repository import Repository, load
from freshline.pipeline.core.settings import Settings, load_settings
from freshline.pipeline.core.types import FeatureValues
from freshline.pipeline.history.evaluator import AtCommitTime, AtSnapshot, Evaluator, Moment, Ref
from freshline.pipeline.history.intervals import declaration, representatives

if TYPE_CHECKING:
    import pyarrow as pa

At = Literal["commit_time", "snapshot"]
CHUNK = 2000
"""Spine keys per statement (whole moments: a moment's keys never split)."""
WORKERS = min(os.cpu_count() or 1, 8)
"""Connections evaluating at once, by default: one a core."""


class SpineError(FrameError):
    """A spine or a feature list the training set cannot be built from (one line)."""


def _arrow() -> Any:
    return arrow("training sets")


def requested(repo: Repository, features: Sequence[str]) -> list[Requested]:
    """``txn_90d`` (every field) or ``geo:distinct_countries_30d`` (one), in order."""
    try:
        return frames_requested(repo.registry, features)
    except FrameError as exc:
        raise SpineError(str(exc)) from None


def read_spine(spine: Any) -> pa.Table:
    """A spine as an Arrow table: an Arrow table, a pandas frame, or a ``.parquet`` or
    ``.csv`` file."""
    pa = _arrow()
    if isinstance(spine, pa.Table):
        return spine
    if isinstance(spine, str | Path):
        path = Path(spine)
        if not path.exists():
            raise SpineError(f"spine file {path} does not exist")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        if path.suffix == ".csv":
            import pyarrow.csv as pcsv

            try:
                return pcsv.read_csv(path)
            except pa.ArrowInvalid as exc:
                raise SpineError(f"spine {path}: {str(exc).splitlines()[0]}") from None
        raise SpineError(f"spine {path}: expected a .parquet or .csv file")
    if type(spine).__name__ == "DataFrame" and hasattr(spine, "to_records"):
        return pa.Table.from_pandas(spine, preserve_index=False)
    raise SpineError(f"a spine is an Arrow table, a pandas frame or a file, not {type(spine)}")


def _column(table: pa.Table, name: str, what: str) -> list[Any]:
    if name not in table.column_names:
        raise SpineError(
            f"the spine has no column {name!r} ({what}); its columns: "
            f"{', '.join(table.column_names)}"
        )
    return list(table.column(name).to_pylist())


def _moments(
    table: pa.Table, timestamp: str, at: At, snapshot: str, delay: dt.timedelta | None
) -> list[Moment]:
    pa = _arrow()
    if timestamp not in table.column_names:
        _column(table, timestamp, "the moment of each row")
    kind = table.schema.field(timestamp).type
    if not pa.types.is_timestamp(kind) or kind.tz is None:
        zone = "a timestamp without a time zone" if pa.types.is_timestamp(kind) else str(kind)
        raise SpineError(
            f"spine column {timestamp!r} is {zone}: give each row's moment with its zone "
            "(e.g. 2026-12-01T10:00:00+00:00)"
        )
    times = table.column(timestamp).to_pylist()
    if any(t is None for t in times):
        raise SpineError(
            f"spine column {timestamp!r} has an empty timestamp (row {times.index(None)})"
        )
    if at == "commit_time":
        shift = delay or dt.timedelta(0)
        return [AtCommitTime(t - shift) for t in times]
    if delay:
        raise SpineError("delay= goes with at='commit_time': a snapshot names its own moment")
    snaps = _column(table, snapshot, "the snapshot each row names, with at='snapshot'")
    return [AtSnapshot(str(s), t) for s, t in zip(snaps, times, strict=True)]


def _refs(table: pa.Table, fs: FeatureSet) -> list[Ref]:
    entity = fs.entity
    ids = _column(table, entity.key, f"the key of entity {entity.name!r}")
    if entity.tenant:
        tenants = _column(table, entity.tenant, f"the tenant of entity {entity.name!r}")
    else:
        tenants = [IMPLICIT_TENANT] * len(ids)
    refs: list[Ref] = []
    for row, (tenant, key) in enumerate(zip(tenants, ids, strict=True)):
        try:
            refs.append((validate_id("tenant", tenant), entity.validate(key)))
        except InvalidId as exc:
            raise SpineError(f"spine row {row}: {exc}") from None
    return refs


def training_set(
    repo: Repository | str | Path,
    spine: Any,
    features: Sequence[str],
    *,
    engine: Engine | None = None,
    settings: Settings | None = None,
    timestamp: str = "timestamp",
    delay: dt.timedelta | None = None,
    at: At = "commit_time",
    snapshot: str = "snapshot",
    chunk: int = CHUNK,
    share: bool = True,
    workers: int = WORKERS,
    progress: Callable[[int, int], None] | None = None,
) -> pa.Table:
    """The spine with the requested features as of each row's moment.

    ``repo``: the repository (or its directory); ``spine``: see the module docstring;
    ``features``: feature set names, or ``set:field``; ``engine``: Postgres (the API's
    login is enough: it reads the history tables), else one made from ``settings`` (else
    the environment's, ``FRESHLINE_POSTGRES_URL``); ``timestamp``: the spine's moment
    column (aware); ``delay``: model serving lag, the value as of ``moment - delay``;
    ``at``: ``"commit_time"`` (the rows as committed at the moment) or ``"snapshot"``
    (as the snapshot in the ``snapshot`` column saw them, with the moment as ``as_of``);
    ``share``: evaluate a declared aggregation once for the spine rows of a key whose
    moments it cannot tell apart (:mod:`~freshline.pipeline.history.intervals`; the same
    values), else once per moment; ``workers``: connections evaluating chunks at once,
    all reading one snapshot (default: one a core); ``progress(done, total)``: called
    once the input is checked, then as spine rows are evaluated (per feature set).

    Raises :class:`SpineError` for a spine or feature list it cannot use, and
    :class:`~freshline.pipeline.history.evaluator.HistoryRefused` where history cannot answer
    without leaking.
    """
    pa = _arrow()
    repository = repo if isinstance(repo, Repository) else load(repo)
    wanted = requested(repository, features)
    table = read_spine(spine)
    moments = _moments(table, timestamp, at, snapshot, delay)
    for r in wanted:
        if r.column in table.column_names:
            raise SpineError(f"the spine already has a column {r.column!r}")
    sets = list(dict.fromkeys(r.feature_set for r in wanted))
    by_entity = {
        fs.entity.name: _refs(table, fs) for fs in {fs.entity.name: fs for fs in sets}.values()
    }
    refs = {fs.name: by_entity[fs.entity.name] for fs in sets}
    if engine is None:
        own = make_engine(settings or load_settings(), pool_size=workers)
        try:
            values = _evaluate(own, sets, moments, refs, chunk, share, workers, progress)
        finally:
            own.dispose()
    else:
        values = _evaluate(engine, sets, moments, refs, chunk, share, workers, progress)
    for r in wanted:
        column = [None if v is None else v[r.field.name] for v in values[r.feature_set.name]]
        table = table.append_column(
            pa.field(r.column, arrow_type(r.field.type)), arrow_column(r.field.type, column)
        )
    return table


def _evaluate(
    engine: Engine,
    sets: list[FeatureSet],
    moments: list[Moment],
    refs: dict[str, list[Ref]],
    chunk: int,
    share: bool,
    workers: int,
    progress: Callable[[int, int], None] | None,
) -> dict[str, list[dict[str, Any] | None]]:
    """Per feature set, each spine row's values (None: the query gave its key no row),
    read by ``workers`` connections in REPEATABLE READ transactions of one snapshot:
    every chunk sees the same history."""
    total = len(moments) * len(sets)
    done = 0
    if progress:
        progress(done, total)
    values: dict[str, list[dict[str, Any] | None]] = {}
    with _readers(engine, workers) as evaluators, ThreadPoolExecutor(workers) as pool:
        free: queue.SimpleQueue[Evaluator] = queue.SimpleQueue()
        for evaluator in evaluators:
            free.put(evaluator)
        for fs in sets:
            keys = refs[fs.name]
            firsts = _firsts(evaluators[0], fs, moments, keys) if share else None
            rows: dict[Moment, list[int]] = defaultdict(list)
            for n, moment in enumerate(moments):
                if firsts is None or firsts[n] == n:
                    rows[moment].append(n)
            got: list[dict[str, Any] | None] = [None] * len(moments)
            count = sum(len(r) for r in rows.values())
            batches = _chunks(rows, min(chunk, max(1, -(-count // workers))))  # each a slice
            asks = ({m: [keys[n] for n in rows[m]] for m in batch} for batch in batches)
            answered = pool.map(functools.partial(_evaluate_one, free, fs), asks)
            for batch, answers in zip(batches, answered, strict=True):
                for moment in batch:
                    for n in rows[moment]:
                        got[n] = answers[moment].get(keys[n])
                    done += len(rows[moment])
                if progress:
                    progress(done, total)
            if firsts is not None:
                got = [got[first] for first in firsts]
                done += len(moments) - count
                if progress:
                    progress(done, total)
            values[fs.name] = got
    return values


def _evaluate_one(
    free: queue.SimpleQueue[Evaluator], fs: FeatureSet, moments: dict[Moment, list[Ref]]
) -> dict[Moment, dict[Ref, FeatureValues]]:
    """``fs`` at ``moments`` by whichever evaluator is free."""
    evaluator = free.get()
    try:
        return evaluator.evaluate(fs, moments)
    finally:
        free.put(evaluator)


_SNAPSHOT_ID = re.compile(r"[0-9A-F]+(-[0-9A-F]+)+")


@contextlib.contextmanager
def _readers(engine: Engine, workers: int) -> Iterator[list[Evaluator]]:
    """``workers`` evaluators, each on a connection of its own, in read-only
    REPEATABLE READ transactions that all read the first one's snapshot
    (``pg_export_snapshot``), with the first one's ``now``; rolled back after."""
    with contextlib.ExitStack() as stack:

        def begin(snapshot: str | None) -> Connection:
            conn = stack.enter_context(
                engine.connect().execution_options(isolation_level="REPEATABLE READ")
            )
            if snapshot is not None:
                conn.exec_driver_sql(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
            conn.exec_driver_sql("SET TRANSACTION READ ONLY")
            # A statement of many moments is estimated dear enough for JIT, whose
            # compiling costs more than the index lookups it would speed up (EXPLAIN
            # ANALYZE: about 40% of device_risk's 2,000 moments).
            conn.exec_driver_sql("SET LOCAL jit = off")
            return conn

        first = Evaluator.on(begin(None))
        evaluators = [first]
        if workers > 1:
            snapshot = first.conn.execute(sa.text("SELECT pg_export_snapshot()")).scalar_one()
            if not _SNAPSHOT_ID.fullmatch(snapshot):
                raise ValueError(f"unexpected snapshot id {snapshot!r}")
            for _ in range(workers - 1):
                evaluators.append(dataclasses.replace(first, conn=begin(snapshot), _read={}))
        yield evaluators
        for evaluator in evaluators:
            evaluator.conn.rollback()


def _firsts(
    evaluator: Evaluator, fs: FeatureSet, moments: list[Moment], keys: list[Ref]
) -> list[int] | None:
    """For each spine row, the first row whose values it must share
    (:mod:`~freshline.pipeline.history.intervals`); None where ``fs`` is not a shared
    declaration or the moments are snapshots. Every moment is checked here, since only
    the first rows reach the evaluator."""
    decl = declaration(fs)
    if decl is None or not moments or not isinstance(moments[0], AtCommitTime):
        return None
    ends = {m: [keys[0]] for m in (min(moments, key=_at), max(moments, key=_at))}
    evaluator.check(fs, ends)
    read = evaluator.reads(fs, ends)
    return representatives(evaluator.conn, fs, decl, read, [m.at for m in moments], keys)


def _at(moment: Moment) -> dt.datetime:
    return moment.at


def _chunks(rows: dict[Moment, list[int]], size: int) -> list[list[Moment]]:
    batches: list[list[Moment]] = [[]]
    count = 0
    for moment, members in rows.items():
        if batches[-1] and count + len(members) > size:
            batches.append([])
            count = 0
        batches[-1].append(moment)
        count += len(members)
    return [b for b in batches if b]


def write(table: pa.Table, out: str | Path) -> Path:
    """Write a training set to ``.parquet`` or ``.csv``."""
    path = Path(out)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    elif path.suffix == ".csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, path)
    else:
        raise SpineError(f"--out {path}: expected a .parquet or .csv file")
    return path
