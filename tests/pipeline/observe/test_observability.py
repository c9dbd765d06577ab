"""Each observability figure moves as it should under driven traffic, on the real services."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator

import orjson
import pytest
import redis
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.consumers.kafka import Producer, admin_client
from freshline.consumers.topics import ensure, managed_topics
from freshline.pipeline.core.codec import encode_entry
from freshline.pipeline.core.keys import feature_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import qualified
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.observe.staleness import GroupLag, sample, source_topics
from tests.consumers.conftest import wait_for
from tests.helpers import REGISTRY, Api, api_for, fresh_version, make_url_redis

# The staleness test samples a Redis database of its own, small enough for one sample to
# cover every key, so the injected entry is always seen.
STALENESS_REDIS_DB = int(os.environ.get("FRESHLINE_TEST_STALENESS_REDIS_DB", "13"))


def metric(text: str, name: str, /, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``; 0 if none."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if not m:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture
def obs_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "schema_version": fresh_version(),
            "consumer_metrics_port": 0,
            "local_cache_size": 0,
            "ops_cache_s": 0.0,  # a fresh Redis sample on every scrape
        }
    )  # counts Redis hits


@pytest.fixture
def tenant(tenant_factory: Callable[..., SeedSummary]) -> str:
    return tenant_factory(users=10, transactions=200).tenants[0]


@pytest.fixture
def api(
    obs_settings: Settings, engine: Engine, redis_client: redis.Redis, tenant: str
) -> Iterator[Api]:
    with api_for(obs_settings, engine, redis_client, tenant) as client:
        yield client


def test_hits_raise_the_hit_rate_and_each_latency_is_measured(api: Api) -> None:
    before = api.ops("/metrics").text
    assert api.get("/v1/features/txn_90d/3").json()["source"] == "computed"
    for _ in range(4):
        assert api.get("/v1/features/txn_90d/3").json()["source"] == "hit"
    after = api.ops("/metrics").text

    def moved(name: str, /, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("freshline_api_feature_hits_total", feature_set="txn_90d") == 4
    assert moved("freshline_api_feature_misses_total", feature_set="txn_90d") == 1
    assert moved("freshline_cache_read_seconds_count", cache="feature", name="txn_90d") == 4
    assert moved("freshline_cache_miss_seconds_count", cache="feature", name="txn_90d") == 1
    assert moved("freshline_compute_seconds_count", cache="feature", name="txn_90d") == 1
    assert moved("freshline_compute_seconds_sum", cache="feature", name="txn_90d") > 0

    status = api.ops("/status.json").json()
    txn = next(s for s in status["feature_sets"] if s["name"] == "txn_90d")
    assert txn["current"]["hit_rate"] == pytest.approx(0.8)
    assert (txn["current"]["hits"], txn["current"]["misses"]) == (4, 1)
    for _ in range(5):
        api.get("/v1/features/txn_90d/3")
    status = api.ops("/status.json").json()
    txn = next(s for s in status["feature_sets"] if s["name"] == "txn_90d")
    assert txn["current"]["hit_rate"] == pytest.approx(0.9)  # 9 hits of 10 reads


@pytest.fixture
def stale_api(obs_settings: Settings, engine: Engine, tenant: str) -> Iterator[Api]:
    url = make_url_redis(obs_settings.redis_url, STALENESS_REDIS_DB)
    local = obs_settings.model_copy(update={"redis_url": url})
    client = redis.Redis.from_url(url)
    try:
        with api_for(local, engine, client, tenant) as api:
            yield api
    finally:
        for key in client.scan_iter(match=f"*:{local.schema_version}:*", count=1000):
            client.unlink(key)
        client.close()


def test_an_entry_older_than_its_ttl_fires_the_staleness_check(stale_api: Api, tenant: str) -> None:
    svc = stale_api.app.state.services
    for user in (1, 2, 3):
        assert stale_api.get(f"/v1/features/txn_90d/{user}").status_code == 200
    fresh = stale_api.ops("/metrics").text
    assert metric(fresh, "freshline_staleness_sampled_entries", feature_set="txn_90d") == 3
    assert metric(fresh, "freshline_staleness_over_ttl_entries", feature_set="txn_90d") == 0

    fs = REGISTRY["txn_90d"]
    ttl_ms = fs.ttl_s * 1000
    old = time.time_ns() // 1_000_000 - 2 * ttl_ms
    key = feature_key(svc.reader.schema_version, EntityRef("txn_90d", tenant, "4"))
    raw = encode_entry([None] * len(fs.fields), svc.reader.schema_version, old, 1)
    svc.redis.set(key, raw, px=10 * ttl_ms)  # a TTL not enforced: alive long past its age

    found = sample(svc.redis, REGISTRY, svc.reader.schema_version)
    assert found.complete, "the sample must cover this test's whole Redis database"
    assert found.by_set["txn_90d"].over_ttl == 1

    stale = stale_api.ops("/metrics").text
    assert metric(stale, "freshline_staleness_over_ttl_entries", feature_set="txn_90d") == 1
    oldest = metric(stale, "freshline_staleness_oldest_age_seconds", feature_set="txn_90d")
    assert oldest >= 2 * fs.ttl_s
    assert metric(stale, "freshline_feature_ttl_seconds", feature_set="txn_90d") == fs.ttl_s
    status = stale_api.ops("/status.json").json()
    assert any("txn_90d" in p and "older than" in p for p in status["problems"])

    immortal = feature_key(svc.reader.schema_version, EntityRef("geo", tenant, "5"))
    svc.redis.set(
        immortal,
        encode_entry(
            [None] * len(REGISTRY["geo"].fields), svc.reader.schema_version, old + ttl_ms, 1
        ),
    )
    try:
        text = stale_api.ops("/metrics").text
        assert metric(text, "freshline_staleness_immortal_entries", feature_set="geo") == 1
    finally:
        svc.redis.delete(immortal)  # the session ends by checking no key is left so


@pytest.fixture
def admin(settings: Settings) -> AdminClient:
    return admin_client(settings)


@pytest.mark.kafka
def test_lag_grows_while_no_consumer_runs(settings: Settings, admin: AdminClient) -> None:
    tag = uuid.uuid4().hex[:8]
    local = settings.model_copy(
        update={"topic_prefix": f"test{tag}.", "consumer_group": f"test-{tag}"}
    )
    topics = managed_topics(local)
    ensure(admin, 2, topics=topics)
    topic = qualified(local, "transaction.updated")
    feeds = source_topics(local, REGISTRY)
    assert topic in feeds["txn_90d"]
    lag = GroupLag(local)
    try:
        wait_for(lambda: lag.by_feature_set(feeds)["txn_90d"] == 0, "the new topics")
        with Producer(local) as producer:
            for i in range(7):
                producer.produce(topic, orjson.dumps({"i": i}), str(i).encode())
            producer.flush()
            wait_for(lambda: lag.by_feature_set(feeds)["txn_90d"] == 7, "a lag of 7")
            for i in range(5):
                producer.produce(topic, orjson.dumps({"i": i}), str(i).encode())
            producer.flush()
        wait_for(lambda: lag.by_feature_set(feeds)["txn_90d"] == 12, "a lag of 12")
        assert lag.measure([topic]) == {topic: 12}
    finally:
        lag.close()
        for future in admin.delete_topics(topics, operation_timeout=10).values():
            future.result()
