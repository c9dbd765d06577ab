"""The oracle: what must hold once a scenario's faults are over and the consumers quiesce.

(a) **Values.** For every entity the workload touched, and every entry of its tenant
    present in Redis, the served entry (active schema version) equals two answers that
    share no code with the consumers' path: the feature set's defining full query
    (never the incremental path) and a plain Python reference over the raw rows
    (:mod:`tests.faults.reference`), both at the moment the entries were read, from
    one snapshot (or, where a window edge passed while they were read, at a moment of
    that read). Correct or absent: a missing entry or a tombstone passes. The two
    answers must also agree with each other, for every entity checked.
(b) **Accounting.** Per partition of every topic the group reads: the group committed
    every record (committed offset = end offset); the domain-event partitions hold
    exactly the records the workload produced, and the CDC topics at least as many
    records as its SQL changed; the dead-letter topic holds only what the scenario
    expects. Per topic, the consumers' counters (every member's, killed ones included)
    count every record at least once: ``applied + dead_lettered + skipped >= produced``,
    with ``applied`` covering the non-null records and ``skipped`` the tombstones.
    Redeliveries (counted more than once) are reported, not failed: at-least-once is
    the contract. A shortfall is a record committed without being counted: skipped
    silently.
(c) **TTLs.** Every feature and lease key of the instance has one (SCAN + PTTL).
(d) **Processes.** Every consumer is alive unless the scenario killed it.
(e) **Readers.** Every value the API (in-process tier on) and the Python client served
    while the case ran and after it quiesced was the reference's at some moment within
    its grace (:mod:`tests.faults.readers`).

Quiescence (:func:`quiesce`): the CDC topics hold the records the workload's SQL must
yield, every partition's committed offset is its end offset, and no live member holds
a batch it has not counted, all within a deadline.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
import sqlalchemy as sa
from confluent_kafka import Consumer as KafkaConsumer
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from freshline.consumers.topics import event_topics, subscription
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.versions import state
from freshline.pipeline.core.services import kafka_security_config
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import qualified
from freshline.pipeline.core.types import EntityRef, Entry, FeatureValues
from tests.faults.processes import Counts, Fleet
from tests.faults.readers import READERS, SETTLED_GRACE_S, Readers, judge
from tests.faults.reference import FEATURE_SETS, Values, load, one, pieces, reference
from tests.faults.workload import Produced, Ref, Workload
from tests.helpers import REGISTRY, kafka_headers

Partition = tuple[str, int]
DLQ_SOURCE = (
    "x-freshline-source-topic",
    "x-freshline-source-partition",
    "x-freshline-source-offset",
)
POLL_S = 0.1
EXAMPLES = 5


class NotQuiesced(Exception):
    """The consumers did not settle before the deadline; the message says where."""


# -- Kafka reading ----------------------------------------------------------------------


def subscribed_partitions(admin: AdminClient, settings: Settings) -> list[Partition]:
    """Every partition of the topics ``freshline consume`` reads by default."""
    patterns = [re.compile(t[1:]) if t.startswith("^") else None for t in subscription(settings)]
    names = [t for t in subscription(settings) if not t.startswith("^")]
    topics = admin.list_topics(timeout=15).topics
    out: list[Partition] = []
    for name, meta in sorted(topics.items()):
        if meta.error is not None:
            continue
        if name in names or any(p is not None and p.match(name) for p in patterns):
            out += [(name, p) for p in sorted(meta.partitions)]
    return out


def _probe(settings: Settings, group: str = "freshline-faults-probe") -> KafkaConsumer:
    return KafkaConsumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
            **kafka_security_config(settings),
        }
    )


def end_offsets(settings: Settings, partitions: Iterable[Partition]) -> dict[Partition, int]:
    probe = _probe(settings)
    try:
        return {
            (t, p): probe.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
            for t, p in partitions
        }
    finally:
        probe.close()


def committed_offsets(
    settings: Settings, group: str, partitions: Iterable[Partition]
) -> dict[Partition, int]:
    """The group's committed offsets (-1 where it committed none)."""
    probe = _probe(settings, group)
    try:
        got = probe.committed([TopicPartition(t, p) for t, p in partitions], timeout=15)
        return {(tp.topic, tp.partition): tp.offset for tp in got}
    finally:
        probe.close()


def position_group(settings: Settings, group: str, offsets: dict[Partition, int]) -> None:
    """Commit ``offsets`` for a group with no members yet: where its members will start."""
    probe = _probe(settings, group)
    try:
        probe.commit(
            offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False
        )
    finally:
        probe.close()


@dataclass(frozen=True, slots=True)
class Record:
    topic: str
    partition: int
    offset: int
    value: bytes | None
    headers: dict[str, bytes]


def read_range(
    settings: Settings, ranges: dict[Partition, tuple[int, int]], deadline_s: float = 60.0
) -> list[Record]:
    """Every record in ``[start, end)`` of each partition."""
    wanted = {tp: rng for tp, rng in ranges.items() if rng[1] > rng[0]}
    if not wanted:
        return []
    probe = _probe(settings)
    out: list[Record] = []
    try:
        probe.assign([TopicPartition(t, p, start) for (t, p), (start, _) in wanted.items()])
        left = dict(wanted)
        end = time.monotonic() + deadline_s
        while left:
            if time.monotonic() > end:
                raise NotQuiesced(f"could not read back {sorted(left)} in {deadline_s:.0f}s")
            for msg in probe.consume(500, timeout=0.5):
                if msg.error() is not None:
                    continue
                topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
                assert topic is not None and partition is not None and offset is not None
                key = (topic, partition)
                if key not in left or offset >= left[key][1]:
                    continue
                out.append(Record(topic, partition, offset, msg.value(), kafka_headers(msg)))
                if offset + 1 >= left[key][1]:
                    del left[key]
    finally:
        probe.close()
    return out


# -- quiescence ------------------------------------------------------------------------


def wait(
    condition: Callable[[], bool],
    what: str,
    deadline_s: float,
    detail: Callable[[], str] = lambda: "",
) -> None:
    """Poll ``condition`` until it holds; :class:`NotQuiesced` naming ``what`` at the deadline."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            extra = detail()
            raise NotQuiesced(
                f"{what}: not within {deadline_s:.0f}s" + (f" ({extra})" if extra else "")
            )
        time.sleep(POLL_S)  # polling interval, not synchronisation


def cdc_delivered(
    settings: Settings, start: dict[Partition, int], expected: dict[str, int]
) -> tuple[bool, str]:
    """Whether each CDC topic grew by at least what the workload's SQL must yield."""
    ends = end_offsets(settings, [tp for tp in start if ".public." in tp[0]])
    grown: dict[str, int] = defaultdict(int)
    for (topic, p), end in ends.items():
        grown[topic.rsplit(".", 1)[1]] += end - start[(topic, p)]
    short = {t: f"{grown.get(t, 0)}/{n}" for t, n in expected.items() if grown.get(t, 0) < n}
    return not short, ", ".join(f"{t} {v}" for t, v in sorted(short.items()))


def lag(settings: Settings, group: str, partitions: list[Partition]) -> dict[Partition, int]:
    ends = end_offsets(settings, partitions)
    done = committed_offsets(settings, group, partitions)
    return {
        tp: ends[tp] - max(done.get(tp, -1), 0)
        for tp in partitions
        if ends[tp] - max(done.get(tp, -1), 0) > 0
    }


def slot_caught_up(engine: Engine, slot: str, lsn: str) -> bool:
    """Whether Debezium confirmed ``lsn`` on its slot: every change committed before it
    is in Kafka (Debezium confirms a position only after its records were written)."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT confirmed_flush_lsn >= CAST(:lsn AS pg_lsn) FROM pg_replication_slots "
                    "WHERE slot_name = :slot"
                ),
                {"lsn": lsn, "slot": slot},
            ).scalar()
        )


def quiesce(
    settings: Settings,
    fleet: Fleet,
    start: dict[Partition, int],
    cdc_expected: dict[str, int],
    deadline_s: float,
    engine: Engine | None = None,
    slot: str = "",
    end_lsn: str = "",
) -> None:
    """Wait for CDC delivery, then for zero lag with every live member between batches.

    CDC delivery is the slot's confirmed position passing ``end_lsn`` (the WAL position
    after the workload's last commit), and each CDC topic holding at least the records
    the workload's SQL must yield. The count alone is not enough: a restarted connector
    repeats records, so a topic can reach the count before the last change arrives.
    """
    end = time.monotonic() + deadline_s
    state_cdc: list[str] = [""]
    if engine is not None and slot and end_lsn:
        wait(
            lambda: slot_caught_up(engine, slot, end_lsn),
            f"Debezium to confirm WAL position {end_lsn} on slot {slot}",
            deadline_s,
        )

    def delivered() -> bool:
        ok, state_cdc[0] = cdc_delivered(settings, start, cdc_expected)
        return ok

    wait(
        delivered,
        "Debezium to deliver every change the workload committed",
        deadline_s,
        lambda: f"records/expected: {state_cdc[0]}",
    )
    partitions = list(start)
    last: list[dict[Partition, int]] = [{}]

    def settled() -> bool:
        if not fleet.alive():
            return False
        last[0] = lag(settings, fleet.group, partitions)
        return not last[0] and fleet.settled()

    def where() -> str:
        behind = ", ".join(f"{t}[{p}]: {n}" for (t, p), n in sorted(last[0].items()))
        mid = [m.name for m in fleet.alive() if m.mid_batch()]
        return (
            f"lag {behind or 'none'}; mid-batch: {', '.join(mid) or 'none'}; "
            f"alive: {', '.join(m.name for m in fleet.alive()) or 'none'}"
        )

    wait(
        settled,
        "the consumer group to commit every record with no batch in hand",
        max(1.0, end - time.monotonic()),
        where,
    )


# -- the checks ------------------------------------------------------------------------


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    checked: int = 0
    present: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    disagreements: list[dict[str, Any]] = field(default_factory=list)
    """Values on which the full query and the Python reference differ."""
    accounting: dict[str, Any] = field(default_factory=dict)
    ttl_violations: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    readers: dict[str, Any] = field(default_factory=dict)
    """(e): what the readers were served, and the answers true at no moment in their grace."""

    @property
    def passed(self) -> bool:
        return not self.failures


def tenant_keys(client: redis.Redis, version: int, tenant: str) -> set[Ref]:
    """Every entity of ``tenant`` with an entry (or tombstone) in ``version``."""
    found: set[Ref] = set()
    for key in client.scan_iter(match=f"feat:{version}:*:{{{tenant}:*}}", count=1000):
        text = key.decode() if isinstance(key, bytes) else key
        _, _, tag = text.partition("{")
        _, _, entity = tag.rstrip("}").partition(":")
        found.add((tenant, entity))
    return found


@dataclass(frozen=True, slots=True)
class Truth:
    """What a served entry must equal: two independent answers, at one moment, from one
    snapshot."""

    as_of: datetime
    full: dict[str, dict[Ref, FeatureValues]]
    """Per feature set, the defining full query's values: never the incremental path
    the consumers may recompute by (``txn_90d``'s, by default)."""
    reference: dict[str, dict[Ref, Values]]
    """Per feature set, the plain Python reference's over the raw rows
    (:mod:`tests.faults.reference`), which shares no code with either query."""


def truth(engine: Engine, refs: Sequence[Ref], as_of: datetime | None = None) -> Truth:
    """Both answers for ``refs`` at ``as_of``: by default the moment of this call
    (Postgres's ``now()`` in the transaction, as a recompute without ``as_of`` takes).

    One REPEATABLE READ transaction holds them: its first statement takes the snapshot
    that the full query and the reference's plain SELECTs then both read.
    """
    known = set(FEATURE_SETS)
    if set(REGISTRY.names()) != known:
        raise ValueError(
            f"the reference knows {sorted(known)}, the registry has {sorted(REGISTRY.names())}"
        )
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        moment: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
        at = moment if as_of is None else as_of
        full = {fs.name: compute(conn, fs, refs, as_of=at, path="full").values for fs in REGISTRY}
        by_hand = reference(conn, refs, at)
        conn.rollback()
    return Truth(at, full, by_hand)


Elsewhen = Callable[[str, Ref, Entry], bool]
"""Whether an entry that differs from the truth at the check's moment was true at another
moment it may have been read at."""


def compare(
    refs: Sequence[Ref],
    served: Mapping[str, Sequence[Entry | None]],
    want: Truth,
    verdict: Verdict,
    last_change: dict[tuple[str, str, str], tuple[int, str, int]] | None = None,
    elsewhen: Elsewhen | None = None,
) -> None:
    """(a) on entries already read: each present one equals both answers of ``want``
    (or, per ``elsewhen``, both answers at another moment it may have been read at).

    ``served`` holds, per feature set, the entries of ``refs`` in order (None: absent or
    a tombstone, which passes). A mismatch names which answer it differs from. Where
    the two answers differ from each other (entry or not), the oracle cannot judge:
    that fails too, as a disagreement.
    """
    for name, entries in served.items():
        for (t, e), entry in zip(refs, entries, strict=True):
            full, by_hand = want.full[name].get((t, e)), want.reference[name][(t, e)]
            if full != by_hand:
                verdict.disagreements.append(
                    {
                        "feature_set": name,
                        "tenant": t,
                        "entity": e,
                        "full_query": full,
                        "reference": by_hand,
                    }
                )
            verdict.checked += 1
            if entry is None:
                continue
            verdict.present += 1
            differs = [
                what
                for what, value in (("full query", full), ("reference", by_hand))
                if entry.values != value
            ]
            if not differs or (elsewhen is not None and elsewhen(name, (t, e), entry)):
                continue
            change = (last_change or {}).get((name, t, e))
            verdict.mismatches.append(
                {
                    "feature_set": name,
                    "tenant": t,
                    "entity": e,
                    "served": entry.values,
                    "differs_from": differs,
                    "full_query": full,
                    "reference": by_hand,
                    "as_of": want.as_of.isoformat(),
                    "computed_at_ms": entry.computed_at_ms,
                    "watermark": hex(entry.watermark),
                    "last_change": None
                    if change is None
                    else {
                        "index": change[0],
                        "kind": change[1],
                        "committed_at_ms": change[2],
                        "entry_computed": "after"
                        if entry.computed_at_ms >= change[2]
                        else "before",
                    },
                }
            )
    if verdict.mismatches:
        sets = sorted({m["feature_set"] for m in verdict.mismatches})
        against = {
            what: sum(what in m["differs_from"] for m in verdict.mismatches)
            for what in ("full query", "reference")
        }
        verdict.failures.append(
            f"(a) {len(verdict.mismatches)} of {verdict.present} present entries differ "
            f"(from the full query: {against['full query']}, from the reference: "
            f"{against['reference']}; {', '.join(sets)}); e.g. {verdict.mismatches[0]}"
        )
    if verdict.disagreements:
        sets = sorted({d["feature_set"] for d in verdict.disagreements})
        verdict.failures.append(
            f"(a) the full query and the Python reference disagree on "
            f"{len(verdict.disagreements)} values ({', '.join(sets)}): a definition and "
            f"tests/faults/reference.py differ; e.g. {verdict.disagreements[0]}"
        )


def check_values(
    engine: Engine,
    client: redis.Redis,
    settings: Settings,
    touched: set[Ref],
    tenant: str,
    verdict: Verdict,
    last_change: dict[tuple[str, str, str], tuple[int, str, int]] | None = None,
) -> None:
    """(a): served equals both the full defining query and the Python reference, or is
    absent.

    Every entry is read first, over ``[R0, R1]``, then both answers from one snapshot
    with ``as_of`` = ``R1`` (:func:`truth`): nothing commits after ``R0`` (the
    consumers quiesced, the workload is over), so that snapshot holds the rows the
    entries were read against. Rows do cross window edges (the workload makes some
    that age out during and after the case), and an entry whose horizon passed expired
    in Redis, so it reads as absent; one that differs at ``R1`` passes if both answers
    give its values at some moment of ``[R0 - SETTLED_GRACE_S, R1]`` (an edge passed
    while it was read: :func:`tests.faults.reference.pieces` finds the moments).

    A mismatch names the last change that could alter that feature set of the entity:
    an entry computed before that change committed was never refreshed after it (an
    event lost or misrouted); one computed after it read a state without it (a snapshot
    or visibility problem).
    """
    version = state(client, settings).active
    refs = sorted(touched | tenant_keys(client, version, tenant))
    store = EntryStore(client, version, registry=REGISTRY)
    began = time.time()
    served = {fs.name: store.read([EntityRef(fs.name, t, e) for t, e in refs]) for fs in REGISTRY}
    ended = time.time()

    def elsewhen(name: str, ref: Ref, entry: Entry) -> bool:
        with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            rows = load(conn, [ref])
            conn.rollback()
        lo = datetime.fromtimestamp(began - SETTLED_GRACE_S, UTC)
        for at, _ in pieces(rows, ref, lo, datetime.fromtimestamp(ended, UTC)):
            if one(rows, ref, at)[name] == entry.values:
                return truth(engine, [ref], at).full[name].get(ref) == entry.values
        return False

    want = truth(engine, refs, datetime.fromtimestamp(ended, UTC))
    compare(refs, served, want, verdict, last_change, elsewhen)
    if verdict.present == 0:
        verdict.failures.append(
            f"(a) no entry present for {len(refs)} entities: the check would pass vacuously"
        )


def check_accounting(
    settings: Settings,
    fleet: Fleet,
    start: dict[Partition, int],
    produced: list[Produced],
    cdc_expected: dict[str, int],
    dlq_start: dict[Partition, int],
    verdict: Verdict,
    expect_dead_letter: Callable[[Record], bool] = lambda _r: False,
) -> None:
    """(b): every record committed and counted; the dead-letter topic as expected."""
    partitions = list(start)
    ends = end_offsets(settings, partitions)
    committed = committed_offsets(settings, fleet.group, partitions)
    records = read_range(settings, {tp: (start[tp], ends[tp]) for tp in partitions})
    dlq_ends = end_offsets(settings, dlq_start)
    dead = read_range(settings, {tp: (dlq_start[tp], dlq_ends[tp]) for tp in dlq_start})
    totals: Counts = fleet.totals()
    domain = {qualified(settings, t) for t in event_topics()}
    failures = verdict.failures

    # Per partition: produced, committed, and the workload's own records.
    per_partition: dict[str, dict[str, int]] = {}
    below: dict[str, int] = defaultdict(int)
    """Per topic: the records below the group's committed offsets (those it has done)."""
    sent: dict[Partition, set[int]] = defaultdict(set)
    for p in produced:
        sent[(p.topic, p.partition)].add(p.offset)
    for tp in partitions:
        name = f"{tp[0]}[{tp[1]}]"
        n = ends[tp] - start[tp]
        done = committed.get(tp, -1)
        per_partition[name] = {"produced": n, "committed_to": done, "end": ends[tp]}
        below[tp[0]] += max(0, min(done, ends[tp]) - start[tp])
        if n and done < ends[tp]:
            failures.append(
                f"(b) {name}: committed to {done} of {ends[tp]}: "
                f"{ends[tp] - max(done, start[tp])} records never committed"
            )
        if tp[0] in domain:
            mine = sent.pop(tp, set())
            have = {r.offset for r in records if (r.topic, r.partition) == tp}
            if mine != have:
                failures.append(
                    f"(b) {name}: holds {len(have)} records, the workload "
                    f"produced {len(mine)} there"
                )
    for tp, offsets in sent.items():
        failures.append(
            f"(b) {tp[0]}[{tp[1]}]: {len(offsets)} produced records outside the group's partitions"
        )

    # The dead-letter topic: only what the scenario expects, each with its reason.
    by_coord = {(r.topic, r.partition, r.offset): r for r in records}
    lettered: set[tuple[str, int, int]] = set()
    unexpected: list[str] = []
    for d in dead:
        try:
            coord = (
                d.headers[DLQ_SOURCE[0]].decode(),
                int(d.headers[DLQ_SOURCE[1]]),
                int(d.headers[DLQ_SOURCE[2]]),
            )
        except (KeyError, ValueError):
            unexpected.append(f"dead letter {d.partition}:{d.offset} without its source headers")
            continue
        lettered.add(coord)
        source = by_coord.get(coord)
        if source is None or not expect_dead_letter(source):
            kind = d.headers.get("x-freshline-error-kind", b"?").decode(errors="replace")
            why = d.headers.get("x-freshline-error", b"").decode(errors="replace")
            unexpected.append(f"{coord[0]}[{coord[1]}]@{coord[2]}: {kind}: {why}")
    missing = [
        f"{r.topic}[{r.partition}]@{r.offset}"
        for r in records
        if expect_dead_letter(r) and (r.topic, r.partition, r.offset) not in lettered
    ]
    if unexpected:
        failures.append(
            f"(b) {len(unexpected)} unexpected dead letters, e.g. "
            f"{'; '.join(unexpected[:EXAMPLES])}"
        )
    if missing:
        failures.append(
            f"(b) {len(missing)} bad records not dead-lettered: {', '.join(missing[:EXAMPLES])}"
        )

    # CDC: every change the workload committed reached its topic.
    cdc_records: dict[str, int] = defaultdict(int)
    for r in records:
        if r.topic not in domain:
            cdc_records[r.topic.rsplit(".", 1)[1]] += 1
    for table, n in sorted(cdc_expected.items()):
        if cdc_records.get(table, 0) < n:
            failures.append(
                f"(b) CDC {table}: {cdc_records.get(table, 0)} records, the "
                f"workload's SQL must yield {n}"
            )

    # Per topic: the counters count every record at least once.
    per_topic: dict[str, dict[str, int]] = {}
    by_topic: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_topic[r.topic].append(r)
    for topic in sorted({t for t, _ in partitions}):
        rs = by_topic.get(topic, [])
        nulls = sum(1 for r in rs if r.value is None)
        dl = sum(1 for r in rs if (r.topic, r.partition, r.offset) in lettered)
        row = {
            "produced": len(rs),
            "committed": below[topic],
            "tombstones": nulls,
            "dead_lettered_distinct": dl,
            "consumed": totals.total("consumed", topic),
            "applied": totals.total("applied", topic),
            "dead_lettered": totals.total("dead_lettered", topic),
            "skipped": totals.total("skipped", topic),
        }
        row["counted"] = row["applied"] + row["dead_lettered"] + row["skipped"]
        row["redelivered"] = max(0, row["counted"] - row["produced"])
        per_topic[topic] = row
        # Uncommitted records are reported per partition above; a committed record that
        # no process counted was skipped silently.
        if row["counted"] < row["committed"]:
            failures.append(
                f"(b) {topic}: {row['committed']} records committed, counted "
                f"{row['counted']} (applied {row['applied']} + dead-lettered "
                f"{row['dead_lettered']} + skipped {row['skipped']}): "
                f"{row['committed'] - row['counted']} skipped silently"
            )
        elif row["committed"] == row["produced"] and row["applied"] < len(rs) - nulls - dl:
            failures.append(
                f"(b) {topic}: {len(rs) - nulls - dl} records to apply, applied {row['applied']}"
            )
    verdict.accounting = {
        "produced": sum(r["produced"] for r in per_topic.values()),
        "counted": sum(r["counted"] for r in per_topic.values()),
        "redelivered": sum(r["redelivered"] for r in per_topic.values()),
        "dead_lettered": len(lettered),
        "workload_events": len(produced),
        "cdc_expected": dict(cdc_expected),
        "per_topic": per_topic,
        "per_partition": per_partition,
    }


def check_readers(readers: Readers | None, workload: Workload, verdict: Verdict) -> None:
    """(e): every value a reader was served was true at some moment within its grace."""
    if readers is None:
        return
    got = judge(
        readers.answers, workload.history, workload.watched, readers.errors, workload.unsure
    )
    verdict.readers = {**got.summary(), "versions": dict(readers.versions)}
    if got.mismatches:
        verdict.failures.append(
            f"(e) readers: {len(got.mismatches)} of {got.present} served values were true "
            f"at no moment within their grace (by reader: {got.by_reader}); "
            f"e.g. {got.mismatches[0]}"
        )
    for reader in READERS:
        row = got.by_reader.get(reader, {})
        if not row.get("present"):
            verdict.failures.append(
                f"(e) readers: {reader} served no value in {row.get('answers', 0)} answers "
                f"(errors: {got.errors}): its check would pass vacuously"
            )


def check_ttls(client: redis.Redis, verdict: Verdict) -> None:
    """(c): no feature or lease key without a TTL."""
    for pattern in ("feat:*", "lease:*"):
        batch: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) == 500:
                _ttl_batch(client, batch, verdict)
                batch = []
        _ttl_batch(client, batch, verdict)
    if verdict.ttl_violations:
        verdict.failures.append(
            f"(c) {len(verdict.ttl_violations)} keys without a TTL, e.g. "
            f"{', '.join(verdict.ttl_violations[:EXAMPLES])}"
        )


def _ttl_batch(client: redis.Redis, keys: list[bytes], verdict: Verdict) -> None:
    if not keys:
        return
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    for key, ttl in zip(keys, pipe.execute(), strict=True):
        if ttl == -1:  # -2: gone since the scan, which is fine
            verdict.ttl_violations.append(key.decode(errors="replace"))


def check_processes(fleet: Fleet, verdict: Verdict) -> None:
    """(d): every member alive unless the scenario killed it."""
    for m in fleet.unexpectedly_dead():
        verdict.dead.append(f"{m.name} (pid {m.pid}) exited {m.proc.returncode}")
    if verdict.dead:
        verdict.failures.append(f"(d) consumers died: {', '.join(verdict.dead)}")
