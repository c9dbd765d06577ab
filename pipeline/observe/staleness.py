"""How old is what we serve: entry ages sampled from Redis, and consumer-group lag.

Staleness
---------
:func:`sample` reads a random sample of one schema version's feature entries and
reports, per feature set, the oldest and the mean ``computed_at`` age against the
set's TTL. It never uses ``KEYS`` or ``RANDOMKEY``: it walks ``SCAN MATCH
feat:<version>:*`` a few steps from a random cursor (wrapping once through cursor 0),
reads each key's value and ``PTTL`` in one pipeline, and stops at ``want`` entries or
``max_calls`` SCAN steps. An entry older than its TTL, or one without an expiry, is a
bug (every entry has a TTL: see the design's contracts) and is counted as such.

The mean age says what governs an entry's life. Entries that live out their TTL
untouched have ages spread evenly over ``[0, TTL]`` (mean TTL/2); entries replaced by
change events long before that are younger (mean roughly the time between changes).
:mod:`freshline.pipeline.observe.advisor` uses this to advise on TTLs.

Consumer lag
------------
:class:`GroupLag` asks the broker, not the consumers, how far the consumer group is
behind: per partition, the end offset minus the group's committed offset, for the group
that has members assigned the topics (the status page names it). A consumer
that has died reports nothing, but this figure keeps growing while events arrive.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis

from freshline.pipeline.core.cluster import is_cluster
from freshline.pipeline.core.codec import ENTRY_TAG, HEADER
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.keys import FEATURE_PREFIX, feature_pattern
from freshline.pipeline.core.settings import Settings

log = logging.getLogger(__name__)

SCAN_COUNT = 1000
MAX_SCAN_CALLS = 32
SAMPLE_WANT = 200


@dataclass(frozen=True, slots=True)
class Staleness:
    """One feature set's sampled entry ages (seconds), against its TTL."""

    feature_set: str
    ttl_s: int
    sampled: int = 0
    oldest_age_s: float | None = None
    mean_age_s: float | None = None
    over_ttl: int = 0
    """Sampled entries whose age exceeds the TTL: the TTL is not enforced."""
    immortal: int = 0
    """Sampled keys (entries or tombstones) without any expiry."""


@dataclass(frozen=True, slots=True)
class Sample:
    """The result of one :func:`sample` call."""

    by_set: dict[str, Staleness]
    scan_calls: int
    complete: bool
    """True when the walk covered the whole keyspace (every matching key was seen)."""


def _table_size(client: redis.Redis) -> int:
    """A power of two at least the key count: the range SCAN cursors start in."""
    n = max(1, int(client.dbsize()))
    return 1 << (n - 1).bit_length()


def scan_sample(
    client: redis.Redis,
    pattern: str,
    *,
    want: int = SAMPLE_WANT,
    count: int = SCAN_COUNT,
    max_calls: int = MAX_SCAN_CALLS,
    rng: random.Random | None = None,
) -> tuple[list[bytes], int, bool]:
    """Up to ``want`` distinct keys matching ``pattern``, walked from a random cursor.

    Returns ``(keys, scan_calls, complete)``. The cursor starts at a random slot of the
    hash table, runs to the end (cursor 0), then wraps once from 0; a walk that comes
    back to 0 the second time has seen every key. On Redis Cluster: a share of
    ``want`` from every master, each walked so.
    """
    if is_cluster(client):
        masters = cast(Any, client).get_primaries()
        share = -(-want // len(masters))
        found: list[bytes] = []
        calls, complete = 0, True
        for node in masters:
            part, n, done = scan_sample(
                node.redis_connection,
                pattern,
                want=share,
                count=count,
                max_calls=max_calls,
                rng=rng,
            )
            found += part
            calls += n
            complete = complete and done
        return found[:want], calls, complete
    rng = rng or random.Random()
    start = rng.randrange(_table_size(client))
    cursor = start
    wrapped = start == 0
    seen: dict[bytes, None] = {}
    calls = 0
    while calls < max_calls and len(seen) < want:
        cursor, keys = client.scan(cursor=cursor, match=pattern, count=count)
        calls += 1
        for key in keys:
            seen[key if isinstance(key, bytes) else str(key).encode()] = None
        if cursor == 0:
            if wrapped:
                return list(seen)[:want], calls, True
            wrapped = True
    return list(seen)[:want], calls, False


def _feature_set_of(key: bytes) -> str | None:
    parts = key.split(b":", 3)
    if len(parts) < 4 or parts[0] != FEATURE_PREFIX.encode():
        return None
    return parts[2].decode()


def sample(
    client: redis.Redis,
    registry: Registry,
    schema_version: int,
    *,
    want: int = SAMPLE_WANT,
    count: int = SCAN_COUNT,
    max_calls: int = MAX_SCAN_CALLS,
    now_ms: int | None = None,
    rng: random.Random | None = None,
) -> Sample:
    """Sample ``schema_version``'s entries; see the module docstring.

    Every feature set of ``registry`` appears in the result, with ``sampled == 0`` when
    none of its entries were found.
    """
    keys, calls, complete = scan_sample(
        client,
        feature_pattern(schema_version),
        want=want,
        count=count,
        max_calls=max_calls,
        rng=rng,
    )
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
        pipe.pttl(key)
    replies = pipe.execute() if keys else []
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    ages: dict[str, list[float]] = {name: [] for name in registry.names()}
    immortal: dict[str, int] = dict.fromkeys(ages, 0)
    for i, key in enumerate(keys):
        raw, pttl = replies[2 * i], replies[2 * i + 1]
        name = _feature_set_of(key)
        if name not in ages or not isinstance(raw, bytes):
            continue  # another registry's set, or the key expired since the SCAN
        if pttl == -1:
            immortal[name] += 1
        if raw[:1] != ENTRY_TAG:
            continue  # a tombstone: no computed_at
        try:
            computed_at_ms = int(orjson.loads(raw[HEADER:])[1])
        except (orjson.JSONDecodeError, IndexError, TypeError, ValueError):
            log.warning("unreadable entry %r while sampling staleness", key)
            continue
        ages[name].append(max(0, now - computed_at_ms) / 1000)
    by_set: dict[str, Staleness] = {}
    for name, found in ages.items():
        ttl = registry[name].ttl_s
        by_set[name] = Staleness(
            feature_set=name,
            ttl_s=ttl,
            sampled=len(found),
            oldest_age_s=max(found) if found else None,
            mean_age_s=sum(found) / len(found) if found else None,
            over_ttl=sum(1 for a in found if a > ttl),
            immortal=immortal[name],
        )
    return Sample(by_set, calls, complete)


# -- consumer-group lag -----------------------------------------------------------------


def source_topics(settings: Settings, registry: Registry) -> dict[str, list[str]]:
    """Feature set -> the broker topics whose events can change it (domain and CDC)."""
    from freshline.pipeline.core.repository import active
    from freshline.pipeline.core.topics import CDC_PREFIX, qualified

    events = active().events
    out: dict[str, list[str]] = {}
    for name in registry.names():
        tables = {s.table for s in registry[name].sources}
        topics = [qualified(settings, e.topic) for e in events if e.table.name in tables]
        topics += [f"{settings.topic_prefix}{CDC_PREFIX}.public.{t}" for t in sorted(tables)]
        out[name] = topics
    return out


class GroupLag:
    """The lag of the consumer group reading the repository's topics, from the broker.

    The group is the one actually consuming: among the groups with members assigned
    any of the topics, ``settings.consumer_group`` if it is one, else the one assigned
    the most of their partitions; with none consuming, ``settings.consumer_group``.
    :attr:`group` names the group last measured and :attr:`missing` the topics asked
    for that do not exist. One admin client and one probe consumer (never subscribed,
    so it joins no group) are made on first use and reused; call :meth:`close`.
    """

    def __init__(self, settings: Settings, *, timeout_s: float = 2.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        self.group = settings.consumer_group
        self.consuming = False
        """Whether :attr:`group` had members assigned the topics at the last measure."""
        self.missing: list[str] = []
        self._probe: Any = None
        self._admin: Any = None

    def _client(self) -> Any:
        if self._probe is None:
            from confluent_kafka import Consumer

            from freshline.pipeline.core.services import kafka_security_config

            self._probe = Consumer(
                {
                    "bootstrap.servers": self.settings.kafka_bootstrap,
                    "group.id": self.settings.consumer_group,
                    "enable.auto.commit": False,
                    "socket.timeout.ms": int(self.timeout_s * 1000),
                    **kafka_security_config(self.settings),
                }
            )
        return self._probe

    def _admin_client(self) -> Any:
        if self._admin is None:
            from confluent_kafka.admin import AdminClient

            from freshline.pipeline.core.services import kafka_security_config

            self._admin = AdminClient(
                {
                    "bootstrap.servers": self.settings.kafka_bootstrap,
                    "socket.timeout.ms": int(self.timeout_s * 1000),
                    **kafka_security_config(self.settings),
                }
            )
        return self._admin

    def consuming_group(self, topics: Iterable[str]) -> tuple[str, bool]:
        """The group consuming ``topics`` (see the class), and whether any is."""
        from confluent_kafka import ConsumerGroupState

        wanted = set(topics)
        admin = self._admin_client()
        listed = admin.list_consumer_groups(
            states={
                ConsumerGroupState.STABLE,
                ConsumerGroupState.PREPARING_REBALANCING,
                ConsumerGroupState.COMPLETING_REBALANCING,
            },
            request_timeout=self.timeout_s,
        ).result()
        ids = [g.group_id for g in listed.valid]
        assigned: dict[str, int] = {}
        if ids:
            described = admin.describe_consumer_groups(ids, request_timeout=self.timeout_s)
            for group, future in described.items():
                try:
                    members = future.result().members
                except Exception as exc:  # a group this login may not describe
                    log.debug("group %s not described: %s", group, exc)
                    continue
                count = sum(
                    1
                    for m in members
                    if m.assignment is not None
                    for tp in m.assignment.topic_partitions
                    if tp.topic in wanted
                )
                if count:
                    assigned[group] = count
        if not assigned:
            return self.settings.consumer_group, False
        if self.settings.consumer_group in assigned:
            return self.settings.consumer_group, True
        return max(sorted(assigned), key=assigned.__getitem__), True

    def measure(self, topics: Iterable[str]) -> dict[str, int]:
        """Records behind the end, per existing topic, summed over its partitions, for
        the consuming group (:attr:`group`): the high watermark less its committed offset.

        A partition the group never committed counts from its earliest offset (the
        group reads from the start: ``auto_offset_reset=earliest``). Topics that do not
        exist are left out, and listed in :attr:`missing`.
        """
        from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition

        probe = self._client()
        wanted = list(dict.fromkeys(topics))
        metadata = probe.list_topics(timeout=self.timeout_s)
        found = {t for t in wanted if (m := metadata.topics.get(t)) is not None and m.error is None}
        self.missing = [t for t in wanted if t not in found]
        parts = [
            TopicPartition(t, p)
            for t in wanted
            if t in found
            for p in metadata.topics[t].partitions
        ]
        self.group, self.consuming = self.consuming_group(found)
        if not parts:
            return {}
        request = [ConsumerGroupTopicPartitions(self.group, parts)]
        offsets = (
            self._admin_client()
            .list_consumer_group_offsets(request, request_timeout=self.timeout_s)[self.group]
            .result()
        )
        lag: dict[str, int] = {}
        for tp in offsets.topic_partitions:
            try:
                low, high = probe.get_watermark_offsets(tp, timeout=self.timeout_s)
            except KafkaException as exc:
                # Lag is advisory: a partition without a leader this moment (a topic
                # just created, a broker restarting) is left out, not an error.
                log.debug("no offsets for %s[%s]: %s", tp.topic, tp.partition, exc)
                continue
            done = tp.offset if tp.offset >= 0 else low
            lag[tp.topic] = lag.get(tp.topic, 0) + max(0, high - done)
        return lag

    def by_feature_set(self, topics_of: Mapping[str, list[str]]) -> dict[str, int]:
        """Per feature set, the summed lag of the topics that feed it."""
        per_topic = self.measure(t for ts in topics_of.values() for t in ts)
        return {name: sum(per_topic.get(t, 0) for t in ts) for name, ts in topics_of.items()}

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self._admin = None
