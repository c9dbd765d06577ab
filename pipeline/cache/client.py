"""The Python client for scoring services: features straight from Redis, no HTTP hop.

One call reads any number of (feature set, tenant, entity) entries in one Redis round
trip and returns each with its age and schema version, or ``None`` for a miss: the
caller decides whether to read through (:class:`freshline.pipeline.cache.readthrough.ReadThrough`).
With ``local=`` a started :class:`freshline.pipeline.cache.local.LocalTier` answers first, and the
entries read from Redis fill it.

With ``readthrough=``, a read may ask for freshness: ``after=`` a token from
``freshline.token()`` (:func:`freshline.pipeline.cache.tokens.freshline_token`), or
``max_staleness_ms=``; it then never answers ``None``, and never an entry older than
asked (:mod:`freshline.pipeline.cache.freshness`).

With ``served=`` (a :class:`freshline.pipeline.observe.served.ServedLog`) the client logs
its reads as the read API does, in the same records (route ``client``): a call is
logged when a feature set it reads asks for it (``log_sample``) or the log's settings
do (``FRESHLINE_SERVED_LOG_SAMPLE``), sampled by a hash of its ``request_id``, or always
with ``log=True``.

A Redis server back with fewer writes than it acknowledged (restarted from an older
snapshot, a replica promoted) serves nothing until a consumer has raised the floors:
its entries are misses meanwhile (:mod:`freshline.pipeline.cache.server`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, overload

import redis

from freshline.pipeline.cache import freshness
from freshline.pipeline.cache.arrivals import Arrivals
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.tokens import Tokens, freshline_token
from freshline.pipeline.core import frames
from freshline.pipeline.core.clock import now_ms
from freshline.pipeline.core.codec import Row, parse_watermark
from freshline.pipeline.core.errors import ConfigError, SchemaVersionUnknown
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.types import EntityRef, Entry, FeatureValues, Item, LazyRefs

if TYPE_CHECKING:
    import pyarrow as pa

    from freshline.pipeline.cache.hot import HotReads
    from freshline.pipeline.cache.local import LocalTier
    from freshline.pipeline.cache.readthrough import ReadThrough
    from freshline.pipeline.cache.roster import Registration
    from freshline.pipeline.cache.versions import Pointer, VersionResolver
    from freshline.pipeline.core.lock import Lock
    from freshline.pipeline.core.settings import Settings

__all__ = ["FeatureClient", "Features", "ReadLog", "freshline_token"]


class Features(NamedTuple):
    """One entity's features as served: values, age and the schema version.

    A named tuple: of the objects a read makes per entity, the cheapest to build.
    """

    feature_set: str
    tenant: str
    entity: str
    values: FeatureValues
    age_ms: int
    schema_version: int
    watermark: int


Read = tuple[str, str, str, str, Features | None]
"""One read as logged: feature set, tenant, entity, where it came from, what it served."""


class ReadLog(Protocol):
    """Where a client logs its reads: :class:`freshline.pipeline.observe.served.ServedLog`
    (a layer above this one, hence a protocol here)."""

    @property
    def enabled(self) -> bool: ...
    @property
    def sample(self) -> float: ...
    def chosen(self, request_id: str | None, rate: float, asked: bool) -> str | None:
        """The call's request id if it is logged at ``rate`` (or ``asked``), else None."""
        ...

    def log_reads(self, request_id: str, route: str, at_us: int, reads: Sequence[Read]) -> None:
        """Queue the records of one call's ``reads``."""
        ...

    def close(self, timeout_s: float = 10.0) -> None: ...


class _Refs(LazyRefs):
    """Items seen as refs, each built only when asked for (hot-read sampling reads a few)."""

    __slots__ = ("items",)

    def __init__(self, items: list[Item]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def _ref(self, i: int) -> EntityRef:
        return EntityRef(*self.items[i])


class FeatureClient:
    """Read feature entries for one schema version, or for the active one.

    >>> client = FeatureClient.from_url("redis://127.0.0.1:6379/0", schema_version=1)
    >>> client.get("txn_90d", "acme", "42")  # Features(...) or None

    With ``versions`` (see :meth:`following`) each call reads the version the
    resolver names at its start, decoded with that version's locked field list, so
    the client follows a deploy flip without a restart and no answer mixes versions.
    With ``hot``, reads are sampled into the per-entity counters that warming uses
    (:meth:`following` flushes them in the background, so sampling costs no round trip).
    With ``readthrough`` (on the same Redis), reads may ask for freshness (the module
    docstring); :meth:`close` then ends the subscription they wait with.
    """

    def __init__(
        self,
        client: redis.Redis,
        schema_version: int,
        *,
        registry: Registry,
        local: LocalTier | None = None,
        versions: VersionResolver | None = None,
        hot: HotReads | None = None,
        readthrough: ReadThrough | None = None,
        served: ReadLog | None = None,
    ) -> None:
        self.store = EntryStore(client, schema_version, registry=registry)
        self.local = local
        self.versions = versions
        self.hot = hot
        self.readthrough = readthrough
        self.served = served if served is not None and served.enabled else None
        # The share of calls each feature set logs (FeatureSet.log_sample), where it logs any.
        self._log_samples = {fs.name: fs.log_sample for fs in registry if fs.log_sample > 0}
        self._stores = {schema_version: self.store}
        self._tokens: Tokens | None = None
        self._arrivals: Arrivals | None = None
        self._registration: Registration | None = None
        # Each feature set's entity: ids are checked and normalised by its key type.
        self._entities = {fs.name: fs.entity for fs in registry}
        # The feature sets that declare a default freshness bound (FeatureSet.max_staleness_ms).
        self._bounds = {
            fs.name: fs.max_staleness_ms for fs in registry if fs.max_staleness_ms is not None
        }

    @classmethod
    def from_url(
        cls,
        url: str,
        schema_version: int,
        *,
        registry: Registry,
        local: LocalTier | None = None,
    ) -> FeatureClient:
        return cls(redis.Redis.from_url(url), schema_version, registry=registry, local=local)

    @classmethod
    def following(  # noqa: PLR0913 (the constructor's collaborators, each optional)
        cls,
        client: redis.Redis,
        settings: Settings,
        *,
        listen: bool = True,
        registry: Registry,
        pointer: Pointer | None = None,
        lock: Lock | None = None,
        local: LocalTier | None = None,
        readthrough: ReadThrough | None = None,
        served: ReadLog | None = None,
    ) -> FeatureClient:
        """A client on the active-version pointer that samples reads for warming
        (``local``: an in-process tier in front of Redis; ``readthrough``: see the class;
        with ``served``, it logs them).

        Listening, it registers itself as a reader (:mod:`freshline.pipeline.cache.roster`) until
        :meth:`close`, so ``deploy flip`` knows which versions it can serve.
        """
        from freshline.pipeline.cache.hot import HotReads
        from freshline.pipeline.cache.roster import Proc, Registration
        from freshline.pipeline.cache.versions import DEFAULT_POINTER, VersionResolver

        pointer = pointer or DEFAULT_POINTER
        versions = VersionResolver(client, settings, pointer=pointer, lock=lock)
        features = cls(
            client,
            settings.schema_version,
            registry=registry,
            local=local,
            versions=versions,
            hot=HotReads(client, flush_s=1.0),
            readthrough=readthrough,
            served=served,
        )
        if listen:
            versions.listen()
            proc = Proc.of("client", versions.lock, registry, pointer=pointer)
            features._registration = Registration(
                client, proc, pointer=pointer, serving=versions.current
            ).start()
        return features

    def get(
        self,
        feature_set: str,
        tenant: str,
        entity: str | int,
        *,
        after: str | None = None,
        max_staleness_ms: int | None = None,
        wait_ms: int = freshness.DEFAULT_WAIT_MS,
        request_id: str | None = None,
        log: bool = False,
    ) -> Features | None:
        """:meth:`get_many` of one item."""
        return self.get_many(
            [(feature_set, tenant, entity)],
            after=after,
            max_staleness_ms=max_staleness_ms,
            wait_ms=wait_ms,
            request_id=request_id,
            log=log,
        )[0]

    @overload
    def get_many(
        self,
        items: Sequence[tuple[str, str, str | int]],
        *,
        after: str | None = ...,
        max_staleness_ms: int | None = ...,
        wait_ms: int = ...,
        as_: Literal["features"] = ...,
        request_id: str | None = ...,
        log: bool = ...,
    ) -> list[Features | None]: ...

    @overload
    def get_many(
        self,
        items: Sequence[tuple[str, str, str | int]],
        *,
        after: str | None = ...,
        max_staleness_ms: int | None = ...,
        wait_ms: int = ...,
        as_: Literal["arrow"],
        request_id: str | None = ...,
        log: bool = ...,
    ) -> pa.Table: ...

    def get_many(
        self,
        items: Sequence[tuple[str, str, str | int]],
        *,
        after: str | None = None,
        max_staleness_ms: int | None = None,
        wait_ms: int = freshness.DEFAULT_WAIT_MS,
        as_: Literal["features", "arrow"] = "features",
        request_id: str | None = None,
        log: bool = False,
    ) -> list[Features | None] | pa.Table:
        """All ``items`` in one MGET, in order; ``None`` marks a miss.

        With ``as_="arrow"``, an Arrow table instead, a row per item
        (:func:`freshline.pipeline.core.frames.items_frame`: ``feature_set``, ``tenant``,
        ``entity``, ``age_ms``, ``schema_version``, then each set's fields as
        ``feature_set__field``, typed as training sets type them; a miss is nulls). It
        needs pyarrow (the ``training`` extra).

        With ``after`` (a freshness token) or ``max_staleness_ms``, only entries at or
        after the token, computed less than ``max_staleness_ms`` ago, are served; others
        are waited for (``after``: up to ``wait_ms``, for the consumer's write) and then
        computed, so nothing is ``None`` (see :mod:`freshline.pipeline.cache.freshness`; which of
        those happened is the read-through's to count, :attr:`ReadThrough.counters`).
        A feature set that declares ``max_staleness_ms`` gives it to a read that gives
        none (the smallest of the items' sets); without a read-through an entry past it
        is a miss.

        Each entity id is checked and normalised as its feature set's entity keys it
        (:func:`freshline.pipeline.core.features.validate_key`, the read API's rule: an upper-case
        uuid reads the entry of its lower-case spelling); one that is not a key of that
        type raises :class:`~freshline.pipeline.core.errors.InvalidId`, as HTTP answers 400.

        With a served log (the module docstring), ``request_id`` names the call in it (1
        to 64 of ``A-Z a-z 0-9 . _ : -``, else one is made) and ``log=True`` logs it
        whatever the sampling.
        """
        if as_ != "features":  # one comparison on the hot path
            if as_ != "arrow":
                raise ValueError(f"as_ is 'features' or 'arrow', not {as_!r}")
            frames.arrow()  # before the read: without pyarrow, say so first
            named = self._canonical(items)
            found = self.get_many(
                named,
                after=after,
                max_staleness_ms=max_staleness_ms,
                wait_ms=wait_ms,
                request_id=request_id,
                log=log,
            )
            return frames.items_frame(self.store.registry, named, found)
        items = self._canonical(items)
        served = self.served
        logged = None if served is None else self._logged(served, items, request_id, log)
        if served is None or logged is None:
            return self._read(items, after, max_staleness_ms, wait_ms, None)
        at_us = time.time_ns() // 1000
        sources: list[str] = []
        found = self._read(items, after, max_staleness_ms, wait_ms, sources)
        self._log(served, logged, at_us, items, found, sources)
        return found

    def _read(
        self,
        items: list[Item],
        after: str | None,
        max_staleness_ms: int | None,
        wait_ms: int,
        sources: list[str] | None,
    ) -> list[Features | None]:
        if self._bounds and max_staleness_ms is None:
            bounds = [self._bounds[fs] for fs, _, _ in items if fs in self._bounds]
            if bounds:  # the sets' declared default, the smallest
                max_staleness_ms = min(bounds)
                if after is None and self.readthrough is None:
                    return self._within(items, max_staleness_ms, sources)
        if after is not None or max_staleness_ms is not None:
            return self._fresh(items, after, max_staleness_ms, wait_ms, sources)
        return self._plain(items, sources)

    def _logged(
        self, log: ReadLog, items: list[Item], request_id: str | None, asked: bool
    ) -> str | None:
        """The call's request id if it is logged, else ``None``."""
        rate = max([log.sample, *(self._log_samples.get(fs, 0.0) for fs, _, _ in items)])
        if rate <= 0.0 and not asked:
            return None
        return log.chosen(request_id, rate, asked)

    @staticmethod
    def _log(
        log: ReadLog,
        rid: str,
        at_us: int,
        items: list[Item],
        found: list[Features | None],
        sources: list[str],
    ) -> None:
        """Queue the call's records, as the read API's."""
        reads: list[Read] = [
            (fs, tenant, entity, "miss" if features is None else source, features)
            for (fs, tenant, entity), features, source in zip(items, found, sources, strict=True)
        ]
        log.log_reads(rid, "client", at_us, reads)

    def get_frame(
        self,
        features: Sequence[str],
        tenant: str,
        entities: Sequence[str | int],
        *,
        after: str | None = None,
        max_staleness_ms: int | None = None,
        wait_ms: int = freshness.DEFAULT_WAIT_MS,
    ) -> pa.Table:
        """Batch scoring reads as an Arrow table, a row per entity of ``entities``, in order.

        ``features``: feature sets (``txn_90d``, every field) or ``set:field``, of one
        entity. Columns: the entity's tenant column (where it has one) and key column,
        then a column per field, ``feature_set__field``, named and typed as
        :func:`freshline.training_set` names and types them, so a model trained on a
        training set scores on this frame. One MGET (:meth:`get_many`, whose freshness
        keywords it takes); a miss is nulls. Needs pyarrow (the ``training`` extra):
        without it, :class:`~freshline.pipeline.core.frames.FrameError` says so.
        """
        frames.arrow()  # before the read: without pyarrow, say so first
        wanted = frames.requested(self.store.registry, features)
        sets = list(dict.fromkeys(r.feature_set for r in wanted))
        entity = sets[0].entity
        other = next((fs for fs in sets if fs.entity.name != entity.name), None)
        if other is not None:
            raise frames.FrameError(
                f"a frame is about one entity: {sets[0].name!r} is about {entity.name!r}, "
                f"{other.name!r} about {other.entity.name!r}"
            )
        ids = [entity.validate(e) for e in entities]
        found = self.get_many(
            [(fs.name, tenant, i) for fs in sets for i in ids],
            after=after,
            max_staleness_ms=max_staleness_ms,
            wait_ms=wait_ms,
        )
        n = len(ids)
        by_set = {fs.name: found[k * n : (k + 1) * n] for k, fs in enumerate(sets)}
        return frames.entity_frame(entity, wanted, tenant, ids, by_set)

    def _canonical(self, items: Sequence[tuple[str, str, str | int]]) -> list[Item]:
        """``items`` with each entity id in its key type's canonical text."""
        entities = self._entities
        out: list[Item] = []
        append = out.append
        for fs, tenant, entity in items:
            of = entities.get(fs)
            if of is None:  # not this registry's: the store names the sets it has
                append((fs, tenant, entity if type(entity) is str else str(entity)))
            elif (
                of.type == "bigint"
                and type(entity) is str
                and entity.isdigit()
                and entity.isascii()
                and len(entity) <= 18  # below 2**63 - 1 by its length
                and (len(entity) == 1 or entity[0] != "0")
            ):
                append((fs, tenant, entity))  # the common case, without a call
            else:
                append((fs, tenant, of.validate(entity)))
        return out

    def _plain(
        self, items: Sequence[tuple[str, str, str | int]], sources: list[str] | None = None
    ) -> list[Features | None]:
        """Every item as cached (tier, then Redis), ``None`` for a miss; with ``sources``,
        where each answer came from is appended there (for the served log)."""
        store = self._store_for_call()
        version = store.schema_version
        named = _named(items)
        out: list[Features | None] = []
        append = out.append
        if self.local is not None:
            entries = self._through_tier(self.local, named, store, sources)
            now = time.time_ns() // 1_000_000
            for (fs, tenant, entity), e in zip(named, entries, strict=True):
                append(
                    None
                    if e is None
                    else Features(
                        fs,
                        tenant,
                        entity,
                        e.values,
                        max(0, now - e.computed_at_ms),
                        e.schema_version,
                        e.watermark,
                    )
                )
        else:
            rows = store.read_rows(named)
            out = self._rows_as_features(named, rows, version)
            if store is not self.store and None in rows and self._stands_in(version):
                # A version this code does not compute: its misses, from the own one.
                missing = [i for i, row in enumerate(rows) if row is None]
                own = self.store
                found = self._rows_as_features(
                    [named[i] for i in missing],
                    own.read_rows([named[i] for i in missing]),
                    own.schema_version,
                )
                for i, features in zip(missing, found, strict=True):
                    out[i] = features
            if sources is not None:
                sources.extend("hit" for _ in out)
        if self.hot is not None:
            self.hot.record(version, _Refs(named))
        return out

    @staticmethod
    def _rows_as_features(
        named: Sequence[Item], rows: Sequence[Row | None], version: int
    ) -> list[Features | None]:
        """Each item's :class:`Features` from its decoded row (no entry object in
        between), ``None`` for a miss."""
        now = time.time_ns() // 1_000_000
        out: list[Features | None] = []
        append = out.append
        for (fs, tenant, entity), row in zip(named, rows, strict=True):
            if row is None:
                append(None)
                continue
            values, computed_at_ms, watermark = row
            age_ms = now - computed_at_ms
            append(
                Features(
                    fs,
                    tenant,
                    entity,
                    values,
                    age_ms if age_ms > 0 else 0,
                    version,
                    parse_watermark(watermark),
                )
            )
        return out

    def _within(
        self,
        items: Sequence[tuple[str, str, str | int]],
        bound_ms: int,
        sources: list[str] | None = None,
    ) -> list[Features | None]:
        """A plain read under a declared bound with nothing to recompute with: an entry
        computed ``bound_ms`` ago or longer is a miss."""
        found = self._plain(items, sources)
        return [f if f is not None and f.age_ms < bound_ms else None for f in found]

    def _fresh(
        self,
        items: Sequence[tuple[str, str, str | int]],
        after: str | None,
        max_staleness_ms: int | None,
        wait_ms: int,
        sources: list[str] | None = None,
    ) -> list[Features | None]:
        started = time.monotonic()
        rt = self.readthrough
        if rt is None:
            raise ConfigError(
                "reads with after= or max_staleness_ms= need FeatureClient(readthrough=...)"
            )
        if max_staleness_ms is not None and max_staleness_ms < 0:
            raise ValueError(f"max_staleness_ms must be 0 or more, got {max_staleness_ms}")
        if self._tokens is None:
            self._tokens = Tokens(rt.primary or rt.engine, self.store.redis)
        if self._arrivals is None:
            self._arrivals = Arrivals(self.store.redis)
        rank = None
        if after is not None:
            rank = freshness.rank_of(self._tokens, after, started + max(0, wait_ms) / 1000)
        fresh = freshness.Freshness(rank, max_staleness_ms, max(0, wait_ms))
        store = self._store_for_call()
        version = store.schema_version
        if self.local is None:
            # Every entry taken (the usual case): read and answered as a plain read is.
            named = _named(items)
            rows = store.read_rows(named)
            now = now_ms()
            if all(row is not None and fresh.takes_row(row, now) for row in rows):
                if self.hot is not None:
                    self.hot.record(version, _Refs(named))
                if sources is not None:
                    sources.extend("hit" for _ in rows)
                return self._rows_as_features(named, rows, version)
        target = rt if version == rt.store.schema_version else rt._for_version(version)
        refs = [EntityRef(fs, tenant, str(entity)) for fs, tenant, entity in items]
        results = freshness.read(
            target,
            refs,
            fresh,
            arrivals=self._arrivals,
            local=self.local,
            started=started,
        )
        if self.hot is not None:
            self.hot.record(version, refs)
        if sources is not None:
            sources.extend("miss" if r is None else r.source for r in results)
        return [
            None
            if r is None
            else Features(
                r.ref.feature_set,
                r.ref.tenant,
                r.ref.entity,
                r.values,
                r.age_ms,
                r.schema_version,
                r.watermark,
            )
            for r in results
        ]

    def close(self) -> None:
        """End the subscriptions this client started, if any (the one reads asking for
        freshness wait with; :meth:`following`'s deploy subscription and registration)."""
        if self._arrivals is not None:
            self._arrivals.close()
        if self.served is not None:  # sends what is queued
            self.served.close()
        if self._registration is not None:  # following()'s, with the resolver it made
            self._registration.close()
            self._registration = None
            if self.versions is not None:
                self.versions.close()

    @staticmethod
    def _through_tier(
        local: LocalTier, items: list[Item], store: EntryStore, sources: list[str] | None
    ) -> list[Entry | None]:
        """The local tier first; one MGET for the rest, which then fills the tier."""
        refs = [EntityRef(*item) for item in items]
        version = store.schema_version
        entries = [local.get(r, version) for r in refs]
        missing = [i for i, e in enumerate(entries) if e is None]
        if sources is not None:
            sources.extend("local" if e is not None else "hit" for e in entries)
        if missing:
            token = local.token()
            for i, entry in zip(missing, store.read([refs[i] for i in missing]), strict=True):
                entries[i] = entry
                if entry is not None:
                    local.put(refs[i], entry, token)
        return entries

    def _store_for_call(self) -> EntryStore:
        """The active version's store, decoding with its field lists (the lock's, else
        the published ones); this client's own while those are unknown and its own
        version is written, else :class:`SchemaVersionUnknown`."""
        versions = self.versions
        if versions is None:
            return self.store
        version = versions.current()
        store = self._stores.get(version)
        if store is None:
            decoders = versions.decoders(version)
            if decoders is None:
                versions.foreign += 1
                if not versions.written(self.store.schema_version):
                    versions.refused += 1
                    raise SchemaVersionUnknown(version, self.store.schema_version)
                return self.store
            store = self._stores[version] = EntryStore(self.store.redis, version, registry=decoders)
        return store

    def _stands_in(self, version: int) -> bool:
        """Whether this client answers misses of ``version`` from its own: it does not
        compute it, and its own version is still written."""
        versions = self.versions
        return (
            versions is not None
            and not versions.computes(version, self.store.registry)
            and versions.written(self.store.schema_version)
        )


def _named(items: Sequence[tuple[str, str, str | int]]) -> list[Item]:
    """``items`` with each entity id as text."""
    return [
        (fs, tenant, entity if type(entity) is str else str(entity)) for fs, tenant, entity in items
    ]
