# The demo's harness, not code a user's repository needs (it may use freshline's internals).
"""The guided part of ``scripts/demo``: a change made, and fresh features served.

Runs against the stack, consumer and API that ``scripts/demo`` started, and calls the
API through :func:`freshline.pipeline.core.http.fetch` (the standard library's client), as any
scoring service would::

    python -m fraud.demo tour API_URL API_KEY
    python -m fraud.demo catch-up
    python -m fraud.demo cdc API_URL API_KEY TENANT USER PSQL_URL
    python -m fraud.demo served OPS_URL SERVED_DIR

Every timed change first waits for the consumer group to catch up (:func:`catch_up`):
on a fresh clone the seed's tens of thousands of CDC events are still queued, and a
change behind them would time the backlog, not the pipeline.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import sqlalchemy as sa

from freshline import FreshlineError
from freshline.pipeline.core.db import make_engine, make_owner_engine
from freshline.pipeline.core.http import fetch
from freshline.pipeline.core.settings import Settings, load_settings
from freshline.pipeline.observe.staleness import GroupLag

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient
    from sqlalchemy.engine import Engine

    from freshline.pipeline.observe.skew import SkewReport

DEADLINE_S = 15.0
"""How long a change may take to be served before the demo says it did not arrive."""
CATCH_UP_S = 300.0
"""How long the demo waits for the consumer to work through a backlog."""
PROGRESS_S = 5.0
"""How often the wait says how many events are still queued."""
API_HINT = "is `freshline serve` running? scripts/demo starts it"
USAGE = """usage: python -m fraud.demo tour API_URL API_KEY
       python -m fraud.demo catch-up
       python -m fraud.demo cdc API_URL API_KEY TENANT USER PSQL_URL
       python -m fraud.demo served OPS_URL SERVED_DIR
"""


def has_tenant(tenant: str) -> bool:
    engine = make_engine(load_settings())
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT 1 FROM freshline.tenants WHERE id = :t"), {"t": tenant}
        )
        return found.first() is not None


class Api:
    """The read API as a scoring service calls it: a bearer key, JSON in and out."""

    def __init__(self, base: str, key: str) -> None:
        self.base = base.rstrip("/")
        self.key = key

    def call(self, method: str, path: str, body: object | None = None) -> tuple[int, Any]:
        """``(status, decoded JSON body)``, whatever the status."""
        response = fetch(
            self.base + path,
            method=method,
            body=None if body is None else orjson.dumps(body),
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
            service="the read API",
            hint=API_HINT,
        )
        return response.status, response.json()


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


# -- waiting for the consumer -------------------------------------------------------


def queued(admin: AdminClient, lag: GroupLag, timeout_s: float = 10.0) -> int | None:
    """Records the consumer group (``lag``'s) has yet to commit on the topics assigned
    to its members: per partition, the high watermark less the committed offset
    (:meth:`GroupLag.measure`).

    ``None`` while the group is not stable with an assignment (no member has joined,
    or a rebalance is under way): it is then not known to be caught up.
    """
    from confluent_kafka import ConsumerGroupState

    group = lag.settings.consumer_group
    found = admin.describe_consumer_groups([group], request_timeout=timeout_s)
    described = found[group].result()
    if described.state != ConsumerGroupState.STABLE:
        return None
    topics = {tp.topic for member in described.members for tp in member.assignment.topic_partitions}
    if not topics:
        return None
    return sum(lag.measure(sorted(topics)).values())


def catch_up(settings: Settings, deadline_s: float = CATCH_UP_S) -> bool:
    """Wait until the consumer group has nothing queued on its partitions (:func:`queued`).

    Says how many events are still queued every few seconds while it waits; False, and
    says so, if the deadline passes first.
    """
    from freshline.consumers.kafka import admin_client

    admin, lag = admin_client(settings), GroupLag(settings)
    try:
        return _wait_for(admin, lag, deadline_s)
    finally:
        lag.close()


def _wait_for(admin: AdminClient, lag: GroupLag, deadline_s: float) -> bool:
    started = time.monotonic()
    next_report = 0.0
    said_waiting = False
    while True:
        count = queued(admin, lag)
        waited = time.monotonic() - started
        if count == 0:
            if said_waiting:
                _say(f"the consumer caught up in {waited:.0f} s")
            return True
        if waited > deadline_s:
            left = "an unknown number of" if count is None else f"{count:,}"
            _say(
                f"the consumer still has {left} events queued after {deadline_s:.0f} s: "
                "the times below include waiting behind them"
            )
            return False
        if waited >= next_report:
            _say(
                "waiting for the consumer to catch up before a timed change: "
                + (
                    f"group {lag.settings.consumer_group!r} has no assignment yet (is "
                    "`freshline consume` running, or still joining?)"
                    if count is None
                    else f"{count:,} events still queued"
                )
            )
            said_waiting, next_report = True, waited + PROGRESS_S
        time.sleep(0.2)  # polling the broker while the consumer works


# -- the tour -----------------------------------------------------------------------


def _brief(values: dict[str, Any]) -> str:
    return (
        f"txn_count={values['txn_count']} txn_sum={values['txn_sum']:.2f} "
        f"txn_max={values['txn_max']:.2f}"
    )


def tour(base: str, key: str, tenant: str = "acme", user: int = 1) -> list[str]:
    """Read, change, watch the change arrive, batch-read, predict.

    Returns what went wrong, one line per failed check (empty when every step did what it
    printed): the change is served, the batch answers, the second prediction comes from
    the inference cache and equals the computed one.
    """
    from fraud.training import MODEL_NAME, vector
    from freshline.consumers.kafka import Producer
    from freshline.pipeline.core.topics import qualified

    settings = load_settings()
    api = Api(base, key)
    path = f"/v1/features/txn_90d/{user}"

    status, first = api.call("GET", path)
    if status != 200:
        return [f"GET {path}: {status} {first}"]
    _say(f"GET {path}: {status} {first['source']}, {_brief(first['values'])}")
    status, again = api.call("GET", path)
    if status != 200:
        return [f"GET {path} again: {status} {again}"]
    _say(f"GET {path} again: {again['source']}, {again['age_ms']} ms old")

    failed: list[str] = []
    catch_up(settings)
    engine = make_owner_engine(settings)  # the change is the application's write
    producer = Producer(settings)
    producer.inner.list_topics(timeout=10)  # connected before the change, as a service is
    committed = datetime.now(UTC)
    with engine.begin() as conn:
        txn = conn.execute(
            sa.text(
                "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
                "VALUES (:t, :u, 4999.00, 'm-demo', '11.0.0.42') RETURNING id"
            ),
            {"t": tenant, "u": user},
        ).scalar_one()
    started = time.monotonic()  # the change has committed
    producer.produce(
        qualified(settings, "transaction.created"),
        orjson.dumps(
            {
                "tenant": tenant,
                "user_id": user,
                "transaction_id": txn,
                "occurred_at": committed.isoformat(),
            }
        ),
        f"{tenant}:{user}".encode(),
    )
    producer.close()
    _say(f"INSERT transaction {txn} of 4999.00 for user {user}, and its transaction.created event")
    while time.monotonic() - started < DEADLINE_S:
        status, now = api.call("GET", path + "?mode=cache-only")
        if status == 200 and now["values"]["txn_count"] != again["values"]["txn_count"]:
            waited = (time.monotonic() - started) * 1000
            _say(f"served fresh {waited:.0f} ms after the commit: {_brief(now['values'])}")
            break
        time.sleep(0.02)  # polling the API, as a dashboard would
    else:
        failed.append(
            f"the change did not arrive within {DEADLINE_S:.0f} s: is `freshline consume` running?"
        )
        _say(failed[-1])

    entities = [str(u) for u in range(user, user + 5)]
    status, batch = api.call(
        "POST",
        "/v1/features/batch",
        {"feature_sets": ["txn_90d", "device_risk", "geo"], "entities": entities},
    )
    if status != 200:
        return [*failed, f"POST /v1/features/batch: {status} {batch}"]
    items = batch["items"]
    hits = sum(1 for i in items if i["hit"])
    _say(
        f"POST /v1/features/batch: {len(items)} entries, {hits} from the cache, "
        f"{len(items) - hits} computed"
    )

    per_user: dict[str, dict[str, Any]] = {}
    for item in items:
        per_user.setdefault(item["entity"], {})[item["feature_set"]] = item["values"]
    inputs = [vector(per_user[e]) for e in entities]
    answers: list[list[dict[str, Any]]] = []
    for attempt in ("first", "second"):
        status, pred = api.call("POST", f"/v1/models/{MODEL_NAME}/predict", {"inputs": inputs})
        if status != 200:
            failed.append(f"predict ({attempt} call): {status} {pred}")
            _say(failed[-1])
            return failed
        answers.append(pred["predictions"])
        cached = sum(1 for p in pred["predictions"] if p["hit"])
        scores = ", ".join(f"{p['value']:.3f}" for p in pred["predictions"])
        _say(
            f"predict ({attempt} call, model {pred['model_version']}): [{scores}], "
            f"{cached} of {len(inputs)} from the inference cache"
        )
    computed, again = answers
    if not all(p["hit"] for p in again):
        failed.append("the second predict call was not served from the inference cache")
    elif [p["value"] for p in again] != [p["value"] for p in computed]:
        failed.append("a cached prediction differs from the computed one")
    else:
        _say("the cached predictions equal the computed ones")
    return failed


# -- the CDC step -------------------------------------------------------------------


def cdc_change(
    base: str, key: str, tenant: str, user: int, psql_url: str, deadline_s: float = 10.0
) -> bool:
    """An UPDATE made with plain ``psql`` (no freshline code in the write), then the
    served ``txn_90d`` polled until it changes; False if it did not within the deadline.
    """
    api = Api(base, key)
    path = f"/v1/features/txn_90d/{user}"

    def served(mode: str) -> dict[str, Any] | None:
        status, body = api.call("GET", f"{path}?mode={mode}")
        if status == 404:
            return None  # not cached (yet)
        if status != 200:
            raise FreshlineError(f"GET {path}?mode={mode}: {status} {body}")
        return dict(body["values"])

    def brief(values: dict[str, Any]) -> str:
        return (
            f"txn_sum={values['txn_sum']} txn_max={values['txn_max']} "
            f"txn_count={values['txn_count']}"
        )

    before = served("read-through")  # fills the cache if the entry was cold
    if before is None:
        raise FreshlineError(f"tenant {tenant} has no user {user}")
    _say(f"-- before: tenant {tenant} user {user}: {brief(before)}")
    quoted = "'" + tenant.replace("'", "''") + "'"  # a literal, as psql shows it
    sql = (
        f"UPDATE transactions SET amount = amount + 100 WHERE tenant_id = {quoted} "
        f"AND id = (SELECT max(id) FROM transactions WHERE tenant_id = {quoted} "
        f"AND user_id = {int(user)} AND created_at > now() - interval '90 days')"
    )
    _say(f"-- psql: {sql}")
    subprocess.run(["psql", psql_url, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-c", sql], check=True)
    committed = time.monotonic()
    after: dict[str, Any] | None = before
    while after is None or after == before:
        if time.monotonic() - committed > deadline_s:
            _say(
                f"-- no change served within {deadline_s:.0f} s: is `freshline consume` "
                "running, and did it start after the CDC topics existed? "
                "(see `freshline cdc status`)"
            )
            return False
        time.sleep(0.01)  # polling the API, as a dashboard would
        after = served("cache-only")
    elapsed = time.monotonic() - committed
    _say(f"-- after:  tenant {tenant} user {user}: {brief(after)}")
    _say(
        f"-- served the new value {elapsed * 1000:.0f} ms after psql returned "
        f"({'within' if elapsed < 1 else 'NOT within'} a second)"
    )
    return True


# -- what was served, checked --------------------------------------------------------

SERVED_S = 60.0
"""How long the demo waits for its reads to reach the served log's files, and for
history to be complete to the last of them."""
_COUNTS = re.compile(r'^freshline_served_log_total\{outcome="(\w+)"\} (\S+)$', re.M)


def logged_reads(ops: str, deadline_s: float = SERVED_S) -> int:
    """How many records the API's served log has sent, once it has sent (or dropped)
    every one it queued (its ``/metrics`` on the ops port ``ops``)."""
    started = time.monotonic()
    while True:
        text = fetch(ops.rstrip("/") + "/metrics", service="the API's ops port").text()
        counts = {name: float(value) for name, value in _COUNTS.findall(text)}
        queued = counts.get("queued", 0)
        done = counts.get("sent", 0) + counts.get("dropped", 0) + counts.get("failed", 0)
        if done >= queued or time.monotonic() - started > deadline_s:
            return int(counts.get("sent", 0))
        time.sleep(0.1)  # the log's thread sends within its linger


def complete_to(engine: Engine) -> datetime | None:
    """What every captured table's history is complete to (None: not yet anything)."""
    from freshline.pipeline.history.evaluator import captured

    with engine.connect() as conn:
        ends = [c.complete_to for c in captured(conn).values()]
    return None if not ends or None in ends else min(e for e in ends if e is not None)


def wait_for_history(engine: Engine, moment: datetime, deadline_s: float = SERVED_S) -> bool:
    """Wait until history is complete to ``moment`` (the recorder marks it at each of
    Debezium's heartbeats, every 10 s); False if the deadline passes first."""
    started = time.monotonic()
    said = False
    while (done := complete_to(engine)) is None or done < moment:
        if time.monotonic() - started > deadline_s:
            _say(f"history is complete only to {done} after {deadline_s:.0f} s")
            return False
        if not said:
            _say("waiting for history to be complete to the last read (a heartbeat, <= 10 s)")
            said = True
        time.sleep(0.2)  # polling Postgres while the recorder works
    return True


def show_training_set(engine: Engine, tenant: str) -> int:
    """Print the example's training set from history (:mod:`fraud.training`): one row
    per ``tenant`` transaction since history started, features as of its moment."""
    from fraud.training import MODEL_INPUTS, features, spine

    rows = spine(engine, tenant)
    if rows is None or rows.num_rows == 0:
        _say("training set: no transaction in history yet")
        return 0
    table = features(engine, rows).to_pylist()
    labels = sum(1 for r in table if r["reversed"])
    _say(
        f"training set: {len(table):,} {tenant} transactions since history started, each "
        f"with the {len(MODEL_INPUTS)} model features as of its moment; {labels} reversed"
    )
    for row in table[-2:]:
        shown = ", ".join(f"{n}={row[f'{fs}__{n}']}" for fs, n in MODEL_INPUTS[:2])
        shown += f", geo countries={row['geo__distinct_countries_30d']}"
        _say(f"  user {row['user_id']} at {row['timestamp']:%H:%M:%S.%f}: {shown}")
    return len(table)


def check_served(settings: Settings, sent: int, directory: Path, tenant: str = "acme") -> list[str]:
    """The demo's ending: the ``sent`` records of its logged reads written to
    ``directory`` (``freshline served sink``'s work), the training set built from
    history, and the skew report on the reads (``freshline skew``'s check): served
    values against the training set's at each entry's snapshot (must be equal) and at
    the request's moment (stale).

    Returns what went wrong: an exact mismatch, or no read checked at all.
    """
    from freshline.consumers.served import ServedSink
    from freshline.pipeline.core.repository import active
    from freshline.pipeline.observe.served_files import ParquetLog
    from freshline.pipeline.observe.skew import check

    registry = active().registry
    sink = ServedSink(settings, registry, directory, poll_s=0.2)
    try:
        written = sink.run(max_rows=sent, timeout=SERVED_S) if sent else 0
    finally:
        sink.close()
    rows = ParquetLog(directory).read().to_pylist()
    _say(f"the served log: {sent:,} logged requests, {written:,} reads written to {directory}")
    if not rows:
        return ["no read was logged"]
    engine = make_engine(settings)
    try:
        wait_for_history(engine, max(r["requested_at"] for r in rows))
        show_training_set(engine, tenant)
        snapshot = engine.execution_options(isolation_level="REPEATABLE READ")
        with snapshot.connect() as conn, conn.begin():
            report = check(conn, registry, rows)
    finally:
        engine.dispose()
    return _show_skew(report)


def _show_skew(report: SkewReport) -> list[str]:
    """The skew report in a few lines; what went wrong."""
    _say("skew: served values against the training set's (freshline skew shows the table)")
    for s in report.sets.values():
        ages = s.ages()
        age = f", {ages['p50']:,}/{ages['max']:,} ms old (p50/max)" if ages else ""
        unchecked = "".join(f", {n} unchecked ({why})" for why, n in s.unchecked.items())
        _say(
            f"  {s.feature_set:<12} {s.reads:>4} reads: {s.checked} checked, "
            f"{s.mismatched} wrong, {s.stale} stale{age}, {s.missing} missing{unchecked}"
        )
    checked = sum(s.checked for s in report.sets.values())
    if report.mismatched:
        return [f"{report.mismatched} exact mismatches: served values unlike their snapshot's"]
    if not checked:
        return ["no logged read could be checked against history"]
    _say(f"exact mismatches: 0 of {checked} reads checked at their entry's snapshot")
    return []


def main(argv: list[str]) -> int:
    match argv:
        case ["tour", base, key]:
            failed = tour(base, key)
            for line in failed:
                sys.stderr.write(f"demo: failed: {line}\n")
            return 1 if failed else 0
        case ["catch-up"]:
            catch_up(load_settings())
        case ["cdc", base, key, tenant, user, psql_url]:
            catch_up(load_settings())
            return 0 if cdc_change(base, key, tenant, int(user), psql_url) else 1
        case ["served", ops, directory]:
            failed = check_served(load_settings(), logged_reads(ops), Path(directory))
            for line in failed:
                sys.stderr.write(f"demo: failed: {line}\n")
            return 1 if failed else 0
        case _:
            sys.stderr.write(USAGE)
            return 2
    return 0


def run(argv: list[str]) -> int:
    """:func:`main`, with an expected failure (a service down, a refused write) as one line."""
    from freshline.pipeline.core.services import translate_errors

    try:
        with translate_errors():
            return main(argv)
    except FreshlineError as exc:
        sys.stderr.write(f"demo: error: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
