"""What one caller must not be able to do to everyone (issue 30), on the real services."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis
from sqlalchemy.engine import Engine

from pipeline.cache.readthrough import Hooks, ReadThrough, Result
from pipeline.cache.store import FeatureStore
from pipeline.core.keys import LEASE_PREFIX
from pipeline.core.types import EntityRef
from tests.conftest import wait_until

# Long enough that no lease or wait in these tests ends by running out: a lease that
# is still there, or a read that is still waiting, was never ended by the code.
FOREVER_MS = 600_000
GHOSTS = [str(u) for u in range(900_000, 900_100)]  # user ids with no row in ``users``


@pytest.fixture(scope="module")
def tenant(tenant_factory_module: Callable[..., Any]) -> str:
    return str(tenant_factory_module(users=5, transactions=50).tenants[0])


def leases(client: redis.Redis, version: int) -> list[bytes]:
    return list(client.scan_iter(match=f"{LEASE_PREFIX}:{version}:*", count=1000))


def read_through(client: redis.Redis, engine: Engine, version: int) -> ReadThrough:
    store = FeatureStore(client, version)
    return ReadThrough(store, engine, lease_ms=FOREVER_MS, wait_ms=FOREVER_MS, early_refresh=False)


# -- 3: leases always end ---------------------------------------------------------------


def test_reads_of_ids_without_source_rows_end_their_leases(
    redis_client: redis.Redis, engine: Engine, tenant: str, version: int
) -> None:
    rt = read_through(redis_client, engine, version)
    refs = [EntityRef("txn_90d", tenant, u) for u in GHOSTS]
    first = rt.get_many(refs)
    assert {r.source for r in first} == {"uncached"}
    assert leases(redis_client, version) == []
    # A repeat leases again and computes: it never waits on a lease.
    again = rt.get_many(refs)
    assert {r.source for r in again} == {"uncached"}
    assert rt.counters.lease_waits == 0
    assert [r.values for r in again] == [r.values for r in first]
    assert leases(redis_client, version) == []


def test_a_reader_waiting_on_an_id_without_a_source_row_stops_when_its_holder_is_done(
    redis_client: redis.Redis, engine: Engine, tenant: str, version: int
) -> None:
    ref = EntityRef("txn_90d", tenant, GHOSTS[0])
    holder, waiter = (read_through(redis_client, engine, version) for _ in range(2))
    queried, resume = threading.Event(), threading.Event()

    def pause(_: list[EntityRef]) -> None:
        queried.set()
        resume.wait(30)

    holder.hooks.after_compute = pause
    answers: dict[str, Result] = {}

    def read(name: str, rt: ReadThrough) -> None:
        answers[name] = rt.get(ref)

    threads = [
        threading.Thread(target=read, args=(name, rt), daemon=True)
        for name, rt in (("holder", holder), ("waiter", waiter))
    ]
    threads[0].start()
    assert queried.wait(30)  # the holder has its lease and has queried
    threads[1].start()
    assert wait_until(lambda: waiter.counters.lease_waits == 1, timeout=30)
    resume.set()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a reader is still waiting on a lease"
    assert answers["holder"].source == answers["waiter"].source == "uncached"
    assert answers["waiter"].values == answers["holder"].values
    assert leases(redis_client, version) == []


def test_a_failed_computation_ends_its_leases(
    redis_client: redis.Redis, engine: Engine, tenant: str, version: int
) -> None:
    def fail(_: list[EntityRef]) -> None:
        raise ConnectionError("the database went away mid-read")

    rt = read_through(redis_client, engine, version)
    rt.hooks = Hooks(before_compute=fail)
    refs = [EntityRef(fs, tenant, "1") for fs in ("txn_90d", "geo")]
    with pytest.raises(ConnectionError):
        rt.get_many(refs)
    assert leases(redis_client, version) == []
    rt.hooks = Hooks()
    assert {r.source for r in rt.get_many(refs)} == {"computed"}
    assert rt.counters.lease_waits == 0
