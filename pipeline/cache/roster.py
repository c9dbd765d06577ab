"""Who runs what: each reader and consumer registers itself in Redis while it runs.

A ``serve`` worker, a ``consume`` process and a listening
:class:`~freshline.pipeline.cache.client.FeatureClient` each keep a :class:`Registration`: one key
(``freshline:{deploy}:procs:<role>:<id>``, a JSON :class:`Proc`) with a TTL of
:data:`TTL_S`, renewed every third of it by a thread of its own, and its id in the
role's index (a sorted set scored by expiry, with the same TTL, renewed too). The role
is the Redis login's (:data:`READER`, :data:`CONSUMER`), so an ACL key pattern lets
each login write its own role's registrations only. A process that dies leaves a key
that expires within :data:`TTL_S`.

:func:`roster` lists them: ``freshline deploy status``, the status page, and
``deploy flip``, which refuses a target a registered process does not know
(:mod:`freshline.pipeline.deploy.pointer`). See docs/deploys.md.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Final, Literal

import orjson
import redis

from freshline.pipeline.cache.versions import DEFAULT_POINTER, Pointer
from freshline.pipeline.core.cluster import is_cluster
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.lock import Lock

log = logging.getLogger(__name__)

TTL_S: Final = 15
"""How long a registration outlives its last renewal (renewed every third of it)."""

Role = Literal["reader", "consumer"]
READER: Final[Role] = "reader"
CONSUMER: Final[Role] = "consumer"
Kind = Literal["serve", "consume", "client"]
ROLE: Final[dict[Kind, Role]] = {"serve": READER, "client": READER, "consume": CONSUMER}


@dataclass(frozen=True, slots=True)
class Proc:
    """One running process as registered.

    ``knows``: the versions its lock has (it decodes their entries); ``computes``: those
    its code computes (a reader serves their misses, a consumer writes them);
    ``serving``: the version a reader served last (None for a consumer); ``group``: the
    consumer group a consumer consumes for; ``paused``: what holds a consumer's batch (a
    configuration failure's cause and remedy, such as a feature set's failing
    statement), None while it applies.
    """

    id: str
    kind: Kind
    host: str
    pid: int
    knows: tuple[int, ...]
    computes: tuple[int, ...]
    group: str | None = None
    serving: int | None = None
    scope: str = ""
    paused: str | None = None

    @property
    def role(self) -> Role:
        return ROLE[self.kind]

    @property
    def name(self) -> str:
        """How a message names it: kind, host and pid (and group)."""
        group = f" of group {self.group}" if self.group else ""
        return f"{self.kind} {self.host}:{self.pid}{group}"

    @classmethod
    def of(
        cls,
        kind: Kind,
        lock: Lock,
        registry: Registry,
        *,
        group: str | None = None,
        pointer: Pointer = DEFAULT_POINTER,
    ) -> Proc:
        """This process, running ``registry``'s code with ``lock``."""
        host = socket.gethostname()
        return cls(
            id=f"{kind}-{uuid.uuid4().hex[:12]}",
            kind=kind,
            host=host,
            pid=os.getpid(),
            knows=tuple(sorted(lock.versions)),
            computes=tuple(v for v in sorted(lock.versions) if lock.compatible(v, registry)),
            group=group,
            scope=pointer.scope,
        )

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Proc:
        doc = orjson.loads(raw)
        doc["knows"] = tuple(doc["knows"])
        doc["computes"] = tuple(doc["computes"])
        return cls(**doc)


class Registration:
    """Keep ``proc`` registered while this process runs: :meth:`start`, :meth:`close`.

    ``serving`` (for a reader) says which version it serves now, ``paused`` (for a
    consumer) what holds its batch; both are written with each renewal. A renewal that
    fails (Redis away, a login without the ACL) is logged once and retried at the next;
    the process runs on either way.
    """

    def __init__(
        self,
        client: redis.Redis,
        proc: Proc,
        *,
        pointer: Pointer = DEFAULT_POINTER,
        serving: Callable[[], int | None] | None = None,
        paused: Callable[[], str | None] | None = None,
        ttl_s: float = TTL_S,
    ) -> None:
        self.redis = client
        self.proc = proc
        self.pointer = pointer
        self.serving = serving
        self.paused = paused
        self.ttl_ms = int(ttl_s * 1000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    @property
    def key(self) -> str:
        return self.pointer.proc_key(self.proc.role, self.proc.id)

    def renew(self) -> None:
        """Write the registration and its index entry, each with the TTL."""
        proc = self.proc
        if self.serving is not None:
            try:
                serving = self.serving()
            except Exception:  # a reader that cannot tell says nothing
                serving = None
            if serving != proc.serving:
                proc = self.proc = Proc(**{**asdict(proc), "serving": serving})
        if self.paused is not None and (paused := self.paused()) != proc.paused:
            proc = self.proc = Proc(**{**asdict(proc), "paused": paused})
        index = self.pointer.procs_index(proc.role)
        expires = int(time.time() * 1000) + self.ttl_ms
        # MULTI, so the index never lacks its TTL (a cluster's pipelines have none).
        pipe = self.redis.pipeline(transaction=not is_cluster(self.redis))
        pipe.set(self.key, proc.to_json(), px=self.ttl_ms)
        pipe.zadd(index, {proc.id: expires})
        pipe.zremrangebyscore(index, "-inf", int(time.time() * 1000))
        pipe.pexpire(index, self.ttl_ms)
        pipe.execute()

    def start(self) -> Registration:
        """Register now (a failure is logged), then renew in a thread until closed."""
        self._renew_logged()
        self._thread = threading.Thread(
            target=self._run, name=f"freshline-roster-{self.proc.id}", daemon=True
        )
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            self._renew_logged()

    def _renew_logged(self) -> None:
        try:
            self.renew()
        except (redis.RedisError, OSError) as exc:
            if not self._failing:
                log.warning("could not register %s in Redis (%s); retrying", self.proc.name, exc)
            self._failing = True
        else:
            if self._failing:
                log.info("registered %s in Redis again", self.proc.name)
            self._failing = False

    def close(self) -> None:
        """Stop renewing and remove the registration (it would expire anyway)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(self.key)
            pipe.zrem(self.pointer.procs_index(self.proc.role), self.proc.id)
            pipe.execute()
        except (redis.RedisError, OSError):
            pass  # it expires within the TTL


def roster(client: redis.Redis, *, pointer: Pointer = DEFAULT_POINTER) -> list[Proc]:
    """Every process registered on ``pointer`` now, readers first."""
    now = int(time.time() * 1000)
    procs: list[Proc] = []
    for role in (READER, CONSUMER):
        found = client.zrangebyscore(pointer.procs_index(role), now, "+inf")
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in found]
        if not ids:
            continue
        raws = client.mget([pointer.proc_key(role, i) for i in ids])
        procs += [Proc.from_json(raw) for raw in raws if raw is not None]
    return [p for p in procs if p.scope == pointer.scope]


def strangers(procs: Iterable[Proc], version: int) -> list[str]:
    """Why the processes in ``procs`` would not serve or write ``version`` after a flip
    to it, one line each (empty: none).

    A reader must compute it (otherwise its misses come from another version). A
    consumer group that writes it must do so in every member (otherwise the partitions
    of the members that do not are never written); a group none of whose members
    writes it is an older group that keeps writing the version left, for a rollback.
    """
    procs = list(procs)
    lines = [
        f"{p.name} does not compute schema version {version} "
        f"(it computes {_listed(p.computes)}; its lock has {_listed(p.knows)})"
        for p in procs
        if p.role == READER and version not in p.computes
    ]
    groups: dict[str | None, list[Proc]] = {}
    for p in procs:
        if p.role == CONSUMER:
            groups.setdefault(p.group, []).append(p)
    if groups and not any(version in p.computes for m in groups.values() for p in m):
        lines.append(f"no running consumer writes schema version {version}")
    for members in groups.values():
        if any(version in m.computes for m in members):
            lines += [
                f"{m.name} does not write schema version {version} while others of its group "
                f"do (it computes {_listed(m.computes)})"
                for m in members
                if version not in m.computes
            ]
    return lines


def _listed(versions: Iterable[int]) -> str:
    return ", ".join(map(str, versions)) or "none"
