"""What the API reads with: the in-process tier (optional), then Redis, then Postgres.

One call answers many (feature set, entity) pairs of one tenant: the local tier
first; one MGET for the rest; for the misses, one query per feature set through the
lease-guarded read-through (:class:`pipeline.cache.readthrough.ReadThrough`), unless the
mode is ``cache-only``, which reports them as misses instead.

On the event loop, :meth:`FeatureReader.cached` answers from the local tier and one
MGET with the asyncio client (the same keys, floors and decoding as
:meth:`pipeline.cache.store.FeatureStore.read`); only what needs the database goes to
the thread pool, through :meth:`FeatureReader.read`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

from pipeline.cache.local import LocalTier
from pipeline.cache.readthrough import ReadThrough
from pipeline.core.clock import now_ms
from pipeline.core.cluster import amget
from pipeline.core.errors import InvalidId
from pipeline.core.keys import validate_id
from pipeline.core.types import EntityRef, Entry, FeatureValues

if TYPE_CHECKING:
    import redis.asyncio

Mode = Literal["read-through", "cache-only"]
AnswerSource = Literal["local", "hit", "waited", "computed", "uncached", "miss"]
MODES: tuple[Mode, ...] = ("read-through", "cache-only")
MAX_USER_ID = 10**18
MAX_USER_DIGITS = len(str(MAX_USER_ID - 1))


def parse_entity(value: object) -> str:
    """A user id as the feature queries key it: a non-negative integer, no leading zeros.

    ``"007"`` would reach Redis as a key of its own while Postgres answers for ``7``,
    so only the canonical spelling is accepted.
    """
    if (isinstance(value, str) and value.isdigit() and value.isascii()
            and len(value) <= MAX_USER_DIGITS and (len(value) == 1 or value[0] != "0")):
        return value  # the common case; it passes validate_id by construction
    text = validate_id("entity", value)
    if not text.isdigit() or (len(text) > 1 and text[0] == "0") or int(text) >= MAX_USER_ID:
        raise InvalidId("entity", value, "a user id is a non-negative integer, no leading zeros")
    return text


class Answer(NamedTuple):
    """One ref's answer (a tuple: one cheap object per entity of a response)."""

    ref: EntityRef
    values: FeatureValues | None
    source: AnswerSource
    age_ms: int
    schema_version: int

    @property
    def hit(self) -> bool:
        return self.source in ("local", "hit", "waited")


class FeatureReader:
    """Reads for the API: ``read(refs, mode)`` and ``await cached(refs, mode)``.

    ``aredis`` is the asyncio client :meth:`cached` reads with; the app sets it at
    start-up, on the loop that serves (see :func:`pipeline.api.app.create_app`).
    """

    def __init__(self, readthrough: ReadThrough, local: LocalTier | None = None,
                 aredis: redis.asyncio.Redis | None = None) -> None:
        self.readthrough = readthrough
        self.local = local
        self.aredis = aredis

    @property
    def schema_version(self) -> int:
        """The version this call would serve: the active pointer's, when following it."""
        return self._target().store.schema_version

    def _target(self) -> ReadThrough:
        rt = self.readthrough
        if rt.versions is None:
            return rt
        version = rt.versions.current(rt.store.registry)
        # The read-through's per-version twin, so cache-only reads and the local tier
        # use the same namespace as read-through ones within a call.
        return rt if version == rt.store.schema_version else rt._for_version(version)

    def read(self, refs: Sequence[EntityRef], mode: Mode = "read-through") -> list[Answer]:
        """Answer every ref, in order, all from one schema version (blocking)."""
        target = self._target()
        answers, pending = self._from_local(target, refs)
        if pending:
            todo = [refs[i] for i in pending]
            token = self.local.token() if self.local is not None else 0
            fetched = (self._cache_only(target, todo) if mode == "cache-only"
                       else self._through(target, todo))
            self._fill(answers, pending, fetched, token)
        return [a for a in answers if a is not None]

    async def cached(self, refs: Sequence[EntityRef],
                     mode: Mode = "read-through") -> list[Answer] | None:
        """Every ref from the local tier or one MGET, without blocking the event loop.

        ``None`` when :meth:`read` must finish the job off the loop: a miss, or a hot
        entry that XFetch picks for early refresh, in ``read-through`` mode (in
        ``cache-only`` mode a miss is an answer), or no asyncio client.
        """
        if self.aredis is None:
            return None
        target = self._target()
        store = target.store
        answers, pending = self._from_local(target, refs)
        if pending:
            todo = refs if len(pending) == len(refs) else [refs[i] for i in pending]
            token = self.local.token() if self.local is not None else 0
            entries = store.entries(todo, await amget(self.aredis, store.read_keys(todo)))
            now = now_ms()
            if mode == "read-through" and any(
                    entry is None or target.should_refresh(ref, entry, now)
                    for ref, entry in zip(todo, entries, strict=True)):
                return None
            self._fill(answers, pending,
                       self._answers(todo, entries, now, store.schema_version), token)
        if target.hot is not None:  # read() samples its reads in ReadThrough.get_many
            target.hot.record(store.schema_version, refs)
        return answers  # type: ignore[return-value]  # every slot is filled

    def _from_local(self, target: ReadThrough, refs: Sequence[EntityRef],
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
                answers[i] = Answer(ref, entry.values, "local",
                                    max(0, now - entry.computed_at_ms), version)
        return answers, pending

    def _fill(self, answers: list[Answer | None], pending: list[int],
              fetched: list[tuple[Answer, Entry | None]], token: int) -> None:
        """Put fetched answers in place, and their entries in the in-process tier."""
        local = self.local
        for i, (answer, entry) in zip(pending, fetched, strict=True):
            answers[i] = answer
            if local is not None and entry is not None:
                local.put(answer.ref, entry, token)

    @staticmethod
    def _answers(refs: Sequence[EntityRef], entries: Sequence[Entry | None], now: int,
                 version: int) -> list[tuple[Answer, Entry | None]]:
        """Hits and misses, as read from Redis."""
        return [(Answer(ref, None, "miss", 0, version), None) if entry is None
                else (Answer(ref, entry.values, "hit", max(0, now - entry.computed_at_ms),
                             entry.schema_version), entry)
                for ref, entry in zip(refs, entries, strict=True)]

    @classmethod
    def _cache_only(cls, target: ReadThrough,
                    refs: list[EntityRef]) -> list[tuple[Answer, Entry | None]]:
        entries = target.store.read(refs)
        return cls._answers(refs, entries, now_ms(), target.store.schema_version)

    @staticmethod
    def _through(target: ReadThrough,
                 refs: list[EntityRef]) -> list[tuple[Answer, Entry | None]]:
        started_ms = now_ms()
        out: list[tuple[Answer, Entry | None]] = []
        for r in target.get_many(refs):
            answer = Answer(r.ref, r.values, r.source, r.age_ms, r.schema_version)
            entry = None
            if r.source != "uncached":
                # ``started_ms - age`` is no later than the true computed_at, so the
                # local copy's lifetime errs short. A computed value whose store was
                # refused is safe to hold too: the invalidation that revoked its lease
                # is published after it, and voids this put or drops the copy.
                entry = Entry(r.values, r.schema_version, started_ms - r.age_ms, r.watermark)
            out.append((answer, entry))
        return out
