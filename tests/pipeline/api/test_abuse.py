"""What one caller must not be able to do to everyone (issue 30), on the real services."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy.engine import Engine

from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.api.routes import MAX_JSON_DEPTH
from freshline.pipeline.cache.readthrough import Hooks, ReadThrough, Result
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.keys import LEASE_PREFIX
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, Api, fresh_version, running, wait_until

# Long enough that no lease or wait in these tests ends by running out: a lease that
# is still there, or a read that is still waiting, was never ended by the code.
FOREVER_MS = 600_000
GHOSTS = [str(u) for u in range(900_000, 900_100)]  # user ids with no row in ``users``


@pytest.fixture(scope="module")
def tenant(tenant_factory_module: Callable[..., Any]) -> str:
    return str(tenant_factory_module(users=5, transactions=50).tenants[0])


def leases(client: redis.Redis, version: int) -> list[bytes]:
    return list(client.scan_iter(match=f"{LEASE_PREFIX}:{version}:*", count=1000))


def read_through(client: redis.Redis, engine: Engine, version: int) -> ReadThrough:
    store = EntryStore(client, version, registry=REGISTRY)
    return ReadThrough(store, engine, lease_ms=FOREVER_MS, wait_ms=FOREVER_MS, early_refresh=False)


# -- 3: leases always end ---------------------------------------------------------------


def test_reads_of_ids_without_source_rows_end_their_leases(
    redis_client: redis.Redis, engine: Engine, tenant: str, version: int
) -> None:
    rt = read_through(redis_client, engine, version)
    refs = [EntityRef("txn_90d", tenant, u) for u in GHOSTS]
    first = rt.get_many(refs)
    assert {r.source for r in first} == {"uncached"}
    assert leases(redis_client, version) == []
    # A repeat leases again and computes: it never waits on a lease.
    again = rt.get_many(refs)
    assert {r.source for r in again} == {"uncached"}
    assert rt.counters.lease_waits == 0
    assert [r.values for r in again] == [r.values for r in first]
    assert leases(redis_client, version) == []


def test_a_reader_waiting_on_an_id_without_a_source_row_stops_when_its_holder_is_done(
    redis_client: redis.Redis, engine: Engine, tenant: str, version: int
) -> None:
    ref = EntityRef("txn_90d", tenant, GHOSTS[0])
    holder, waiter = (read_through(redis_client, engine, version) for _ in range(2))
    queried, resume = threading.Event(), threading.Event()

    def pause(_: list[EntityRef]) -> None:
        queried.set()
        resume.wait(30)

    holder.hooks.after_compute = pause
    answers: dict[str, Result] = {}

    def read(name: str, rt: ReadThrough) -> None:
        answers[name] = rt.get(ref)

    threads = [
        threading.Thread(target=read, args=(name, rt), daemon=True)
        for name, rt in (("holder", holder), ("waiter", waiter))
    ]
    threads[0].start()
    assert queried.wait(30)  # the holder has its lease and has queried
    threads[1].start()
    assert wait_until(lambda: waiter.counters.lease_waits == 1, timeout=30)
    resume.set()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a reader is still waiting on a lease"
    assert answers["holder"].source == answers["waiter"].source == "uncached"
    assert answers["waiter"].values == answers["holder"].values
    assert leases(redis_client, version) == []


def test_a_failed_computation_ends_its_leases(
    redis_client: redis.Redis, engine: Engine, tenant: str, version: int
) -> None:
    def fail(_: list[EntityRef]) -> None:
        raise ConnectionError("the database went away mid-read")

    rt = read_through(redis_client, engine, version)
    rt.hooks = Hooks(before_compute=fail)
    refs = [EntityRef(fs, tenant, "1") for fs in ("txn_90d", "geo")]
    with pytest.raises(ConnectionError):
        rt.get_many(refs)
    assert leases(redis_client, version) == []
    rt.hooks = Hooks()
    assert {r.source for r in rt.get_many(refs)} == {"computed"}
    assert rt.counters.lease_waits == 0


# -- 9: JSON bodies nested too deep -----------------------------------------------------


def nested(depth: int, kind: str = "object") -> str:
    """JSON text of a value ``depth`` containers deep."""
    if kind == "object":
        return '{"a":' * depth + "0" + "}" * depth
    return "[" * depth + "0" + "]" * depth


SCOPE = '"model": "bot", "model_version": "v1", "template_version": "t1"'
PARAMS = '"params": {"temperature": 0, "x": DEEP}'
DEEP_BODIES = {  # each route's body, with DEEP where the deep value goes
    "/v1/features/batch": '{"feature_sets": ["txn_90d"], "entities": [DEEP]}',
    "/v1/models/m/predict": '{"inputs": [DEEP]}',
    "/v1/llm/cache/lookup": f'{{{SCOPE}, "prompt": "hi", {PARAMS}}}',
    "/v1/llm/cache/store": f'{{{SCOPE}, "prompt": "hi", "response": "yo", {PARAMS}}}',
    "/v1/llm/cache/flag": f'{{{SCOPE}, "entry_id": "00000000000000aa", "params": DEEP}}',
}


def post_deep(api: Api, path: str, depth: int, kind: str = "object") -> httpx.Response:
    """POST ``path`` its body with a value ``depth`` levels deep at DEEP."""
    content = DEEP_BODIES[path].replace("DEEP", nested(depth, kind))
    return api.post(path, content=content, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def deep_api(
    settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> Iterator[Api]:
    app = create_app(
        settings.model_copy(
            update={"schema_version": fresh_version(), "semantic_enabled": True}  # /v1/llm too
        ),
        engine=engine,
        redis_client=redis_client,
        follow_deploys=False,
        registry=REGISTRY,
    )
    with running(app, create_api_key(engine, tenant)) as api:
        yield api


@pytest.mark.parametrize("depth", [300, 2000])
@pytest.mark.parametrize("kind", ["object", "array"])
@pytest.mark.parametrize("path", list(DEEP_BODIES))
def test_bodies_nested_too_deep_are_refused_without_a_traceback(
    deep_api: Api, caplog: pytest.LogCaptureFixture, path: str, kind: str, depth: int
) -> None:
    with caplog.at_level(logging.INFO):
        answer = post_deep(deep_api, path, depth, kind)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "json_too_deep"
    assert f"more than {MAX_JSON_DEPTH} levels" in error["message"]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


def test_params_nested_to_the_limit_are_served_and_one_level_more_is_not(deep_api: Api) -> None:
    # The body is level 1, params level 2, "x" level 3: x's value fills the rest.
    most = MAX_JSON_DEPTH - 2
    stored = post_deep(deep_api, "/v1/llm/cache/store", most)
    assert stored.status_code == 201, stored.text
    found = post_deep(deep_api, "/v1/llm/cache/lookup", most)
    assert found.status_code == 200 and found.json()["hit"] is True, found.text
    deeper = post_deep(deep_api, "/v1/llm/cache/lookup", most + 1)
    assert deeper.status_code == 400 and deeper.json()["error"]["code"] == "json_too_deep"
