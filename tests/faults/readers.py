"""Readers in the oracle: what the API and the Python client served, judged over time.

While a case runs, and again once the consumers have quiesced, :class:`Readers` reads
the workload's watched users (every feature set) through the two ways a service reads:
``freshline serve`` (:class:`Api`, one worker, the in-process tier on, ``cache-only``
so a miss is answered as one and never filled by the reader) and
:class:`freshline.pipeline.cache.client.FeatureClient` with its own
:class:`freshline.pipeline.cache.local.LocalTier`, following the deploy pointer. Each answer is
kept with the wall-clock moments its request was ``sent`` and ``received``.

**The truth over time.** The workload is the only writer of source rows. Each change
reads the watched users' rows in its own transaction, after its SQL
(:attr:`tests.faults.workload.Workload.history`): what the database holds from that
change's commit until the next one's. The commit happened somewhere in the change's
``[start, end]``, so a state is held at most from the *previous* observation's start
(a write outside the workload, a scenario's own, shows in the next observation: it
committed after the previous one began) to the *next* observation's end; consecutive
observations that leave a user's rows alike (:func:`tests.faults.reference.fingerprint`)
are one state of that user (:class:`Timeline`). With the rows fixed, a value still
changes with time at the windows' edges, at moments the rows give
(:func:`tests.faults.reference.pieces`): so within a state the reference is evaluated at
the start of each piece, which yields every value the user had, and when.

**The rule.** An answer "absent" (a miss, a tombstone, a 404, or an error while a fault
is on) is always allowed. A served value must equal the plain Python reference
(:mod:`tests.faults.reference`) at some moment ``t`` with
``sent - grace <= t <= received``. The search runs from ``received`` back to the case's
start, so an answer is either matched, *stale* (true only before ``sent - grace``: its
staleness is how long before ``received`` it was last true) or *never true* (a value no
state of the case had): both are mismatches. The grace is :data:`SETTLED_GRACE_S` for
answers read after quiescence (nothing commits then, but a window edge may pass while
a request is in flight) and :data:`FAULT_GRACE_S` for those read while faults are on:
the guarantee there is "correct or absent", and freshness only while the consumers
keep up (docs/guarantees.md), so a value from before an outage is allowed for its
length. The answers' staleness is reported (nines within 1 s and 10 s) either way.

The check is sound as long as each observation's rows are the committed state in its
span; it is also strict: no sampling, every transient state of the case is known.
"""

from __future__ import annotations

import bisect
import logging
import math
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis

from freshline.pipeline.cache.client import FeatureClient
from freshline.pipeline.cache.local import LocalTier
from freshline.pipeline.cache.versions import VersionResolver
from freshline.pipeline.core.lock import Lock
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import Settings
from tests.faults.reference import FEATURE_SETS, Ref, Rows, Values, fingerprint, one, pieces
from tests.faults.stack import FRESHLINE, PrivateStack, free_ports
from tests.faults.workload import Observation
from tests.helpers import REGISTRY

log = logging.getLogger("freshline.faults.readers")

SETTLED_GRACE_S = 2.0
"""The grace for answers read after quiescence: a request in flight while an edge passes."""
FAULT_GRACE_S = 120.0
"""The grace for answers read while a scenario runs: longer than any of its outages."""
READ_EVERY_S = 0.2
"""Pause between two rounds of reads (each round: the client, then the API)."""
SLACK_S = 0.05
"""Added to each state's span either side: Postgres's ``now()`` and Python's clock are
the same clock, read at slightly different moments."""
SETTLED_ROUNDS = 10
READERS = ("api", "client")
API_LOGIN = ("FRESHLINE_POSTGRES_URL", "FRESHLINE_REDIS_USERNAME", "FRESHLINE_REDIS_PASSWORD")
FIGURE_GRACES = (1.0, 10.0)


@dataclass(frozen=True, slots=True)
class Answer:
    reader: str
    """``api`` or ``client``."""
    feature_set: str
    ref: Ref
    values: Values | None
    """None: absent (a miss, a tombstone, or the reader's error)."""
    sent: float
    received: float
    grace: float
    computed_at_ms: int | None = None
    """The entry's, where the reader says (the client; the API gives its age)."""
    watermark: int | None = None


class Api:
    """``freshline serve`` on the private stack: one worker, the in-process tier on (the
    default ``FRESHLINE_LOCAL_CACHE_SIZE``), no ops port, with the settings the
    consumers have (the same schema version: not a ``freshline.toml`` the working
    directory may hold) and the stack's API logins (its env file's)."""

    def __init__(self, stack: PrivateStack, directory: Path) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = directory / "serve.log"
        directory.mkdir(parents=True, exist_ok=True)
        logins = stack.env_file()
        env = stack.freshline_env(stack.settings)
        for name in API_LOGIN:
            if logins.get(name):
                env[name] = logins[name]
        env["FRESHLINE_OPS_PORT"] = "0"
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with self.log.open("ab") as sink:
            self.proc = subprocess.Popen(
                [FRESHLINE, "serve", "--port", str(self.port), "--workers", "1"],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        end = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.close()
                raise RuntimeError(f"freshline serve did not come up: {self.tail()}")
            time.sleep(0.1)  # polling the port while it starts

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Readers:
    """Reads ``refs`` in rounds through the API and the client, in a thread of its own,
    until :meth:`settle`; each answer kept as an :class:`Answer`."""

    def __init__(
        self,
        api: Api,
        api_key: str,
        settings: Settings,
        refs: Sequence[Ref],
        lock: Lock | None = None,
    ) -> None:
        self.refs = list(refs)
        self.answers: list[Answer] = []
        self.errors: Counter[str] = Counter()
        self.versions: Counter[str] = Counter()
        """Present answers by reader and the schema version they were read from."""
        self._http = httpx.Client(
            base_url=api.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=5
        )
        self._redis: redis.Redis = redis_client(
            settings, socket_timeout=5, socket_connect_timeout=5
        )
        self._tier = LocalTier(self._redis, max_entries=10_000, registry=REGISTRY).start()
        self._client = FeatureClient(
            self._redis,
            settings.schema_version,
            local=self._tier,
            versions=VersionResolver(self._redis, settings, lock=lock),
            registry=REGISTRY,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="readers", daemon=True)
        self._grace = FAULT_GRACE_S

    def start(self) -> Readers:
        if self.refs:
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(READ_EVERY_S):  # pacing the reads
            self.round()

    def round(self) -> None:
        """One read of every watched user's feature sets: the client's, then the API's."""
        items = [(fs, t, e) for t, e in self.refs for fs in FEATURE_SETS]
        sent = time.time()
        try:
            got = self._client.get_many(items)
        except Exception as exc:
            self.errors[f"client: {type(exc).__name__}"] += 1
        else:
            received = time.time()
            self.versions.update(f"client v{f.schema_version}" for f in got if f is not None)
            for (fs, t, e), f in zip(items, got, strict=True):
                self.answers.append(
                    Answer("client", fs, (t, e), None, sent, received, self._grace)
                    if f is None
                    else Answer(
                        "client",
                        fs,
                        (t, e),
                        dict(f.values),
                        sent,
                        received,
                        self._grace,
                        int(received * 1000) - f.age_ms,
                        f.watermark,
                    )
                )
        sent = time.time()
        try:
            response = self._http.post(
                "/v1/features/batch",
                params={"mode": "cache-only"},
                json={"feature_sets": list(FEATURE_SETS), "entities": [e for _, e in self.refs]},
            )
        except httpx.HTTPError as exc:
            self.errors[f"api: {type(exc).__name__}"] += 1
            return
        received = time.time()
        if response.status_code != 200:
            self.errors[f"api: {response.status_code}"] += 1
            return
        tenant = self.refs[0][0]
        body = response.json()
        self.versions[f"api v{body['schema_version']}"] += sum(
            item["values"] is not None for item in body["items"]
        )
        for item in body["items"]:
            self.answers.append(
                Answer(
                    "api",
                    item["feature_set"],
                    (tenant, str(item["entity"])),
                    item["values"],
                    sent,
                    received,
                    self._grace,
                )
            )

    def settle(self, rounds: int = SETTLED_ROUNDS) -> None:
        """Stop the thread; then read ``rounds`` more times, judged with the settled grace
        (call once the consumers have quiesced)."""
        self.stop()
        self._grace = SETTLED_GRACE_S
        for _ in range(rounds):
            self.round()
            time.sleep(READ_EVERY_S)  # pacing the reads

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def close(self) -> None:
        self.stop()
        self._http.close()
        self._client.close()
        self._tier.close()
        self._redis.close()


# -- the truth over time ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class State:
    """One user's rows, held at most over ``[start, end]`` (wall clock, s)."""

    start: float
    end: float
    rows: Rows


class Timeline:
    """Per watched user, its states in order, from the workload's observations."""

    def __init__(self, observations: Sequence[Observation], refs: Sequence[Ref]) -> None:
        obs = sorted(observations, key=lambda o: o.start)
        self.states: dict[Ref, list[State]] = {}
        for ref in refs:
            states: list[State] = []
            prints = [fingerprint(o.rows, ref) for o in obs]
            i = 0
            while i < len(obs):
                j = i
                while j + 1 < len(obs) and prints[j + 1] == prints[i]:
                    j += 1
                start = obs[i - 1].start if i > 0 else -math.inf
                end = obs[j + 1].end if j + 1 < len(obs) else math.inf
                states.append(State(start - SLACK_S, end + SLACK_S, obs[i].rows))
                i = j + 1
            self.states[ref] = states
        self._values: dict[tuple[int, Ref, datetime], dict[str, Values]] = {}

    def value(self, state: State, ref: Ref, as_of: datetime) -> dict[str, Values]:
        key = (id(state.rows), ref, as_of)
        got = self._values.get(key)
        if got is None:
            got = self._values[key] = one(state.rows, ref, as_of)
        return got

    def last_true(self, answer: Answer, since: float) -> float | None:
        """The latest moment in ``[since, received]`` at which ``answer``'s value was the
        reference's; None if at none."""
        states = self.states.get(answer.ref, [])
        upto = bisect.bisect_right([s.start for s in states], answer.received)
        for state in reversed(states[:upto]):
            lo, hi = max(state.start, since), min(state.end, answer.received)
            if state.end < since:
                break
            if hi < lo:
                continue
            for p_lo, p_hi in reversed(pieces(state.rows, answer.ref, _at(lo), _at(hi))):
                if self.value(state, answer.ref, p_lo)[answer.feature_set] == answer.values:
                    return p_hi.timestamp()
        return None


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


@dataclass
class ReadersVerdict:
    """What the readers were served, and the answers no moment within their grace had."""

    answers: int = 0
    present: int = 0
    absent: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    by_reader: dict[str, dict[str, int]] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    within: dict[str, int] = field(default_factory=dict)
    """Per grace (``1s``, ``10s``): present answers true at some moment that recent."""
    max_staleness_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "answers": self.answers,
            "present": self.present,
            "absent": self.absent,
            "errors": self.errors,
            "by_reader": self.by_reader,
            "mismatches": len(self.mismatches),
            "mismatch_examples": self.mismatches[:5],
            "within": self.within,
            "max_staleness_s": round(self.max_staleness_s, 3),
        }


def judge(
    answers: Sequence[Answer],
    observations: Sequence[Observation],
    refs: Sequence[Ref],
    errors: Counter[str] | None = None,
    unsure: Sequence[tuple[float, float]] = (),
) -> ReadersVerdict:
    """Every answer against the truth over time (the module docstring's rule).

    A mismatch lists what the reference gave over the answer's window, and whether an
    attempt of the workload whose outcome is unknown (``unsure``: a connection error
    during it) ran before it: a state the history never saw may then have existed."""
    timeline = Timeline(observations, refs)
    since = min((o.start for o in observations), default=0.0)
    verdict = ReadersVerdict(errors=dict(errors or {}))
    within = Counter[str]()
    for answer in answers:
        verdict.answers += 1
        row = verdict.by_reader.setdefault(
            answer.reader, {"answers": 0, "present": 0, "mismatches": 0}
        )
        row["answers"] += 1
        if answer.values is None:
            verdict.absent += 1
            continue
        verdict.present += 1
        row["present"] += 1
        last = timeline.last_true(answer, since)
        stale = None if last is None else max(0.0, answer.received - last)
        if stale is not None:
            verdict.max_staleness_s = max(verdict.max_staleness_s, stale)
            for grace in FIGURE_GRACES:
                within[f"{grace:g}s"] += stale <= grace
        if stale is not None and stale <= answer.grace + (answer.received - answer.sent):
            continue
        row["mismatches"] += 1
        state = _state_at(timeline, answer.ref, answer.received)
        window = (answer.sent - answer.grace, answer.received)
        verdict.mismatches.append(
            {
                "computed_at": None
                if answer.computed_at_ms is None
                else _at(answer.computed_at_ms / 1000).isoformat(),
                "watermark": None if answer.watermark is None else hex(answer.watermark),
                "reference_in_window": _values_between(timeline, answer, *window),
                "unsure_attempts_before": sum(lo <= answer.received for lo, _ in unsure),
                "reader": answer.reader,
                "feature_set": answer.feature_set,
                "entity": answer.ref[1],
                "served": answer.values,
                "received": _at(answer.received).isoformat(),
                "grace_s": answer.grace,
                "last_true_s_before": None if stale is None else round(stale, 3),
                "reference_then": None
                if state is None
                else timeline.value(state, answer.ref, _at(answer.received))[answer.feature_set],
            }
        )
    verdict.within = dict(within)
    return verdict


def _values_between(
    timeline: Timeline, answer: Answer, lo: float, hi: float
) -> list[Values | None]:
    """The reference's distinct values of ``answer``'s feature set over ``[lo, hi]``."""
    found: list[Values | None] = []
    for state in timeline.states.get(answer.ref, []):
        a, b = max(state.start, lo), min(state.end, hi)
        if b < a:
            continue
        for start, _ in pieces(state.rows, answer.ref, _at(a), _at(b)):
            got = timeline.value(state, answer.ref, start)[answer.feature_set]
            if got not in found:
                found.append(got)
    return found[-8:]


def _state_at(timeline: Timeline, ref: Ref, at: float) -> State | None:
    found = [s for s in timeline.states.get(ref, []) if s.start <= at]
    return found[-1] if found else None
