"""The served log: what the read API answered, kept for training and the skew report.

A request is logged when a feature set it reads asks for it (``FeatureSet.log_sample``)
or its caller does (the ``Freshline-Log: 1`` header), sampled by a hash of its request
id, so a request (a batch) is logged whole or not at all. The id is the caller's
``X-Request-Id`` when it is 1 to 64 letters, digits and ``._:-``, else one made here; the
response echoes it.

The read path does little: the reader notes the entries it served
(:func:`saw_grid`, :func:`saw`) in a dict the request's context holds, and the route
puts one :class:`Served` record in a bounded queue. A thread encodes the records and
produces them to ``<prefix>freshline.served``; a full queue drops the record and counts
it (``freshline_served_log_total{outcome="dropped"}``), never slowing or failing a read.
Entries go out as the bytes Redis held (tier and read-through entries re-encoded from
what was served); :mod:`freshline.consumers.served` decodes them. See ``docs/observability.md``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import confluent_kafka
import orjson
from prometheus_client import Counter

from freshline.pipeline.core.codec import encode_entry
from freshline.pipeline.core.services import kafka_security_config
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import SERVED, qualified
from freshline.pipeline.core.types import EntityRef, Entry

log = logging.getLogger(__name__)

REQUEST_ID_HEADER: Final = "x-request-id"
LOG_HEADER: Final = "freshline-log"
REQUEST_ID: Final = re.compile(r"[A-Za-z0-9._:\-]{1,64}")
FORMAT: Final = 1
"""The version of a log message's JSON (:meth:`Served.message`)."""

SOURCES: Final = {
    "local": "tier",
    "hit": "redis",
    "waited": "redis",
    "computed": "read-through",
    "uncached": "read-through",
    "miss": "miss",
}
"""Where an answer came from (:data:`freshline.pipeline.api.reader.AnswerSource`), as logged."""

LOGGED = Counter(
    "freshline_served_log",
    "Served-log records by outcome: queued on the read path, dropped there (queue full), "
    "sent to Kafka, failed delivery.",
    ["outcome"],
)


class ServedResult(Protocol):
    """What a read-through answers (:class:`freshline.pipeline.cache.readthrough.Result`)."""

    @property
    def values(self) -> Any: ...
    @property
    def age_ms(self) -> int: ...
    @property
    def schema_version(self) -> int: ...
    @property
    def watermark(self) -> int: ...


Read = tuple[str, str, str, str, "ServedResult | None"]
"""One read of the Python client: feature set, tenant, entity, source, what it served."""

Seen = dict[tuple[str, str], "bytes | str | Entry | ServedResult | None"]
"""What the reader served each (feature set, entity) from: entry bytes, or an entry."""

_SEEN: ContextVar[Seen | None] = ContextVar("freshline_served", default=None)


def watch() -> Seen:
    """Start noting what this request's reads serve (the context's, and the thread
    pool's calls made from it): the dict they fill."""
    seen: Seen = {}
    _SEEN.set(seen)
    return seen


def stop() -> None:
    """Stop noting this context's reads."""
    _SEEN.set(None)


def saw_grid(
    feature_sets: Sequence[str], entities: Sequence[str], raws: Sequence[bytes | None]
) -> None:
    """Note the MGET of a grid (entity-major, ``len(feature_sets)`` per entity)."""
    seen = _SEEN.get()
    if seen is None:
        return
    k = len(feature_sets)
    for i in range(k * len(entities)):
        seen[feature_sets[i % k], entities[i // k]] = raws[i]


def saw(refs: Iterable[EntityRef], entries: Iterable[Entry | ServedResult | None]) -> None:
    """Note the entries (or read-through results) served for ``refs``."""
    seen = _SEEN.get()
    if seen is None:
        return
    for ref, entry in zip(refs, entries, strict=False):
        seen[ref.feature_set, ref.entity] = entry


def request_id(given: str | None) -> str:
    """The caller's id when it is well formed, else a new one."""
    if given is not None and REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


_request_id = request_id  # for ServedLog.chosen, whose parameter has the name


def sampled(rid: str, rate: float) -> bool:
    """Whether the request ``rid`` is in the sampled share ``rate`` (0 to 1): the same
    answer for the same id, everywhere."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(rid.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < rate * 2**64


@dataclass(slots=True)
class Served:
    """One logged request: what it read (``items``: feature set, entity, answer's
    source, entry) and, for a prediction, the model and each entity's prediction."""

    request_id: str
    tenant: str
    route: str
    at_us: int
    items: list[tuple[str, str, str, bytes | str | Entry | ServedResult | None]]
    model: str | None = None
    model_version: str | None = None
    predictions: dict[str, Any] = field(default_factory=dict)
    values: dict[tuple[str, str], Any] = field(default_factory=dict)
    """Values served with no entry noted for them (a read the reader did not note)."""

    def message(self) -> bytes:
        """The Kafka message: JSON, each entry as the text of its stored bytes."""
        return orjson.dumps(
            {
                "v": FORMAT,
                "request_id": self.request_id,
                "tenant": self.tenant,
                "route": self.route,
                "at_us": self.at_us,
                "model": self.model,
                "model_version": self.model_version,
                "items": [
                    {
                        "feature_set": fs,
                        "entity": entity,
                        "source": SOURCES.get(source, source),
                        "entry": _entry_text(entry, self.at_us),
                        "prediction": self.predictions.get(entity),
                        "values": self.values.get((fs, entity)),
                    }
                    for fs, entity, source, entry in self.items
                ],
            }
        )


def _entry_text(entry: bytes | str | Entry | ServedResult | None, at_us: int) -> str | None:
    """An entry as the text of its stored bytes (entries are ASCII and UTF-8 JSON)."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, bytes):
        return entry.decode()
    # A read-through's result was computed at most its age before the request.
    computed = entry.computed_at_ms if isinstance(entry, Entry) else at_us // 1000 - entry.age_ms
    raw = encode_entry(list(entry.values.values()), entry.schema_version, computed, entry.watermark)
    return raw.decode()


class ServedLog:
    """The bounded queue and the thread that produces what it holds to Kafka.

    ``capacity`` records wait at most; :meth:`put` past it drops and counts. The thread
    and its producer start with the first record; :meth:`close` sends what is queued
    (``timeout_s`` at most) and stops it.
    """

    def __init__(self, settings: Settings, capacity: int | None = None) -> None:
        self.topic = qualified(settings, SERVED)
        self.capacity = settings.served_log_buffer if capacity is None else capacity
        self.sample = settings.served_log_sample
        self._config: dict[str, Any] = {
            "bootstrap.servers": settings.kafka_bootstrap,
            "client.id": "freshline-served-log",
            "linger.ms": 50,
            "compression.type": "lz4",
            **kafka_security_config(settings),
        }
        self._queue: queue.Queue[Served | None] = queue.Queue(max(self.capacity, 1))
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, record: Served) -> bool:
        """Queue ``record`` for Kafka without waiting; ``False`` (counted) when full."""
        if self._thread is None:
            self._start()
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            LOGGED.labels("dropped").inc()
            return False
        LOGGED.labels("queued").inc()
        return True

    def chosen(self, request_id: str | None, rate: float, asked: bool) -> str | None:
        """The id of a call (the caller's ``request_id`` when well formed) if it is
        logged: ``asked``, or sampled at ``rate``; else ``None``."""
        rid = _request_id(request_id)
        return rid if asked or sampled(rid, rate) else None

    def log_reads(self, request_id: str, route: str, at_us: int, reads: Sequence[Read]) -> None:
        """Queue one call's ``reads`` (feature set, tenant, entity, source, what was
        served), one record per tenant: the Python client's side of the log."""
        by_tenant: dict[str, Served] = {}
        for fs, tenant, entity, source, entry in reads:
            record = by_tenant.get(tenant)
            if record is None:
                record = by_tenant[tenant] = Served(request_id, tenant, route, at_us, [])
            record.items.append((fs, entity, source, entry))
        for record in by_tenant.values():
            self.put(record)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="freshline-served-log", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        producer = confluent_kafka.Producer(self._config)
        try:
            while True:
                try:
                    record = self._queue.get(timeout=0.5)
                except queue.Empty:  # idle: serve delivery reports all the same
                    producer.poll(0)
                    continue
                if record is None:
                    break
                self._produce(producer, record)
                producer.poll(0)
        finally:
            left = producer.flush(self._flush_s)
            if left:
                LOGGED.labels("failed").inc(left)
                log.warning("served log: %d records not delivered at close", left)

    _flush_s = 10.0

    def _produce(self, producer: confluent_kafka.Producer, record: Served) -> None:
        try:
            producer.produce(
                self.topic, record.message(), record.request_id, on_delivery=_delivered
            )
        except BufferError:  # librdkafka's own queue is full: Kafka is away or slow
            self.dropped += 1
            LOGGED.labels("dropped").inc()
        except (confluent_kafka.KafkaException, ValueError, TypeError) as exc:
            _failed(f"a record was not produced: {exc}")

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop the thread (``timeout_s`` for both)."""
        thread = self._thread
        if thread is None:
            return
        self._flush_s = timeout_s
        deadline = time.monotonic() + timeout_s
        while True:  # the stop marker waits for room, never drops a record
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    log.warning("served log: closed with %d records queued", self._queue.qsize())
                    return
        thread.join(timeout_s + 1)
        self._thread = None


def _delivered(err: confluent_kafka.KafkaError | None, _msg: confluent_kafka.Message) -> None:
    if err is None:
        LOGGED.labels("sent").inc()
    else:
        _failed(f"a record was not delivered: {err}")


_WARNED = [0.0]
WARN_EVERY_S: Final = 60.0


def _failed(what: str) -> None:
    """Count a failure; warn at most once a minute (a broker away fails every record)."""
    LOGGED.labels("failed").inc()
    now = time.monotonic()
    if now - _WARNED[0] >= WARN_EVERY_S:
        _WARNED[0] = now
        log.warning("served log: %s (freshline_served_log_total counts them all)", what)
