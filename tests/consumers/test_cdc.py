"""CDC end to end: plain SQL -> Postgres WAL -> Debezium (Kafka Connect) -> consumer -> Redis.

Nothing of freshline is in the write path: the changes are plain SQL statements. The
module registers one connector of its own (its own topic prefix, so its own connector
name, replication slot and topics) against the session's test database, runs one
in-process consumer on its topics in its own schema version, and removes all of it
afterwards. Each test seeds its own tenant.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.topics import ensure, ensure_cdc_topics, managed_topics
from freshline.consumers.worker import Worker
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cdc.connect import (
    ConnectClient,
    Names,
    captured_tables,
    connector_config,
    connector_running,
    drop_slot,
    names,
    streaming,
)
from freshline.pipeline.core.keys import feature_pattern
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.consumers.conftest import own_settings, wait_for
from tests.helpers import REGISTRY, cli

pytestmark = [pytest.mark.kafka, pytest.mark.connect]

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 2
DEADLINE_S = 60.0

Key = tuple[str, str, str]
"""(feature set, tenant, entity)"""


@dataclass
class Cdc:
    settings: Settings
    names: Names
    worker: Worker
    client: ConnectClient

    def consumed(self) -> int:
        return self.worker.totals.consumed

    def wait_consumed(self, count: int, what: str) -> None:
        wait_for(lambda: self.consumed() >= count, what, DEADLINE_S)

    def running(self) -> bool:
        return connector_running(self.client, self.names.connector)


@pytest.fixture(scope="module")
def tenants(tenant_factory_module: Callable[..., SeedSummary]) -> list[str]:
    """One tenant per test, seeded *before* the connector exists: with snapshot mode
    ``no_data`` none of these rows becomes an event, so each test sees only its own."""
    return tenant_factory_module(users=40, transactions=1200, tenants=4).tenants


@pytest.fixture(scope="module")
def cdc(
    settings: Settings, engine: Engine, admin: AdminClient, tenants: list[str]
) -> Iterator[Cdc]:
    local = own_settings(settings, "cdc", PARTITIONS)
    owned = names(local)
    client = ConnectClient(local.connect_url)
    ensure(admin, PARTITIONS, topics=managed_topics(local))
    tables = captured_tables(REGISTRY)
    ensure_cdc_topics(local, [owned.topic(t) for t in tables])
    client.put_config(owned.connector, connector_config(local, owned, snapshot_mode="no_data"))
    worker = Worker(local)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:  # surfaced by the test, not lost in the thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="cdc-consumer", daemon=True)
    env = Cdc(local, owned, worker, client)
    try:
        # The slot exists from the moment the connector streams: commits after it are captured.
        wait_for(
            lambda: streaming(client, engine, owned),
            "the connector to run and create its slot",
            DEADLINE_S,
        )
        # A new group reads from the earliest offset: nothing captured before it joins is lost.
        thread.start()
        yield env
    finally:
        worker.stop()
        thread.join(timeout=30)
        client.delete(owned.connector)
        drop_slot(engine, owned.slot)
        topics = [
            *(owned.topic(t) for t in tables),
            *managed_topics(local),
            owned.heartbeat_topic,
        ]
        for future in admin.delete_topics(topics, operation_timeout=10).values():
            with contextlib.suppress(Exception):  # a topic never created (no heartbeat yet)
                future.result()
    assert not failure, failure


def snapshot(client: redis.Redis, version: int) -> dict[Key, bytes]:
    """Every feature entry of ``version``: (feature set, tenant, entity) -> raw bytes."""
    keys = sorted(client.scan_iter(match=feature_pattern(version), count=1000))
    out: dict[Key, bytes] = {}
    for key, raw in zip(keys, client.mget(keys) if keys else [], strict=True):
        _, _, fs, tag = key.decode().split(":", 3)
        tenant, entity = tag.strip("{}").split(":")
        if raw is not None:
            assert isinstance(raw, bytes)  # the client does not decode responses
            out[(fs, tenant, entity)] = raw
    return out


def changed(before: dict[Key, bytes], after: dict[Key, bytes]) -> set[Key]:
    return {k for k, v in after.items() if before.get(k) != v}


def stale(
    engine: Engine, client: redis.Redis, version: int, keys: set[Key]
) -> list[tuple[Key, object, object]]:
    """The entries of ``keys`` absent or unequal to a direct recompute from Postgres now:
    each with that recompute and the entry."""
    store = EntryStore(client, version, registry=REGISTRY)
    found: list[tuple[Key, object, object]] = []
    for fs, tenant, entity in sorted(keys):
        truth = compute(engine, REGISTRY[fs], [(tenant, entity)]).values[(tenant, entity)]
        entry = store.read([EntityRef(fs, tenant, entity)])[0]
        if entry is None or entry.values != truth:
            found.append(((fs, tenant, entity), truth, entry))
    return found


def assert_fresh(engine: Engine, client: redis.Redis, version: int, keys: set[Key]) -> None:
    """Each entry equals a direct recompute from Postgres now."""
    found = stale(engine, client, version, keys)
    assert not found, found


def sql(engine: Engine, statement: str, **params: object) -> list[sa.Row[*tuple[Any, ...]]]:
    with engine.begin() as conn:
        result = conn.execute(sa.text(statement), params)
        return list(result) if result.returns_rows else []


class Changes:
    """Plain SQL committed one statement at a time, and the entries each one changed."""

    def __init__(self, cdc: Cdc, engine: Engine, client: redis.Redis) -> None:
        self.cdc, self.engine, self.client = cdc, engine, client
        self.now = snapshot(client, cdc.settings.schema_version)
        self.rows: list[sa.Row[*tuple[Any, ...]]] = []

    def commit(self, events: int, what: str, statement: str, **params: object) -> set[Key]:
        """Run ``statement``, wait for the consumer to take the ``events`` it makes (a
        DELETE makes two: the change and its tombstone), and return the entries changed
        since the last snapshot; ``rows`` keeps what the statement returned."""
        base, start = self.now, self.cdc.consumed()
        self.rows = sql(self.engine, statement, **params)
        self.cdc.wait_consumed(start + events, what)
        self.now = snapshot(self.client, self.cdc.settings.schema_version)
        return changed(base, self.now)


def test_insert_update_delete_reach_exactly_the_affected_users(
    cdc: Cdc,
    engine: Engine,
    redis_client: redis.Redis,
    tenants: list[str],
) -> None:
    tenant = tenants[0]
    version = cdc.settings.schema_version
    user_sets = ("txn_90d", "geo")

    changes = Changes(cdc, engine, redis_client)
    step = changes.commit(
        1,
        "the INSERT",
        "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
        "VALUES (:t, 3, 512.25, 'm-cdc', '11.0.0.7') RETURNING id",
        t=tenant,
    )
    (txn,) = changes.rows[0]
    assert step == {(fs, tenant, "3") for fs in user_sets}
    assert_fresh(engine, redis_client, version, step)

    # An UPDATE that moves the row to another user affects the old user and the new.
    step = changes.commit(
        1,
        "the UPDATE",
        "UPDATE transactions SET user_id = 4, amount = 77.10 WHERE tenant_id = :t AND id = :id",
        t=tenant,
        id=txn,
    )
    assert step == {(fs, tenant, u) for fs in user_sets for u in ("3", "4")}
    assert_fresh(engine, redis_client, version, step)

    # A DELETE (and the tombstone after it) affects the user the row belonged to.
    step = changes.commit(
        2,
        "the DELETE and its tombstone",
        "DELETE FROM transactions WHERE tenant_id = :t AND id = :id",
        t=tenant,
        id=txn,
    )
    assert step == {(fs, tenant, "4") for fs in user_sets}
    assert_fresh(
        engine, redis_client, version, {(fs, tenant, u) for fs in user_sets for u in ("3", "4")}
    )
    assert cdc.worker.totals.dead_lettered == 0


def test_a_device_change_reaches_every_user_of_the_device(
    cdc: Cdc,
    engine: Engine,
    redis_client: redis.Redis,
    tenants: list[str],
) -> None:
    tenant = tenants[1]
    version = cdc.settings.schema_version
    (device,) = sql(
        engine,
        "SELECT device_id FROM user_devices WHERE tenant_id = :t ORDER BY device_id LIMIT 1",
        t=tenant,
    )[0]
    # Share the device with two more users (each link is one event, applied first).
    start, links = cdc.consumed(), 0
    for user in (2, 3):
        links += len(
            sql(
                engine,
                "INSERT INTO user_devices VALUES (:t, :u, :d) ON CONFLICT DO NOTHING RETURNING 1",
                t=tenant,
                u=user,
                d=device,
            )
        )
    cdc.wait_consumed(start + links, "the new user_devices links")
    users = {
        str(u)
        for (u,) in sql(
            engine,
            "SELECT user_id FROM user_devices WHERE tenant_id = :t AND device_id = :d",
            t=tenant,
            d=device,
        )
    }
    assert len(users) >= 3

    changes = Changes(cdc, engine, redis_client)
    step = changes.commit(
        1,
        "the device UPDATE",
        "UPDATE devices SET risk_score = 0.987 WHERE tenant_id = :t AND id = :d",
        t=tenant,
        d=device,
    )
    assert step == {("device_risk", tenant, u) for u in users}
    assert_fresh(engine, redis_client, version, step)

    # Unlinking a user from the device (every column is the key: DEFAULT identity suffices).
    gone = min(users)
    step = changes.commit(
        2,
        "the user_devices DELETE and its tombstone",
        "DELETE FROM user_devices WHERE tenant_id = :t AND user_id = :u AND device_id = :d",
        t=tenant,
        u=int(gone),
        d=device,
    )
    assert ("device_risk", tenant, gone) in step
    assert_fresh(engine, redis_client, version, {("device_risk", tenant, gone)})


def test_a_geoip_range_change_reaches_the_users_with_transactions_in_it(
    cdc: Cdc,
    engine: Engine,
    redis_client: redis.Redis,
    tenants: list[str],
) -> None:
    tenant = tenants[2]
    version = cdc.settings.schema_version
    # A /24 of the benchmarking range (198.18.0.0/15): no seeded IP is in it.
    net = f"198.{18 + uuid.uuid4().int % 2}.{uuid.uuid4().int % 256}"
    ips = {"5": f"{net}.10", "6": f"{net}.20", "7": f"{net}.200"}
    start = cdc.consumed()
    for user, ip in ips.items():
        sql(
            engine,
            "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
            "VALUES (:t, :u, 10, 'm-geo', CAST(:ip AS inet))",
            t=tenant,
            u=int(user),
            ip=ip,
        )

    def in_range(lo: str, hi: str) -> set[Key]:
        rows = sql(
            engine,
            "SELECT DISTINCT tenant_id, user_id FROM transactions WHERE ip "
            "BETWEEN CAST(:lo AS inet) AND CAST(:hi AS inet)",
            lo=lo,
            hi=hi,
        )
        return {("geo", str(t), str(u)) for t, u in rows}

    lo, hi = f"{net}.0", f"{net}.255"
    assert {k[1:] for k in in_range(lo, hi)} >= {(tenant, u) for u in ips}
    # Let the three INSERTs land first, so the geoip changes below are measured alone. The
    # count, not the entries: the worker counts a batch only after writing it, so entries
    # can be in Redis while the counter is a batch behind, and a baseline taken then would
    # let the geoip wait below return on the INSERTs' own batch (a CI failure, stop 21).
    cdc.wait_consumed(start + len(ips), "the transaction INSERTs")
    assert all(("geo", tenant, u) in snapshot(redis_client, version) for u in ips)

    changes = Changes(cdc, engine, redis_client)
    step = changes.commit(
        1,
        "the geoip INSERT",
        "INSERT INTO geoip VALUES (CAST(:lo AS inet), CAST(:hi AS inet), 'ZZ', 'Testville', 64512)",
        lo=lo,
        hi=hi,
    )
    assert step == in_range(lo, hi)
    assert_fresh(engine, redis_client, version, in_range(lo, hi))

    # Shrinking the range: the users in the *old* range are affected (REPLICA IDENTITY
    # FULL gives the old ip_to), including user 7, whose IP fell out of it.
    affected = in_range(lo, hi)
    step = changes.commit(
        1,
        "the geoip UPDATE",
        "UPDATE geoip SET ip_to = CAST(:hi AS inet), country = 'ZY' "
        "WHERE ip_from = CAST(:lo AS inet)",
        lo=lo,
        hi=f"{net}.127",
    )
    assert step == affected
    assert ("geo", tenant, "7") in affected
    assert_fresh(engine, redis_client, version, affected)

    step = changes.commit(
        2,
        "the geoip DELETE and its tombstone",
        "DELETE FROM geoip WHERE ip_from = CAST(:lo AS inet)",
        lo=lo,
    )
    assert step == in_range(lo, f"{net}.127")
    assert_fresh(engine, redis_client, version, affected)


def test_restarting_the_connect_worker_mid_burst_loses_nothing(
    cdc: Cdc,
    engine: Engine,
    redis_client: redis.Redis,
    tenants: list[str],
) -> None:
    tenant = tenants[3]
    version = cdc.settings.schema_version
    stop = threading.Event()
    written: list[int] = []
    touched: set[str] = set()
    errors: list[BaseException] = []

    def burst() -> None:
        # One statement per transaction, cycling inserts, moves and deletes over 30 users.
        i = 0
        try:
            while not stop.is_set():
                user = 1 + (i * 7) % 30
                if i % 3 == 0:
                    rows = sql(
                        engine,
                        "INSERT INTO transactions (tenant_id, user_id, amount, "
                        "merchant_id, ip) VALUES (:t, :u, :a, 'm-burst', '11.0.0.9') "
                        "RETURNING user_id",
                        t=tenant,
                        u=user,
                        a=1 + i % 97,
                    )
                elif i % 3 == 1:
                    rows = sql(
                        engine,
                        "UPDATE transactions x SET user_id = :u, "
                        "amount = x.amount + 1 FROM transactions o "
                        "WHERE x.tenant_id = :t AND x.id = (SELECT min(id) FROM "
                        "transactions WHERE tenant_id = :t AND user_id = :v) "
                        "AND o.tenant_id = x.tenant_id AND o.id = x.id "
                        "RETURNING x.user_id, o.user_id",
                        t=tenant,
                        u=user,
                        v=1 + user % 30,
                    )
                else:
                    rows = sql(
                        engine,
                        "DELETE FROM transactions WHERE tenant_id = :t AND id = "
                        "(SELECT max(id) FROM transactions WHERE tenant_id = :t "
                        "AND user_id = :u) RETURNING user_id",
                        t=tenant,
                        u=user,
                    )
                # Only users a committed change actually touched (a DELETE may match nothing).
                touched.update(str(u) for row in rows for u in row)
                written.append(i)
                i += 1
                stop.wait(0.005)  # pacing of the writer, not synchronisation
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=burst, name="cdc-burst", daemon=True)
    start = cdc.consumed()
    writer.start()
    try:
        wait_for(lambda: cdc.consumed() > start + 20, "the first burst events to be applied")
        before_restart = len(written)
        restart = subprocess.run(
            [str(ROOT / "scripts" / "stack"), "restart-connect"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert restart.returncode == 0, restart.stdout + restart.stderr
        wait_for(cdc.running, "the connector to run again after the restart", DEADLINE_S)
        after_restart = len(written)
        consumed_at_restart = cdc.consumed()
        wait_for(
            lambda: cdc.consumed() > consumed_at_restart + 20, "events from the restarted connector"
        )
    finally:
        stop.set()
        writer.join(timeout=30)
    assert not errors, errors
    assert 0 < before_restart < after_restart < len(written), "writes before, during, after"

    keys = {(fs, tenant, u) for fs in ("txn_90d", "geo") for u in touched}

    try:
        wait_for(
            lambda: not stale(engine, redis_client, version, keys),
            "Redis to equal Postgres for every touched user",
            90,
        )
    except pytest.fail.Exception:
        found = stale(engine, redis_client, version, keys)
        pytest.fail(f"stale entries: {found}; totals {cdc.worker.totals}")


def test_status_shows_the_connector_and_the_slot(cdc: Cdc) -> None:
    s = cdc.settings
    env = {
        "FRESHLINE_POSTGRES_URL": s.postgres_url,
        "FRESHLINE_TOPIC_PREFIX": s.topic_prefix,
        "COLUMNS": "200",
    }
    done = cli("cdc", "status", **env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"connector  {cdc.names.connector}: RUNNING" in done.stdout
    assert f"slot       {cdc.names.slot}: active" in done.stdout
    assert "retains" in done.stdout
    missing = cli("cdc", "status", "--name", "no-such-connector", **env)
    assert missing.returncode == 1
    assert "not registered" in missing.stdout
