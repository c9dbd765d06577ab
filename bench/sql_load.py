"""Background SQL load for the benchmarks: :mod:`bench.cdc_freshness`'s workload (70%
INSERT, 30% UPDATE, users in proportion to their history, ``synchronous_commit=on``) at
a fixed rate, from a process of its own so this process's GIL does not slow its pacing,
optionally publishing each write's domain event."""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import orjson
import psycopg

from bench.pacing import paced

UPDATE_SHARE = 0.3
"""The share of writes that UPDATE one of the writer's earlier rows; the rest INSERT."""

PER_WRITER = 500
"""Writes/s one background writer thread is asked for; more writers for more."""

CONNECT_DEADLINE_S = 180.0
"""How long the writers' process may take to start and connect."""


def _load_main(
    conninfo: str,
    tenant: str,
    users: list[int],
    rate: int,
    seconds: float,
    seed: int,
    events: dict[str, str] | None,
    stop: MpEvent,
    ready: MpEvent,
    done: Any,
) -> None:
    """A process of writer threads offering ``rate`` SQL writes/s in all (the workload of
    :mod:`bench.cdc_freshness`) for ``seconds`` or until ``stop``; with ``events`` (the
    domain topics by event name), each write also publishes its domain event, on the
    broker the environment's settings name. Sets ``ready`` once every writer has its
    connection; puts the writes made in ``done``."""
    writers = max(1, -(-rate // PER_WRITER))
    producer = None
    if events is not None:
        # Here, not at the top: the spawned process imports this module, and only a
        # writer that publishes needs the Kafka client.
        from freshline.consumers.kafka import Producer
        from freshline.pipeline.core.settings import Settings

        producer = Producer(Settings(), **{"linger.ms": 1})
    counts = [0] * writers
    connected = threading.Barrier(writers, action=ready.set)

    def writer(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        mine: list[int] = []
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = on")
            connected.wait()
            for _ in paced(rate / writers, seconds):
                if stop.is_set():
                    break
                if mine and rng.random() < UPDATE_SHARE:
                    txn = rng.choice(mine)
                    row = conn.execute(
                        "UPDATE transactions SET amount = amount + 1 WHERE tenant_id = %s "
                        "AND id = %s RETURNING user_id",
                        (tenant, txn),
                        prepare=True,
                    ).fetchone()
                    user, topic = (int(row[0]) if row else 0), "transaction.updated"
                else:
                    user = rng.choice(users)
                    ip = f"11.{rng.randint(0, 127)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
                    row = conn.execute(
                        "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
                        "VALUES (%s, %s, %s, %s, %s) RETURNING id",
                        (
                            tenant,
                            user,
                            round(rng.uniform(1, 500), 2),
                            f"m{rng.randint(1, 300)}",
                            ip,
                        ),
                        prepare=True,
                    ).fetchone()
                    txn, topic = (int(row[0]) if row else 0), "transaction.created"
                    mine.append(txn)
                if producer is not None and events is not None and user:
                    producer.produce(
                        events[topic],
                        orjson.dumps({"tenant": tenant, "user_id": user, "transaction_id": txn}),
                        f"{tenant}:{user}".encode(),
                    )
                    producer.inner.poll(0)
                counts[k] += 1

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if producer is not None:
        producer.flush()
        producer.close()
    done.put(sum(counts))


@contextlib.contextmanager
def background(
    conninfo: str,
    tenant: str,
    users: list[int],
    rate: int,
    seconds: float,
    *,
    seed: int = 7,
    events: dict[str, str] | None = None,
) -> Iterator[Callable[[bool], tuple[int, float]]]:
    """Run :func:`_load_main` in a process of its own (its pacing is not slowed by this
    process's GIL); yields, once its writers are connected, a function that stops it
    (``now``, or else at the end of ``seconds``) and returns (writes, seconds)."""
    mp = multiprocessing.get_context("spawn")
    stop, ready, done = mp.Event(), mp.Event(), mp.Queue()
    proc = mp.Process(
        target=_load_main,
        args=(conninfo, tenant, users, rate, seconds, seed, events, stop, ready, done),
        daemon=True,
    )
    proc.start()
    # A deadline, not a measure: a spawned interpreter's imports took over 60 s at a
    # load average of 35 (the smoke runs beside the fault profile and the cluster).
    if not ready.wait(CONNECT_DEADLINE_S):
        proc.kill()
        raise RuntimeError(
            f"the background writers did not connect within {CONNECT_DEADLINE_S:.0f} s"
        )
    started = time.monotonic()
    result: list[tuple[int, float]] = []

    def finish(now: bool) -> tuple[int, float]:
        if not result:
            if now:
                stop.set()
            writes = int(done.get(timeout=seconds + 60))
            result.append((writes, time.monotonic() - started))
            proc.join(10)
        return result[0]

    try:
        yield finish
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
