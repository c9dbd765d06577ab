"""Read-through: serve hits, compute misses in one query, and never store a stale set.

``get_many`` reads every key in one MGET, takes a lease per miss (``SET NX PX``, same
hash tag as the entry) in one round trip, computes the misses it holds leases for with
one query per feature set, and stores them with the lease-guarded write: an
invalidation or source write in the meantime revokes the lease, and the result is
answered but not stored. Readers without a lease wait a bounded time for the holder's
result (one computation per missing key: Meta's leases against thundering herds); a
lease ends as soon as its holder is done. Hot keys are refreshed a little before they
expire by one reader (XFetch, Vattani et al., VLDB 2015). On a replica a result is
stored only when the replica has replayed past the primary's WAL position read at the
miss; on the primary only once the WAL its snapshot saw is flushed.

Why these keep the cache correct or absent: docs/keys.md, "Read-through fills from a
replica, and only durable ones", and "Writes, watermarks and leases".
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.cache.recompute import (
    Batch,
    Flusher,
    NotYetDurable,
    Position,
    compute,
    entity_ids,
    primary_position,
    replayed_lsn,
    wait_durable,
)
from freshline.pipeline.cache.store import LEASE_BUSY, LEASE_FOUND, LEASE_GRANTED, EntryStore
from freshline.pipeline.core.clock import now_ms
from freshline.pipeline.core.db import autocommit, sql_text
from freshline.pipeline.core.errors import SchemaVersionUnknown, ServiceUnavailable
from freshline.pipeline.core.features import IMPLICIT_TENANT, Entity
from freshline.pipeline.core.types import EntityRef, Entry, FeatureValues

if TYPE_CHECKING:
    from freshline.pipeline.cache.hot import HotReads
    from freshline.pipeline.cache.versions import VersionResolver

Source = Literal["local", "hit", "computed", "waited", "uncached"]
"""Where an answer came from; ``local`` (the in-process tier) only for reads asking for
freshness (:mod:`freshline.pipeline.cache.freshness`)."""
Hook = Callable[[list[EntityRef]], None]
XFETCH_BETA = 1.0
DURABLE_WAIT_MS = 250
"""How long a fill waits for Postgres to flush past its snapshot before it answers
without storing: a little over the default ``wal_writer_delay`` (200 ms), so a role
that may not force a flush still stores once the WAL writer has run."""
_MIN_DRAW = 1e-12
_MAX_LOG = -math.log(_MIN_DRAW)  # the largest gap is delta * beta * this

log = logging.getLogger(__name__)


class ReplicaBehind(ServiceUnavailable):
    """A read that must see a recent commit, on a replica behind the primary (or with
    no primary to tell): it can neither compute from the replica nor store."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(
            "Postgres replica",
            engine.url.render_as_string(hide_password=True),
            "not known to have replayed the primary's latest commits",
            hint="retry shortly",
        )


@dataclass(frozen=True, slots=True)
class Result:
    """A read's answer: the values, where they came from, and how old they are."""

    ref: EntityRef
    values: FeatureValues
    source: Source
    age_ms: int
    schema_version: int
    watermark: int

    @property
    def hit(self) -> bool:
        return self.source in ("local", "hit", "waited")

    @classmethod
    def served(cls, ref: EntityRef, entry: Entry, source: Source, now: int) -> Result:
        """``entry`` served as it is, ``now`` (epoch ms) giving its age."""
        return cls(
            ref,
            entry.values,
            source,
            max(0, now - entry.computed_at_ms),
            entry.schema_version,
            entry.watermark,
        )


def existing_entities(
    db: Engine | Connection, entity: Entity, refs: Sequence[EntityRef]
) -> set[tuple[str, str]]:
    """The ``(tenant, entity)`` pairs of ``refs`` that are rows of the entity's table
    (:attr:`Entity.table`; in the fraud example, ``users``), all of them if it has none.

    A read-through stores only these: an id with no source row would otherwise cost
    a full-TTL entry of empty features, and anyone with a key could fill Redis with
    them. One indexed query per computed group; the lease still guards the race with
    an entity created or deleted meanwhile (its change event revokes the lease).
    """
    pairs = {(r.tenant, r.entity) for r in refs}
    if not pairs or entity.table is None:
        return pairs
    tenants, ids = entity_ids(pairs, entity)
    column = entity.table_key or entity.key
    if entity.tenant:
        statement = sql_text(
            f"SELECT e.{entity.tenant}, e.{column}::text FROM {entity.table} e "
            f"JOIN unnest(CAST(:tenants AS text[]), CAST(:ids AS {entity.type}[])) AS k(t, id) "
            f"ON e.{entity.tenant} = k.t AND e.{column} = k.id"
        )
    else:
        statement = sql_text(
            f"SELECT '{IMPLICIT_TENANT}', e.{column}::text FROM {entity.table} e "
            f"WHERE e.{column} = ANY(CAST(:ids AS {entity.type}[]))"
        )
    params = {"tenants": tenants, "ids": ids}
    if isinstance(db, Connection):
        return {(t, e) for t, e in db.execute(statement, params)}
    with autocommit(db) as conn:
        return {(t, e) for t, e in conn.execute(statement, params)}


@dataclass(slots=True)
class Hooks:
    """Seams. ``after_compute`` runs between the query and the write (tests);
    ``on_computed`` is given a computation on the primary just before its entries are
    stored (history keeps the snapshot they name: :mod:`freshline.pipeline.history.snapshots`)."""

    before_compute: Hook | None = None
    after_compute: Hook | None = None
    on_computed: Callable[[Sequence[Batch]], None] | None = None


@dataclass(slots=True)
class Counters:
    hits: int = 0
    computed: int = 0
    waited: int = 0
    uncached: int = 0
    stored: int = 0
    refused: int = 0
    lease_waits: int = 0
    """Misses whose lease another reader held, so this one waited for its result."""
    early_refresh: int = 0
    lagging: int = 0
    """Batches of misses a lagging replica answered uncached."""
    undurable: int = 0
    """Fills answered uncached because Postgres had not flushed past their snapshot
    within ``durable_wait_ms`` (docs/keys.md says why)."""
    compute_ms: dict[str, float] = field(default_factory=dict)


class ReadThrough:
    """``get``/``get_many`` over a :class:`EntryStore` and the source database.

    With ``versions``, each call serves the active schema version (resolved once per
    call, :meth:`for_call`). One this code does not compute is read with its field
    lists and its misses are answered from the store's own version while that one is
    written, else refused (:class:`~freshline.pipeline.core.errors.SchemaVersionUnknown`).
    ``hot`` samples reads for warming. ``durable_wait_ms`` bounds a fill's wait for
    Postgres's flush (0: no wait, only if every writer commits synchronously).
    """

    def __init__(
        self,
        store: EntryStore,
        engine: Engine,
        *,
        lease_ms: int = 5000,
        wait_ms: int = 2000,
        hooks: Hooks | None = None,
        early_refresh: bool = True,
        versions: VersionResolver | None = None,
        hot: HotReads | None = None,
        primary: Engine | None = None,
        durable_wait_ms: int = DURABLE_WAIT_MS,
    ) -> None:
        self.store = store
        self.engine = engine
        self.primary = primary
        self.lease_ms = lease_ms
        self.wait_ms = wait_ms
        self.hooks = hooks or Hooks()
        self.early_refresh = early_refresh
        self.counters = Counters()
        self.versions = versions
        self.hot = hot
        self._at_version: dict[int, ReadThrough] = {}
        self.own: ReadThrough | None = None
        """On a twin for a version this code does not compute: the read-through of the
        code's own version, which answers its misses while it is written."""
        self._standby: bool | None = None  # asked on the first miss
        self.durable_wait_ms = durable_wait_ms
        self.flusher = Flusher(engine, log, "a read-through fill")

    def get(self, ref: EntityRef) -> Result:
        return self.get_many([ref])[0]

    def for_call(self) -> ReadThrough:
        """The read-through a call serves with: the active version's (see the class
        docstring); this one without ``versions``. Raises :class:`SchemaVersionUnknown`
        when the active version can be neither decoded nor stood in for."""
        versions = self.versions
        if versions is None:
            return self
        version = versions.current()
        if version == self.store.schema_version:
            return self
        if versions.computes(version, self.store.registry):
            return self._for_version(version)
        versions.foreign += 1
        if version in self._at_version or versions.decoders(version) is not None:
            return self._for_version(version)
        return self._fallback_target(version)

    def _fallback_target(self, version: int) -> ReadThrough:
        """This read-through, standing in for ``version`` while its own is written."""
        versions = self.versions
        if versions is not None and not versions.written(self.store.schema_version):
            versions.refused += 1
            raise SchemaVersionUnknown(version, self.store.schema_version)
        return self

    def get_many(self, refs: Sequence[EntityRef]) -> list[Result]:
        """Answer every ref, in order; duplicates are read once."""
        return self.for_call()._serve(refs)

    def _serve(self, refs: Sequence[EntityRef]) -> list[Result]:
        """:meth:`get_many` on this read-through's own version."""
        own = self.own
        if self.hot is not None:
            self.hot.record(self.store.schema_version, refs)
        unique = list(dict.fromkeys(refs))
        entries = self.store.read(unique)
        now = now_ms()
        answers: dict[EntityRef, Result] = {}
        misses: list[EntityRef] = []
        refresh: list[EntityRef] = []
        for ref, entry in zip(unique, entries, strict=True):
            if entry is None:
                misses.append(ref)
                continue
            answers[ref] = Result.served(ref, entry, "hit", now)
            if self.should_refresh(ref, entry, now):
                refresh.append(ref)
        self.counters.hits += len(answers)
        if own is not None:  # a version this code does not compute: its misses, from own
            if misses:
                found = own._fallback_target(self.store.schema_version)._serve(misses)
                answers.update(zip(misses, found, strict=True))
        elif misses or refresh:
            if self.standby and self.primary is None:
                answers.update(self._compute(misses, None))  # served, never stored
            else:
                answers.update(self._resolve(misses, refresh))
        return [answers[r] for r in refs]

    def _gate(self) -> Position | None:
        """On a replica: the primary's position if the replica has replayed past it."""
        if self.primary is None:
            return None
        position = primary_position(self.primary)
        if replayed_lsn(self.engine) < position.lsn:
            self.counters.lagging += 1
            return None
        return position

    @property
    def standby(self) -> bool:
        """True when the engine is a hot standby (a read replica): see the docstring."""
        if self._standby is None:
            with self.engine.connect() as conn:
                self._standby = bool(conn.execute(sa.text("SELECT pg_is_in_recovery()")).scalar())
        return self._standby

    def _for_version(self, version: int) -> ReadThrough:
        """The same read-through on another version's namespace, sharing counters; for a
        version this code does not compute, one that decodes it with its field lists,
        never computes, and answers its misses from this one (:attr:`own`)."""
        if version not in self._at_version:
            registry = self.store.registry
            foreign = self.versions is not None and not self.versions.computes(version, registry)
            if foreign and self.versions is not None:
                registry = self.versions.decoders(version) or registry
            store = EntryStore(
                self.store.redis,
                version,
                registry=registry,
                tombstone_ttl_s=self.store.tombstone_ttl_ms // 1000,
            )
            other = ReadThrough(
                store,
                self.engine,
                lease_ms=self.lease_ms,
                wait_ms=self.wait_ms,
                hooks=self.hooks,
                early_refresh=self.early_refresh and not foreign,
                hot=self.hot,
                primary=self.primary,
                durable_wait_ms=self.durable_wait_ms,
            )
            other.counters = self.counters
            other.own = self if foreign else None
            other.flusher = self.flusher
            other._standby = self._standby
            self._at_version[version] = other
        return self._at_version[version]

    def should_refresh(self, ref: EntityRef, entry: Entry, now: int) -> bool:
        """XFetch: refresh early with a probability that rises toward expiry."""
        return entry.computed_at_ms <= self.refresh_horizon(
            ref.feature_set, now
        ) and self.draw_refresh(ref.feature_set, entry.computed_at_ms, now)

    def refresh_horizon(self, feature_set: str, now: int) -> float:
        """Entries of ``feature_set`` computed after this are never refreshed at ``now``.

        No XFetch draw can reach their expiry, so a reader checking many entries
        draws a random number only for those computed at or before it.
        """
        if not self.early_refresh:
            return -math.inf
        ttl_ms = self.store.registry[feature_set].ttl_s * 1000
        delta = self.counters.compute_ms.get(feature_set, 5.0) * XFETCH_BETA
        # expiry = computed_at + the shortest jittered TTL; no draw reaches it while
        # now + delta * _MAX_LOG < expiry.
        return now + delta * _MAX_LOG - ttl_ms * 0.9

    def draw_refresh(self, feature_set: str, computed_at_ms: int, now: int) -> bool:
        """The XFetch draw for one entry: ``now + gap`` past its expiry."""
        if not self.early_refresh:
            return False
        ttl_ms = self.store.registry[feature_set].ttl_s * 1000
        delta = self.counters.compute_ms.get(feature_set, 5.0) * XFETCH_BETA
        expiry = computed_at_ms + ttl_ms * 0.9  # the shortest jittered TTL
        gap = -delta * math.log(random.random() or _MIN_DRAW)
        return now + gap >= expiry

    def _gated(self, mine: list[EntityRef], token: str) -> Position | None:
        """On a replica, once ``mine`` are leased: :meth:`_gate`, releasing the leases
        if the replica lags (or the primary fails), so their waiters need not wait."""
        try:
            gate = self._gate()
        except BaseException:
            self.store.release(mine, token)
            raise
        if gate is None:
            self.store.release(mine, token)
        return gate

    def _resolve(
        self, misses: list[EntityRef], refresh: list[EntityRef]
    ) -> dict[EntityRef, Result]:
        token = uuid.uuid4().hex
        wanted = misses + refresh
        flags = [False] * len(misses) + [True] * len(refresh)
        leases = self.store.lease(wanted, token, self.lease_ms, flags)
        now = now_ms()
        found = {
            r: Result.served(r, e, "hit", now)
            for r, (code, e) in zip(wanted, leases, strict=True)
            if code == LEASE_FOUND and e is not None
        }
        self.counters.hits += len(found)
        mine = [r for r, (code, _) in zip(wanted, leases, strict=True) if code == LEASE_GRANTED]
        # Misses whose lease another reader holds wait for that reader's result; an
        # early refresh that lost the race just keeps serving its hit.
        others = [r for r, (code, _) in zip(misses, leases, strict=False) if code == LEASE_BUSY]
        gate: Position | None = None
        if self.standby:  # the lease first, then the primary's watermark: see the docstring
            gate = self._gated(mine, token)
            if gate is None:  # a lagging replica: the misses are served, never stored
                unfound = [r for r in misses if r not in found]
                return {**found, **self._compute(unfound, None)}
        self.counters.early_refresh += sum(
            1 for code, _ in leases[len(misses) :] if code == LEASE_GRANTED
        )
        try:
            answers = self._compute(mine, token, gate)
        except BaseException:
            self.store.release(mine, token)  # its waiters need not wait out the lease
            raise
        answers.update(found)
        if others:
            answers.update(self._wait_or_compute(others))
        return answers

    def recompute(self, refs: Sequence[EntityRef], accept: Callable[[Entry], bool]) -> list[Result]:
        """Compute ``refs`` anew, whatever Redis holds: a read that refused the cached
        entries (:mod:`freshline.pipeline.cache.freshness`). Each ref is leased as an early
        refresh is (granted even over an entry), computed and stored under the lease;
        one another reader holds is waited for (``wait_ms``) until an entry ``accept``
        takes lands, else computed here without storing.

        Every result comes from a snapshot taken after this call began (on a replica,
        stored under the primary's watermark read now), so its watermark reaches any
        bar known before it. On a replica that has not replayed the primary's
        position, nothing could: :class:`ReplicaBehind`. A version this code does not
        compute is recomputed in its own, while that one is written.
        """
        if self.own is not None:
            return self.own._fallback_target(self.store.schema_version).recompute(refs, accept)
        unique = list(dict.fromkeys(refs))
        if self.standby and self.primary is None:
            raise ReplicaBehind(self.engine)
        token = uuid.uuid4().hex
        leases = self.store.lease(unique, token, self.lease_ms, [True] * len(unique))
        mine = [r for r, (code, _) in zip(unique, leases, strict=True) if code == LEASE_GRANTED]
        others = [r for r, (code, _) in zip(unique, leases, strict=True) if code != LEASE_GRANTED]
        gate: Position | None = None
        if self.standby:  # the lease first, then the primary's watermark: see the docstring
            gate = self._gated(mine, token)
            if gate is None:
                raise ReplicaBehind(self.engine)
        try:
            answers = self._compute(mine, token, gate)
        except BaseException:
            self.store.release(mine, token)
            raise
        if others:
            answers.update(self._wait_or_compute(others, accept, gate))
        return [answers[r] for r in refs]

    def _compute(
        self, refs: list[EntityRef], token: str | None, gate: Position | None = None
    ) -> dict[EntityRef, Result]:
        """One query per feature set; store under ``token`` if given, with the
        watermark of ``gate`` (a primary's position the replica has passed) if given."""
        answers: dict[EntityRef, Result] = {}
        by_set: dict[str, list[EntityRef]] = defaultdict(list)
        for ref in refs:
            by_set[ref.feature_set].append(ref)
        for name, group in by_set.items():
            if self.hooks.before_compute:
                self.hooks.before_compute(group)
            # One connection for the query and the checks that follow, each statement
            # on its own (autocommit: no BEGIN or ROLLBACK, one pool ping).
            with autocommit(self.engine) as conn:
                started = time.perf_counter()
                batch = compute(
                    conn, self.store.registry[name], [(r.tenant, r.entity) for r in group]
                )
                elapsed = (time.perf_counter() - started) * 1000
                prev = self.counters.compute_ms.get(name, elapsed)
                self.counters.compute_ms[name] = 0.8 * prev + 0.2 * elapsed
                if gate is not None:
                    batch = replace(batch, watermark=gate.watermark)
                if self.hooks.after_compute:
                    self.hooks.after_compute(group)
                if token is None:
                    self.counters.uncached += len(group)
                    answers.update(self._from_batch(batch, group, "uncached"))
                    continue
                # Ids with no source row first: they are never stored, so a group of
                # them (a flood of ghost ids) need not wait for the flush, nor ask.
                known = existing_entities(conn, self.store.registry[name].entity, group)
                if known and not self._durable(batch, conn):
                    # answered, not stored, as an unknown id is (docs/keys.md)
                    known = set()
                    self.counters.undurable += len(group)
            filled = [r for r in group if (r.tenant, r.entity) in known]
            unknown = [r for r in group if (r.tenant, r.entity) not in known]
            if filled and gate is None and self.hooks.on_computed is not None:
                self.hooks.on_computed([batch])
            written = self.store.fill(batch, token, filled)
            if unknown:
                self.store.release(unknown, token)
            self.counters.computed += len(filled)
            self.counters.uncached += len(unknown)
            self.counters.stored += written.written
            self.counters.refused += len(filled) - written.written
            answers.update(self._from_batch(batch, filled, "computed"))
            answers.update(self._from_batch(batch, unknown, "uncached"))
        return answers

    def _durable(self, batch: Batch, conn: Connection) -> bool:
        """Whether Postgres has flushed its WAL past ``batch``'s snapshot, waiting up to
        ``durable_wait_ms`` (docs/keys.md says why), asked, and made to flush, on
        ``conn`` (the fill's: one connection per fill, so fills that hold every pooled
        connection never wait for another). A batch from a standby has no position and
        needs no wait."""
        if not batch.lsn or not self.durable_wait_ms:
            return True
        try:
            wait_durable(
                conn,
                batch.lsn,
                self.durable_wait_ms / 1000,
                force=lambda: self.flusher(conn),  # this fill's connection: never a second
            )
        except NotYetDurable as exc:
            log.debug("%s: %s answered, not stored", exc, batch.feature_set.name)
            return False
        return True

    def _from_batch(
        self, batch: Batch, refs: list[EntityRef], source: Source
    ) -> dict[EntityRef, Result]:
        now = now_ms()
        return {
            r: Result(
                r,
                batch.values[(r.tenant, r.entity)],
                source,
                max(0, now - batch.computed_at_ms),
                self.store.schema_version,
                batch.watermark,
            )
            for r in refs
        }

    def _wait_or_compute(
        self,
        refs: list[EntityRef],
        accept: Callable[[Entry], bool] | None = None,
        gate: Position | None = None,
    ) -> dict[EntityRef, Result]:
        """Wait for the lease holders' results with backoff, then compute the rest:
        those still missing at the deadline, and at once those whose lease ended
        without an entry (the holder stored nothing). With ``accept``, an entry it
        refuses counts as missing."""
        answers: dict[EntityRef, Result] = {}
        pending = list(refs)
        abandoned: list[EntityRef] = []
        self.counters.lease_waits += len(refs)
        deadline = time.monotonic() + self.wait_ms / 1000
        pause = 0.001
        while pending and time.monotonic() < deadline:
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.02)
            now = now_ms()
            still: list[EntityRef] = []
            entries, leased = self.store.read_leased(pending)
            for ref, entry, held in zip(pending, entries, leased, strict=True):
                if entry is not None and (accept is None or accept(entry)):
                    answers[ref] = Result.served(ref, entry, "waited", now)
                elif held:
                    still.append(ref)
                else:
                    abandoned.append(ref)
            pending = still
        self.counters.waited += len(answers)
        if pending or abandoned:
            answers.update(self._compute(abandoned + pending, None, gate))
        return answers
