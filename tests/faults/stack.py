"""A private instance of the local stack, for faults that must not touch the shared one.

``scripts/stack`` runs it (``FRESHLINE_STACK_DIR`` and ``FRESHLINE_STACK_*_PORT`` point
it at its own directory and free ports), so the services are the very ones users run;
``start``/``stop``/``kill`` act on one service of *this* instance only.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from pipeline.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
STACK_SCRIPT = ROOT / "scripts" / "stack"
FRESHLINE = str(Path(sys.executable).with_name("freshline"))
SERVICES = ("postgres", "redis", "kafka", "connect", "toxiproxy")
PORT_NAMES = ("pg", "redis", "kafka", "controller", "connect", "toxiproxy")


class StackError(Exception):
    """``scripts/stack`` or a ``freshline`` command failed; the message has its output."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports the kernel calls free now (bound together, then released)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def clean_env() -> dict[str, str]:
    """This process's environment without any freshline or stack setting (tests/conftest.py
    loads the shared stack's into it): children get only what the private stack says."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("FRESHLINE_", "PG", "PROMETHEUS_MULTIPROC_DIR"))}


@dataclass
class PrivateStack:
    """One private instance: its directory, its ports, and the settings that reach it."""

    directory: Path
    ports: dict[str, int]
    partitions: int = 3

    @classmethod
    def allocate(cls, directory: Path, partitions: int = 3) -> PrivateStack:
        return cls(directory, dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True)),
                   partitions)

    @property
    def stack_env(self) -> dict[str, str]:
        env = clean_env()
        env["FRESHLINE_STACK_DIR"] = str(self.directory)
        for name, port in self.ports.items():
            env[f"FRESHLINE_STACK_{name.upper()}_PORT"] = str(port)
        return env

    @functools.cached_property
    def settings(self) -> Settings:
        # Every field given, so no FRESHLINE_* variable of this process (tests/conftest.py
        # loads the shared stack's) can reach the private instance's settings.
        defaults = {name: f.default for name, f in Settings.model_fields.items()}
        return Settings(**{**defaults, **dict(
            postgres_url="postgresql+psycopg://freshline:freshline@127.0.0.1:"
            f"{self.ports['pg']}/freshline",
            redis_url=f"redis://127.0.0.1:{self.ports['redis']}/0",
            kafka_bootstrap=f"127.0.0.1:{self.ports['kafka']}",
            connect_url=f"http://127.0.0.1:{self.ports['connect']}",
            topic_prefix="",
            topic_partitions=self.partitions,
            **self._redis_admin(),
        )})

    def _redis_admin(self) -> dict[str, str]:
        """The Redis admin's login from the instance's env file, once ``up`` wrote it."""
        path = self.directory / "env"
        if not path.is_file():
            return {}
        values = dict(line.split("=", 1) for line in path.read_text().splitlines()
                      if "=" in line and not line.startswith("#"))
        user = values.get("FRESHLINE_STACK_REDIS_ADMIN_USER", "").strip("'")
        password = values.get("FRESHLINE_STACK_REDIS_ADMIN_PASSWORD", "").strip("'")
        return {"redis_username": user, "redis_password": password} if user else {}

    @property
    def toxiproxy_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['toxiproxy']}"

    def freshline_env(self, settings: Settings | None = None) -> dict[str, str]:
        """The environment a ``freshline`` child process gets: ``settings`` as FRESHLINE_*."""
        s = settings or self.settings
        env = clean_env()
        for name, value in s.model_dump().items():
            plain = value.get_secret_value() if isinstance(value, SecretStr) else value
            env[f"FRESHLINE_{name.upper()}"] = str(plain)
        return env

    def script(self, *args: str, timeout: float = 300) -> str:
        """Run ``scripts/stack ARGS`` on this instance; its output, or StackError."""
        done = subprocess.run([str(STACK_SCRIPT), *args], env=self.stack_env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise StackError(f"scripts/stack {' '.join(args)} exited {done.returncode}:\n"
                             f"{done.stdout}{done.stderr}")
        return done.stdout + done.stderr

    def freshline(self, *args: str, timeout: float = 300) -> str:
        """Run ``freshline ARGS`` against this instance."""
        done = subprocess.run([FRESHLINE, *args], env=self.freshline_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise StackError(f"freshline {' '.join(args)} exited {done.returncode}:\n"
                             f"{done.stdout}{done.stderr}")
        return done.stdout + done.stderr

    def up(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.script("up")
        self.script("start", "toxiproxy")

    def down(self, *, keep_data: bool = False) -> None:
        """Stop every service; then delete the data, unless told to keep it (logs stay)."""
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
