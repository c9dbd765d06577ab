"""Reading the dead-letter topic back: what is in it, and replaying records once fixed.

``freshline dlq list`` counts the dead letters by reason and source topic;
``freshline dlq replay`` sends each chosen record back to the topic it was read from,
with its original key, value and headers (and ``x-freshline-replay-of`` naming the
dead letter), so the consumers apply it on their normal path. An event only names
what changed and the consumer recomputes from Postgres, so a record replayed late
writes today's value, never the one of its time.

Per chunk of records, the order of side effects is: produce them to their source
topics, flush (the broker acknowledged every one), then record them in the ledger. A
crash in between replays the chunk again on the next run: at least once, which the
conditional writes make harmless.

The ledger is one Redis hash per dead-letter topic
(:func:`freshline.pipeline.core.keys.dlq_replayed_key`): field ``<partition>:<offset>``, value
the dead letter's timestamp (ms), so that a record at the same position of a topic
deleted and made again is not taken for one already replayed. Each replay drops the
fields below their partition's first retained offset: those records are gone.

Never replayed: a copy cut to fit the topic (``x-freshline-truncated``: its value is
not the record's), and a record that does not name its source topic.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Self

import redis
from confluent_kafka import KafkaError, Message, TopicPartition

from freshline.consumers.dlq import (
    ERROR_CLASS,
    ERROR_KIND,
    HEADER_PREFIX,
    REPLAY_OF,
    SOURCE_TOPIC,
    TRUNCATED,
)
from freshline.consumers.kafka import Consumer, Headers, Producer, check_message
from freshline.pipeline.core.errors import ConfigError, ServiceUnavailable
from freshline.pipeline.core.keys import dlq_replayed_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import DLQ, qualified

READ_STALL_S = 30.0
"""How long reading may go without a record or an end of partition before giving up."""
CHUNK = 500
"""Records produced, flushed and recorded together."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record of the dead-letter topic, its headers read."""

    partition: int
    offset: int
    timestamp_ms: int
    error_class: str
    kind: str | None
    source_topic: str | None
    truncated: bool
    key: bytes | None
    value: bytes | None
    headers: Headers
    """The record's own headers, freshline's removed."""

    @classmethod
    def of(cls, msg: Message) -> DeadLetter:
        raw = msg.headers() or []
        pairs: Headers = list(raw.items()) if isinstance(raw, dict) else raw
        ours = {k: _text(v) for k, v in pairs if k.startswith(HEADER_PREFIX)}
        _, timestamp = msg.timestamp()
        return cls(
            partition=int(msg.partition() or 0),
            offset=int(msg.offset() or 0),
            timestamp_ms=int(timestamp),
            error_class=ours.get(ERROR_CLASS) or "?",
            kind=ours.get(ERROR_KIND),
            source_topic=ours.get(SOURCE_TOPIC) or None,
            truncated=ours.get(TRUNCATED) == "1",
            key=_bytes(msg.key()),
            value=_bytes(msg.value()),
            headers=[(k, v) for k, v in pairs if not k.startswith(HEADER_PREFIX)],
        )

    @property
    def reason(self) -> str:
        """The decoding rejection's kind (``invalid_id``), else the error's class."""
        return self.kind or self.error_class

    @property
    def position(self) -> str:
        return f"{self.partition}:{self.offset}"


class DeadLetterLog:
    """The dead-letter topic, read from each partition's first retained record to its
    end as it was on opening: records dead-lettered meanwhile (a replayed record
    that fails again, say) wait for the next run. A context manager."""

    def __init__(self, settings: Settings) -> None:
        self.topic = qualified(settings, DLQ)
        self.prefix = settings.topic_prefix
        self.consumer = Consumer(
            settings,
            **{"group.id": f"{settings.consumer_group}.dlq", "enable.partition.eof": True},
        )
        self.ends = self._ends()

    @property
    def total(self) -> int:
        """How many records there are to read."""
        return sum(high - low for low, high in self.ends.values())

    def _ends(self) -> dict[int, tuple[int, int]]:
        """Per partition, the first retained offset and the offset after the last."""
        inner = self.consumer.inner
        try:
            found = inner.list_topics(self.topic, timeout=10).topics.get(self.topic)
        except Exception as exc:
            raise ServiceUnavailable("Kafka", self.consumer.bootstrap, str(exc)) from exc
        if found is None or found.error is not None or not found.partitions:
            raise ConfigError(
                f"there is no dead-letter topic {self.topic!r} (FRESHLINE_TOPIC_PREFIX is "
                f"{self.prefix!r}); create the topics with: freshline topics ensure"
            )
        return {
            p: inner.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10)
            for p in sorted(found.partitions)
        }

    def __iter__(self) -> Iterator[DeadLetter]:
        todo = {p: high for p, (low, high) in self.ends.items() if high > low}
        if not todo:
            return
        inner = self.consumer.inner
        inner.assign([TopicPartition(self.topic, p, self.ends[p][0]) for p in todo])
        heard = time.monotonic()
        while todo:
            batch = inner.consume(num_messages=CHUNK, timeout=0.5)
            if batch:
                heard = time.monotonic()
            elif time.monotonic() - heard > READ_STALL_S:
                raise ServiceUnavailable(
                    "Kafka",
                    self.consumer.bootstrap,
                    f"{self.topic} gave nothing for {READ_STALL_S:.0f}s",
                )
            for raw in batch:
                partition = raw.partition() or 0
                err = raw.error()
                if err is not None and err.code() == KafkaError._PARTITION_EOF:
                    todo.pop(partition, None)
                    continue
                msg = check_message(raw)
                if msg is None or partition not in todo:
                    continue
                offset = msg.offset() or 0
                if offset >= todo[partition] - 1:
                    todo.pop(partition)
                if offset < self.ends[partition][1]:
                    yield DeadLetter.of(msg)

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Ledger:
    """Which dead letters were replayed (see the module's docstring)."""

    def __init__(self, client: redis.Redis, topic: str) -> None:
        self.client = client
        self.key = dlq_replayed_key(topic)
        self._done: dict[str, int] | None = None

    def done(self) -> dict[str, int]:
        if self._done is None:
            raw = self.client.hgetall(self.key)
            self._done = {_text(k) or "": int(v) for k, v in raw.items()}
        return self._done

    def has(self, letter: DeadLetter) -> bool:
        return self.done().get(letter.position) == letter.timestamp_ms

    def record(self, letters: Iterable[DeadLetter]) -> None:
        mapping = {letter.position: letter.timestamp_ms for letter in letters}
        if mapping:
            self.client.hset(self.key, mapping=mapping)  # type: ignore[arg-type]
            self.done().update(mapping)

    def prune(self, ends: dict[int, tuple[int, int]]) -> int:
        """Forget the records no longer in the topic; return how many."""
        gone = []
        for position in self.done():
            partition, _, offset = position.partition(":")
            span = ends.get(int(partition))
            if span is None or int(offset) < span[0]:
                gone.append(position)
        if gone:
            self.client.hdel(self.key, *gone)
            for position in gone:
                del self.done()[position]
        return len(gone)


@dataclass(slots=True)
class Group:
    """The dead letters of one reason from one source topic."""

    reason: str
    source_topic: str
    count: int = 0
    replayed: int = 0
    oldest_ms: int = 0
    newest_ms: int = 0


def summarise(letters: Iterable[DeadLetter], ledger: Ledger) -> list[Group]:
    """Count ``letters`` by reason and source topic, most first."""
    groups: dict[tuple[str, str], Group] = {}
    for letter in letters:
        source = letter.source_topic or "?"
        group = groups.get((letter.reason, source))
        if group is None:
            group = groups[letter.reason, source] = Group(
                letter.reason, source, oldest_ms=letter.timestamp_ms
            )
        group.count += 1
        group.replayed += ledger.has(letter)
        group.oldest_ms = min(group.oldest_ms, letter.timestamp_ms)
        group.newest_ms = max(group.newest_ms, letter.timestamp_ms)
    return sorted(groups.values(), key=lambda g: (-g.count, g.reason, g.source_topic))


@dataclass(slots=True)
class ReplayReport:
    """What a replay did (or, dry, would do)."""

    replayed: Counter[str] = field(default_factory=Counter)
    """Records sent back, per source topic."""
    already: int = 0
    """Chosen records that an earlier replay sent back."""
    not_replayable: int = 0
    """Chosen records cut to fit the topic, or naming no source topic."""
    pruned: int = 0


def choose(letter: DeadLetter, reason: str | None, since_ms: int | None) -> bool:
    """Whether ``letter`` matches ``--reason`` (its kind or its error class) and
    ``--since`` (dead-lettered at or after it)."""
    if reason is not None and reason not in (letter.kind, letter.error_class):
        return False
    return since_ms is None or letter.timestamp_ms >= since_ms


def replay(
    settings: Settings,
    client: redis.Redis,
    *,
    reason: str | None = None,
    since_ms: int | None = None,
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayReport:
    """Send the chosen dead letters not yet replayed back to their source topics.

    ``progress(read, total)`` is called as records are read. A delivery the broker
    refuses raises :class:`freshline.consumers.kafka.DeliveryFailed`, with nothing of its chunk
    recorded: the next run sends the chunk again.
    """
    report = ReplayReport()
    with DeadLetterLog(settings) as log, Producer(settings) as producer:
        ledger = Ledger(client, log.topic)
        if not dry_run:
            report.pruned = ledger.prune(log.ends)
        chunk: list[DeadLetter] = []

        def send() -> None:
            if not dry_run:
                producer.flush()
                ledger.record(chunk)
            chunk.clear()

        read = 0
        for letter in log:
            read += 1
            if progress is not None and read % 100 == 0:
                progress(read, log.total)
            if not choose(letter, reason, since_ms):
                continue
            topic = letter.source_topic
            if letter.truncated or topic is None:
                report.not_replayable += 1
                continue
            if ledger.has(letter):
                report.already += 1
                continue
            if not dry_run:
                producer.produce(
                    topic,
                    letter.value,
                    letter.key,
                    headers=[
                        *letter.headers,
                        (REPLAY_OF, f"{log.topic}:{letter.position}".encode()),
                    ],
                )
            report.replayed[topic] += 1
            chunk.append(letter)
            if len(chunk) >= CHUNK:
                send()
        send()
        if progress is not None:
            progress(read, log.total)
    return report


def _text(data: str | bytes | None) -> str | None:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def _bytes(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data
