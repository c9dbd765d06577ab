"""Per-tenant budgets of the Redis keys a caller can cause, in keys and in bytes.

A :class:`TenantBudget` keeps, for each tenant, two keys in the tenant's hash tag
(their names come from :mod:`freshline.pipeline.core.keys`, e.g.
:func:`freshline.pipeline.core.keys.inference_budget_keys`):

* a sorted set of the tenant's keys, each member ``<key>|<bytes>``, scored by the
  moment (Redis's clock, ms) the key expires;
* a counter of the bytes its members stand for.

Both carry a TTL that ends with the last member's expiry: the bookkeeping of a tenant
that stops writing goes with its entries.

Order of a write of new entries (:meth:`TenantBudget.admit`, then the caller):

1. one script, atomic on the tenant's two keys: members whose expiry has passed leave
   (their bytes with them); the new members go in (one already there moves to its new
   expiry, its bytes not counted twice); then the lowest-scored, the tenant's
   oldest, are popped until both limits hold. It returns the keys popped. A write of
   more than :data:`ADMIT_CHUNK` entries runs it once per chunk, so that no call holds
   Redis long (a chunk's popped keys may include earlier chunks' new ones);
2. the caller writes its new entries, except those popped (a batch larger than the
   budget keeps the part that fits), and ``UNLINK``s the popped keys that were not its
   own. Only this tenant's writes add to its set, so every key popped is this
   tenant's: another tenant's entries are never touched.

Counting comes before writing: the count errs towards less room, never more
(docs/security.md, "Redis memory: per-tenant budgets and maxmemory", says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import redis

ENTRY_OVERHEAD_BYTES: Final = 256
"""What Redis spends on a string key with a TTL and on its sorted-set member, besides
the key's and value's own bytes. Measured on Redis 7.0 (``used_memory`` over 10,000
keys): about 150 bytes per string key with a TTL and 100 per sorted-set member."""

ADMIT_CHUNK: Final = 32
"""Entries counted per script call, at most. The script holds Redis, which every tenant's
reads wait on, for about 15 µs an entry (ZADD and ZPOPMIN on a sorted set at its
budget, and Lua's own work): 100 entries at once held it 1.5 ms, long enough to show in
others' p99 (``bench/abuse.py``). Chunks of 32 hold it under 0.6 ms each, and a chunk
keeps every invariant on its own."""

# A member's cost is its suffix after the last '|': found from 24 characters before
# the end (a '|' and at most 20 digits), not by trying the pattern at every position.
_ADMIT: Final = """
local function cost(member)
  return tonumber(string.match(member, '|(%d+)$', -24)) or 0
end
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local expiry = now + tonumber(ARGV[1])
local max_keys, max_bytes = tonumber(ARGV[2]), tonumber(ARGV[3])
local bytes = tonumber(redis.call('GET', KEYS[2]) or '0')
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, member in ipairs(gone) do bytes = bytes - cost(member) end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) end
if #ARGV > 3 then
  local members = {unpack(ARGV, 4)}
  local scores = redis.call('ZMSCORE', KEYS[1], unpack(members))
  local args = {}
  for i, member in ipairs(members) do
    -- one already there moves to its new expiry, its bytes not counted twice
    if not scores[i] then bytes = bytes + cost(member) end
    args[2 * i - 1] = expiry
    args[2 * i] = member
  end
  redis.call('ZADD', KEYS[1], unpack(args))
end
local n = redis.call('ZCARD', KEYS[1])
local popped = {}
while n > 0 and (n > max_keys or bytes > max_bytes) do
  local oldest = redis.call('ZPOPMIN', KEYS[1], math.max(1, n - max_keys))
  for i = 1, #oldest, 2 do
    bytes = bytes - cost(oldest[i])
    popped[#popped + 1] = oldest[i]
  end
  n = n - #oldest / 2
end
if n == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  local ttl = math.max(1, tonumber(last[2]) - now + 1000)
  redis.call('SET', KEYS[2], math.max(0, bytes), 'PX', ttl)
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return popped
"""


def entry_cost(key: str, value_bytes: int) -> int:
    """The bytes one entry is counted for: its key twice (the key and its member),
    its value, and :data:`ENTRY_OVERHEAD_BYTES`."""
    return 2 * len(key.encode()) + value_bytes + ENTRY_OVERHEAD_BYTES


class TenantBudget:
    """At most ``max_keys`` keys and ``max_bytes`` bytes per tenant for one kind of
    entry; see the module docstring for the order of a write."""

    def __init__(self, client: redis.Redis, *, max_keys: int, max_bytes: int) -> None:
        if max_keys < 1 or max_bytes < 1:
            raise ValueError(f"budgets must be positive, got {max_keys} keys, {max_bytes} bytes")
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self._admit = client.register_script(_ADMIT)

    def admit(
        self, keys: tuple[str, str], entries: Sequence[tuple[str, int]], ttl_ms: int
    ) -> set[str]:
        """Count ``entries`` (key, value size in bytes), expiring in ``ttl_ms``, against
        the tenant whose budget ``keys`` are (its sorted set and byte counter); return
        the keys that had to go to stay within budget: the tenant's oldest, maybe some
        of ``entries`` themselves, which the caller must then not write."""
        return {key for key, _ in self.admit_costs(keys, entries, ttl_ms)}

    def admit_costs(
        self, keys: tuple[str, str], entries: Sequence[tuple[str, int]], ttl_ms: int
    ) -> list[tuple[str, int]]:
        """:meth:`admit`, each key popped with the bytes it was counted for: a key
        whose value has since been written again with another size has a member of
        its own, and a caller can tell the two apart by their sizes."""
        members = [f"{key}|{entry_cost(key, size)}" for key, size in entries]
        popped: list[tuple[str, int]] = []
        for start in range(0, max(1, len(members)), ADMIT_CHUNK):
            chunk = members[start : start + ADMIT_CHUNK]
            got = self._admit(keys=list(keys), args=[ttl_ms, self.max_keys, self.max_bytes, *chunk])
            popped += [_key_and_cost(member) for member in got]
        return popped


def memory_problem(client: redis.Redis) -> str | None:
    """What keeps the budgets from protecting every tenant on ``client``'s server, if
    anything (read with ``INFO memory``, which the API's Redis user may run).

    Budgets bound each tenant; only ``maxmemory`` bounds them all. Under
    ``noeviction`` a full Redis refuses writes and nothing is lost; any other policy
    may evict (every freshline key has a TTL, so ``volatile-*`` may evict them all,
    watermark floors and tombstones included) and an older write could then land
    (:func:`freshline.pipeline.cache.store.check_eviction_policy` refuses such a server).
    """
    info: dict[str, Any] = client.info("memory")
    servers = [v for v in info.values() if isinstance(v, dict)] or [info]  # a cluster: per node
    for server in servers:
        if not int(server.get("maxmemory") or 0):
            return (
                "Redis has no maxmemory: the per-tenant budgets bound each tenant, but "
                "nothing bounds them all; set maxmemory (with maxmemory-policy "
                "noeviction) below the memory the host can give it"
            )
        policy = str(server.get("maxmemory_policy", ""))
        if policy != "noeviction":
            return (
                f"Redis's maxmemory-policy is {policy}: it may evict entries, floors or "
                "tombstones, and an older write could then land; set it to noeviction"
            )
    return None


def usage(client: redis.Redis, keys: tuple[str, str]) -> tuple[int, int]:
    """``(keys, bytes)`` counted now in the budget whose keys are ``keys`` (expired
    members included until the next write drops them)."""
    pipe = client.pipeline(transaction=False)
    pipe.zcard(keys[0])
    pipe.get(keys[1])
    n, size = pipe.execute()
    return int(n), int(size or 0)


def _key_and_cost(member: bytes | str) -> tuple[str, int]:
    text = member.decode() if isinstance(member, bytes) else member
    key, _, cost = text.rpartition("|")
    return key, int(cost or 0)
