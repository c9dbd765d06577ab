"""Running one case (a scenario with a seed) on the private stack, and its environment.

:class:`FaultEnv` is the session's: the private stack (its Postgres moved to
transaction-id epoch :func:`xid_epoch` first), migrated, its topics made, one tenant
seeded per case (before the Debezium connector exists, so the seed is not streamed),
the connector registered, a Toxiproxy proxy in front of its Redis and of its
Postgres, and ``freshline serve`` for the readers (:mod:`tests.faults.readers`).

:func:`run_case` gives each case a consumer group of its own, positioned at the end
of every topic it reads (so it sees only this case's records), starts the scenario's
consumers and the readers, runs the workload and the scenario's faults, then quiesces,
reads once more and asks the oracle. Whatever happens, it leaves the stack whole for
the next case: toxics removed, every service running, every consumer stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import redis
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine, make_url

from fraud.seed import seed
from freshline.consumers.kafka import Producer, admin_client
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.cdc.connect import names
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.lock import Lock, LockedSet
from freshline.pipeline.core.maintenance import install_missing
from freshline.pipeline.core.repository import active
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import DLQ, qualified
from freshline.pipeline.dev import processes
from freshline.pipeline.dev.chaos import CaseResult, Profile
from tests.faults import injectors, oracle
from tests.faults.processes import Fleet, Member
from tests.faults.readers import Api, Readers
from tests.faults.scenarios import Scenario
from tests.faults.stack import PrivateStack, free_ports
from tests.faults.toxiproxy import Proxy, Toxiproxy
from tests.faults.workload import Produced, Workload
from tests.helpers import REGISTRY

log = logging.getLogger("freshline.faults")

HORIZON = "4 hours"
"""How long the seeded data stays clear of the feature windows' edges (see _clear_edges)."""
QUIESCE_S = 180.0
WORKLOAD_S = 600.0
LOG_LINES = 25
ABANDONED_CLOSE = "the Kafka consumer did not close within"
"""What freshline.consumers.kafka logs when it leaves a hung close behind."""
Case = tuple[str, int]
WATCHED = 16
"""How many of a case's users the readers read (the hottest, and a few others)."""
XID_EPOCH_ENV = "FRESHLINE_CHAOS_XID_EPOCH"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
"""Where ``scripts/stack`` runs Postgres from."""
DEPLOYABLE = 2
"""How many schema versions after the stack's the private repository locks, with this
code's definitions, for scenarios that deploy them (see _repository)."""


def xid_epoch(profile: Profile) -> int:
    """The transaction-id epoch the private Postgres runs in: ``FRESHLINE_CHAOS_XID_EPOCH``,
    else 1 for the long profile and 0 (as a new cluster is) for the short one, so both
    epochs are run. Debezium sends 32-bit ids; every later epoch widens them the same
    way, so 1 stands for all of them."""
    chosen = os.environ.get(XID_EPOCH_ENV)
    return int(chosen) if chosen else int(profile.name == "long")


def _repository(into: Path, version: int) -> Path:
    """A copy of the active repository whose lock holds ``version`` and the next
    :data:`DEPLOYABLE` ones, all with this code's definitions: what every ``freshline``
    process of the private stack runs on, so a scenario can deploy a new version (a
    redeploy of the same definitions) and readers can decode it."""
    repo = into / "repo"
    source = active()
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(
        source.path,
        repo,
        ignore=shutil.ignore_patterns(source.lock_path.name, "__pycache__", "*.egg-info"),
    )
    entry = {fs.name: LockedSet.of(fs) for fs in REGISTRY}
    versions = range(version, version + DEPLOYABLE + 1)
    Lock(dict.fromkeys(versions, entry)).save(repo / source.lock_path.name)
    return repo


def _set_epoch(stack: PrivateStack, epoch: int) -> None:
    """Move the stopped-and-restarted Postgres to ``epoch`` (``pg_resetwal -e``): the
    next transaction id stays, only its epoch changes, so every row stays visible."""
    stack.stop("postgres")
    command = [
        str(PG_BIN / "pg_resetwal"),
        "-e",
        str(epoch),
        "-D",
        str(stack.directory / "pg" / "data"),
    ]
    if os.geteuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise RuntimeError(f"pg_resetwal -e {epoch} failed: {done.stdout}{done.stderr}")
    stack.start("postgres")


@dataclass
class FaultEnv:
    stack: PrivateStack
    settings: Settings
    engine: Engine
    superuser: Engine
    """Postgres as its superuser: for ``ALTER SYSTEM`` (:mod:`tests.faults.injectors`)."""
    redis: redis.Redis
    admin: AdminClient
    toxiproxy: Toxiproxy
    proxies: dict[str, Proxy]
    tenants: dict[Case, str] = field(default_factory=dict)
    api: Api | None = None
    epoch: int = 0

    @property
    def lock(self) -> Lock:
        """The lock of the repository the stack's ``freshline`` processes run on."""
        if self.stack.repo is None:
            return Lock.load()
        return Lock.load(self.stack.repo / active().lock_path.name)

    @classmethod
    def create(cls, stack: PrivateStack, cases: Sequence[Case], profile: Profile) -> FaultEnv:
        stack.up()
        stack.repo = _repository(stack.directory, stack.settings.schema_version)
        epoch = xid_epoch(profile)
        if epoch:
            _set_epoch(stack, epoch)
        stack.freshline("db", "upgrade")
        stack.freshline("topics", "ensure")
        settings = stack.settings
        engine = make_engine(settings, pool_size=4)
        with engine.begin() as conn:  # what apply --alter-tables installs
            install_missing(conn, REGISTRY.maintenances())
        tenants: dict[Case, str] = {}
        for i, (name, case_seed) in enumerate(cases, 1):
            summary = seed(
                engine,
                users=profile.entities,
                transactions=profile.rows,
                seed=case_seed,
                tenant_prefix=f"c{i}s{case_seed}-",
            )
            tenants[(name, case_seed)] = summary.tenants[0]
        _clear_edges(engine)
        stack.freshline("cdc", "register", "--wait", "120")
        toxi = Toxiproxy(stack.toxiproxy_url)
        redis_port, pg_port = free_ports(2)
        proxies = {
            "redis": toxi.create(
                "redis", listen=redis_port, upstream=f"127.0.0.1:{stack.ports['redis']}"
            ),
            "postgres": toxi.create(
                "postgres", listen=pg_port, upstream=f"127.0.0.1:{stack.ports['pg']}"
            ),
            # The broker's second listener advertises this proxy's port (scripts/stack).
            "kafka": toxi.create(
                "kafka",
                listen=stack.ports["kafka_proxied_advertised"],
                upstream=f"127.0.0.1:{stack.ports['kafka_proxied']}",
            ),
        }
        with engine.connect() as conn:
            found = conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
        if found >> 32 != epoch:
            raise RuntimeError(f"Postgres is in xid epoch {found >> 32}, not {epoch}")
        return cls(
            stack,
            settings,
            engine,
            make_engine(stack.superuser_settings, pool_size=1),
            redis_client(settings),
            admin_client(settings),
            toxi,
            proxies,
            tenants,
            Api(stack, stack.directory / "serve"),
            epoch,
        )

    def close(self) -> None:
        if self.api is not None:
            self.api.close()
        self.redis.close()
        self.engine.dispose()
        self.superuser.dispose()

    def heal(self) -> list[str]:
        """Undo whatever a case left broken; what had to be restarted or reset."""
        restarted = []
        self.toxiproxy.reset()
        for service in ("postgres", "redis", "kafka", "connect"):
            pid = self.stack.pid(service)
            if pid is None or not Path(f"/proc/{pid}").exists():
                self.stack.start(service)
                restarted.append(service)
        if injectors.heal_postgres(self.superuser):
            restarted.append("postgres synchronous replication settings")
        if injectors.heal_topic(self.admin, qualified(self.settings, DLQ), "max.message.bytes"):
            restarted.append("the dead-letter topic's max.message.bytes")
        removed = injectors.reset_deploy(self.redis, self.settings)
        if removed is not None:
            keys = "".join(f"; {n} keys of version {v} removed" for v, n in removed.items())
            restarted.append(f"the deploy pointer (back to the settings' version{keys})")
        return restarted


def _clear_edges(engine: Engine) -> None:
    """Keep the seeded rows off the edges of the feature windows for ``HORIZON``.

    The features count rows newer than now - 90 days, now - 30 days and now - 24 hours;
    a seeded row just inside an edge would drop out while a case runs, and a served
    value computed before that moment would then differ from the recompute after it
    without anything being wrong. Those rows move back past the edge (out of the window
    they were about to leave anyway), before the connector exists, so no event is made.
    """
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"""
            UPDATE transactions
               SET created_at = created_at - interval '{HORIZON}',
                   updated_at = updated_at - interval '{HORIZON}'
             WHERE (created_at > now() - interval '90 days'
                    AND created_at <= now() - interval '90 days' + interval '{HORIZON}')
                OR (created_at > now() - interval '30 days'
                    AND created_at <= now() - interval '30 days' + interval '{HORIZON}')""")
        )
        conn.execute(
            sa.text(f"""
            UPDATE devices SET first_seen = first_seen - interval '{HORIZON}'
             WHERE first_seen > now() - interval '24 hours'
               AND first_seen <= now() - interval '24 hours' + interval '{HORIZON}'""")
        )


@dataclass
class Run:
    """What a scenario gets: the case's stack, consumers, workload, and its random stream."""

    env: FaultEnv
    scenario: Scenario
    seed: int
    fleet: Fleet
    workload: Workload
    changes: int
    history: list[str] = field(default_factory=list)
    partitions: int = 0
    """How many partitions the group reads."""

    def __post_init__(self) -> None:
        # Faults draw from their own stream, so a scenario's choices never shift the
        # workload's (and vice versa).
        self.rng = random.Random(f"faults:{self.scenario.name}:{self.seed}")

    @property
    def stack(self) -> PrivateStack:
        return self.env.stack

    @property
    def proxies(self) -> dict[str, Proxy]:
        return self.env.proxies

    def note(self, what: str) -> None:
        line = f"@{self.workload.progress} {what}"
        self.history.append(line)
        log.info("%s/%s: %s", self.scenario.name, self.seed, line)

    def at(self, lo: float, hi: float) -> int:
        """A change count between ``lo`` and ``hi`` of the workload (fractions)."""
        return self.rng.randint(int(lo * self.changes), int(hi * self.changes))

    def span(self, lo: int, hi: int) -> int:
        """A number of changes for a fault to last."""
        return self.rng.randint(lo, hi)

    def pick_member(self) -> Member:
        live = sorted(self.fleet.alive(), key=lambda m: m.name)
        if not live:
            raise RuntimeError("no live consumer to pick")
        return self.rng.choice(live)

    def consumer_settings(self) -> Settings:
        """The settings consumers start with: through the scenario's proxies, if any."""
        s = self.env.stack.consumer_settings
        update: dict[str, str] = {}
        if "redis" in self.scenario.via:
            update["redis_url"] = f"redis://127.0.0.1:{self.proxies['redis'].port}/0"
        if "postgres" in self.scenario.via:
            url = make_url(s.postgres_url).set(port=self.proxies["postgres"].port)
            update["postgres_url"] = url.render_as_string(hide_password=False)
        if "kafka" in self.scenario.via:
            update["kafka_bootstrap"] = f"127.0.0.1:{self.proxies['kafka'].port}"
        return s.model_copy(update=update)

    def group_members(self) -> int:
        desc = self.env.admin.describe_consumer_groups([self.fleet.group])[self.fleet.group]
        return len(desc.result(timeout=15).members)

    def spread(self, members: int) -> bool:
        """The group has ``members`` members, each owning some of all its partitions."""
        return _spread(self.env, self.fleet.group, members, self.partitions)

    def produce(
        self, topic: str, value: bytes, key: bytes | None = None, **overrides: object
    ) -> Produced:
        """Produce one record of the scenario's own onto a domain topic (``overrides``:
        producer settings) and count it as produced, so the oracle accounts for it."""
        settings = self.env.settings
        with Producer(settings, **overrides) as producer:
            delivery = producer.produce(qualified(settings, topic), value, key)
        self.workload.adopt(delivery)
        if delivery.partition is None or delivery.offset is None:
            raise RuntimeError(f"the broker did not acknowledge the record on {topic}")
        return Produced(delivery.topic, delivery.partition, delivery.offset)

    def catch_mid_batch(
        self, member: Member, *, leave_stopped: bool = False, deadline_s: float = 30.0
    ) -> bool:
        """Freeze ``member`` (SIGSTOP) at a moment it holds an uncounted batch.

        Samples: stop it, read its counters from the shared files, and if it is between
        batches let it run until the workload commits one more change, then try again.
        Returns whether it was caught mid-batch; it is left stopped either way when
        ``leave_stopped`` (or when caught), else running.
        """
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            member.sigstop()
            _wait(member.stopped, f"{member.name} to stop", 10)
            if member.mid_batch():
                return True
            member.sigcont()
            with contextlib.suppress(TimeoutError):
                self.workload.wait_for(self.workload.progress + 1, deadline_s=5)
        if leave_stopped:
            member.sigstop()
            _wait(member.stopped, f"{member.name} to stop", 10)
        return False


_wait = processes.wait_for


def _spread(env: FaultEnv, group: str, members: int, partitions: int) -> bool:
    """The group has ``members`` members, each owning some of all ``partitions``."""
    desc = env.admin.describe_consumer_groups([group])[group].result(timeout=15)
    owned = [len(m.assignment.topic_partitions) for m in desc.members]
    return len(owned) == members and sum(owned) == partitions and all(owned)


NOISE = re.compile(
    r"Connect to ipv4|_TRANSPORT|brokers are down|Disconnected|"
    r"Coordinator load in progress: retrying|_ALL_BROKERS_DOWN"
)


def _interesting(text: str) -> str:
    """The log lines that explain a failure: freshline's own errors first, then warnings
    (librdkafka's reconnection chatter left out)."""
    lines = text.splitlines()
    fatal = [line for line in lines if line.startswith("error:") or "Traceback" in line]
    keep = [
        line
        for line in lines
        if not NOISE.search(line)
        and re.search(r"error|critical|exception|warning", line, re.IGNORECASE)
    ]
    return "\n".join(dict.fromkeys(fatal + keep[-LOG_LINES:]))


def run_case(
    env: FaultEnv, scenario: Scenario, case_seed: int, profile: Profile, directory: Path
) -> CaseResult:
    """Run ``scenario`` with ``case_seed``; the oracle's verdict as a :class:`CaseResult`."""
    started = time.monotonic()
    settings = env.settings
    tenant = env.tenants[(scenario.name, case_seed)]
    directory.mkdir(parents=True, exist_ok=True)
    # The consumers' Kafka login may join only groups named freshline* (scripts/stack).
    group = f"freshline-faults-{scenario.name}-{case_seed}-{uuid.uuid4().hex[:6]}"
    partitions = oracle.subscribed_partitions(env.admin, settings)
    start = oracle.end_offsets(settings, partitions)
    oracle.position_group(settings, group, start)
    dlq = qualified(settings, DLQ)
    dlq_meta = env.admin.list_topics(dlq, timeout=15).topics[dlq]
    dlq_start = oracle.end_offsets(settings, [(dlq, p) for p in dlq_meta.partitions])
    fleet = Fleet(settings, env.stack.freshline_env(), directory, group=group)
    verdict = oracle.Verdict()
    history: list[str] = []
    workload: Workload | None = None
    readers: Readers | None = None
    quiesced = False
    try:
        producer = Producer(settings)
        workload = Workload(env.engine, producer, tenant, case_seed, watch=WATCHED)
        run = Run(
            env, scenario, case_seed, fleet, workload, profile.changes, history, len(partitions)
        )
        for _ in range(scenario.consumers):
            fleet.spawn(run.consumer_settings())
        oracle.wait(
            lambda: _spread(env, group, scenario.consumers, len(partitions)),
            "the consumers to join and share every partition",
            120,
        )
        run.note(f"{scenario.consumers} consumers own {len(partitions)} partitions")
        if env.epoch:
            run.note(f"Postgres in transaction-id epoch {env.epoch}")
        workload.observe()
        if env.api is not None:
            key = create_api_key(env.engine, tenant, label="faults-readers")
            readers = Readers(env.api, key, settings, workload.watched, env.lock).start()
        thread = workload.start(profile.changes, profile.rate)
        try:
            scenario.inject(run)
        except Exception as exc:
            verdict.failures.append(f"scenario: {type(exc).__name__}: {exc}")
            log.exception("scenario %s failed", scenario.name)
        thread.join(timeout=WORKLOAD_S)
        if thread.is_alive() or workload.error is not None:
            workload.stop()
            verdict.failures.append(f"workload did not finish: {workload.error!r}")
        producer.close(timeout=60)
        run.note(
            f"workload done: {workload.report.changes} changes, {workload.report.events} "
            f"events, {time.monotonic() - started:.0f} s into the case"
        )
        try:
            with env.engine.connect() as conn:
                end_lsn = str(conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar())
            oracle.quiesce(
                settings,
                fleet,
                start,
                dict(workload.cdc_expected),
                QUIESCE_S,
                env.engine,
                names(settings).slot,
                end_lsn,
            )
            run.note(f"quiesced, {time.monotonic() - started:.0f} s into the case")
            quiesced = True
        except oracle.NotQuiesced as exc:
            verdict.failures.append(f"quiesce: {exc}")
        if readers is not None:
            readers.stop()
            if quiesced:
                workload.observe()  # after the scenario's own writes, if any
                readers.settle()
            run.note(
                f"readers: {len(readers.answers)} answers, "
                f"{time.monotonic() - started:.0f} s into the case"
            )
        for check, args in (
            (
                oracle.check_values,
                (
                    env.engine,
                    env.redis,
                    settings,
                    workload.touched,
                    tenant,
                    verdict,
                    workload.last_change,
                ),
            ),
            (
                oracle.check_accounting,
                (
                    settings,
                    fleet,
                    start,
                    workload.produced,
                    dict(workload.cdc_expected),
                    dlq_start,
                    verdict,
                    scenario.expect_dead_letter,
                ),
            ),
            (oracle.check_readers, (readers, workload, verdict)),
            (oracle.check_ttls, (env.redis, verdict)),
            (oracle.check_processes, (fleet, verdict)),
        ):
            try:
                check(*args)
            except Exception as exc:
                verdict.failures.append(f"{check.__name__}: {type(exc).__name__}: {exc}")
                log.exception("%s failed", check.__name__)
    finally:
        if readers is not None:
            readers.close()
        codes = fleet.shutdown()
        for name, code in codes.items():
            if code not in (0, None):
                verdict.failures.append(f"(d) {name} exited {code} on SIGTERM")
        for m in fleet.members:
            # A bounded close that gave up (librdkafka 4674) still exits 0: every applied
            # offset was committed. Said in the history, so a run shows how often.
            if m.name in codes and ABANDONED_CLOSE in m.log_tail(60):
                history.append(
                    f"{m.name}: Kafka consumer close abandoned after its bound "
                    f"(librdkafka 4674); exited {codes[m.name]}"
                )
        restarted = env.heal()
        if restarted:
            history.append(f"after the case: restarted {', '.join(restarted)}")
    logs = ""
    if not verdict.passed:
        parts = [
            f"--- {m.name} ({m.log.name}) ---\n{_interesting(m.log_tail(400))}"
            for m in fleet.members
        ]
        logs = "\n".join(p for p in parts if p.strip())
    return CaseResult(
        scenario=scenario.name,
        seed=case_seed,
        passed=verdict.passed,
        duration_s=round(time.monotonic() - started, 1),
        failures=verdict.failures,
        checked=verdict.checked,
        present=verdict.present,
        mismatches=len(verdict.mismatches),
        mismatch_examples=verdict.mismatches[:5],
        accounting=verdict.accounting,
        ttl_violations=len(verdict.ttl_violations),
        dead_processes=verdict.dead,
        readers=verdict.readers,
        faults=history,
        workload={}
        if workload is None
        else {
            "tenant": tenant,
            "changes": workload.report.changes,
            "by_kind": dict(workload.report.by_kind),
            "events": workload.report.events,
            "touched": len(workload.touched),
            "db_retries": workload.report.db_retries,
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
        logs=logs,
    )
