"""The fault scenarios, one function each, in a registry the tests are generated from.

A scenario runs while the workload runs. It times its faults by the workload's progress
(``run.at(...)`` draws a change count from the scenario's seeded random stream;
``run.workload.wait_for(n)`` waits for it), injects them for real (signals to consumer
processes, ``scripts/stack kill|stop|start`` on the private stack, Toxiproxy toxics),
heals them and returns. The harness (:mod:`tests.faults.harness`) then lets the
workload finish, waits for the consumers to quiesce and runs the oracle.

Adding one::

    @scenario("dlq-unavailable", consumers=2, short=False)
    def dlq_unavailable(run: Run) -> None:
        run.workload.wait_for(run.at(0.2, 0.4))
        ...                          # break something, note it, heal it
        run.note("dead-letter topic deleted")

``expect_dead_letter`` (a predicate over a produced record) tells the oracle which
records a scenario made bad on purpose, so their dead letters are expected; ``via``
routes the consumers' Redis and/or Postgres connections through Toxiproxy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.faults.oracle import Record

if TYPE_CHECKING:
    from tests.faults.harness import Run

Inject = Callable[["Run"], None]


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Inject
    consumers: int = 1
    short: bool = False
    """Part of the ``short`` profile (CI)."""
    via: tuple[str, ...] = ()
    """Dependencies the consumers reach through Toxiproxy: "redis", "postgres"."""
    expect_dead_letter: Callable[[Record], bool] = lambda _r: False
    description: str = ""


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, *, consumers: int = 1, short: bool = False, via: tuple[str, ...] = (),
             expect_dead_letter: Callable[[Record], bool] = lambda _r: False,
             ) -> Callable[[Inject], Inject]:
    """Register a scenario under ``name`` (its docstring is its description)."""
    def register(fn: Inject) -> Inject:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} registered twice")
        SCENARIOS[name] = Scenario(name, fn, consumers, short, via, expect_dead_letter,
                                   (fn.__doc__ or "").strip().splitlines()[0])
        return fn
    return register


def wait_until(condition: Callable[[], bool], what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)  # polling interval, not synchronisation


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
    wait_until(lambda: run.group_members() == others,
               "the group to evict the stopped member (session timeout)", 90)
    run.note(f"group evicted {victim.name}")
    run.workload.wait_for(run.workload.progress + run.span(20, 80))
    victim.sigcont()
    run.note(f"SIGCONT {victim.name}")


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
    run.workload.wait_for(run.workload.progress + run.span(40, 120))
    proxy.remove(toxic)
    proxy.disable()
    run.note(f"{service}: partitioned (proxy disabled: connections closed, new ones refused)")
    run.workload.wait_for(run.workload.progress + run.span(40, 120))
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
    run.workload.wait_for(run.workload.progress + run.span(40, 120))
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
