"""Revocation across a lost subscription, and a revoke that could not tell anyone.

An API worker trusts its key cache only while its revocation subscription is
confirmed; a revocation published while the subscription is reconnecting reaches no
one. The first test cuts the worker's subscription for real (CLIENT KILL, on a Redis
of its own so no other client is touched) and holds its reconnect and one lookup at
chosen points, so the interleaving is certain rather than likely.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.api.accounts import (
    create_tenant,
    issue_api_key,
    list_api_keys,
    revoke_api_key,
)
from freshline.pipeline.api.auth import Authenticator, Principal, Unauthorized
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.keys import APIKEY_CHANNEL
from freshline.pipeline.core.settings import Settings
from tests.helpers import cli, error_line, free_port, wait_until

DEADLINE_S = 10.0


def fresh_tenant() -> str:
    return f"rev-{uuid.uuid4().hex[:10]}"


class HeldConnection(redis.Connection):
    """A real connection whose socket the test can refuse (``refusing``: a Redis that
    cannot be reached) or hold (``open`` clear: a reconnect that stalls, as across a
    network blip, without failing)."""

    refusing: ClassVar[threading.Event] = threading.Event()
    open: ClassVar[threading.Event] = threading.Event()
    stalled: ClassVar[threading.Event] = threading.Event()

    def _connect(self) -> socket.socket:
        if self.refusing.is_set():
            raise ConnectionRefusedError("refused by the test")
        if not self.open.is_set():
            self.stalled.set()
            self.open.wait(DEADLINE_S)
        sock: socket.socket = super()._connect()
        return sock


class HeldLookup:
    """Holds one thread's API key lookup after Postgres answered, before it is cached."""

    def __init__(self, engine: Engine, thread_name: str) -> None:
        self.thread_name = thread_name
        self.read = threading.Event()
        self.release = threading.Event()
        sa.event.listen(engine, "after_cursor_execute", self._hold)

    def _hold(self, *args: Any) -> None:
        statement = args[2]
        if threading.current_thread().name == self.thread_name and "api_keys" in statement:
            self.read.set()
            self.release.wait(DEADLINE_S)


@pytest.fixture
def own_engine(settings: Settings) -> Iterator[Engine]:
    """The worker's own engine, so the hold sees only the worker's statements."""
    engine = make_engine(settings)
    yield engine
    engine.dispose()


def test_a_revocation_published_while_the_subscription_reconnects_is_not_missed(
    engine: Engine,
    own_engine: Engine,
    private_redis: tuple[str, Callable[[], None], Callable[[], None]],
) -> None:
    url, _stop, _start = private_redis
    operator = redis.Redis.from_url(url)
    HeldConnection.refusing.clear()
    HeldConnection.open.set()
    HeldConnection.stalled.clear()
    worker_client = redis.Redis(
        connection_pool=redis.ConnectionPool.from_url(url, connection_class=HeldConnection)
    )
    tenant = fresh_tenant()
    create_tenant(engine, tenant)
    issued = issue_api_key(engine, tenant)
    auth = Authenticator(own_engine, redis_client=worker_client, ttl_s=60).start()
    held = HeldLookup(own_engine, "lookup")
    answers: list[Principal] = []
    lookup = threading.Thread(
        target=lambda: answers.append(auth.principal(issued.key)), name="lookup"
    )
    try:
        assert auth.wait_live(DEADLINE_S)
        # The subscription connection is killed, and its reconnects fail for a while
        # (each failure clears the cache); then one stalls.
        HeldConnection.refusing.set()
        [sub] = [c["id"] for c in operator.client_list() if c.get("name") == "freshline-apikeys"]
        assert operator.client_kill_filter(_id=sub) == 1
        assert wait_until(lambda: not auth.wait_live(0), DEADLINE_S)
        HeldConnection.open.clear()
        HeldConnection.refusing.clear()
        assert HeldConnection.stalled.wait(DEADLINE_S)
        # A request looks the key up meanwhile: Postgres says it is valid.
        lookup.start()
        assert held.read.wait(DEADLINE_S)
        # The key is revoked now; its message is published while nobody listens.
        assert operator.pubsub_numsub(APIKEY_CHANNEL) == [(APIKEY_CHANNEL.encode(), 0)]
        revoke_api_key(engine, operator, issued.key_id)
        # The subscription comes back; then the lookup finishes.
        HeldConnection.open.set()
        assert auth.wait_live(DEADLINE_S)
        held.release.set()
        lookup.join(DEADLINE_S)
        assert [a.key_id for a in answers] == [issued.key_id]  # right when it read
        # The revoked key is refused at once, not served from the cache for a minute.
        assert auth.cached(issued.key) == (False, None)
        with pytest.raises(Unauthorized) as refused:
            auth.principal(issued.key)
        assert refused.value.reason == "revoked_key"
    finally:
        HeldConnection.refusing.clear()
        HeldConnection.open.set()
        held.release.set()
        auth.close()
        worker_client.close()
        operator.close()


def test_a_revoke_whose_publish_fails_says_so(engine: Engine) -> None:
    tenant = fresh_tenant()
    create_tenant(engine, tenant)
    issued = issue_api_key(engine, tenant)
    nobody = redis.Redis(port=free_port(), socket_connect_timeout=2)
    with pytest.raises(FreshlineError) as failed:
        revoke_api_key(engine, nobody, issued.key_id)
    assert issued.key_id in str(failed.value) and "not published" in str(failed.value)
    # The row is revoked all the same: a worker that looks the key up refuses it.
    [info] = [k for k in list_api_keys(engine, tenant) if k.key_id == issued.key_id]
    assert info.state() == "revoked"


def test_apikey_revoke_fails_loudly_when_redis_does_not_answer(
    settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    tenant = fresh_tenant()
    create_tenant(engine, tenant)
    issued = issue_api_key(engine, tenant)
    revoked = cli(
        "apikey",
        "revoke",
        issued.key_id,
        FRESHLINE_POSTGRES_URL=settings.postgres_url,
        FRESHLINE_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        FRESHLINE_AUDIT_LOG=str(tmp_path / "audit.jsonl"),
    )
    line = error_line(revoked)
    assert issued.key_id in line and "not published" in line
    assert revoked.stdout == ""
