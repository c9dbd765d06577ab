"""What the API reads with: the in-process tier (optional), then Redis, then Postgres.

One call answers a :class:`Lookup`, every (feature set, entity) pair of one tenant's
request: the local tier first; one MGET for the rest; for the misses, one query per
feature set through the lease-guarded read-through
(:class:`freshline.pipeline.cache.readthrough.ReadThrough`), unless the mode is ``cache-only``,
which reports them as misses instead.

On the event loop, :meth:`FeatureReader.cached` answers from the local tier and one
MGET with the asyncio client (the same keys, floors and decoding as
:meth:`freshline.pipeline.cache.store.EntryStore.read`); only what needs the database goes to
the thread pool, through :meth:`FeatureReader.read`. Each answer is the JSON object
the API sends for it (:class:`Answer`): one object per entity, built once, except in
:meth:`FeatureReader.cached_batch` for a batch of hits, which answers the whole
response's bytes, spliced from the stored entries (:mod:`freshline.pipeline.api.splice`).

Neither serves an entry from a Redis server the consumers have not vouched for (one
back with fewer writes than it acknowledged, :mod:`freshline.pipeline.cache.server`): the
asyncio client's MGETs read as all absent then, as the store's reads do for
:meth:`FeatureReader.read`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict, cast

import redis

from freshline.pipeline.api.deadlines import Deadlines
from freshline.pipeline.api.fastpath import HeldConnections
from freshline.pipeline.api.splice import Spliced, Splicer
from freshline.pipeline.cache.arrivals import Arrivals, WaitHistory
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.readthrough import ReadThrough
from freshline.pipeline.cache.server import ServerGate, async_server_gate
from freshline.pipeline.cache.tokens import Tokens
from freshline.pipeline.core.clock import now_ms
from freshline.pipeline.core.cluster import amget, is_cluster
from freshline.pipeline.core.codec import Row
from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.features import BIGINT_RULE, validate_key
from freshline.pipeline.core.types import EntityRef, Entry, FeatureValues, LazyRefs
from freshline.pipeline.observe import served

if TYPE_CHECKING:
    import redis.asyncio

Mode = Literal["read-through", "cache-only"]
AnswerSource = Literal["local", "hit", "waited", "computed", "uncached", "miss"]
MODES: tuple[Mode, ...] = ("read-through", "cache-only")
HIT_SOURCES: frozenset[str] = frozenset({"local", "hit", "waited"})
MAX_USER_ID = 10**18
MAX_USER_DIGITS = len(str(MAX_USER_ID - 1))


def parse_entity(value: object) -> str:
    """A user id as the feature queries key it: a non-negative integer, no leading zeros.

    ``"007"`` would reach Redis as a key of its own while Postgres answers for ``7``,
    so only the canonical spelling is accepted.
    """
    if (
        isinstance(value, str)
        and value.isdigit()
        and value.isascii()
        and len(value) <= MAX_USER_DIGITS
        and (len(value) == 1 or value[0] != "0")
    ):
        return value  # the common case; it passes validate_id by construction
    text = validate_key("bigint", value)  # the one rule, and its message
    if int(text) >= MAX_USER_ID:
        raise InvalidId("entity", value, f"{BIGINT_RULE}, of at most {MAX_USER_DIGITS} digits")
    return text


_LEADING_ZERO = re.compile(r"(?<![0-9])0[0-9]")


def parse_entities(values: Sequence[object]) -> list[str]:
    """:func:`parse_entity` of each value; a JSON number such as ``7.0`` is the integer 7.

    The common case, every value a canonical id as a string, is checked over the whole
    list at once (a handful of C-level calls); anything else id by id.
    """
    if values and set(map(type, values)) == {str}:
        texts = cast(Sequence[str], values)
        digits = "".join(texts)  # all digits exactly when each id is
        lengths = list(map(len, texts))
        if (
            digits.isdigit()
            and digits.isascii()
            and min(lengths) >= 1
            and max(lengths) <= MAX_USER_DIGITS
            and not _LEADING_ZERO.search(",".join(texts))
        ):
            return list(texts)
    return [parse_entity(int(v) if isinstance(v, float) and v.is_integer() else v) for v in values]


class Answer(TypedDict):
    """One entity's answer for one feature set: the JSON object the API sends."""

    feature_set: str
    entity: str
    values: FeatureValues | None
    hit: bool
    source: AnswerSource
    age_ms: int
    schema_version: int
    took_ms: NotRequired[int]
    """Only for a read asking for freshness: ms from the request's start until this
    answer was had (:mod:`freshline.pipeline.api.freshness`)."""


def answer(
    feature_set: str,
    entity: str,
    values: FeatureValues | None,
    source: AnswerSource,
    age_ms: int,
    schema_version: int,
) -> Answer:
    return {
        "feature_set": feature_set,
        "entity": entity,
        "values": values,
        "hit": source in HIT_SOURCES,
        "source": source,
        "age_ms": age_ms,
        "schema_version": schema_version,
    }


class Lookup(LazyRefs):
    """Every (feature set, entity) pair of one tenant's request, entity-major.

    ``lookup[i]`` is ``EntityRef(feature_sets[i % k], tenant, entities[i // k])`` for
    ``k`` feature sets, built only when asked for: the read from Redis needs none.
    """

    __slots__ = ("entities", "feature_sets", "tenant")

    def __init__(self, tenant: str, feature_sets: Sequence[str], entities: Sequence[str]) -> None:
        self.tenant = tenant
        self.feature_sets = tuple(feature_sets)
        self.entities = entities

    def __len__(self) -> int:
        return len(self.feature_sets) * len(self.entities)

    def _ref(self, i: int) -> EntityRef:
        e, f = divmod(i, len(self.feature_sets))
        return EntityRef(self.feature_sets[f], self.tenant, self.entities[e])

    def __iter__(self) -> Iterator[EntityRef]:
        tenant, sets = self.tenant, self.feature_sets
        return (EntityRef(fs, tenant, e) for e in self.entities for fs in sets)

    def __repr__(self) -> str:
        return f"Lookup({self.tenant!r}, {self.feature_sets!r}, {list(self.entities)!r})"


class FeatureReader:
    """Reads for the API: ``read(lookup, mode)`` and ``await cached(lookup, mode)``.

    ``aredis`` is the asyncio client :meth:`cached` reads with
    (:func:`freshline.pipeline.api.fastpath.async_client`); the app sets it at start-up, on the
    loop that serves (see :func:`freshline.pipeline.api.app.create_app`). Its reads are bounded
    by ``timeout_s`` (redis-py's socket timeout would cost the loop a timer per
    command, ``asyncio.timeout`` one per call): one check per loop every tenth of it
    (:class:`freshline.pipeline.api.deadlines.Deadlines`), so a read is cut off within 1.1 times
    ``timeout_s``. Unless it is a cluster client, its MGETs run on connections held
    between calls (:class:`freshline.pipeline.api.fastpath.HeldConnections`).

    Reads asking for freshness (:mod:`freshline.pipeline.api.freshness`) check tokens with
    ``tokens`` and wait for writes with ``arrivals`` (made from the read-through's
    engines and Redis when not given; :meth:`close` ends the latter's subscription).
    """

    def __init__(
        self,
        readthrough: ReadThrough,
        local: LocalTier | None = None,
        aredis: redis.asyncio.Redis | None = None,
        timeout_s: float | None = None,
        *,
        tokens: Tokens | None = None,
        arrivals: Arrivals | None = None,
    ) -> None:
        self.readthrough = readthrough
        self.local = local
        self.aredis = aredis
        self.tokens = tokens or Tokens(
            readthrough.primary or readthrough.engine, readthrough.store.redis
        )
        self.arrivals = arrivals or Arrivals(readthrough.store.redis)
        self.waits = WaitHistory()
        self.timeout_s = timeout_s
        self._deadlines = None if timeout_s is None else Deadlines(tick_s=timeout_s / 10)
        self._splicers: dict[tuple[str, int], Splicer] = {}  # (feature set, version)
        # The MGETs' connections (freshline.pipeline.api.fastpath), for aredis unless a cluster.
        self._held: HeldConnections | None = None
        self._held_for: object = None
        self._gate = ServerGate(vouched=True)  # aredis's (freshline.pipeline.cache.server)

    def close(self) -> None:
        """End the subscription reads asking for freshness wait with (if it started)."""
        self.arrivals.close()

    @property
    def schema_version(self) -> int:
        """The version this call would serve: the active pointer's, when following it."""
        rt = self.readthrough
        return rt.store.schema_version if rt.versions is None else rt.versions.current()

    def _target(self) -> ReadThrough:
        # The read-through's per-version twin, so cache-only reads and the local tier
        # use the same namespace as read-through ones within a call.
        return self.readthrough.for_call()

    def read(self, lookup: Lookup, mode: Mode = "read-through") -> list[Answer]:
        """Answer every pair, in order, all from one schema version (blocking)."""
        target = self._target()
        refs = list(lookup)
        answers, pending = self._from_local(target, refs)
        if pending:
            todo = [refs[i] for i in pending]
            token = self.local.token() if self.local is not None else 0
            fetched = (
                self._cache_only(target, todo)
                if mode == "cache-only"
                else self._through(target, todo)
            )
            self._fill(answers, pending, todo, fetched, token)
        return answers  # type: ignore[return-value]  # every slot is filled

    async def cached(self, lookup: Lookup, mode: Mode = "read-through") -> list[Answer] | None:
        """Every pair from the local tier or one MGET, without blocking the event loop.

        ``None`` when :meth:`read` must finish the job off the loop: a miss, or a hot
        entry that XFetch picks for early refresh, in ``read-through`` mode (in
        ``cache-only`` mode a miss is an answer), or no asyncio client.
        """
        if self.aredis is None:
            return None
        target = self._target()
        if self.local is None:
            answers = await self._from_redis(target, lookup, mode)
        else:
            answers = await self._through_tier(self.local, target, lookup, mode)
        if answers is not None and target.hot is not None:
            # read() samples its reads in ReadThrough.get_many
            target.hot.record(target.store.schema_version, lookup)
        return answers

    async def _mget(self, keys: list[str]) -> list[bytes | None]:
        aredis = self.aredis
        if self._held_for is not aredis:  # a client set since the last call
            self._held_for = aredis
            self._held = None if aredis is None or is_cluster(aredis) else HeldConnections(aredis)
            if aredis is not None:
                self._gate = async_server_gate(aredis)
        call = amget(aredis, keys) if self._held is None else self._held.mget(keys)
        if self.timeout_s is None or self._deadlines is None:
            raws = await call
        else:
            try:
                raws = await self._deadlines.bound(call, self.timeout_s)
            except TimeoutError:
                # The cancelled command dropped its connection (redis-py disconnects on
                # any interruption), so no reply is left behind for the next one.
                raise redis.exceptions.TimeoutError(
                    f"Redis did not answer within {self.timeout_s:g} s"
                ) from None
        gate = self._gate
        if gate.vouched or (aredis is not None and await gate.aadmits(aredis)):
            return raws
        return [None] * len(raws)

    async def cached_batch(
        self, lookup: Lookup, mode: Mode = "read-through"
    ) -> Spliced | list[Answer] | None:
        """:meth:`cached` for a batch, which answers one feature set's hits (without the
        local tier) with the answer's bytes spliced from the stored entries
        (:mod:`freshline.pipeline.api.splice`): the same bytes as encoding :meth:`cached`'s
        answers."""
        if self.aredis is None or self.local is not None or len(lookup.feature_sets) != 1:
            return await self.cached(lookup, mode)
        target = self._target()
        store = target.store
        version = store.schema_version
        [fs] = lookup.feature_sets
        raws = await self._mget(
            store.grid_keys(lookup.tenant, lookup.feature_sets, lookup.entities)
        )
        served.saw_grid(lookup.feature_sets, lookup.entities, raws)
        now = now_ms()
        splicer = self._splicers.get((fs, version))
        if splicer is None:
            splicer = self._splicers[fs, version] = Splicer(fs, store.fields(fs), version)
        spliced = splicer.body(lookup.entities, raws[:-1], raws[-1], now)
        result: Spliced | list[Answer] | None = spliced
        if spliced is None:
            result = self._answers_from(target, lookup, mode, raws, now)
        elif mode == "read-through":  # an entry XFetch picks is the thread pool's job
            horizon = target.refresh_horizon(fs, now)
            computed = spliced.computed_at_ms
            if min(computed) <= horizon and any(
                c <= horizon and target.draw_refresh(fs, c, now) for c in computed
            ):
                return None
        if result is not None and target.hot is not None:
            target.hot.record(version, lookup)
        return result

    async def _from_redis(
        self, target: ReadThrough, lookup: Lookup, mode: Mode
    ) -> list[Answer] | None:
        """One MGET for the whole lookup; no entry object, one answer per pair."""
        raws = await self._mget(
            target.store.grid_keys(lookup.tenant, lookup.feature_sets, lookup.entities)
        )
        return self._answers_from(target, lookup, mode, raws, now_ms())

    @staticmethod
    def _answers_from(
        target: ReadThrough,
        lookup: Lookup,
        mode: Mode,
        raws: list[bytes | None],
        now: int,
        keep: Callable[[Row, int], bool] | None = None,
    ) -> list[Answer] | None:
        """The answers of the MGET of the lookup's :meth:`EntryStore.grid_keys`; with
        ``keep``, ``None`` unless every pair has an entry that ``keep(row, now)`` takes."""
        store = target.store
        version = store.schema_version
        sets, entities = lookup.feature_sets, lookup.entities
        served.saw_grid(sets, entities, raws)
        k = len(sets)
        n = len(raws) - k
        through = mode == "read-through"
        columns: list[list[Answer]] = []
        for j, fs in enumerate(sets):
            rows = store.rows(fs, raws[j:n:k], raws[n + j])
            if keep is not None and not all(row is not None and keep(row, now) for row in rows):
                return None
            if through:  # a miss, or an entry XFetch picks, is the thread pool's job
                horizon = target.refresh_horizon(fs, now)
                for row in rows:
                    if row is None or (row[1] <= horizon and target.draw_refresh(fs, row[1], now)):
                        return None
            columns.append(
                [
                    {
                        "feature_set": fs,
                        "entity": entity,
                        "values": None,
                        "hit": False,
                        "source": "miss",
                        "age_ms": 0,
                        "schema_version": version,
                    }
                    if row is None
                    else {
                        "feature_set": fs,
                        "entity": entity,
                        "values": row[0],
                        "hit": True,
                        "source": "hit",
                        "age_ms": now - row[1] if now > row[1] else 0,
                        "schema_version": version,
                    }
                    for entity, row in zip(entities, rows, strict=True)
                ]
            )
        if k == 1:
            return columns[0]
        return [column[i] for i in range(len(entities)) for column in columns]

    async def _through_tier(
        self, local: LocalTier, target: ReadThrough, lookup: Lookup, mode: Mode
    ) -> list[Answer] | None:
        """The local tier first, one MGET for the rest, whose entries then fill the tier."""
        store = target.store
        refs = list(lookup)
        answers, pending = self._from_local(target, refs)
        if pending:
            todo = refs if len(pending) == len(refs) else [refs[i] for i in pending]
            token = local.token()
            entries = store.entries(todo, await self._mget(store.read_keys(todo)))
            served.saw(todo, entries)
            now = now_ms()
            if mode == "read-through" and any(
                entry is None or target.should_refresh(ref, entry, now)
                for ref, entry in zip(todo, entries, strict=True)
            ):
                return None
            self._fill(
                answers,
                pending,
                todo,
                self._answers(todo, entries, now, store.schema_version),
                token,
            )
        return answers  # type: ignore[return-value]  # every slot is filled

    def _from_local(
        self,
        target: ReadThrough,
        refs: Sequence[EntityRef],
    ) -> tuple[list[Answer | None], list[int]]:
        """Answers from the in-process tier, and the positions it did not have."""
        answers: list[Answer | None] = [None] * len(refs)
        if self.local is None:
            return answers, list(range(len(refs)))
        version = target.store.schema_version
        pending: list[int] = []
        now = now_ms()
        for i, ref in enumerate(refs):
            entry = self.local.get(ref, version)
            if entry is None:
                pending.append(i)
            else:
                served.saw((ref,), (entry,))
                answers[i] = answer(
                    ref.feature_set,
                    ref.entity,
                    entry.values,
                    "local",
                    max(0, now - entry.computed_at_ms),
                    version,
                )
        return answers, pending

    def _fill(
        self,
        answers: list[Answer | None],
        pending: list[int],
        refs: list[EntityRef],
        fetched: list[tuple[Answer, Entry | None]],
        token: int,
    ) -> None:
        """Put fetched answers in place, and their entries in the in-process tier.

        A computed entry was written, not read: the tier stores it once it sees Redis
        hold it (its own write's change report voids ``token``; see
        :mod:`freshline.pipeline.cache.local`).
        """
        local = self.local
        for i, ref, (found, entry) in zip(pending, refs, fetched, strict=True):
            answers[i] = found
            if local is not None and entry is not None:
                local.put(ref, entry, token, verify=found["source"] == "computed")

    @staticmethod
    def _answers(
        refs: Sequence[EntityRef], entries: Sequence[Entry | None], now: int, version: int
    ) -> list[tuple[Answer, Entry | None]]:
        """Hits and misses, as read from Redis."""
        return [
            (answer(ref.feature_set, ref.entity, None, "miss", 0, version), None)
            if entry is None
            else (
                answer(
                    ref.feature_set,
                    ref.entity,
                    entry.values,
                    "hit",
                    max(0, now - entry.computed_at_ms),
                    entry.schema_version,
                ),
                entry,
            )
            for ref, entry in zip(refs, entries, strict=True)
        ]

    @classmethod
    def _cache_only(
        cls, target: ReadThrough, refs: list[EntityRef]
    ) -> list[tuple[Answer, Entry | None]]:
        entries = target.store.read(refs)
        served.saw(refs, entries)
        return cls._answers(refs, entries, now_ms(), target.store.schema_version)

    @staticmethod
    def _through(target: ReadThrough, refs: list[EntityRef]) -> list[tuple[Answer, Entry | None]]:
        started_ms = now_ms()
        out: list[tuple[Answer, Entry | None]] = []
        results = target.get_many(refs)
        served.saw(refs, results)
        for r in results:
            found = answer(
                r.ref.feature_set, r.ref.entity, r.values, r.source, r.age_ms, r.schema_version
            )
            entry = None
            if r.source != "uncached":
                # ``started_ms - age`` is no later than the true computed_at, so the
                # local copy's lifetime errs short. A computed value is held only once
                # Redis is seen holding it (LocalTier.put's verify): one whose store
                # was refused never is.
                entry = Entry(r.values, r.schema_version, started_ms - r.age_ms, r.watermark)
            out.append((found, entry))
        return out
