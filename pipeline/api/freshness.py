"""The read API's reads that ask for freshness: ``after``, ``max_staleness_ms``, ``wait_ms``.

``GET /v1/features/{set}/{id}`` takes them in its query, ``POST /v1/features/batch`` in
its body. A request with neither ``after`` nor ``max_staleness_ms`` is a plain read and
never comes here (no parsing beyond the usual, no round trip of its own).

:func:`read` is the coroutine twin of :func:`freshline.pipeline.cache.freshness.read`, which says
what is served and why it is never older than asked. Here the tier and Redis are read
on the event loop (one MGET, with the asyncio client), the wait for the consumer's
write is a coroutine woken by the entity's invalidation, and only the database work
goes to the thread pool: reading the token key once, ranking a transaction token once,
the recompute. That work runs as the tenant's share of the pool
(:func:`freshline.pipeline.api.tenancy.tenant_pool`): within its concurrency, charged to its pool
time, as every other read's. Each answer has ``took_ms``, the time from the request's
start until it was had.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from freshline.pipeline.api.contracts import MAX_MS, freshness_fields
from freshline.pipeline.api.errors import ApiError
from freshline.pipeline.api.reader import Answer, AnswerSource, FeatureReader, Lookup, Mode, answer
from freshline.pipeline.api.tenancy import Pool
from freshline.pipeline.cache import freshness
from freshline.pipeline.cache.freshness import Freshness
from freshline.pipeline.cache.readthrough import ReadThrough, Result
from freshline.pipeline.cache.tokens import TokenPending, Tokens
from freshline.pipeline.core.clock import now_ms
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import Entry
from freshline.pipeline.observe import served

FIELDS: Final = ("after", "max_staleness_ms", "wait_ms")
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 0.001, 0.05


@dataclass(frozen=True, slots=True)
class Demand:
    """A request's freshness parameters, checked (``wait_ms`` within the server's max).
    ``sized`` when the request gave its own ``wait_ms``: waited in full, where the
    server's default wait is made only while waiting pays
    (:class:`freshline.pipeline.cache.arrivals.WaitHistory`)."""

    after: str | None
    max_staleness_ms: int | None
    wait_ms: int
    sized: bool = False


def from_query(query: Mapping[str, str], settings: Settings) -> Demand | None:
    """The query's demand; ``None`` without ``after`` or ``max_staleness_ms``."""
    values: dict[str, int | None] = {}
    for name in ("max_staleness_ms", "wait_ms"):
        text = query.get(name)
        if text is None:
            values[name] = None
        elif text.isascii() and text.isdigit() and len(text) <= len(str(MAX_MS)):
            values[name] = _in_range(name, int(text), 400, "invalid_parameter")
        else:
            raise ApiError(
                400, "invalid_parameter", f"{name} must be an integer from 0 to {MAX_MS}"
            )
    return _demand(query.get("after"), values, settings)


def from_body(body: Mapping[str, Any], settings: Settings) -> Demand | None:
    """A batch body's demand; ``None`` without ``after`` or ``max_staleness_ms``."""
    if body.keys().isdisjoint(FIELDS):  # a plain batch: one C-level check
        return None
    staleness, wait, after = freshness_fields(body)
    return _demand(after, {"max_staleness_ms": staleness, "wait_ms": wait}, settings)


def defaulted(demand: Demand | None, default_ms: int | None, settings: Settings) -> Demand | None:
    """``demand`` with the feature sets' declared ``max_staleness_ms`` where the request
    gives none (:attr:`freshline.pipeline.core.features.FeatureSet.max_staleness_ms`; for several
    sets, the smallest): a plain read of a set that declares one becomes a bounded read."""
    if default_ms is None or (demand is not None and demand.max_staleness_ms is not None):
        return demand
    if demand is None:
        return Demand(None, default_ms, min(settings.token_wait_ms, settings.token_wait_max_ms))
    return Demand(demand.after, default_ms, demand.wait_ms, demand.sized)


def declared_default(registry: Registry, feature_sets: Iterable[str]) -> int | None:
    """The smallest ``max_staleness_ms`` that ``feature_sets`` declare, if any does."""
    bounds = [
        b for b in (registry[name].max_staleness_ms for name in feature_sets) if b is not None
    ]
    return min(bounds) if bounds else None


def _in_range(name: str, value: int, status: int, code: str) -> int:
    if not 0 <= value <= MAX_MS:
        raise ApiError(status, code, f"{name} must be an integer from 0 to {MAX_MS}")
    return value


def _demand(after: str | None, values: dict[str, int | None], settings: Settings) -> Demand | None:
    staleness = values["max_staleness_ms"]
    if after is None and staleness is None:
        return None
    wait = values["wait_ms"]
    sized = wait is not None
    wait = settings.token_wait_ms if wait is None else wait
    return Demand(after, staleness, min(wait, settings.token_wait_max_ms), sized)


async def rank_of(tokens: Tokens, text: str, deadline: float, pool: Pool) -> int:
    """:func:`freshline.pipeline.cache.freshness.rank_of`, its queries in ``pool``."""
    if not tokens.loaded:
        await pool(tokens.load)
    token = tokens.parse(text)
    rank = tokens.rank(token)
    pause = _FIRST_PAUSE_S
    while rank is None:
        rank = await pool(tokens.resolve, token)
        left = deadline - time.monotonic()
        if rank is None and left <= 0:
            raise TokenPending(token.a)
        if rank is None:
            await asyncio.sleep(min(pause, left))  # backoff while the writer commits
            pause = min(pause * 2, _LONGEST_PAUSE_S)
    return rank


# long: the coroutine twin of cache.freshness.read, kept step for step beside it
async def read(
    reader: FeatureReader, lookup: Lookup, mode: Mode, demand: Demand, pool: Pool
) -> list[Answer]:
    """Answer every pair of ``lookup`` as ``demand`` asks, in order (module docstring);
    the database work in ``pool``, the tenant's share of the thread pool."""
    started = time.monotonic()
    deadline = started + demand.wait_ms / 1000
    rank = None
    if demand.after is not None:  # a token sent before: no coroutine of its own
        rank = reader.tokens.known_rank(demand.after)
        if rank is None:
            rank = await rank_of(reader.tokens, demand.after, deadline, pool)
    fresh = Freshness(rank, demand.max_staleness_ms, demand.wait_ms)
    target = reader._target()
    if reader.aredis is not None and reader.local is None:
        covered = await _all_taken(reader, target, lookup, fresh, started)
        if covered is not None:
            return covered
    version = target.store.schema_version
    refs = list(lookup)
    if reader.aredis is None:  # no asyncio client: all of it in the thread pool
        found = await pool(
            functools.partial(
                freshness.read,
                target,
                refs,
                fresh,
                arrivals=reader.arrivals,
                local=reader.local,
                started=started,
                compute=mode == "read-through",
            )
        )
        served.saw(refs, found)
        took = _took(started)
        return [
            _answer(r, took)
            if r is not None
            else _timed(answer(ref.feature_set, ref.entity, None, "miss", 0, version), started)
            for ref, r in zip(refs, found, strict=True)
        ]

    store = target.store
    local = reader.local
    answers: list[Answer | None] = [None] * len(refs)
    pending: list[int] = []
    now = now_ms()
    for i, ref in enumerate(refs):
        entry = local.get(ref, version) if local is not None else None
        if entry is not None and fresh.takes(entry, now):
            answers[i] = _served(ref.feature_set, ref.entity, entry, "local", now, started)
            served.saw((ref,), (entry,))
        else:
            pending.append(i)

    async def take(todo: list[int], source: AnswerSource) -> tuple[list[int], list[int]]:
        """Serve what ``fresh`` takes of ``todo`` from Redis; the rest, split into those
        worth waiting for and those to compute."""
        seal = local.token() if local is not None else 0
        wanted = [refs[i] for i in todo]
        entries = store.entries(wanted, await reader._mget(store.read_keys(wanted)))
        now = now_ms()
        wait: list[int] = []
        compute: list[int] = []
        for i, ref, entry in zip(todo, wanted, entries, strict=True):
            if entry is not None and fresh.takes(entry, now):
                answers[i] = _served(ref.feature_set, ref.entity, entry, source, now, started)
                served.saw((ref,), (entry,))
                if local is not None:
                    local.put(ref, entry, seal)
            else:
                (wait if fresh.awaits(entry) else compute).append(i)
        return wait, compute

    waiting, computing = await take(pending, "hit") if pending else ([], [])
    if waiting and deadline > time.monotonic() and (demand.sized or reader.waits.worth()):
        loop = asyncio.get_running_loop()
        with reader.arrivals.watch([refs[i] for i in waiting], loop) as watch:
            while waiting:
                watch.clear()
                waiting, more = await take(waiting, "waited")  # first: any write since
                computing += more
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    break
                await watch.until(left)
        if not demand.sized:
            reader.waits.record(not waiting)
    computing += waiting
    if computing and mode == "cache-only":
        for i in computing:
            ref = refs[i]
            missed = answer(ref.feature_set, ref.entity, None, "miss", 0, version)
            answers[i] = _timed(missed, started)
            served.saw((ref,), (None,))
    elif computing:
        seal = local.token() if local is not None else 0
        began = now_ms()
        results = await pool(
            target.recompute, [refs[i] for i in computing], lambda e: fresh.takes(e, now_ms())
        )
        served.saw((r.ref for r in results), results)
        took = _took(started)
        for i, r in zip(computing, results, strict=True):
            answers[i] = _answer(fresh.check(r), took)
            if local is not None and r.source != "uncached":
                local.put(r.ref, Entry(r.values, version, began - r.age_ms, r.watermark), seal)
    if target.hot is not None:
        target.hot.record(version, lookup)
    return answers  # type: ignore[return-value]  # every slot is filled


async def _all_taken(
    reader: FeatureReader, target: ReadThrough, lookup: Lookup, fresh: Freshness, started: float
) -> list[Answer] | None:
    """Every pair's answer from one MGET when ``fresh`` takes each entry (a token read
    of entries the consumer has written since, a bounded read of fresh ones: the usual
    case), built as a plain read builds its hits, with no entry or ref object per pair;
    ``None`` otherwise, and the general path reads again."""
    keys = target.store.grid_keys(lookup.tenant, lookup.feature_sets, lookup.entities)
    raws = await reader._mget(keys)
    answers = reader._answers_from(
        target, lookup, "cache-only", raws, now_ms(), keep=fresh.takes_row
    )
    if answers is None:
        return None
    took = _took(started)
    for found in answers:
        found["took_ms"] = took
    if target.hot is not None:
        target.hot.record(target.store.schema_version, lookup)
    return answers


def _took(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _timed(found: Answer, started: float) -> Answer:
    found["took_ms"] = _took(started)
    return found


def _served(
    feature_set: str, entity: str, entry: Entry, source: AnswerSource, now: int, started: float
) -> Answer:
    age = now - entry.computed_at_ms if now > entry.computed_at_ms else 0
    return _timed(
        answer(feature_set, entity, entry.values, source, age, entry.schema_version), started
    )


def _answer(r: Result, took: int) -> Answer:
    found = answer(r.ref.feature_set, r.ref.entity, r.values, r.source, r.age_ms, r.schema_version)
    found["took_ms"] = took
    return found
