"""The guided part of ``scripts/demo``: a change made, and fresh features served.

Runs against a stack, consumer and API that ``scripts/demo`` started. Uses only the
standard library's HTTP client, so it reads exactly as any scoring service would.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from typing import Any

import orjson
import sqlalchemy as sa

from pipeline.core.db import make_engine
from pipeline.core.settings import load_settings

DEADLINE_S = 15.0


def has_tenant(tenant: str) -> bool:
    engine = make_engine(load_settings())
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT 1 FROM tenants WHERE id = :t"), {"t": tenant})
        return found.first() is not None


class Api:
    def __init__(self, base: str, key: str) -> None:
        self.base = base.rstrip("/")
        self.key = key

    def call(self, method: str, path: str, body: object | None = None) -> tuple[int, Any]:
        data = None if body is None else orjson.dumps(body)
        request = urllib.request.Request(  # noqa: S310 (the demo's own http:// API)
            self.base + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
                return response.status, orjson.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, orjson.loads(exc.read() or b"null")


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _brief(values: dict[str, Any]) -> str:
    return (f"txn_count={values['txn_count']} txn_sum={values['txn_sum']:.2f} "
            f"txn_max={values['txn_max']:.2f}")


def tour(base: str, key: str, tenant: str = "acme", user: int = 1) -> None:
    """Read, change, watch the change arrive, batch-read, predict."""
    from consumers.kafka import Producer
    from pipeline.core.topics import TRANSACTION_CREATED, qualified
    from pipeline.inference.training import MODEL_NAME, vector

    settings = load_settings()
    api = Api(base, key)
    path = f"/v1/features/txn_90d/{user}"

    status, first = api.call("GET", path)
    _say(f"GET {path}: {status} {first['source']}, {_brief(first['values'])}")
    status, again = api.call("GET", path)
    _say(f"GET {path} again: {again['source']}, {again['age_ms']} ms old")

    engine = make_engine(settings)
    producer = Producer(settings)
    producer.inner.list_topics(timeout=10)  # connected before the change, as a service is
    committed = datetime.now(UTC)
    with engine.begin() as conn:
        txn = conn.execute(sa.text(
            "INSERT INTO transactions (tenant_id, user_id, amount, merchant_id, ip) "
            "VALUES (:t, :u, 4999.00, 'm-demo', '11.0.0.42') RETURNING id"),
            {"t": tenant, "u": user}).scalar_one()
    started = time.monotonic()  # the change has committed
    producer.produce(qualified(settings, TRANSACTION_CREATED), orjson.dumps(
        {"tenant": tenant, "user_id": user, "transaction_id": txn,
         "occurred_at": committed.isoformat()}), f"{tenant}:{user}".encode())
    producer.close()
    _say(f"INSERT transaction {txn} of 4999.00 for user {user}, "
         "and its transaction.created event")
    while time.monotonic() - started < DEADLINE_S:
        status, now = api.call("GET", path + "?mode=cache-only")
        if status == 200 and now["values"]["txn_count"] != again["values"]["txn_count"]:
            waited = (time.monotonic() - started) * 1000
            _say(f"served fresh {waited:.0f} ms after the commit: {_brief(now['values'])}")
            break
        time.sleep(0.02)  # polling the API, as a dashboard would
    else:
        _say("the change did not arrive within 15 s: is `freshline consume` running?")

    entities = [str(u) for u in range(user, user + 5)]
    status, batch = api.call("POST", "/v1/features/batch", {
        "feature_sets": ["txn_90d", "device_risk", "geo"], "entities": entities})
    items = batch["items"]
    hits = sum(1 for i in items if i["hit"])
    _say(f"POST /v1/features/batch: {len(items)} entries, {hits} from the cache, "
         f"{len(items) - hits} computed")

    per_user: dict[str, dict[str, Any]] = {}
    for item in items:
        per_user.setdefault(item["entity"], {})[item["feature_set"]] = item["values"]
    inputs = [vector(per_user[e]) for e in entities]
    for attempt in ("first", "second"):
        status, pred = api.call("POST", f"/v1/models/{MODEL_NAME}/predict", {"inputs": inputs})
        if status != 200:
            _say(f"predict: {status} {pred}")
            break
        cached = sum(1 for p in pred["predictions"] if p["hit"])
        scores = ", ".join(f"{p['value']:.3f}" for p in pred["predictions"])
        _say(f"predict ({attempt} call, model {pred['model_version']}): [{scores}], "
             f"{cached} of {len(inputs)} from the inference cache")


if __name__ == "__main__":
    tour(sys.argv[1], sys.argv[2])
