"""The alert rules and the Grafana dashboard name only metrics the code exports.

A renamed metric would leave an alert that never fires; this catches it. Whether the
rules file is valid for Prometheus is promtool's to say (scripts/test runs
``promtool check rules``); these tests check what promtool cannot know.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from sqlalchemy.engine import Engine

import freshline.pipeline.api.metrics  # noqa: F401  (registers the API's metrics)
from freshline.consumers.metrics import consumer_metrics
from freshline.pipeline.api import create_app
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.observe.audit_metrics import audit_metrics
from freshline.pipeline.observe.skew import skew_metrics
from tests.helpers import running

DOCKER = Path(__file__).resolve().parents[3] / "docker"
PROMQL_WORDS = {
    "sum",
    "by",
    "rate",
    "increase",
    "delta",
    "deriv",
    "max",
    "min",
    "avg",
    "and",
    "or",
    "unless",
    "on",
    "ignoring",
    "without",
    "histogram_quantile",
    "le",
    "bool",
    "offset",
    "count",
    "topk",
    "abs",
    "clamp_min",
    "humanize",
    "humanizePercentage",
}
SUFFIXES = ("_total", "_sum", "_count", "_bucket", "_created")


def load_rules() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DOCKER / "alerts.yml").read_text())
    return loaded


def names_in(expr: str) -> set[str]:
    """The metric and recorded-series names an expression reads."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    return {t for t in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if t not in PROMQL_WORDS}


@pytest.fixture(scope="module")
def exported(settings: Settings, engine: Engine, redis_client: redis.Redis) -> Iterator[set[str]]:
    """Every sample name the API and the consumers expose, sampled ones included."""
    consumer_metrics()
    audit_metrics()
    skew_metrics()
    from prometheus_client import REGISTRY as METRICS

    from tests.helpers import REGISTRY

    names: set[str] = set()
    for family in METRICS.collect():
        names.add(family.name)
        names.update(family.name + s for s in SUFFIXES)
    app = create_app(
        settings, engine=engine, redis_client=redis_client, follow_deploys=False, registry=REGISTRY
    )
    with running(app):
        for family in app.state.sampled_metrics.collect():
            names.add(family.name)
    yield names


def test_every_alert_has_the_fields_prometheus_and_people_need() -> None:
    rules = [r for g in load_rules()["groups"] for r in g["rules"]]
    alerts = [r for r in rules if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "FreshlineFeatureHitRateLow",
        "FreshlineCacheSlowerThanCompute",
        "FreshlineEntryOlderThanTTL",
        "FreshlineConsumerLagGrowing",
        "FreshlineDeadLettersGrowing",
    }
    for alert in alerts:
        assert set(alert) == {"alert", "expr", "for", "labels", "annotations"}, alert["alert"]
        assert re.fullmatch(r"\d+[smh]", alert["for"]), alert["alert"]
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert {"summary", "description"} <= set(alert["annotations"])
    for rule in rules:
        if "record" in rule:
            assert set(rule) == {"record", "expr"}
            assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", rule["record"])


def test_the_hit_rate_alert_is_below_25_percent_over_5_minutes() -> None:
    rules = {
        r.get("alert") or r.get("record"): r for g in load_rules()["groups"] for r in g["rules"]
    }
    alert = rules["FreshlineFeatureHitRateLow"]
    assert alert["expr"].endswith("< 0.25") and alert["for"] == "5m"
    assert "[5m]" in rules["freshline:feature_hits:rate5m"]["expr"]


def test_rules_read_only_exported_metrics(exported: set[str]) -> None:
    groups = load_rules()["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    for group in groups:
        for rule in group["rules"]:
            unknown = names_in(rule["expr"]) - exported - recorded
            assert not unknown, f"{rule.get('alert') or rule.get('record')}: {unknown}"


def test_dashboard_reads_only_exported_metrics(exported: set[str]) -> None:
    recorded = {r["record"] for g in load_rules()["groups"] for r in g["rules"] if "record" in r}
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "freshline.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        assert not names_in(expr) - exported - recorded, expr
    prometheus = (DOCKER / "prometheus.yml").read_text()
    assert "/etc/prometheus/alerts.yml" in prometheus
    compose = (DOCKER / "compose.yaml").read_text()
    assert "./alerts.yml:/etc/prometheus/alerts.yml" in compose
    assert "./grafana/dashboards:/var/lib/grafana/dashboards" in compose
