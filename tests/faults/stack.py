"""A private instance of the local stack, for faults that must not touch the shared one.

``scripts/stack`` runs it (``FRESHLINE_STACK_DIR`` and ``FRESHLINE_STACK_*_PORT`` point
it at its own directory and free ports), so the services are the very ones users run;
``start``/``stop``/``kill`` act on one service of *this* instance only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis
from pydantic import SecretStr

from freshline.pipeline.core.settings import Settings
from freshline.pipeline.dev import processes

ROOT = Path(__file__).resolve().parents[2]
STACK_SCRIPT = ROOT / "scripts" / "stack"
FRESHLINE = str(Path(sys.executable).with_name("freshline"))
SERVICES = ("postgres", "redis", "kafka", "connect", "toxiproxy")
PORT_NAMES = (
    "pg",
    "redis",
    "kafka",
    "controller",
    "connect",
    "toxiproxy",
    "kafka_proxied",
    "kafka_proxied_advertised",
)
"""Each given to ``scripts/stack`` as ``FRESHLINE_STACK_<NAME>_PORT``. ``kafka_proxied``
is the broker's second client listener, which advertises ``kafka_proxied_advertised``:
the Toxiproxy port in front of it (scripts/stack, ``write_kafka_conf``)."""


class StackError(Exception):
    """``scripts/stack`` or a ``freshline`` command failed; the message has its output."""


free_ports = processes.free_ports


def settings_env(settings: Settings) -> dict[str, str]:
    """``settings`` as the FRESHLINE_* variables that rebuild it (secrets revealed)."""
    env = {}
    for name, value in settings:
        plain = value.get_secret_value() if isinstance(value, SecretStr) else value
        if isinstance(plain, list):  # comma-separated, as the settings read lists
            text = ",".join(map(str, plain))
        elif isinstance(plain, dict):
            text = orjson.dumps(plain).decode()
        else:
            text = str(plain)
        env[f"FRESHLINE_{name.upper()}"] = text
    return env


def build_settings(values: dict[str, Any]) -> Settings:
    """``Settings(**values)`` and nothing from this process's environment (into which
    tests/conftest.py loads the shared stack's settings)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("FRESHLINE_")}
    try:
        return Settings(**values)
    finally:
        os.environ.update(saved)


def clean_env() -> dict[str, str]:
    """This process's environment without any freshline or stack setting (tests/conftest.py
    loads the shared stack's into it): children get only what the private stack says,
    and the feature repository they all run on."""
    return {
        k: v
        for k, v in os.environ.items()
        if k == "FRESHLINE_REPO"
        or not k.startswith(("FRESHLINE_", "PG", "PROMETHEUS_MULTIPROC_DIR"))
    }


def run(name: str, command: list[str], env: dict[str, str], timeout: float) -> str:
    """Run ``command`` from the repository root; its output, or StackError naming it
    as ``name`` with its arguments."""
    done = subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise StackError(
            f"{name} {' '.join(command[1:])} exited {done.returncode}:\n{done.stdout}{done.stderr}"
        )
    return done.stdout + done.stderr


@dataclass
class PrivateStack:
    """One private instance: its directory, its ports, and the settings that reach it."""

    directory: Path
    ports: dict[str, int]
    partitions: int = 3
    extra_redis: dict[str, int] = field(default_factory=dict)
    """Redis servers a scenario started beside the stack's (name: port); ``down`` stops them."""
    repo: Path | None = None
    """The feature repository ``freshline`` children run on (``FRESHLINE_REPO``), if not
    this process's."""

    @classmethod
    def allocate(cls, directory: Path, partitions: int = 3) -> PrivateStack:
        return cls(
            directory, dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True)), partitions
        )

    @property
    def stack_env(self) -> dict[str, str]:
        env = clean_env()
        env["FRESHLINE_STACK_DIR"] = str(self.directory)
        for name, port in self.ports.items():
            env[f"FRESHLINE_STACK_{name.upper()}_PORT"] = str(port)
        return env

    def env_file(self) -> dict[str, str]:
        """The instance's ``env`` file (``scripts/stack up`` writes it), as a dict."""
        out: dict[str, str] = {}
        for line in (self.directory / "env").read_text().splitlines():
            key, sep, value = line.strip().partition("=")
            if not sep or key.startswith("#"):
                continue
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            out[key] = value
        return out

    def _values(self) -> dict[str, Any]:
        env = self.env_file()
        fields = Settings.model_fields
        values: dict[str, Any] = {
            k.removeprefix("FRESHLINE_").lower(): v
            for k, v in env.items()
            if k.startswith("FRESHLINE_") and k.removeprefix("FRESHLINE_").lower() in fields
        }
        values.update(topic_prefix="", topic_partitions=self.partitions)
        return values

    @functools.cached_property
    def settings(self) -> Settings:
        """The operator's view, from the instance's env file: Postgres as its owner, Redis
        and Kafka as their admin users (migrations, topics, seeding, the workload's writes,
        the oracle)."""
        env = self.env_file()
        values = self._values()
        values["postgres_url"] = env.get("FRESHLINE_POSTGRES_ADMIN_URL") or values["postgres_url"]
        if env.get("FRESHLINE_STACK_REDIS_ADMIN_USER"):
            values["redis_username"] = env["FRESHLINE_STACK_REDIS_ADMIN_USER"]
            values["redis_password"] = env["FRESHLINE_STACK_REDIS_ADMIN_PASSWORD"]
        if env.get("FRESHLINE_STACK_KAFKA_ADMIN_USER"):
            values["kafka_sasl_username"] = env["FRESHLINE_STACK_KAFKA_ADMIN_USER"]
            values["kafka_sasl_password"] = env["FRESHLINE_STACK_KAFKA_ADMIN_PASSWORD"]
        return build_settings(values)

    @functools.cached_property
    def superuser_settings(self) -> Settings:
        """:attr:`settings` with Postgres as its superuser, for the fault injections that
        change the server's settings (``ALTER SYSTEM``): the owner is no superuser."""
        found = self.env_file().get("FRESHLINE_STACK_POSTGRES_SUPERUSER_URL")
        if not found:
            return self.settings
        return self.settings.model_copy(update={"postgres_url": found})

    @functools.cached_property
    def consumer_settings(self) -> Settings:
        """What ``freshline consume`` runs with: the consumer's Postgres login and the
        Redis writer, as scripts/demo hands them to its consumer."""
        env = self.env_file()
        values = self._values()
        values["postgres_url"] = (
            env.get("FRESHLINE_STACK_POSTGRES_CONSUMER_URL") or values["postgres_url"]
        )
        if env.get("FRESHLINE_STACK_REDIS_WRITER_USER"):
            values["redis_username"] = env["FRESHLINE_STACK_REDIS_WRITER_USER"]
            values["redis_password"] = env["FRESHLINE_STACK_REDIS_WRITER_PASSWORD"]
        return build_settings(values)

    @property
    def toxiproxy_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['toxiproxy']}"

    def freshline_env(self, settings: Settings | None = None) -> dict[str, str]:
        """The environment of a ``freshline`` child: the instance's env file (as
        scripts/test loads it), then ``settings``, if given, as FRESHLINE_* variables."""
        env = {**clean_env(), **self.env_file()}
        if settings is not None:
            env.update(settings_env(settings))
        if self.repo is not None:
            env["FRESHLINE_REPO"] = str(self.repo)
        return env

    def script(self, *args: str, timeout: float = 300) -> str:
        """Run ``scripts/stack ARGS`` on this instance; its output, or StackError."""
        return run("scripts/stack", [str(STACK_SCRIPT), *args], self.stack_env, timeout)

    def freshline(self, *args: str, timeout: float = 300) -> str:
        """Run ``freshline ARGS`` against this instance, as its operator."""
        return run("freshline", [FRESHLINE, *args], self.freshline_env(self.settings), timeout)

    def up(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # A fresh instance starts ~10 JVMs (Kafka's format, ACLs, Connect): minutes on a
        # loaded 2-core box.
        self.script("up", timeout=900)
        self.script("start", "toxiproxy")

    def down(self, *, keep_data: bool = False) -> None:
        """Stop every service; then delete the data, unless told to keep it (logs stay)."""
        for name in list(self.extra_redis):
            self.kill_redis(name)
        self.script("down")
        if not keep_data:
            for data in ("pg/data", "kafka/data"):
                shutil.rmtree(self.directory / data, ignore_errors=True)

    def start(self, service: str) -> None:
        self.script("start", service)

    def stop(self, service: str) -> None:
        self.script("stop", service)

    def kill(self, service: str) -> None:
        self.script("kill", service)

    # -- Redis servers of a scenario's own (replicas) ------------------------------------

    def redis_admin(self, port: int) -> redis.Redis:
        """A client of the Redis server on ``port``, as the stack's Redis admin."""
        env = self.env_file()
        return redis.Redis(
            host="127.0.0.1",
            port=port,
            username=env.get("FRESHLINE_STACK_REDIS_ADMIN_USER") or None,
            password=env.get("FRESHLINE_STACK_REDIS_ADMIN_PASSWORD") or None,
            socket_timeout=10,
        )

    def follow(self, port: int, master: int | None) -> None:
        """Make the Redis server on ``port`` a replica of the one on ``master`` (logging in
        as the admin, whose ACL every server of the stack shares), or (None) a master."""
        client = self.redis_admin(port)
        try:
            if master is None:
                client.execute_command("REPLICAOF", "NO", "ONE")
                return
            env = self.env_file()
            user = env.get("FRESHLINE_STACK_REDIS_ADMIN_USER")
            if user:
                client.config_set("masteruser", user)
                client.config_set("masterauth", env["FRESHLINE_STACK_REDIS_ADMIN_PASSWORD"])
            client.execute_command("REPLICAOF", "127.0.0.1", str(master))
        finally:
            client.close()

    def start_redis(self, name: str, *, replica_of: int, port: int | None = None) -> int:
        """Start a Redis server ``name`` configured as the stack's (its ACL file too),
        a replica of the server on ``replica_of``; its port (``port``, or a free one)."""
        base = self.directory / "redis" / "redis.conf"
        directory = self.directory / name
        directory.mkdir(parents=True, exist_ok=True)
        port = port or self.extra_redis.get(name) or free_ports(1)[0]
        own = {
            "port": str(port),
            "pidfile": str(self.directory / "run" / f"{name}.pid"),
            "logfile": str(directory / "redis.log"),
            "dir": str(directory),
        }
        lines = [
            line
            for line in base.read_text().splitlines()
            if line.split(" ", 1)[0] not in own
            and line.split(" ", 1)[0] not in ("replicaof", "masteruser", "masterauth")
        ]
        lines += [f"{k} {v}" for k, v in own.items()]
        env = self.env_file()
        if env.get("FRESHLINE_STACK_REDIS_ADMIN_USER"):
            lines += [
                f"masteruser {env['FRESHLINE_STACK_REDIS_ADMIN_USER']}",
                f"masterauth {env['FRESHLINE_STACK_REDIS_ADMIN_PASSWORD']}",
            ]
        lines.append(f"replicaof 127.0.0.1 {replica_of}")
        conf = directory / "redis.conf"
        conf.write_text("\n".join(lines) + "\n")
        conf.chmod(0o600)  # it holds the admin's password
        run(name, ["redis-server", str(conf)], clean_env(), 60)
        self.extra_redis[name] = port
        return port

    def replication(self, port: int) -> dict[str, Any]:
        """``INFO replication`` of the Redis server on ``port``."""
        client = self.redis_admin(port)
        try:
            return dict(client.info("replication"))
        finally:
            client.close()

    def kill_redis(self, name: str) -> None:
        """SIGKILL Redis server ``name`` (one of :attr:`extra_redis`) and wait until it is gone."""
        pidfile = self.directory / "run" / f"{name}.pid"
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < end:
            time.sleep(0.05)  # polling interval, not synchronisation
        pidfile.unlink(missing_ok=True)

    def pid(self, service: str) -> int | None:
        path = self.directory / "run" / f"{service}.pid"
        try:
            return int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def log(self, service: str) -> Path:
        return {
            "postgres": self.directory / "pg" / "postgres.log",
            "redis": self.directory / "redis" / "redis.log",
            "kafka": self.directory / "kafka" / "kafka.log",
            "connect": self.directory / "connect" / "connect.log",
            "toxiproxy": self.directory / "toxiproxy" / "toxiproxy.log",
        }[service]
