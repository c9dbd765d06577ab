"""The dead-letter topic: records that cannot be applied, unchanged, with the reason.

A dead-lettered record keeps its original key, value and headers; freshline adds
``x-freshline-error-class``, ``-error-kind``, ``-error`` (at most 1 KiB) and
``-source-topic``, ``-source-partition``, ``-source-offset``. A copy that would not fit
``max_bytes`` is cut to :data:`KEPT_VALUE_BYTES` of its value, never dropped, and says
so (``x-freshline-truncated``, ``-original-size``, ``-value-sha256``).
``freshline dlq replay`` (:mod:`freshline.consumers.replay`) sends a record back with
``x-freshline-replay-of``.

Order matters: the caller sends, flushes the producer (which raises if the broker
did not acknowledge), and only then commits the source offset: at least once, never
lost. The headers and their values: docs/events.md, "What happens to a bad event".
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from freshline.consumers.events import EventRejected
from freshline.consumers.kafka import Delivery, Headers, Producer
from freshline.pipeline.core.topics import DLQ

HEADER_PREFIX = "x-freshline-"
ERROR_CLASS = "x-freshline-error-class"
ERROR_KIND = "x-freshline-error-kind"
ERROR = "x-freshline-error"
SOURCE_TOPIC = "x-freshline-source-topic"
SOURCE_PARTITION = "x-freshline-source-partition"
SOURCE_OFFSET = "x-freshline-source-offset"
TRUNCATED = "x-freshline-truncated"
ORIGINAL_SIZE = "x-freshline-original-size"
VALUE_SHA256 = "x-freshline-value-sha256"
REPLAY_OF = "x-freshline-replay-of"

MAX_ERROR_BYTES = 1024
KEPT_VALUE_BYTES = 1024
RECORD_OVERHEAD_BYTES = 512
"""Room left for the record batch framing around key, value and headers."""

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

    def __init__(self, producer: Producer, topic: str = DLQ, *, max_bytes: int = 1_000_000) -> None:
        self.producer = producer
        self.topic = topic
        self.max_bytes = max_bytes

    def send(self, msg: Record, error: BaseException) -> Delivery:
        """Queue ``msg`` for the dead-letter topic with headers saying why.

        Returns the :class:`Delivery`; call ``producer.flush()`` (or
        ``delivery.raise_for_error()`` after a flush) before committing the offset.
        """
        value, key = _as_bytes(msg.value()), _as_bytes(msg.key())
        headers = dead_letter_headers(msg, error)
        if _size(value, key, headers) > self.max_bytes:
            value, headers = _cut(value, headers)
        if _size(value, key, headers) > self.max_bytes:
            # The original headers alone are too big: keep only ours.
            headers = [(k, v) for k, v in headers if k.startswith(HEADER_PREFIX)]
        return self.producer.produce(self.topic, value, key, headers=headers)


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


def _size(value: bytes | None, key: bytes | None, headers: Headers) -> int:
    header_bytes = sum(len(k) + len(v or b"") for k, v in headers)
    return len(value or b"") + len(key or b"") + header_bytes + RECORD_OVERHEAD_BYTES


def _cut(value: bytes | None, headers: Headers) -> tuple[bytes, Headers]:
    """The first bytes of ``value``, with headers giving its size and digest."""
    whole = value or b""
    return whole[:KEPT_VALUE_BYTES], [
        *headers,
        (TRUNCATED, b"1"),
        (ORIGINAL_SIZE, str(len(whole)).encode()),
        (VALUE_SHA256, hashlib.sha256(whole).hexdigest().encode()),
    ]


def _as_bytes(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data
