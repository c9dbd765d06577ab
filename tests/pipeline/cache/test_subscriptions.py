"""The API's pub/sub subscribers under real faults: a half-open connection, a Redis restart.

The in-process tier (invalidations) and the version resolver (deploy messages) each
keep a subscription that lets readers skip a Redis round trip. Both must stop relying
on it within ``FRESHLINE_SUBSCRIPTION_SILENCE_MS`` of the last confirmed contact, and
both must come back by themselves after Redis does.

A restart is real: a throwaway redis-server stopped and started (``private_redis``). A
half-open connection (the TCP connection stays up, the peer silently stops delivering)
cannot be made by stopping a server, which closes its sockets; so :class:`Forwarder`, a
loopback TCP relay of the test's own, sits between the subscriber and the real Redis and
is told to stop relaying, both ways, without closing anything. Nothing is faked.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from typing import TypedDict

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy.engine import Engine

from freshline.pipeline.api.app import create_app
from freshline.pipeline.cache.invalidation import Invalidation
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.versions import Pointer, VersionResolver
from freshline.pipeline.core.lock import Lock, LockedSet
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef, Entry
from freshline.pipeline.deploy.pointer import flip
from tests.helpers import (
    REGISTRY,
    TXN_VALUES,
    UNWINDOWED,
    dark_through_outage,
    observe_refreshes,
    running,
    wait_until,
)

PrivateRedis = tuple[str, Callable[[], None], Callable[[], None]]

# FRESHLINE_SUBSCRIPTION_SILENCE_MS's default, in seconds (test_the_setting_... checks it).
DEFAULT_SILENCE_S = 1.0
# How far past the bound a test waits for the subscriber to give up on a silent
# connection: the bound is what is under test, the slack absorbs scheduling only.
SLACK = 1.5


def entry() -> Entry:
    return Entry(dict(TXN_VALUES), 1, time.time_ns() // 1_000_000, 1)


class Forwarder:
    """A loopback TCP relay to ``target`` that can turn into a blackhole.

    :meth:`cut` stops relaying in both directions on every connection, and every one
    accepted later, except those in ``spare`` (named by the port Redis sees them come
    from, as ``CLIENT LIST`` shows it); nothing is closed, bytes wait in the socket
    buffers as they would behind a dropped route. :meth:`heal` lets them flow again.
    One thread does all the relaying, so once :meth:`cut` returns no byte crosses
    until :meth:`heal`.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._peer: dict[socket.socket, socket.socket] = {}
        self._port: dict[socket.socket, int] = {}  # either end -> the port Redis sees
        self._spare: set[int] | None = None  # None: every connection flows
        self._asked = 0
        self._applied = 0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-forwarder", daemon=True)
        self._thread.start()

    def cut(self, *, spare: Collection[int] = ()) -> None:
        self._set(set(spare))

    def ports(self) -> set[int]:
        """The ports Redis sees this forwarder's connections come from."""
        with self._changed:
            return set(self._port.values())

    def heal(self) -> None:
        self._set(None)

    def _set(self, spare: set[int] | None) -> None:
        with self._changed:
            self._spare = spare
            self._asked += 1
            asked = self._asked
            assert self._changed.wait_for(lambda: self._applied >= asked, timeout=5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in [self._server, *self._peer]:
            sock.close()

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._changed:
                spare = self._spare
                self._applied = self._asked
                self._changed.notify_all()
                flowing = [s for s, p in self._port.items() if spare is None or p in spare]
            # The timeout is a polling interval for cut/heal/close, not synchronisation.
            ready, _, _ = select.select([self._server, *flowing], [], [], 0.005)
            for sock in ready:
                if sock is self._server:
                    self._accept()
                elif sock in self._peer:
                    self._relay(sock)

    def _accept(self) -> None:
        down, _ = self._server.accept()
        try:
            up = socket.create_connection(self.target, timeout=5)
        except OSError:
            down.close()
            return
        up.settimeout(None)
        with self._changed:
            self._peer[down], self._peer[up] = up, down
            self._port[down] = self._port[up] = up.getsockname()[1]

    def _relay(self, sock: socket.socket) -> None:
        peer = self._peer[sock]
        try:
            data = sock.recv(65536)
            if data:
                peer.sendall(data)
                return
        except OSError:
            pass
        with self._changed:
            for s in (sock, peer):
                self._peer.pop(s, None)
                self._port.pop(s, None)
                s.close()


def address(client: redis.Redis) -> tuple[str, int, int]:
    kwargs = client.connection_pool.connection_kwargs
    return str(kwargs["host"]), int(kwargs["port"]), int(kwargs.get("db", 0))


def readers(admin: redis.Redis, hole: Forwarder) -> set[int]:
    """The forwarder's connections that Redis sees subscribed to nothing: the reads'."""
    ports = hole.ports()
    found = {
        int(c["addr"].rpartition(":")[2])
        for c in admin.client_list()
        if int(c.get("sub", 0)) == 0 and int(c.get("psub", 0)) == 0
    }
    return found & ports


def subscribers(client: redis.Redis, channel: str) -> int:
    try:
        return int(client.pubsub_numsub(channel)[0][1])
    except redis.exceptions.ConnectionError:
        return 0


@pytest.fixture
def thread_errors() -> Iterator[list[threading.ExceptHookArgs]]:
    """Exceptions that ended a thread during the test (the traceback redis-py prints)."""
    seen: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        seen.append(args)
        previous(args)

    threading.excepthook = hook
    yield seen
    threading.excepthook = previous


@pytest.fixture
def channel() -> str:
    """A channel of the test's own, so no other test's invalidations reach its tier."""
    return f"test:invalidations:{uuid.uuid4().hex}"


@pytest.fixture
def tenant() -> str:
    return f"subs-{uuid.uuid4().hex[:10]}"


def invalidate(client: redis.Redis, channel: str, ref: EntityRef) -> None:
    message = Invalidation(ref.tenant, ref.feature_set, ref.entity, 2, 1)
    client.publish(channel, message.encode())


# -- a half-open connection ----------------------------------------------------------------


class Login(TypedDict, total=False):
    """Keyword arguments of :class:`redis.Redis` that log in."""

    username: str
    password: str


def login(client: redis.Redis) -> Login:
    """The username and password ``client`` logs in with (the stack's ACL user)."""
    kwargs = client.connection_pool.connection_kwargs
    out = Login()
    if kwargs.get("username"):
        out["username"] = kwargs["username"]
    if kwargs.get("password"):
        out["password"] = kwargs["password"]
    return out


@pytest.mark.parametrize("silence_s", [None, 0.3], ids=["default", "configured"])
def test_a_half_open_subscription_goes_dark_within_the_silence_bound(
    redis_client: redis.Redis, channel: str, tenant: str, silence_s: float | None
) -> None:
    bound = DEFAULT_SILENCE_S if silence_s is None else silence_s
    host, port, db = address(redis_client)
    ref = EntityRef("txn_90d", tenant, "1")
    with Forwarder(host, port) as hole:
        client = redis.Redis(host="127.0.0.1", port=hole.port, db=db, **login(redis_client))
        tier = (
            LocalTier(client, max_entries=10, channel=channel, registry=UNWINDOWED)
            if silence_s is None
            else LocalTier(
                client, max_entries=10, channel=channel, silence_s=silence_s, registry=UNWINDOWED
            )
        ).start()
        try:
            assert tier.wait_live(5)
            assert tier.put(ref, entry(), tier.token())
            in_flight = tier.token()  # a value being read from Redis as the route drops

            hole.cut()
            invalidate(redis_client, channel, ref)  # published, never delivered
            assert wait_until(lambda: not tier.live, timeout=bound * SLACK)
            assert tier.get(ref, 1) is None
            assert tier.put(ref, entry(), tier.token()) is False
            assert wait_until(lambda: tier.stats.drops == 1)  # and it flushed

            hole.heal()
            assert tier.wait_live(10)
            # The entry invalidated in the silence is gone for good ...
            assert tier.get(ref, 1) is None
            assert tier.put(ref, entry(), in_flight) is False
            # ... and the new subscription carries invalidations again.
            assert tier.put(ref, entry(), tier.token())
            assert tier.get(ref, 1) is not None
            invalidate(redis_client, channel, ref)
            assert wait_until(lambda: tier.get(ref, 1) is None)
        finally:
            tier.close()
            client.close()


def test_a_quiet_healthy_subscription_stays_live(redis_client: redis.Redis, channel: str) -> None:
    # No messages at all for many bounds: the heartbeats alone keep it confirmed.
    with LocalTier(
        redis_client, max_entries=10, channel=channel, silence_s=0.2, registry=UNWINDOWED
    ) as tier:
        assert tier.wait_live(5)
        assert wait_until(lambda: tier.heartbeats >= 20, timeout=10)
        assert tier.live
        assert tier.stats.drops == 0 and tier.stats.subscriptions == 1


@pytest.fixture
def deploy(
    settings: Settings, redis_client: redis.Redis
) -> Iterator[tuple[Settings, Lock, Pointer, int, int]]:
    """A private pointer at version ``a`` of an in-memory lock that also knows ``b``."""
    a = 1000 + uuid.uuid4().int % 4000
    b = a + 1
    locked = {fs.name: LockedSet.of(fs) for fs in REGISTRY}
    lock = Lock({a: locked, b: locked})
    pointer = Pointer.scoped(uuid.uuid4().hex)
    yield settings.model_copy(update={"schema_version": a}), lock, pointer, a, b
    redis_client.delete(pointer.active_key, pointer.next_key)


def test_a_resolver_with_a_silent_listener_rereads_the_pointer(
    redis_client: redis.Redis, deploy: tuple[Settings, Lock, Pointer, int, int]
) -> None:
    settings, lock, pointer, a, b = deploy
    settings = settings.model_copy(update={"subscription_silence_ms": 300})
    flip(redis_client, settings, a, lock, pointer=pointer, registry=REGISTRY)
    host, port, db = address(redis_client)
    with Forwarder(host, port) as hole:
        client = redis.Redis(host="127.0.0.1", port=hole.port, db=db, **login(redis_client))
        # Cached for an hour: only the deploy messages keep it current.
        resolver = VersionResolver(client, settings, pointer=pointer, lock=lock, max_age_s=3600)
        assert resolver.current() == a
        got = observe_refreshes(resolver)
        resolver.listen()
        try:
            assert wait_until(lambda: subscribers(redis_client, pointer.channel) >= 1)
            redis_client.publish(pointer.channel, "probe")
            assert got.wait(5)  # the listener hears the channel
            assert resolver.current() == a

            spare = readers(redis_client, hole)
            assert spare
            hole.cut(spare=spare)  # the listener's connection goes silent, reads still work
            flip(
                redis_client, settings, b, lock, pointer=pointer, registry=REGISTRY
            )  # its message is lost
            assert wait_until(lambda: resolver.current() == b, timeout=0.3 * SLACK)
            assert not resolver.listening
        finally:
            resolver.close()
            client.close()


# -- a Redis restart -----------------------------------------------------------------------


def no_retries(url: str) -> redis.Redis:
    """A client that reports a dropped connection at once instead of retrying it.

    redis-py's default retries (about five seconds of them) hide a restart shorter than
    that from a pub/sub reader, and its ``run_in_thread`` worker dies only once they
    run out. Without them a restart of any length reaches the subscriber at once, as a
    longer one does in production.
    """
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0))


def deploy_threads() -> set[threading.Thread]:
    return {
        t for t in threading.enumerate() if t.name.startswith("freshline-deploy-") and t.is_alive()
    }


def assert_survived(
    thread_errors: list[threading.ExceptHookArgs], caplog: pytest.LogCaptureFixture
) -> None:
    """No thread died, and pipeline logged the restart once: one warning that the
    connection was lost, and no traceback."""
    assert thread_errors == []
    records = [r for r in caplog.records if r.name.startswith("freshline.pipeline.")]
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "lost" in warned[0], warned
    assert sum(1 for r in records if r.exc_info) == 0


def test_the_deploy_listener_survives_a_redis_restart(
    private_redis: PrivateRedis,
    deploy: tuple[Settings, Lock, Pointer, int, int],
    thread_errors: list[threading.ExceptHookArgs],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, stop, start = private_redis
    settings, lock, pointer, a, b = deploy
    admin = redis.Redis.from_url(url)
    client = no_retries(url)
    flip(admin, settings, a, lock, pointer=pointer, registry=REGISTRY)
    resolver = VersionResolver(client, settings, pointer=pointer, lock=lock, max_age_s=3600)
    got = observe_refreshes(resolver)
    before = deploy_threads()
    resolver.listen()
    try:
        assert wait_until(lambda: subscribers(admin, pointer.channel) >= 1)
        caplog.set_level(logging.INFO, logger="freshline.pipeline")
        stop()
        start()  # empty: no persistence
        flip(admin, settings, a, lock, pointer=pointer, registry=REGISTRY)
        assert wait_until(lambda: subscribers(admin, pointer.channel) >= 1, timeout=10)
        assert wait_until(lambda: resolver.listening)
        assert len(deploy_threads() - before) == 1  # the same listener thread, still alive
        assert resolver.current() == a
        got.clear()
        flip(admin, settings, b, lock, pointer=pointer, registry=REGISTRY)
        assert got.wait(5)  # the message published after the restart arrived
        assert resolver.current() == b
    finally:
        resolver.close()
        client.close()
        admin.close()
    assert_survived(thread_errors, caplog)


def test_the_local_tier_survives_a_redis_restart(
    private_redis: PrivateRedis,
    channel: str,
    tenant: str,
    thread_errors: list[threading.ExceptHookArgs],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, stop, start = private_redis
    admin = redis.Redis.from_url(url)
    client = no_retries(url)
    ref = EntityRef("txn_90d", tenant, "1")
    tier = LocalTier(client, max_entries=10, channel=channel, registry=UNWINDOWED).start()
    try:
        assert tier.wait_live(5)
        assert tier.put(ref, entry(), tier.token())
        caplog.set_level(logging.INFO, logger="freshline.pipeline")
        dark_through_outage(tier, ref, entry, stop, start)
        invalidate(admin, channel, ref)  # published after the restart: it arrives
        assert wait_until(lambda: tier.get(ref, 1) is None)
    finally:
        tier.close()
        client.close()
        admin.close()
    assert_survived(thread_errors, caplog)


def test_the_api_keeps_both_subscriptions_through_a_redis_restart(
    private_redis: PrivateRedis,
    settings: Settings,
    engine: Engine,
    thread_errors: list[threading.ExceptHookArgs],
) -> None:
    url, stop, start = private_redis
    client = no_retries(url)
    app = create_app(
        settings.model_copy(
            update={
                "redis_url": url,
                "local_cache_size": 10,
                "subscription_silence_ms": 400,
            }
        ),
        engine=engine,
        redis_client=client,
        registry=REGISTRY,
    )
    try:
        with running(app):
            local: LocalTier = app.state.services.reader.local
            versions: VersionResolver = app.state.services.reader.readthrough.versions
            assert local.silence_s == versions.silence_s == 0.4
            assert local.wait_live(5)
            assert wait_until(lambda: versions.listening)
            stop()
            assert wait_until(lambda: not local.live and not versions.listening)
            start()
            assert local.wait_live(10)
            assert wait_until(lambda: versions.listening)
    finally:
        client.close()
    assert thread_errors == []


def test_the_setting_defaults_to_one_second_and_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().subscription_silence_ms == DEFAULT_SILENCE_S * 1000
    monkeypatch.setenv("FRESHLINE_SUBSCRIPTION_SILENCE_MS", "250")
    assert Settings().subscription_silence_ms == 250
