"""Process control for the fault scenarios: ``freshline consume`` members of one group.

Each member is a real ``freshline consume`` process with its own log file and its own
metrics port. All members of a scenario share one ``PROMETHEUS_MULTIPROC_DIR``: the
counters live in memory-mapped files that outlive the process, so the group's totals
include the work of members that were SIGKILLed, and a SIGSTOPped member's counters
can be read while it cannot answer a scrape.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from freshline.pipeline.core.settings import Settings
from tests.faults.stack import FRESHLINE, ROOT, free_ports, settings_env

CLOCK_SHIM = Path(__file__).resolve().parent / "clock"
"""A directory whose ``sitecustomize`` steps a member's wall clock (``spawn(clock=...)``)."""

COUNTERS = {
    "freshline_events_consumed": "consumed",
    "freshline_events_applied": "applied",
    "freshline_events_dead_lettered": "dead_lettered",
    "freshline_events_skipped": "skipped",
}


@dataclass
class Counts:
    """The accounting counters, per topic and in total."""

    by_topic: dict[str, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: dict.fromkeys(COUNTERS.values(), 0.0))
    )

    def add(self, metric: str, topic: str, value: float) -> None:
        name = COUNTERS.get(metric.removesuffix("_total"))
        if name is not None:
            self.by_topic[topic][name] += value

    def total(self, name: str, topic: str | None = None) -> int:
        topics = [topic] if topic is not None else list(self.by_topic)
        return int(sum(self.by_topic[t][name] for t in topics if t in self.by_topic))

    @property
    def settled(self) -> bool:
        """``applied + dead_lettered + skipped == consumed``: no batch in hand."""
        return all(
            c["applied"] + c["dead_lettered"] + c["skipped"] == c["consumed"]
            for c in self.by_topic.values()
        )

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {t: {k: int(v) for k, v in c.items()} for t, c in sorted(self.by_topic.items())}

    @classmethod
    def from_samples(cls, samples: Iterable[Sample]) -> Counts:
        counts = cls()
        for s in samples:
            if s.name.endswith("_total"):
                counts.add(s.name, s.labels.get("topic", ""), s.value)
        return counts


def _file_counts(files: list[str]) -> Counts:
    if not files:
        return Counts()
    metrics = MultiProcessCollector.merge(files, accumulate=True)
    return Counts.from_samples(s for m in metrics if m.type == "counter" for s in m.samples)


def _file_counter(files: list[str], name: str, labels: dict[str, str]) -> int:
    """The sum of counter ``name`` (without ``_total``) over samples matching ``labels``."""
    if not files:
        return 0
    total = 0.0
    for metric in MultiProcessCollector.merge(files, accumulate=True):
        for sample in metric.samples:
            if sample.name == f"{name}_total" and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                total += sample.value
    return int(total)


def _file_gauge(files: list[str], name: str, labels: dict[str, str]) -> float:
    """The largest value of gauge ``name`` over samples matching ``labels`` (0 if none)."""
    found = 0.0
    for metric in MultiProcessCollector.merge(files, accumulate=True) if files else ():
        for sample in metric.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                found = max(found, sample.value)
    return found


@dataclass
class Member:
    """One ``freshline consume`` process."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    metrics_port: int
    multiproc_dir: Path
    expected_dead: bool = False
    """Set when the scenario killed it on purpose: check (d) then does not expect it alive."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[0] != "Z"

    def stopped(self) -> bool:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[0] == "T"

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        self.expected_dead = True
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def sigstop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def sigcont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def terminate(self, timeout: float = 60) -> int | None:
        """SIGTERM (finish the batch, commit, exit); SIGKILL at the deadline.

        One SIGTERM only: a second one means "exit now" to ``freshline consume``.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 60) -> int | None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        return self.proc.returncode

    def scrape(self, timeout: float = 2.0) -> Counts | None:
        """The counters from its ``/metrics`` endpoint; None if it does not answer."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=timeout
            ) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        return Counts.from_samples(
            s
            for fam in text_string_to_metric_families(text)
            if fam.type == "counter"
            for s in fam.samples
        )

    def file_counts(self) -> Counts:
        """Its counters read from the shared memory-mapped files (works while stopped)."""
        return _file_counts([str(p) for p in self.multiproc_dir.glob(f"counter_{self.pid}.db")])

    def counter(self, name: str, **labels: str) -> int:
        """One of its counters (e.g. ``freshline_transient_retries``), from the shared files."""
        return _file_counter(
            [str(p) for p in self.multiproc_dir.glob(f"counter_{self.pid}.db")], name, labels
        )

    def mid_batch(self) -> bool:
        """It holds records it has consumed but not yet applied, dead-lettered or skipped."""
        return not self.file_counts().settled

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


class Fleet:
    """The members of one consumer group, started and watched by a scenario."""

    def __init__(
        self,
        settings: Settings,
        env: dict[str, str],
        directory: Path,
        *,
        group: str,
        batch_max_events: int = 200,
    ) -> None:
        self.settings = settings
        self.env = env
        self.directory = directory
        self.group = group
        self.batch_max_events = batch_max_events
        self.multiproc_dir = directory / "prometheus"
        self.multiproc_dir.mkdir(parents=True, exist_ok=True)
        self.members: list[Member] = []

    def spawn(self, settings: Settings | None = None, *, clock: Path | None = None) -> Member:
        """Start one more member (``settings`` may route it through proxies). With
        ``clock``, its wall clock steps by the offset written in that file
        (:data:`CLOCK_SHIM`)."""
        s = (settings or self.settings).model_copy(
            update={"consumer_group": self.group, "batch_max_events": self.batch_max_events}
        )
        name = f"consumer-{len(self.members) + 1}"
        (port,) = free_ports(1)
        env = {
            **self.env,
            "PROMETHEUS_MULTIPROC_DIR": str(self.multiproc_dir),
            "FRESHLINE_CONSUMER_METRICS_PORT": str(port),
        }
        env.update(settings_env(s))
        env["FRESHLINE_CONSUMER_METRICS_PORT"] = str(port)
        code = os.environ.get("FRESHLINE_CHAOS_CODE")
        paths = []
        if clock is not None:
            paths.append(str(CLOCK_SHIM))
            env["FRESHLINE_FAULTS_CLOCK"] = str(clock)
        if code:  # run the consumers from another checkout (a branch under test)
            paths.append(code)
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        log = self.directory / f"{name}.log"
        with log.open("ab") as sink:  # a file, not a pipe: a full pipe would block it
            proc = subprocess.Popen(
                [FRESHLINE, "consume"],
                env=env,
                cwd=code or ROOT,
                stdout=sink,
                stderr=sink,
                start_new_session=True,
            )
        member = Member(name, proc, log, port, self.multiproc_dir)
        self.members.append(member)
        return member

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.alive()]

    def unexpectedly_dead(self) -> list[Member]:
        return [m for m in self.members if not m.expected_dead and not m.alive()]

    def totals(self) -> Counts:
        """Every member's counters summed, the dead ones' included."""
        return _file_counts([str(p) for p in self.multiproc_dir.glob("counter_*.db")])

    def counter(self, name: str, **labels: str) -> int:
        """A counter summed over every member, the dead ones' included."""
        return _file_counter(
            [str(p) for p in self.multiproc_dir.glob("counter_*.db")], name, labels
        )

    def gauge(self, name: str, **labels: str) -> float:
        """A gauge's largest value over the live members (e.g. ``freshline_consumer_paused``,
        kept per process in the shared files)."""
        files = [
            str(p) for m in self.alive() for p in self.multiproc_dir.glob(f"gauge_*_{m.pid}.db")
        ]
        return _file_gauge(files, name, labels)

    def settled(self) -> bool:
        """No live member holds a batch it has not finished counting."""
        return all(not m.mid_batch() for m in self.alive())

    def shutdown(self) -> dict[str, int | None]:
        """SIGTERM every live member at once; their exit codes."""
        live = [m for m in self.members if m.proc.poll() is None]
        for m in live:
            m.proc.send_signal(signal.SIGCONT)
            m.proc.send_signal(signal.SIGTERM)
        return {m.name: m.wait() for m in live}
