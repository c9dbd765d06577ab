"""Which Postgres history each schema version's entries were computed from, in Redis.

A consumer compares every batch's Postgres identity
(:func:`~freshline.pipeline.cache.recompute.source_identity`) with its first batch's; one started
after Postgres changed history (restarted during a failover, say) has nothing of its
own to compare with. So the identity is also recorded beside the entries it vouches
for, one key per schema version (:func:`~freshline.pipeline.core.keys.source_key`), and a batch
compares its snapshot's identity with the record of every version it writes, before
its first write: a consumer asks Redis on its first batch, when the versions written
change, and then every :data:`RECHECK_S` while batches come.

One script does it: if no record names another history, it records the identity in
the versions that have none and renews every record; otherwise it writes nothing and
answers the other history. So two consumers racing on a fresh version agree (the first
records, the second compares), and one on another history changes nothing.

A record lives twice the longest feature-set TTL (as floors do) from its last renewal,
at most :data:`RECHECK_S` before any write it vouches for: once it is gone, every entry
computed on its history has expired. A purge of the version removes it after the
entries (:mod:`freshline.pipeline.deploy.purge`). Every version's record has the hash tag
``{source}``, so the script runs on one node of a Redis Cluster as on one server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import redis

from freshline.pipeline.cache.recompute import SourceIdentity
from freshline.pipeline.core.keys import source_key

RECHECK_S = 5.0
"""While the identity and the versions stay the same, the records are read again (and
renewed) at most this often."""

_CHECK_LUA = """
for _, key in ipairs(KEYS) do
  local recorded = redis.call('GET', key)
  if recorded and recorded ~= ARGV[1] then return recorded end
end
for _, key in ipairs(KEYS) do
  redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
end
return false
"""


def encode(identity: SourceIdentity) -> str:
    """``<system_identifier>:<timeline>``, as recorded."""
    return f"{identity.system_identifier}:{identity.timeline}"


def decode(raw: bytes | str) -> SourceIdentity:
    """A record's identity (timeline -1 if the record is not one :func:`encode` made)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    system_identifier, _, timeline = text.rpartition(":")
    return SourceIdentity(system_identifier, int(timeline) if timeline.isdigit() else -1)


class SourceRecord:
    """The records of the schema versions one consumer writes."""

    def __init__(
        self, client: redis.Redis, ttl_ms: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._check = client.register_script(_CHECK_LUA)
        self.ttl_ms = ttl_ms
        self.clock = clock
        self._vouched: tuple[SourceIdentity, tuple[int, ...]] | None = None
        self._at = 0.0

    def other(self, identity: SourceIdentity, versions: Sequence[int]) -> SourceIdentity | None:
        """The history recorded for one of ``versions`` if it is not ``identity``; else
        ``None``, ``identity`` recorded where none was and every record renewed (unless
        the same identity and versions were, less than :data:`RECHECK_S` ago)."""
        vouched = (identity, tuple(versions))
        now = self.clock()
        if not versions or (vouched == self._vouched and now - self._at < RECHECK_S):
            return None
        keys = [source_key(v) for v in versions]
        recorded = self._check(keys=keys, args=[encode(identity), self.ttl_ms])
        if recorded is not None:
            self._vouched = None
            return decode(recorded)
        self._vouched, self._at = vouched, now
        return None
