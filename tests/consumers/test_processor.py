"""The batch processor against real Postgres and Redis (Kafka comes in test_worker)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from fraud.seed import SeedSummary
from freshline.consumers.processor import Processor
from freshline.consumers.routing import Router, Unroutable
from freshline.pipeline.cache.invalidation import Invalidation
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.keys import INVALIDATION_CHANNEL, feature_pattern
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import ChangeEvent, EntityRef, Entry, FeatureValues
from tests.consumers.conftest import insert_transaction
from tests.helpers import REGISTRY


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=40, transactions=1200).tenants[0]


def make(engine: Engine, client: redis.Redis, version: int) -> Processor:
    return Processor(engine, client, versions=lambda: [version], registry=REGISTRY)


def stored(client: redis.Redis, version: int, tenant: str) -> dict[tuple[str, str], FeatureValues]:
    store = EntryStore(client, version, registry=REGISTRY)
    out = {}
    for key in client.scan_iter(match=feature_pattern(version), count=1000):
        name = key.decode().split(":")[2]
        t, e = key.decode().split("{")[1].rstrip("}").split(":")
        if t == tenant:
            entry = store.read([EntityRef(name, t, e)])[0]
            assert entry is not None
            out[(name, e)] = entry.values
    return out


def truth(engine: Engine, name: str, tenant: str, users: list[str]) -> dict[str, FeatureValues]:
    batch = compute(engine, REGISTRY[name], [(tenant, u) for u in users])
    return {u: batch.values[(tenant, u)] for u in users}


def shared_device(conn: Connection, tenant: str) -> tuple[str, list[str]]:
    """A device of ``tenant`` that more than one user has, and its users (ids, sorted)."""
    device, users = conn.execute(
        sa.text(
            """SELECT device_id, array_agg(user_id::text ORDER BY user_id) FROM user_devices
           WHERE tenant_id = :t GROUP BY device_id HAVING count(*) > 1 LIMIT 1"""
        ),
        {"t": tenant},
    ).one()
    return device, users


def test_a_new_transaction_refreshes_exactly_its_user(
    engine: Engine, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    with engine.begin() as conn:
        txn_id = insert_transaction(conn, tenant, 7, 4321.00, "m-new", "11.0.16.5", device="d1")
    event = ChangeEvent(
        "transactions", "c", tenant, {"tenant_id": tenant, "user_id": 7, "id": txn_id}
    )
    report = make(engine, redis_client, version).apply([event])
    got = stored(redis_client, version, tenant)
    assert set(got) == {("txn_90d", "7"), ("geo", "7")}
    assert got[("txn_90d", "7")] == truth(engine, "txn_90d", tenant, ["7"])["7"]
    assert got[("geo", "7")] == truth(engine, "geo", tenant, ["7"])["7"]
    assert report.writes.written == 2


def test_many_events_for_one_user_make_one_recompute(
    engine: Engine, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    events = [
        ChangeEvent("transactions", "u", tenant, {"tenant_id": tenant, "user_id": 3})
        for _ in range(100)
    ]
    report = make(engine, redis_client, version).apply(events)
    assert report.events == 100
    assert report.entries == 2  # txn_90d and geo of user 3, once each


def test_a_device_change_reaches_every_user_of_it_and_no_other(
    engine: Engine, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    with engine.begin() as conn:
        device, users = shared_device(conn, tenant)
        conn.execute(
            sa.text("UPDATE devices SET risk_score = 0.99 WHERE tenant_id = :t AND id = :d"),
            {"t": tenant, "d": device},
        )
    event = ChangeEvent("devices", "u", tenant, {"tenant_id": tenant, "id": device})
    make(engine, redis_client, version).apply([event])
    got = stored(redis_client, version, tenant)
    assert set(got) == {("device_risk", u) for u in users}
    want = truth(engine, "device_risk", tenant, users)
    for u in users:
        assert got[("device_risk", u)] == want[u]
        assert want[u]["max_device_risk"] == pytest.approx(0.99)


def test_a_transaction_that_moves_users_refreshes_both(
    engine: Engine, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    event = ChangeEvent(
        "transactions",
        "u",
        tenant,
        {"tenant_id": tenant, "user_id": 5, "id": 1},
        before={"tenant_id": tenant, "user_id": 6, "id": 1},
    )
    make(engine, redis_client, version).apply([event])
    assert {e for (_, e) in stored(redis_client, version, tenant)} == {"5", "6"}


def test_a_geoip_change_reaches_the_users_with_transactions_in_the_range(
    engine: Engine, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    with engine.connect() as conn:
        ip_from, ip_to = conn.execute(
            sa.text(
                """SELECT host(g.ip_from), host(g.ip_to) FROM geoip g
               WHERE EXISTS (SELECT 1 FROM transactions x WHERE x.tenant_id = :t
                             AND x.ip BETWEEN g.ip_from AND g.ip_to) LIMIT 1"""
            ),
            {"t": tenant},
        ).one()
        users = {
            str(u)
            for (u,) in conn.execute(
                sa.text(
                    "SELECT DISTINCT user_id FROM transactions WHERE tenant_id = :t "
                    "AND ip BETWEEN CAST(:a AS inet) AND CAST(:b AS inet)"
                ),
                {"t": tenant, "a": ip_from, "b": ip_to},
            )
        }
    event = ChangeEvent("geoip", "u", None, {"ip_from": ip_from, "ip_to": ip_to})
    make(engine, redis_client, version).apply([event])
    got = stored(redis_client, version, tenant)
    assert {e for (name, e) in got if name == "geo"} == users
    assert {name for (name, _) in got} == {"geo"}


def test_redelivery_and_reordering_are_harmless(
    engine: Engine, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    processor = make(engine, redis_client, version)
    stale = compute(engine, REGISTRY["txn_90d"], [(tenant, "9")])  # computed before the change
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE transactions SET amount = amount * 3 WHERE tenant_id = :t AND user_id = 9"
            ),
            {"t": tenant},
        )
    event = ChangeEvent("transactions", "u", tenant, {"tenant_id": tenant, "user_id": 9})
    processor.apply([event])
    processor.apply([event])  # redelivered
    assert (
        EntryStore(redis_client, version, registry=REGISTRY).write(stale).refused == 1
    )  # arrives late
    got = stored(redis_client, version, tenant)
    assert got[("txn_90d", "9")] == truth(engine, "txn_90d", tenant, ["9"])["9"]
    assert got[("txn_90d", "9")] != stale.values[(tenant, "9")]


def in_redis(client: redis.Redis, message: Invalidation) -> Entry | None:
    """The entry a reader told of ``message`` finds in Redis."""
    ref = EntityRef(message.feature_set, message.tenant, message.entity)
    return EntryStore(client, message.schema_version, registry=REGISTRY).read([ref])[0]


def executed(url: str, action: Callable[[], object], *needles: str) -> list[str]:
    """The commands Redis ran during ``action`` that mention one of ``needles``, in the
    order it ran them (MONITOR), whichever connection sent them."""
    sentinel = f"executed-{uuid.uuid4().hex}"
    commands: list[str] = []
    client = redis.Redis.from_url(url, socket_timeout=30)  # a lost sentinel fails, not hangs
    with client.monitor() as monitor:
        action()
        client.echo(sentinel)  # Redis runs it after everything ``action`` sent
        while sentinel not in (command := monitor.next_command()["command"]):
            if any(needle in command for needle in needles):
                commands.append(command)
    client.close()
    return commands


def test_invalidations_are_published_after_the_write(
    engine: Engine, redis_client: redis.Redis, settings: Settings, tenant: str, version: int
) -> None:
    """Whoever is told of a change, on the Redis channel or through the Kafka hand-off,
    finds the new entry in Redis when the message is published."""
    store = EntryStore(redis_client, version, registry=REGISTRY)
    store.write(compute(engine, REGISTRY["txn_90d"], [(tenant, "11")]))  # before the change
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE transactions SET amount = amount * 3 WHERE tenant_id = :t AND user_id = 11"
            ),
            {"t": tenant},
        )
    new = truth(engine, "txn_90d", tenant, ["11"])["11"]
    sub = redis_client.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(INVALIDATION_CHANNEL)
    assert sub.get_message(timeout=5) is None  # the subscribe confirmation, ignored
    # The hand-off to Kafka runs in the processor's thread as it publishes: what it
    # reads is what Redis held at that moment.
    handed_off: list[tuple[Invalidation, Entry | None]] = []
    processor = Processor(
        engine,
        redis_client,
        versions=lambda: [version],
        publish=lambda m: handed_off.append((m, in_redis(redis_client, m))),
        registry=REGISTRY,
    )
    keys = [store.key(EntityRef(name, tenant, "11")) for name in ("txn_90d", "geo")]
    commands = executed(
        settings.redis_url,
        lambda: processor.apply(
            [ChangeEvent("transactions", "u", tenant, {"tenant_id": tenant, "user_id": 11})]
        ),
        *keys,
        tenant,
    )
    seen = []
    while (msg := sub.get_message(timeout=5)) is not None:
        inv = Invalidation.decode(msg["data"])
        if inv.tenant == tenant:
            seen.append(inv)
        if len(seen) == 2:
            break
    sub.close()
    assert {(i.feature_set, i.entity, i.schema_version) for i in seen} == {
        ("txn_90d", "11", version),
        ("geo", "11", version),
    }
    assert sorted((m for m, _ in handed_off), key=str) == sorted(seen, key=str)
    for message, entry in handed_off:
        assert entry is not None, f"{message} was handed off before its entry was written"
        assert entry.watermark == message.watermark
        if message.feature_set == "txn_90d":
            assert entry.values == new
    # On the Redis channel: Redis ran every write of the entries before any PUBLISH.
    publishes = [i for i, c in enumerate(commands) if c.startswith("PUBLISH ")]
    writes = [
        i for i, c in enumerate(commands) if c.split(" ", 1)[0] not in ("PUBLISH", "GET", "MGET")
    ]
    assert publishes and writes, commands
    assert max(writes) < min(publishes), commands


def test_two_versions_are_written_during_a_deploy(
    engine: Engine, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    processor = Processor(
        engine, redis_client, versions=lambda: [version, version + 1], registry=REGISTRY
    )
    processor.apply(
        [ChangeEvent("transactions", "u", tenant, {"tenant_id": tenant, "user_id": 12})]
    )
    assert stored(redis_client, version, tenant) == stored(redis_client, version + 1, tenant)
    assert len(stored(redis_client, version, tenant)) == 2


def test_the_router_leaves_truncates_to_the_processor(engine: Engine) -> None:
    # A truncate has no entities to route to; the processor raises floors instead
    # (tests/consumers/test_truncate.py).
    with engine.connect() as conn, pytest.raises(Unroutable):
        Router(REGISTRY).route(conn, [ChangeEvent("transactions", "t", None, {})])


def test_a_new_device_link_refreshes_every_user_of_that_device(
    engine: Engine, redis_client: redis.Redis, tenant: str, version: int
) -> None:
    with engine.begin() as conn:
        device, users = shared_device(conn, tenant)
        newcomer = conn.execute(
            sa.text("SELECT max(id) FROM users WHERE tenant_id = :t"), {"t": tenant}
        ).scalar_one()
        conn.execute(
            sa.text("INSERT INTO user_devices VALUES (:t, :u, :d) ON CONFLICT DO NOTHING"),
            {"t": tenant, "u": newcomer, "d": device},
        )
    event = ChangeEvent(
        "user_devices", "c", tenant, {"tenant_id": tenant, "user_id": newcomer, "device_id": device}
    )
    make(engine, redis_client, version).apply([event])
    got = stored(redis_client, version, tenant)
    everyone = {*users, str(newcomer)}
    assert set(got) == {("device_risk", u) for u in everyone}
    want = truth(engine, "device_risk", tenant, sorted(everyone))
    for u in everyone:
        assert got[("device_risk", u)]["shared_device_users"] >= len(everyone)
        assert got[("device_risk", u)] == want[u]
