"""The Redis entry store: versioned feature entries, conditional writes, TTLs, tombstones.

Every write is one Lua script: an entry (or tombstone) replaces the current one only
when its watermark is strictly greater (equal is a no-op), and it always sets a TTL; an
entry whose values change with time alone ends at that moment (:func:`entry_ttl_ms`).
Every write's state outlives it by the *fence* (``tombstone_ttl_s``), and a write that
finds no state is refused when over half a fence old. Writes revoke the entity's
read-through lease; a fill stores only while it holds its own. A TRUNCATE raises the
feature set's *floor*: entries below it read as absent. On Redis Cluster the floors are
read once per batch and passed to the scripts; ``get_many`` sends one ``MGET`` per slot,
pipelined. Nothing is served from a server the consumers have not vouched for
(:mod:`freshline.pipeline.cache.server`).

Why each rule keeps stale values out: docs/keys.md, "Why watermarks and writes keep
stale values out".
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from freshline.pipeline.cache.recompute import Batch
from freshline.pipeline.cache.server import ServerGate, server_gate
from freshline.pipeline.core.cluster import is_cluster, mget, rerouted_on_failure
from freshline.pipeline.core.codec import (
    Row,
    decode_entry,
    decode_rows,
    encode_entry,
    encode_tombstone,
    parse_watermark,
    watermark_hex,
)
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.keys import (
    entity_floor_key,
    feature_key,
    feature_keys,
    floor_key,
    grid_keys,
    item_keys,
    lease_key,
)
from freshline.pipeline.core.types import EntityRef, Entry, Item, Watermark, text

# KEYS[1] entry, KEYS[2] lease, KEYS[3] the entity's floor, KEYS[4] the set's floor;
# ARGV[1] encoded entry or tombstone, ARGV[2] TTL in ms, ARGV[3] lease token ("" for a
# source-driven write, which revokes any lease), ARGV[4] when the entry is due (its
# horizon, epoch ms; "" none), ARGV[5] the fence in ms, ARGV[6] the oldest a write to
# an absent key may be, in ms. On a cluster there is no KEYS[4]: ARGV[7] is the set
# floor's value ("" none). The entity's floor stands in for an entry gone early; a
# snapshot watermark ("1" first) keeps its clock, in µs, in its last 13 hex digits.
# Returns 1 written, 0 refused (older, below the floor, or too old for an absent key),
# 2 no-op (equal), 3 due (stored as a tombstone of its watermark), -1 lease lost.
_WRITE_LUA: Final = """
local token = ARGV[3]
if token ~= '' and redis.call('GET', KEYS[2]) ~= token then
  return -1
end
redis.call('DEL', KEYS[2])
local new_wm = string.sub(ARGV[1], 2, 31)
local floor
if #KEYS >= 4 then floor = redis.call('GET', KEYS[4])
elseif ARGV[7] ~= '' then floor = ARGV[7] end
if floor and new_wm < floor then return 0 end
local cur = redis.call('GET', KEYS[1])
local cur_wm = cur and string.sub(cur, 2, 31) or redis.call('GET', KEYS[3])
local now_us
if cur_wm then
  if cur_wm > new_wm then return 0 end
  if cur_wm == new_wm then return 2 end
elseif string.sub(new_wm, 1, 1) == '1' then
  local t = redis.call('TIME')
  now_us = t[1] * 1000000 + t[2]
  if now_us - tonumber(string.sub(new_wm, 18), 16) > ARGV[6] * 1000 then return 0 end
end
local ttl, fence = tonumber(ARGV[2]), tonumber(ARGV[5])
if ARGV[4] ~= '' then
  if not now_us then
    local t = redis.call('TIME')
    now_us = t[1] * 1000000 + t[2]
  end
  local left = tonumber(ARGV[4]) - math.floor(now_us / 1000)
  if left < ttl then ttl = left end
  if ttl < 1 then
    redis.call('SET', KEYS[1], 'T' .. new_wm, 'PX', fence)
    return 3
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
if ttl < fence then redis.call('SET', KEYS[3], new_wm, 'PX', fence) end
return 1
"""

# KEYS[1] entry, KEYS[2] lease, KEYS[3] floor; ARGV[1] token, ARGV[2] lease ms, ARGV[3]
# "1" to grant a lease even when an entry exists (an early refresh); on a cluster no
# KEYS[3] but ARGV[4], the floor's value, as for the write script. Returns {1, entry}
# when a live entry exists (it may have landed since the reader's miss), {2} when the
# lease is granted, {0} when another reader holds it. Checking and leasing in one step
# closes the gap where a reader misses, another fills and releases, and the first
# leases again. An entry below the floor counts as absent.
_LEASE_LUA: Final = """
if ARGV[3] ~= '1' then
  local cur = redis.call('GET', KEYS[1])
  local floor
  if #KEYS >= 3 then floor = redis.call('GET', KEYS[3])
  elseif ARGV[4] ~= '' then floor = ARGV[4] end
  if cur and string.sub(cur, 1, 1) ~= 'T'
      and (not floor or string.sub(cur, 2, 31) >= floor) then
    return {1, cur}
  end
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {2} end
return {0}
"""

# KEYS[1] lease; ARGV[1] token. Ends the lease only if this token still holds it.
_RELEASE_LUA: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS[1] floor; ARGV[1] watermark hex, ARGV[2] TTL in ms. Only ever raises the floor.
_FLOOR_LUA: Final = """
local cur = redis.call('GET', KEYS[1])
if not cur or cur < ARGV[1] then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

Call = tuple[tuple[str, ...], tuple[str | bytes | int, ...]]
"""One script call: its keys (the set's floor last, see :meth:`EntryStore._floors_as_args`)
and its arguments."""

WRITTEN, REFUSED, UNCHANGED, DUE, LEASE_LOST = 1, 0, 2, 3, -1
LEASE_BUSY, LEASE_GRANTED, LEASE_FOUND = 0, 2, 1
TTL_JITTER = 0.1

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WriteResult:
    written: int = 0
    refused: int = 0
    unchanged: int = 0
    lease_lost: int = 0
    due: int = 0
    """Newer than what was there, but past their horizon on arrival: stored as a
    tombstone of their watermark."""

    def add(self, code: int) -> None:
        if code == WRITTEN:
            self.written += 1
        elif code == REFUSED:
            self.refused += 1
        elif code == UNCHANGED:
            self.unchanged += 1
        elif code == DUE:
            self.due += 1
        else:
            self.lease_lost += 1

    def merge(self, other: WriteResult) -> None:
        self.written += other.written
        self.refused += other.refused
        self.unchanged += other.unchanged
        self.lease_lost += other.lease_lost
        self.due += other.due


SAFE_EVICTION_POLICIES: Final = frozenset({"noeviction"})


def check_eviction_policy(client: redis.Redis) -> None:
    """Refuse a Redis that may evict keys: every writer calls this at start-up.

    Writes compare watermarks with the entry (or tombstone) in Redis; if a newer one is
    evicted between a slower writer's snapshot and its write, the older value lands.
    Under ``maxmemory-policy noeviction`` (or no ``maxmemory``) nothing is evicted: a
    full Redis refuses writes instead, which the consumer retries. Where ``CONFIG`` is
    not allowed (a managed Redis, an ACL user without it) the check is logged and
    skipped: then ensuring the policy is the operator's part.
    """
    try:
        config = client.config_get("maxmemory*")
    except redis.exceptions.ResponseError as exc:
        log.warning(
            "could not read Redis's maxmemory-policy (%s); make sure it is "
            "noeviction, or entries may go stale",
            exc,
        )
        return
    policy = text(config.get("maxmemory-policy"))
    maxmemory = int(text(config.get("maxmemory")) or 0)
    if maxmemory and policy not in SAFE_EVICTION_POLICIES:
        raise ConfigError(
            f"Redis may evict keys (maxmemory {maxmemory}, maxmemory-policy {policy}): an "
            "evicted newer entry would let an older one land. Set maxmemory-policy "
            "noeviction (redis.conf, or CONFIG SET maxmemory-policy noeviction)"
        )


def jittered_ttl_ms(ttl_s: int) -> int:
    """The TTL less up to 10%, so entries written together do not expire together."""
    return max(1000, int(ttl_s * 1000 * (1 - TTL_JITTER * random.random())))


def entry_ttl_ms(ttl_s: int, computed_at_ms: int, valid_until_ms: int | None) -> int:
    """An entry's TTL: the jittered TTL, cut to end at ``valid_until_ms`` when its
    values may change with time alone before then (a window moving past a row; see
    :attr:`freshline.pipeline.core.features.FeatureSet.horizon`). Both moments are Postgres's
    clock, so the entry expires within its write's latency of that moment, never
    with the skew of this host's clock. At least 1 ms (Redis's least). The write script
    also ends it at ``valid_until_ms`` by Redis's clock, for a write that arrives late."""
    ttl = jittered_ttl_ms(ttl_s)
    if valid_until_ms is None:
        return ttl
    return max(1, min(ttl, valid_until_ms - computed_at_ms))


class EntryStore:
    """Reads and conditional writes of feature entries for one schema version."""

    def __init__(
        self,
        client: redis.Redis,
        schema_version: int,
        *,
        registry: Registry,
        tombstone_ttl_s: int = 300,
    ) -> None:
        self.redis = client
        self.schema_version = schema_version
        self.registry = registry
        self.tombstone_ttl_ms = tombstone_ttl_s * 1000
        self.fence_ms = self.tombstone_ttl_ms
        """How long every write's compare-and-set state outlives it (docs/keys.md, "The fence")."""
        self.max_age_ms = self.fence_ms // 2
        """The oldest computation a write to a key with no state may store."""
        self._write = client.register_script(_WRITE_LUA)
        self._lease = client.register_script(_LEASE_LUA)
        self._floor = client.register_script(_FLOOR_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._fields: dict[str, tuple[str, ...]] = {}  # per feature set, built once
        self._floor_keys: dict[str, str] = {}
        self.cluster = is_cluster(client)
        self._gate: ServerGate | None = None  # installed by the first read

    def vouched(self) -> bool:
        """Whether the entries on the server may be served (:mod:`freshline.pipeline.cache.server`);
        asked after a read's reply."""
        gate = self._gate or self._gated()
        return gate.vouched or gate.admits(self.redis)

    def _gated(self) -> ServerGate:
        self._gate = server_gate(self.redis)
        return self._gate

    def key(self, ref: EntityRef, schema_version: int | None = None) -> str:
        self.registry[ref.feature_set]
        return feature_key(schema_version or self.schema_version, ref)

    def read(self, refs: Sequence[EntityRef]) -> list[Entry | None]:
        """One MGET for all ``refs``; ``None`` where missing or a tombstone."""
        if not refs:
            return []
        raws = mget(self.redis, self.read_keys(refs))
        return self.entries(refs, raws) if self.vouched() else [None] * len(refs)

    def read_keys(self, refs: Sequence[EntityRef]) -> list[str]:
        """What :meth:`read` fetches in its MGET: each ref's key, then each set's floor.

        For a caller with a client of its own (the API's asyncio one): MGET these, then
        :meth:`entries` turns the replies into what :meth:`read` would answer.
        """
        keys = feature_keys(self.schema_version, refs)
        keys += [self._floor_key(name) for name in dict.fromkeys(r.feature_set for r in refs)]
        return keys

    def entries(
        self, refs: Sequence[EntityRef], raws: Sequence[bytes | str | None]
    ) -> list[Entry | None]:
        """The entries of ``refs`` from the MGET of :meth:`read_keys`.

        ``None`` where missing, a tombstone, or below its feature set's floor.
        """
        version = self.schema_version
        return [
            None if row is None else Entry(row[0], version, row[1], parse_watermark(row[2]))
            for row in self._rows_of([r.feature_set for r in refs], raws)
        ]

    def read_rows(self, items: Sequence[Item]) -> list[Row | None]:
        """:meth:`read` of ``(feature_set, tenant, entity)`` items, as decoded rows.

        The same MGET (keys, then floors) and checks, without an object per item: for
        callers that build their own answer from each row (the Python client).
        """
        if not items:
            return []
        keys = item_keys(self.schema_version, items)
        names = [fs for fs, _, _ in items]
        keys += [self._floor_key(name) for name in dict.fromkeys(names)]
        raws = mget(self.redis, keys)
        return self._rows_of(names, raws) if self.vouched() else [None] * len(items)

    def _rows_of(
        self, names: Sequence[str], raws: Sequence[bytes | str | None]
    ) -> list[Row | None]:
        """Rows of the MGET replies of keys of the feature sets ``names``, then floors."""
        n = len(names)
        sets = list(dict.fromkeys(names))
        floors = dict(zip(sets, raws[n:], strict=True))
        if len(sets) == 1:  # the common case: no regrouping
            return self.rows(sets[0], raws[:n], floors[sets[0]])
        rows: list[Row | None] = [None] * n
        for name in sets:
            at = [i for i, fs in enumerate(names) if fs == name]
            for i, row in zip(
                at, self.rows(name, [raws[i] for i in at], floors[name]), strict=True
            ):
                rows[i] = row
        return rows

    def grid_keys(
        self, tenant: str, feature_sets: Sequence[str], entities: Sequence[str]
    ) -> list[str]:
        """:meth:`read_keys` of every (entity, feature set) pair of one tenant, entity-major.

        The MGET of these answers ``len(entities) * len(feature_sets)`` entries, then
        one floor per feature set; :meth:`rows` decodes each set's column.
        """
        keys = grid_keys(self.schema_version, tenant, feature_sets, entities)
        if len(feature_sets) == 1:
            keys.append(self._floor_key(feature_sets[0]))
        else:
            keys += [self._floor_key(name) for name in feature_sets]
        return keys

    def _floor_key(self, feature_set: str) -> str:
        """:func:`floor_key` of a registered feature set (made once per set)."""
        key = self._floor_keys.get(feature_set)
        if key is None:
            key = self._floor_keys[feature_set] = floor_key(
                self.schema_version, self.registry[feature_set].name
            )
        return key

    def rows(
        self, feature_set: str, raws: Sequence[bytes | str | None], floor: bytes | str | None
    ) -> list[Row | None]:
        """Decoded entries of one feature set
        (:func:`freshline.pipeline.core.codec.decode_rows`)."""
        return decode_rows(raws, self.fields(feature_set), self.schema_version, floor)

    def fields(self, feature_set: str) -> tuple[str, ...]:
        """The feature set's field names, in entry order (looked up once)."""
        fields = self._fields.get(feature_set)
        if fields is None:
            fields = self._fields[feature_set] = self.registry[feature_set].field_names
        return fields

    def _decode(self, feature_set: str, raw: bytes | str | None) -> Entry | None:
        if raw is None:
            return None
        if isinstance(raw, str):
            raw = raw.encode()
        return decode_entry(raw, self.fields(feature_set), self.schema_version)

    def lease(
        self, refs: Sequence[EntityRef], token: str, lease_ms: int, refresh: Sequence[bool]
    ) -> list[tuple[int, Entry | None]]:
        """Try to lease each ref for a read-through fill, in one round trip.

        Each answer is ``(LEASE_GRANTED, None)``, ``(LEASE_BUSY, None)`` or
        ``(LEASE_FOUND, entry)`` when an entry is there now (unless ``refresh``).
        """
        calls: list[Call] = []
        for ref, again in zip(refs, refresh, strict=True):
            keys = (
                self.key(ref),
                lease_key(self.schema_version, ref),
                floor_key(self.schema_version, ref.feature_set),
            )
            calls.append((keys, (token, lease_ms, "1" if again else "")))
        calls = self._floors_as_args(calls)
        out: list[tuple[int, Entry | None]] = []
        replies = self._run(self._lease, calls)
        vouched = self.vouched()
        for ref, reply in zip(refs, replies, strict=True):
            code = int(reply[0])
            if code == LEASE_FOUND and not vouched:  # see the module docstring
                code = LEASE_BUSY
            out.append(
                (code, self._decode(ref.feature_set, reply[1]) if code == LEASE_FOUND else None)
            )
        return out

    def release(self, refs: Sequence[EntityRef], token: str) -> int:
        """End the leases ``token`` still holds on ``refs``, in one round trip; how many.

        For a read-through that will store nothing for them (an id with no source row,
        a failed computation): readers waiting on them stop waiting at once.
        """
        calls: list[Call] = [((lease_key(self.schema_version, ref),), (token,)) for ref in refs]
        return sum(int(n) for n in self._run(self._release, calls))

    def read_leased(self, refs: Sequence[EntityRef]) -> tuple[list[Entry | None], list[bool]]:
        """:meth:`read` of ``refs`` and whether each is leased now, in the same MGET.

        An entry's key and its lease share a hash tag, so on a cluster too each pair is
        read in one command: a fill, which sets the entry and ends the lease in one
        script, is seen whole or not at all.
        """
        if not refs:
            return [], []
        keys = self.read_keys(refs)
        raws = mget(self.redis, keys + [lease_key(self.schema_version, r) for r in refs])
        entries: list[Entry | None] = [None] * len(refs)
        if self.vouched():
            entries = self.entries(refs, raws[: len(keys)])
        return entries, [raw is not None for raw in raws[len(keys) :]]

    def write(
        self,
        batch: Batch,
        *,
        schema_version: int | None = None,
        versions: Sequence[int] = (),
    ) -> WriteResult:
        """Write a computed batch, source-driven: revokes leases, keeps newer entries.

        ``versions``: into each of these schema versions (a deploy writes two), all in
        one pipelined round trip; otherwise into ``schema_version`` (or the store's)."""
        name = batch.feature_set.name
        calls = [
            self._call(batch, EntityRef(name, tenant, entity), values, version, "")
            for version in versions or (schema_version or self.schema_version,)
            for (tenant, entity), values in batch.values.items()
        ]
        return self._written(calls)

    def fill(self, batch: Batch, token: str, refs: Sequence[EntityRef]) -> WriteResult:
        """Store read-through results for ``refs``, only where ``token`` still holds the lease."""
        calls: list[Call] = []
        for ref in refs:
            values = batch.values.get((ref.tenant, ref.entity))
            if values is not None:
                calls.append(self._call(batch, ref, values, self.schema_version, token))
        return self._written(calls)

    def invalidate(
        self,
        refs: Sequence[EntityRef],
        watermark: Watermark,
        *,
        schema_version: int | None = None,
        versions: Sequence[int] = (),
    ) -> WriteResult:
        """Replace entries older than ``watermark`` with a tombstone that lives the fence,
        in each of ``versions`` at once (as :meth:`write`), or in ``schema_version``."""
        tomb = encode_tombstone(watermark)
        calls: list[Call] = [
            (
                (
                    self.key(ref, version),
                    lease_key(version, ref),
                    entity_floor_key(version, ref),
                    floor_key(version, ref.feature_set),
                ),
                (tomb, self.fence_ms, "", "", self.fence_ms, self.max_age_ms),
            )
            for version in versions or (schema_version or self.schema_version,)
            for ref in refs
        ]
        return self._written(calls)

    def truncate(
        self, feature_set: str, watermark: Watermark, *, schema_version: int | None = None
    ) -> None:
        """Void every entry of ``feature_set`` computed before ``watermark``.

        ``watermark`` is that of a snapshot that sees the truncate of a source table.
        The floor lives twice the set's TTL, longer than any entry it voids.
        """
        version = schema_version or self.schema_version
        ttl_ms = 2 * self.registry[feature_set].ttl_s * 1000
        self._run(
            self._floor, [((floor_key(version, feature_set),), (watermark_hex(watermark), ttl_ms))]
        )

    def _call(
        self, batch: Batch, ref: EntityRef, values: dict[str, object], version: int, token: str
    ) -> Call:
        """The write script's keys and arguments for ``ref``'s ``values`` of ``batch``."""
        fs, computed_at_ms = batch.feature_set, batch.computed_at_ms
        raw = encode_entry(
            [values[f] for f in fs.field_names], version, computed_at_ms, batch.watermark
        )
        due = batch.valid_until_ms.get((ref.tenant, ref.entity))
        ttl_ms = entry_ttl_ms(fs.ttl_s, computed_at_ms, due)
        if due is not None and due - computed_at_ms >= fs.ttl_s * 1000:
            due = None  # the TTL ends first: no need for the script to read its clock
        return (
            (
                feature_key(version, ref),
                lease_key(version, ref),
                entity_floor_key(version, ref),
                floor_key(version, fs.name),
            ),
            (raw, ttl_ms, token, "" if due is None else due, self.fence_ms, self.max_age_ms),
        )

    def _floors_as_args(self, calls: list[Call]) -> list[Call]:
        """On a cluster: each call's set floor (its last key) becomes its last argument,
        read once per batch (docs/keys.md, "Truncate floors", for the race this admits);
        unchanged on one node."""
        if not self.cluster or not calls:
            return calls
        names = list(dict.fromkeys(keys[-1] for keys, _ in calls))
        floors = {
            name: text(raw) if raw is not None else ""
            for name, raw in zip(names, mget(self.redis, names), strict=True)
        }
        return [(keys[:-1], (*args, floors[keys[-1]])) for keys, args in calls]

    def _written(self, calls: list[Call]) -> WriteResult:
        result = WriteResult()
        for code in self._run(self._write, self._floors_as_args(calls)):
            result.add(int(code))
        return result

    def _run(self, script: Script, calls: list[Call]) -> list[Any]:
        """Run ``script`` once per call, all in one pipelined round trip.

        Plain EVALSHA: redis-py's ``Script`` in a pipeline sends ``SCRIPT EXISTS``
        before every execute, an extra round trip per batch. Calls the server refused
        with NOSCRIPT (a restart or SCRIPT FLUSH dropped the script) did nothing; they
        are sent again, alone, after loading the script.
        """
        with rerouted_on_failure(self.redis):
            replies = self._pipeline(script, calls)
            missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if missing:
                script.sha = self.redis.script_load(script.script)
                for i, reply in zip(
                    missing, self._pipeline(script, [calls[i] for i in missing]), strict=True
                ):
                    replies[i] = reply
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    def _pipeline(self, script: Script, calls: list[Call]) -> list[Any]:
        if not calls:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for keys, args in calls:
            # execute_command: redis-py's cluster pipeline refuses its evalsha() method,
            # though it routes EVALSHA by its keys (one slot per call: the hash tag).
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "EVALSHA", script.sha, len(keys), *keys, *args
            )
        return list(pipe.execute(raise_on_error=False))
