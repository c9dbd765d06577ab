"""The fault scenarios, one function each, in a registry the tests are generated from.

A scenario runs while the workload runs. It times its faults by the workload's progress
(``run.at(...)`` draws a change count from the scenario's seeded random stream;
``run.workload.wait_for(n)`` waits for it), injects them for real (signals to consumer
processes, ``scripts/stack kill|stop|start`` on the private stack, Toxiproxy toxics),
heals them and returns. The harness (:mod:`tests.faults.harness`) then lets the
workload finish, waits for the consumers to quiesce and runs the oracle.

Adding one::

    @scenario("connect-stop", consumers=2, short=False)
    def connect_stop(run: Run) -> None:
        run.workload.wait_for(run.at(0.2, 0.4))
        run.stack.stop("connect")    # break something, note it, heal it
        run.note("connect stopped")
        ...

``expect_dead_letter`` (a predicate over a produced record) tells the oracle which
records a scenario made bad on purpose, so their dead letters are expected; ``via``
routes the consumers' Redis, Postgres and/or Kafka connections through Toxiproxy (Kafka:
through the broker's second listener, which advertises the proxy's port).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import Producer as RawProducer

from freshline.consumers.events import decode
from freshline.consumers.kafka import client_config
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.cache.versions import state
from freshline.pipeline.core.keys import ACTIVE_SCHEMA_KEY
from freshline.pipeline.core.topics import DLQ, logical, qualified
from freshline.pipeline.dev import processes
from tests.faults import injectors, oracle
from tests.faults.injectors import HeldCommit
from tests.faults.oracle import Partition, Record

if TYPE_CHECKING:
    from tests.faults.harness import Run

Inject = Callable[["Run"], None]
RETRIES = "freshline_transient_retries"
DELIVERY_FAILURES = "freshline_delivery_failures"
CONFIG_RETRIES = "freshline_config_retries"
PAUSED = "freshline_consumer_paused"
APPLIED = "freshline_events_applied"


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Inject
    consumers: int = 1
    short: bool = False
    """Part of the ``short`` profile (CI)."""
    via: tuple[str, ...] = ()
    """Dependencies the consumers reach through Toxiproxy: "redis", "postgres", "kafka"."""
    expect_dead_letter: Callable[[Record], bool] = lambda _r: False
    description: str = ""


SCENARIOS: dict[str, Scenario] = {}


def scenario(
    name: str,
    *,
    consumers: int = 1,
    short: bool = False,
    via: tuple[str, ...] = (),
    expect_dead_letter: Callable[[Record], bool] = lambda _r: False,
) -> Callable[[Inject], Inject]:
    """Register a scenario under ``name`` (its docstring is its description)."""

    def register(fn: Inject) -> Inject:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} registered twice")
        SCENARIOS[name] = Scenario(
            name,
            fn,
            consumers,
            short,
            via,
            expect_dead_letter,
            (fn.__doc__ or "").strip().splitlines()[0],
        )
        return fn

    return register


def wait_until(condition: Callable[[], bool], what: str, deadline_s: float = 60.0) -> None:
    processes.wait_for(condition, what, deadline_s, interval=0.02)


# -- consumer processes ------------------------------------------------------------------


@scenario("consumer-sigkill", consumers=2, short=True)
def consumer_sigkill(run: Run) -> None:
    """A consumer SIGKILLed mid-batch, then a replacement started."""
    run.workload.wait_for(run.at(0.2, 0.5))
    victim = run.pick_member()
    caught = run.catch_mid_batch(victim)
    victim.kill()
    run.note(f"SIGKILL {victim.name} ({'mid-batch' if caught else 'between batches'})")
    run.workload.wait_for(run.workload.progress + run.span(20, 80))
    replacement = run.fleet.spawn(run.consumer_settings())
    run.note(f"started {replacement.name}")


@scenario("consumer-zombie", consumers=2)
def consumer_zombie(run: Run) -> None:
    """A consumer SIGSTOPped past its session timeout (the group evicts it), then SIGCONTed."""
    run.workload.wait_for(run.at(0.15, 0.35))
    victim = run.pick_member()
    run.catch_mid_batch(victim, leave_stopped=True)
    run.note(f"SIGSTOP {victim.name}")
    others = len(run.fleet.alive()) - 1
    wait_until(
        lambda: run.group_members() == others,
        "the group to evict the stopped member (session timeout)",
        90,
    )
    run.note(f"group evicted {victim.name}")
    run.workload.wait_for(run.workload.progress + run.span(20, 80))
    victim.sigcont()
    run.note(f"SIGCONT {victim.name}")


@scenario("consumer-clock-step", consumers=1)
def consumer_clock_step(run: Run) -> None:
    """A consumer's wall clock steps an hour forward, then to an hour behind (its
    monotonic clock runs on), while it shares the partitions with one on the real clock.

    faketime is not installed: the member's Python steps instead (``tests/faults/clock``:
    ``time.time`` and ``time.time_ns`` plus an offset; librdkafka and libpq keep the
    real clock). Its entries are computed with Postgres's clock and expire by Redis's,
    so they must come out the same.
    """
    clock = run.fleet.directory / "clock"
    clock.write_text("0")
    stepped = run.fleet.spawn(run.consumer_settings(), clock=clock)
    wait_until(lambda: run.spread(2), f"{stepped.name} to join and take partitions", 120)
    run.note(f"{stepped.name} (wall clock steppable) shares the partitions")
    for offset in (3600, -3600):
        applied = stepped.counter(APPLIED)
        injectors.step_clock(clock, offset)
        run.note(f"{stepped.name}: wall clock stepped to {offset:+d} s from the real one")
        wait_until(
            lambda applied=applied: stepped.counter(APPLIED) > applied,  # type: ignore[misc]
            f"{stepped.name} to apply events on its stepped clock",
            120,
        )
        run.workload.wait_for(run.workload.progress + run.span(40, 120))


# -- the stack's services -----------------------------------------------------------------


@scenario("redis-restart", consumers=2, short=True)
def redis_restart(run: Run) -> None:
    """Redis crashes (SIGKILL) and comes back empty."""
    run.workload.wait_for(run.at(0.2, 0.5))
    run.stack.kill("redis")
    run.note("redis killed")
    run.workload.wait_for(run.workload.progress + run.span(20, 80))
    run.stack.start("redis")
    run.note("redis started (empty)")


REPLICA = "redis-replica"
FAILOVERS = "freshline_redis_failovers"


def _replicating(run: Run, port: int) -> bool:
    """The Redis server on ``port`` is a replica, linked to its master and synced."""
    info = run.stack.replication(port)
    return (
        info.get("role") == "slave"
        and info.get("master_link_status") == "up"
        and not info.get("master_sync_in_progress")
    )


def _promote(run: Run, port: int) -> None:
    """``REPLICAOF NO ONE`` on ``port``, and the consumers' address (the proxy) moved to it."""
    run.stack.follow(port, None)
    run.proxies["redis"].retarget(f"127.0.0.1:{port}")


@scenario("redis-failover", consumers=1, via=("redis",))
def redis_failover(run: Run) -> None:
    """Redis fails over twice (master SIGKILLed, its replica promoted, the consumers'
    address moved to it, the old master back as a replica); the consumers WAIT for a
    replica before committing offsets.

    The consumers reach Redis through a Toxiproxy proxy, the address a failover moves
    (as a virtual IP or a Sentinel-aware client would). They run with
    ``FRESHLINE_REDIS_WAIT_REPLICAS=1``: the case's first member (without it) is
    replaced by two that wait, before the first failover. While the promoted master
    has no replica, the consumers hold their batches; the old master, started again
    empty, syncs as its replica; then the second failover moves everything back.
    """
    stack = run.stack
    primary = stack.ports["redis"]
    replica = stack.start_redis(REPLICA, replica_of=primary)
    wait_until(lambda: _replicating(run, replica), "the replica to sync", 60)
    run.note(f"{REPLICA} on port {replica} replicates the master (port {primary})")
    settings = run.consumer_settings().model_copy(update={"redis_wait_replicas": 1})
    first = list(run.fleet.alive())
    for _ in range(2):
        run.fleet.spawn(settings)
    for member in first:
        member.expected_dead = True
        code = member.terminate()
        if code != 0:
            raise RuntimeError(f"{member.name} exited {code} on SIGTERM")
    wait_until(lambda: run.spread(2), "the two waiting members to share the partitions", 120)
    run.note(f"{', '.join(m.name for m in first)} replaced by two members that WAIT for 1 replica")

    run.workload.wait_for(run.at(0.25, 0.45))
    stack.kill("redis")
    _promote(run, replica)
    run.note(f"master SIGKILLed; {REPLICA} promoted, the consumers' proxy moved to it")
    run.workload.wait_for(run.workload.progress + run.span(20, 60))
    stack.start("redis")
    stack.follow(primary, replica)
    wait_until(lambda: _replicating(run, primary), "the old master to sync as a replica", 60)
    run.note("the old master, started again empty, synced as the new master's replica")

    run.workload.wait_for(run.workload.progress + run.span(40, 120))
    stack.kill_redis(REPLICA)
    _promote(run, primary)
    run.note(f"{REPLICA} (the master) SIGKILLed; the old master promoted, the proxy moved back")
    stack.start_redis(REPLICA, replica_of=primary)
    wait_until(lambda: _replicating(run, replica), "the replica to sync again", 60)
    run.note(
        f"{REPLICA} synced again; freshline_redis_failovers_total: {run.fleet.counter(FAILOVERS)}"
    )


@scenario("kafka-restart", consumers=2)
def kafka_restart(run: Run) -> None:
    """The Kafka broker restarts (clean stop, start)."""
    run.workload.wait_for(run.at(0.15, 0.35))
    run.stack.stop("kafka")
    run.note("kafka stopped")
    run.workload.wait_for(run.workload.progress + run.span(20, 80))
    run.stack.start("kafka")
    run.note("kafka started")


@scenario("postgres-restart", consumers=2, short=True)
def postgres_restart(run: Run) -> None:
    """Postgres restarts (fast shutdown, start); writers and consumers retry."""
    run.workload.wait_for(run.at(0.2, 0.5))
    run.stack.stop("postgres")
    run.note("postgres stopped")
    run.stack.start("postgres")
    run.note("postgres started")


@scenario("postgres-crash", consumers=2)
def postgres_crash(run: Run) -> None:
    """Postgres crashes (``pg_ctl stop -m immediate``: no checkpoint, crash recovery at
    the next start) while a consumer holds a batch, then starts again."""
    run.workload.wait_for(run.at(0.2, 0.5))
    victim = run.pick_member()
    caught = run.catch_mid_batch(victim)
    try:
        run.stack.kill("postgres")
    finally:
        victim.sigcont()
    run.note(
        f"postgres crashed (immediate stop) with {victim.name} "
        f"{'frozen mid-batch' if caught else 'between batches'}; {victim.name} resumed"
    )
    run.stack.start("postgres")
    run.note("postgres started (crash recovery)")


@scenario("postgres-async-commit-crash", consumers=2)
def postgres_async_commit_crash(run: Run) -> None:
    """With ``synchronous_commit = off``, Postgres crashes holding commits that were
    visible and never flushed: no consumer serves one.

    ``ALTER SYSTEM`` turns ``synchronous_commit`` off for every session, the workload's
    included; a while later the WAL writer is SIGSTOPped, so every commit from then on
    is visible and not flushed. Odd seeds also take ``TEMPORARY`` from ``PUBLIC``: the
    consumers cannot force a flush, and hold their batches (``NotYetDurable``) until
    the crash; even seeds leave it, and the consumers' forced flushes make durable
    what they computed from. Then the WAL writer is SIGKILLed (the postmaster's crash
    path), Postgres is stopped immediately and started again: the commits never
    flushed are gone. The CDC records the workload counted since it went asynchronous
    are no longer expected (those of commits that survived still come).
    """
    su = run.env.superuser
    run.workload.wait_for(run.at(0.15, 0.3))
    expected = dict(run.workload.cdc_expected)  # every change so far committed durably
    consumers_wait = run.seed % 2 == 1
    held = run.fleet.counter(RETRIES, service="postgres")
    try:
        if consumers_wait:
            injectors.revoke_temporary(su)
            run.note("TEMPORARY revoked from PUBLIC: the consumers cannot force a WAL flush")
        injectors.asynchronous_commits(su)
        run.note("synchronous_commit = off (ALTER SYSTEM, reloaded)")
        run.workload.wait_for(run.workload.progress + run.span(20, 60))
        pid = injectors.freeze_wal_writer(su)
        run.note(f"WAL writer (pid {pid}) SIGSTOPped: commits visible, not flushed")
        try:
            run.workload.wait_for(run.workload.progress + run.span(20, 60))
            if consumers_wait:
                wait_until(
                    lambda: run.fleet.counter(RETRIES, service="postgres") > held,
                    "a consumer to hold a batch whose snapshot is not flushed (NotYetDurable)",
                    60,
                )
            inserted, flushed = injectors.wal_positions(su)
            run.note(
                f"{inserted - flushed:,} bytes of WAL inserted and not flushed; "
                f"{run.fleet.counter(RETRIES, service='postgres') - held} postgres retries"
            )
        finally:
            injectors.crash_wal_writer(pid)
        run.note("WAL writer SIGKILLed: the postmaster's crash path")
        # The workload waits from here until the recovered state is observed: a change
        # it retries the moment Postgres is back would otherwise move that state on
        # unseen, and an entry of it would look true at no moment.
        run.workload.hold()
        run.stack.kill("postgres")
        run.note("postgres stopped immediately")
        # The workload is retrying its change while Postgres is down: its counts hold
        # still. Every change counted since `expected` may be lost; one that survived
        # yields its records anyway, and the oracle asks for at least the expected ones.
        counted = dict(run.workload.cdc_expected)
        unsure = {t: n - expected.get(t, 0) for t, n in counted.items() if n > expected.get(t, 0)}
        run.workload.cdc_expected.subtract(unsure)
        run.note(f"CDC records no longer expected (changes maybe lost): {unsure}")
        run.stack.start("postgres")
        # The crash took back commits the readers' reference saw: what is true now is
        # an earlier state, which it must see too.
        run.workload.observe()
        run.note("postgres started (crash recovery); the recovered state observed")
    finally:
        run.workload.release()
        injectors.heal_postgres(su)
    run.note("synchronous_commit reset, TEMPORARY granted to PUBLIC")


@scenario("connect-kill", consumers=1)
def connect_kill(run: Run) -> None:
    """The Kafka Connect worker (Debezium) is SIGKILLed, then started again."""
    run.workload.wait_for(run.at(0.2, 0.5))
    run.stack.kill("connect")
    run.note("connect killed")
    run.workload.wait_for(run.workload.progress + run.span(40, 120))
    run.stack.start("connect")
    run.note("connect started")


# -- the network, through Toxiproxy -------------------------------------------------------


def _latency_then_partition(run: Run, service: str) -> None:
    proxy = run.proxies[service]
    run.workload.wait_for(run.at(0.1, 0.3))
    ms = run.rng.choice((50, 100, 200, 400))
    toxic = proxy.latency(ms, ms // 4)
    run.note(f"{service}: latency {ms} ms (jitter {ms // 4})")
    try:  # a workload that stalls must not leave the fault in place for the next case
        run.workload.wait_for(run.workload.progress + run.span(40, 120))
    finally:
        proxy.remove(toxic)
    proxy.disable()
    run.note(f"{service}: partitioned (proxy disabled: connections closed, new ones refused)")
    try:
        run.workload.wait_for(run.workload.progress + run.span(40, 120))
    finally:
        proxy.enable()
    run.note(f"{service}: partition healed")


@scenario("redis-latency-partition", consumers=2, short=True, via=("redis",))
def redis_latency_partition(run: Run) -> None:
    """Latency, then a partition, between the consumers and Redis (Toxiproxy)."""
    _latency_then_partition(run, "redis")


@scenario("postgres-latency-partition", consumers=2, via=("postgres",))
def postgres_latency_partition(run: Run) -> None:
    """Latency, then a partition, between the consumers and Postgres (Toxiproxy)."""
    _latency_then_partition(run, "postgres")


def _blackhole(run: Run, service: str) -> None:
    proxy = run.proxies[service]
    run.workload.wait_for(run.at(0.2, 0.4))
    toxic = proxy.timeout(0)
    run.note(f"{service}: black hole (data dropped, connections left open)")
    try:
        run.workload.wait_for(run.workload.progress + run.span(40, 120))
    finally:
        proxy.remove(toxic)
    run.note(f"{service}: black hole removed")


@scenario("redis-blackhole", consumers=2, via=("redis",))
def redis_blackhole(run: Run) -> None:
    """A silent partition to Redis: requests vanish and no connection is closed."""
    _blackhole(run, "redis")


@scenario("postgres-blackhole", consumers=2, via=("postgres",))
def postgres_blackhole(run: Run) -> None:
    """A silent partition to Postgres: queries vanish and no connection is closed."""
    _blackhole(run, "postgres")


def _refused_on_proxied_listener(run: Run) -> None:
    """The consumers' login may not write a domain topic on the listener behind the
    proxy either: the stack's ACLs name logins, not listeners."""
    settings = run.consumer_settings()
    topic = qualified(settings, "transaction.updated")
    producer = RawProducer(
        client_config(
            settings, "producer", **{"enable.idempotence": False, "message.timeout.ms": 30000}
        )
    )
    errors: list[KafkaError | None] = []
    producer.produce(topic, b"{}", callback=lambda err, _msg: errors.append(err))
    if producer.flush(60) or not errors:
        raise TimeoutError(f"no answer to a write on {topic} through the proxy")
    if errors[0] is None or errors[0].code() != KafkaError.TOPIC_AUTHORIZATION_FAILED:
        raise KafkaException(
            f"the consumers' login wrote {topic} through the proxied listener, or failed "
            f"otherwise: {errors[0]}"
        )
    run.note(f"the consumers' login is refused a write on {topic} through the proxy (ACLs)")


@scenario("kafka-partition", consumers=2, via=("kafka",))
def kafka_partition(run: Run) -> None:
    """Latency, then a silent partition past the session timeout, between the consumers
    and Kafka (Toxiproxy); then healed.

    The consumers bootstrap on the broker's second listener, which advertises the
    proxy's port, so every connection they make to the broker goes through it; the
    workload's producer and the oracle use the first. The black hole drops data both
    ways and keeps connections open; it lasts until the group coordinator has evicted
    every member (their session timeout) and the workload has moved on, so the members
    come back holding batches of a generation that is gone.
    """
    proxy = run.proxies["kafka"]
    _refused_on_proxied_listener(run)
    run.workload.wait_for(run.at(0.1, 0.25))
    ms = run.rng.choice((50, 100, 200, 400))
    toxic = proxy.latency(ms, ms // 4)
    run.note(f"kafka: latency {ms} ms (jitter {ms // 4})")
    try:
        run.workload.wait_for(run.workload.progress + run.span(40, 120))
    finally:
        proxy.remove(toxic)
    holes = [proxy.timeout(0), proxy.timeout(0, stream="downstream")]
    run.note("kafka: black hole (data dropped both ways, connections left open)")
    try:
        wait_until(
            lambda: run.group_members() == 0,
            "the group to evict every member (session timeout)",
            120,
        )
        run.note("the group evicted every member")
        run.workload.wait_for(run.workload.progress + run.span(40, 120))
    finally:
        for hole in holes:
            proxy.remove(hole)
    run.note("kafka: partition healed")
    members = len(run.fleet.alive())
    wait_until(lambda: run.spread(members), "the members to rejoin and share the partitions", 180)
    run.note(f"{members} members rejoined and share the partitions")


# -- the group under a dependency outage --------------------------------------------------


@scenario("member-joins-dies-during-redis-outage", consumers=1)
def member_joins_dies_during_redis_outage(run: Run) -> None:
    """While Redis is down, a second member joins (a rebalance mid-retry), then is SIGKILLed.

    The first member is retrying a batch when the second joins and takes some of its
    (paused) partitions; the second one then retries too, and dies. Odd seeds bring
    Redis back once the dead member's partitions are back with the first one (assigned
    during its retry); even seeds bring it back at once, so they come back after the
    retry, when the first one is reading again.
    """
    run.workload.wait_for(run.at(0.1, 0.25))
    first = run.fleet.members[0]
    retries = first.counter(RETRIES, service="redis")
    run.stack.kill("redis")
    run.note("redis killed")
    wait_until(
        lambda: first.counter(RETRIES, service="redis") > retries,
        f"{first.name} to retry a batch while Redis is down",
        120,
    )
    run.note(f"{first.name} retrying its batch")
    second = run.fleet.spawn(run.consumer_settings())
    run.note(f"started {second.name}")
    wait_until(lambda: run.spread(2), f"{second.name} to join and take partitions", 120)
    run.note(f"rebalanced: {first.name} and {second.name} share the partitions")
    wait_until(
        lambda: second.counter(RETRIES, service="redis") > 0,
        f"{second.name} to retry a batch of its own",
        120,
    )
    second.kill()
    run.note(f"SIGKILL {second.name} (mid-retry)")
    if run.seed % 2:
        wait_until(
            lambda: run.spread(1),
            f"{first.name} to own every partition again "
            "(the group evicts the dead member at its session timeout)",
            120,
        )
        retries = first.counter(RETRIES, service="redis")
        wait_until(
            lambda: first.counter(RETRIES, service="redis") >= retries + 2,
            f"{first.name} to poll through two more retries",
            120,
        )
        run.note(f"{first.name} owns every partition, still retrying")
    run.stack.start("redis")
    run.note("redis started (empty)")


# -- Postgres: a change visible after its event -------------------------------------------


def _find_event(
    run: Run, held: HeldCommit, start: dict[Partition, int], deadline_s: float
) -> tuple[Partition, int]:
    """The CDC record of ``held``'s transaction: its partition and offset."""
    settings = run.env.settings
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        ends = oracle.end_offsets(settings, start)
        for r in oracle.read_range(settings, {tp: (start[tp], ends[tp]) for tp in start}):
            if r.value is None:
                continue
            event = decode(logical(settings, r.topic), None, r.value)
            if event is not None and held.matches(event.txid):
                return (r.topic, r.partition), r.offset
        start = ends
        time.sleep(0.1)  # polling interval, not synchronisation
    raise TimeoutError(f"no CDC record of transaction {held.txid} in {deadline_s:.0f}s")


@scenario("commit-visibility-window", consumers=2)
def commit_visibility_window(run: Run) -> None:
    """A change's CDC event reaches the consumers while its commit still waits for a
    synchronous standby (flushed, not visible); the commit then completes, no event follows.

    ``synchronous_standby_names`` names a standby that never connects; one UPDATE
    commits with ``synchronous_commit = on`` and waits. Once the consumers have its
    event (they retry the batch, or, without the visibility check, apply and commit
    it), the waiting backend is cancelled: the commit completes locally.
    """
    start = run.at(0.3, 0.6)
    run.workload.wait_for(start)
    env, settings, tenant = run.env, run.env.settings, run.workload.tenant
    spared = run.workload.spared_transactions(start)
    if not spared:
        raise RuntimeError("no transaction of a user the rest of the workload spares")
    txn, user = run.rng.choice(spared)
    cdc = {
        tp: o
        for tp, o in oracle.end_offsets(
            settings,
            [
                (t, p)
                for t, p in oracle.subscribed_partitions(env.admin, settings)
                if t.endswith(".public.transactions")
            ],
        ).items()
    }
    base = run.fleet.counter(RETRIES, service="visibility")
    injectors.hold_synchronous_commits(env.superuser)
    run.note(f"synchronous_standby_names: {injectors.ABSENT_STANDBY} (never connects)")
    held: HeldCommit | None = None
    try:
        end = time.monotonic() + 60
        while True:
            held = HeldCommit(
                env.engine,
                "UPDATE transactions SET amount = amount + :d, "
                "updated_at = now() WHERE tenant_id = :t AND id = :id",
                {"d": round(1000 + run.rng.random() * 1000, 2), "t": tenant, "id": txn},
            )
            held.begin()
            wait_until(held.settled, "the commit to wait for the standby or end", 30)
            if not held.finished:
                break
            # The checkpointer had not taken the new standby name yet: a plain commit.
            run.note(
                f"UPDATE of transaction {txn} committed before the standby was required; again"
            )
            if time.monotonic() > end:
                raise TimeoutError("commits never waited for the absent standby")
        run.workload.touched.add((tenant, str(user)))
        run.note(
            f"UPDATE of transaction {txn} (user {user}): commit flushed, waiting "
            f"(xid {held.txid}, pid {held.pid})"
        )
        tp, offset = _find_event(run, held, cdc, 60)
        run.note(f"its CDC record: {tp[0]}[{tp[1]}]@{offset}")

        def consumed() -> bool:
            done = oracle.committed_offsets(settings, run.fleet.group, [tp])[tp]
            return done > offset or run.fleet.counter(RETRIES, service="visibility") >= base + 2

        wait_until(consumed, "the consumers to take the record (retry it, or commit it)", 120)
        retried = run.fleet.counter(RETRIES, service="visibility") - base
        run.note(f"consumers have the record ({retried} visibility retries)")
        held.cancel()
        if held.error is not None:
            raise RuntimeError(f"the held commit failed: {held.error!r}")
        run.workload.last_change[("txn_90d", tenant, str(user))] = (
            run.workload.progress,
            "held-commit",
            time.time_ns() // 1_000_000,
        )
        run.note("wait cancelled: the commit completed locally and is visible")
    finally:
        injectors.heal_postgres(env.superuser)
        if held is not None:
            held.close()
    run.note("synchronous_standby_names reset")
    wait_until(
        lambda: oracle.committed_offsets(settings, run.fleet.group, [tp])[tp] > offset,
        "the consumers to apply and commit the record",
        120,
    )
    run.note("the record is applied and committed")


# -- the deployment's configuration -------------------------------------------------------

MALFORMED_POINTER = b"2 "
"""A deploy pointer that does not parse (a trailing space): no schema version."""
PAUSE_LINE = "consumer paused by a configuration error (deploy)"
RESUME_LINE = "consumer resumed: the configuration error (deploy) is fixed"


def _log_count(run: Run, line: str) -> dict[str, int]:
    return {m.name: m.log.read_text(errors="replace").count(line) for m in run.fleet.members}


@scenario("malformed-deploy-pointer", consumers=2)
def malformed_deploy_pointer(run: Run) -> None:
    """The deploy pointer holds ``"2 "`` for a while: the consumers pause (one log line
    each, ``freshline_consumer_paused``), dead-letter nothing, and apply every held
    record once it is fixed."""
    run.workload.wait_for(run.at(0.15, 0.35))
    client = run.env.redis
    saved = client.get(ACTIVE_SCHEMA_KEY)
    base = run.fleet.counter(CONFIG_RETRIES, cause="deploy")
    injectors.set_key(client, ACTIVE_SCHEMA_KEY, MALFORMED_POINTER)
    run.note(f"{ACTIVE_SCHEMA_KEY} = {MALFORMED_POINTER!r} (was {saved!r})")
    try:
        wait_until(
            lambda: all(n >= 1 for n in _log_count(run, PAUSE_LINE).values()),
            "every consumer to log that the deploy pointer paused it",
            120,
        )
        wait_until(
            lambda: run.fleet.gauge(PAUSED, cause="deploy") == 1,
            f"{PAUSED}{{cause=deploy}} to show the pause",
            30,
        )
        run.workload.wait_for(run.workload.progress + run.span(20, 80))
        wait_until(
            lambda: run.fleet.counter(CONFIG_RETRIES, cause="deploy") >= base + 4,
            "the consumers to retry their held batches",
            120,
        )
        run.note(
            f"paused: {PAUSED}{{cause=deploy}} 1, "
            f"{run.fleet.counter(CONFIG_RETRIES, cause='deploy') - base} held retries"
        )
    finally:
        injectors.set_key(client, ACTIVE_SCHEMA_KEY, saved)
    run.note(f"{ACTIVE_SCHEMA_KEY} restored")
    wait_until(
        lambda: all(n >= 1 for n in _log_count(run, RESUME_LINE).values()),
        "every consumer to log that it resumed",
        120,
    )
    wait_until(
        lambda: run.fleet.gauge(PAUSED, cause="deploy") == 0,
        f"{PAUSED}{{cause=deploy}} back to 0",
        30,
    )
    paused = _log_count(run, PAUSE_LINE)
    if any(n != 1 for n in paused.values()):
        raise AssertionError(f"the pause is to be logged once per consumer, was {paused}")
    run.note(f"resumed; the pause logged once by each consumer ({paused})")


def _cli(run: Run, *args: object) -> None:
    """Run ``freshline ARGS`` as the operator; what it said (its progress bars left out)
    goes into the history."""
    lines = run.stack.freshline(*map(str, args)).splitlines()
    said = " ".join(" ".join(line.split()) for line in lines if "━" not in line)
    run.note(f"freshline {' '.join(map(str, args))}: {said[:240] or 'ok'}")


def _served_version(run: Run, api_key: str, version: int) -> None:
    """Wait until the read API serves ``version`` (it follows the deploy channel)."""
    if run.env.api is None:
        raise RuntimeError("no read API on the private stack")
    url = f"{run.env.api.url}/v1/features/batch"
    user = next(iter(sorted(run.workload.users)))

    def serves() -> bool:
        response = httpx.post(
            url,
            params={"mode": "cache-only"},
            json={"feature_sets": ["txn_90d"], "entities": [user]},
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=5,
        )
        return response.status_code == 200 and response.json()["schema_version"] == version

    wait_until(serves, f"the read API to serve schema version {version}", 30)


@scenario("deploy-under-load", consumers=2)
def deploy_under_load(run: Run) -> None:
    """A deploy cycle under load through the CLI: start, warm, flip, roll back, flip
    again, purge the version left; then a second deploy started, warmed and cancelled.

    The new version is a redeploy of the same definitions (the private repository's
    lock holds the next versions with this code's), so the consumers write both and
    the oracle checks the active one; the readers follow the pointer throughout. Each
    step waits for some of the workload's changes, so the consumers write under every
    state of the pointer; after each flip the read API must serve the version flipped to.
    """
    tenant = run.workload.tenant
    old = state(run.env.redis, run.env.settings).active
    new, cancelled = old + 1, old + 2
    key = create_api_key(run.env.engine, tenant, label="faults-deploy")

    def then() -> None:
        run.workload.wait_for(run.workload.progress + run.span(5, 20))

    run.workload.wait_for(run.at(0.02, 0.06))
    _cli(run, "deploy", "start", new)
    then()
    _cli(run, "warm", "--version", new, "--all", "--tenant", tenant)
    then()
    for version in (new, old, new):  # the flip, the rollback, the flip again
        _cli(run, "deploy", "flip", version)
        _served_version(run, key, version)
        then()
    _cli(run, "purge", "--version", old, "--force")
    then()
    _cli(run, "deploy", "start", cancelled)
    _cli(run, "warm", "--version", cancelled, "--all", "--tenant", tenant)
    then()
    _cli(run, "deploy", "cancel")
    _cli(run, "deploy", "status")


# -- records the consumers must dead-letter -----------------------------------------------

OVERSIZED_BYTES = 1_048_400
"""A value the broker takes (its limit is 1,048,588 bytes a record batch) whose dead-letter
copy, with the headers freshline adds, it would refuse."""


def _oversized(record: Record) -> bool:
    return record.value is not None and len(record.value) >= OVERSIZED_BYTES


@scenario("oversized-record", consumers=2, short=True, expect_dead_letter=_oversized)
def oversized_record(run: Run) -> None:
    """A record of about 1 MB, too big to dead-letter whole, among the good events."""
    run.workload.wait_for(run.at(0.2, 0.5))
    tenant = run.workload.tenant
    user = run.rng.choice(sorted(run.workload.users))
    head = f'{{"tenant": "{tenant}", "user_id": {user}, "pad": "'.encode()
    value = head + b"x" * (OVERSIZED_BYTES - len(head) - 2) + b'"}'
    where = run.produce(
        "transaction.updated",
        value,
        f"{tenant}:{user}".encode(),
        **{"message.max.bytes": 2_000_000},
    )
    run.note(
        f"produced a {len(value):,}-byte record at {where.topic}[{where.partition}]@{where.offset}"
    )


MALFORMED = b"{not json: faults "


def _malformed(record: Record) -> bool:
    return record.value is not None and record.value.startswith(MALFORMED)


@scenario("dlq-unavailable", consumers=2, expect_dead_letter=_malformed)
def dlq_unavailable(run: Run) -> None:
    """The dead-letter topic refuses every write (max.message.bytes 64) while malformed
    records arrive; then it takes them again."""
    run.workload.wait_for(run.at(0.15, 0.35))
    env, tenant = run.env, run.workload.tenant
    dlq = qualified(env.settings, DLQ)
    refused = run.fleet.counter(DELIVERY_FAILURES, topic=dlq)
    injectors.set_topic_config(env.admin, dlq, "max.message.bytes", "64")
    run.note(f"{dlq}: max.message.bytes 64 (every dead letter refused)")
    try:
        for i in range(run.span(3, 6)):
            user = run.rng.choice(sorted(run.workload.users))
            where = run.produce(
                "transaction.updated", MALFORMED + str(i).encode(), f"{tenant}:{user}".encode()
            )
            run.note(f"malformed record at {where.topic}[{where.partition}]@{where.offset}")
            run.workload.wait_for(run.workload.progress + run.span(5, 30))
        wait_until(
            lambda: run.fleet.counter(DELIVERY_FAILURES, topic=dlq) >= refused + 2,
            "the consumers to count refused dead letters and send them again",
            120,
        )
        run.note(
            f"freshline_delivery_failures_total{{topic={dlq}}}: "
            f"{run.fleet.counter(DELIVERY_FAILURES, topic=dlq) - refused}"
        )
        run.workload.wait_for(run.workload.progress + run.span(40, 120))
    finally:
        injectors.heal_topic(env.admin, dlq, "max.message.bytes")
    run.note(f"{dlq}: max.message.bytes back to the broker's default")
