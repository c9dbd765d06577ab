"""The dead-letter topic: records that cannot be applied, unchanged, with the reason.

A dead-lettered record keeps its original key, value and headers; freshline adds
headers that say why and where it came from::

    x-freshline-error-class      EventRejected (or another exception's class name)
    x-freshline-error-kind       malformed_json, missing_field, ... (EventRejected only)
    x-freshline-error            the message, at most 1 KiB
    x-freshline-source-topic     the topic it was read from
    x-freshline-source-partition the partition, as decimal text
    x-freshline-source-offset    the offset, as decimal text

Order matters: the caller sends, flushes the producer (which raises if the broker
did not acknowledge), and only then commits the source offset. A crash in between
re-reads the record and dead-letters it again: at least once, never lost.
"""

from __future__ import annotations

from typing import Protocol

from consumers.events import EventRejected
from consumers.kafka import Delivery, Headers, Producer
from pipeline.core.topics import DLQ

HEADER_PREFIX = "x-freshline-"
ERROR_CLASS = "x-freshline-error-class"
ERROR_KIND = "x-freshline-error-kind"
ERROR = "x-freshline-error"
SOURCE_TOPIC = "x-freshline-source-topic"
SOURCE_PARTITION = "x-freshline-source-partition"
SOURCE_OFFSET = "x-freshline-source-offset"

MAX_ERROR_BYTES = 1024

RecordHeaders = dict[str, str | bytes | None] | list[tuple[str, str | bytes | None]] | None


class Record(Protocol):
    """What :meth:`DeadLetters.send` reads from a record; a confluent-kafka Message fits."""

    def topic(self) -> str | None: ...
    def partition(self) -> int | None: ...
    def offset(self) -> int | None: ...
    def key(self) -> str | bytes | None: ...
    def value(self) -> str | bytes | None: ...
    def headers(self) -> RecordHeaders: ...


class DeadLetters:
    """Sends records that cannot be applied to the dead-letter topic."""

    def __init__(self, producer: Producer, topic: str = DLQ) -> None:
        self.producer = producer
        self.topic = topic

    def send(self, msg: Record, error: BaseException) -> Delivery:
        """Queue ``msg`` for the dead-letter topic with headers saying why.

        Returns the :class:`Delivery`; call ``producer.flush()`` (or
        ``delivery.raise_for_error()`` after a flush) before committing the offset.
        """
        return self.producer.produce(self.topic, _as_bytes(msg.value()), _as_bytes(msg.key()),
                                     headers=dead_letter_headers(msg, error))


def dead_letter_headers(msg: Record, error: BaseException) -> Headers:
    """The original headers (any earlier ``x-freshline-*`` ones dropped), then ours."""
    original = msg.headers() or []
    pairs = list(original.items()) if isinstance(original, dict) else original
    kept: Headers = [(k, v) for k, v in pairs if not k.startswith(HEADER_PREFIX)]
    text = (error.reason if isinstance(error, EventRejected) else str(error)) or repr(error)
    ours: Headers = [
        (ERROR_CLASS, type(error).__name__.encode()),
        (ERROR, text.encode("utf-8", "replace")[:MAX_ERROR_BYTES]),
        (SOURCE_TOPIC, (msg.topic() or "").encode()),
        (SOURCE_PARTITION, str(msg.partition()).encode()),
        (SOURCE_OFFSET, str(msg.offset()).encode()),
    ]
    if isinstance(error, EventRejected):
        ours.insert(1, (ERROR_KIND, error.kind.encode()))
    return kept + ours


def _as_bytes(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data
