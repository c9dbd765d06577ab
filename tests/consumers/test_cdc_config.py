"""The connector configuration and names, without services; the CLI's failure modes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from freshline.consumers.topics import subscription
from freshline.pipeline.cdc.connect import captured_tables, connector_config, names, slot_name
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY, cli, error_line

ROOT = Path(__file__).resolve().parents[2]


def test_names_follow_the_topic_prefix() -> None:
    plain = names(Settings())
    assert (plain.connector, plain.slot, plain.topic_prefix) == (
        "freshline-postgres",
        "freshline",
        "freshline",
    )
    assert plain.topic("transactions") == "freshline.public.transactions"
    mine = names(Settings(topic_prefix="Test-1a.b."))
    assert mine.connector == "Test-1a.b.freshline-postgres"
    assert mine.topic_prefix == "Test-1a.b.freshline"
    assert re.fullmatch(r"[a-z0-9_]{1,63}", mine.slot) and mine.slot == "test_1a_b_freshline"
    assert len(slot_name("x" * 200)) <= 63


@pytest.mark.parametrize("prefix", ["", "cdc1234."])
def test_the_subscription_takes_table_topics_but_not_heartbeats_or_messages(prefix: str) -> None:
    settings = Settings(topic_prefix=prefix)
    owned = names(settings)
    pattern = re.compile(subscription(settings)[-1])
    assert pattern.match(owned.topic("transactions"))
    assert not pattern.match(owned.heartbeat_topic)
    assert not pattern.match(f"{owned.topic_prefix}.message")


def test_connector_config() -> None:
    settings = Settings(
        postgres_url="postgresql+psycopg://u:p%40ss@db.example:6543/shop", connect_secrets_file=""
    )
    config = connector_config(settings, names(settings), database_host="postgres")
    assert config["database.hostname"] == "postgres"
    assert (
        config["database.port"],
        config["database.user"],
        config["database.password"],
        config["database.dbname"],
    ) == ("6543", "u", "p@ss", "shop")
    assert config["plugin.name"] == "pgoutput"
    assert config["snapshot.mode"] == "no_data"
    assert config["value.converter.schemas.enable"] == "false"
    assert config["decimal.handling.mode"] == "string"
    assert config["tombstones.on.delete"] == "true"
    assert int(config["heartbeat.interval.ms"]) > 0
    assert config["table.include.list"].split(",") == [
        f"public.{t}" for t in captured_tables(REGISTRY)
    ]
    assert all(isinstance(v, str) for v in config.values())


def test_the_connectors_poll_and_linger_come_from_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The defaults are the short commit-to-Kafka path; under a sustained high write
    rate an operator sets what was faster there (``docs/cdc.md``)."""
    plain = Settings()
    config = connector_config(plain, names(plain))
    assert (config["poll.interval.ms"], config["producer.override.linger.ms"]) == ("10", "0")
    monkeypatch.setenv("FRESHLINE_CDC_POLL_INTERVAL_MS", "50")
    monkeypatch.setenv("FRESHLINE_CDC_LINGER_MS", "5")
    busy = Settings()
    config = connector_config(busy, names(busy))
    assert (config["poll.interval.ms"], config["producer.override.linger.ms"]) == ("50", "5")


def test_with_a_secrets_file_the_login_is_a_provider_reference() -> None:
    settings = Settings(
        postgres_url="postgresql+psycopg://u:p%40ss@db.example:6543/shop",
        postgres_admin_url="postgresql+psycopg://o:s3cret@db.example/shop",
        connect_secrets_file="/etc/connect/pg.properties",
    )
    config = connector_config(settings, names(settings))
    assert config["database.password"] == "${file:/etc/connect/pg.properties:database.password}"
    # Debezium's own replication role, named in the same file: not the owner.
    assert config["database.user"] == "${file:/etc/connect/pg.properties:database.user}"
    assert "s3cret" not in str(config) and "p@ss" not in str(config)
    without = settings.model_copy(update={"connect_secrets_file": ""})
    assert connector_config(without, names(without))["database.user"] == "o"


def test_the_migration_publishes_exactly_the_captured_tables() -> None:
    spec = importlib.util.spec_from_file_location(
        "m0002", ROOT / "examples" / "fraud" / "migrations" / "versions" / "0002_cdc.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert sorted(module.CAPTURED) == captured_tables(REGISTRY)


def test_register_says_in_one_line_when_connect_is_down(settings: Settings) -> None:
    done = cli(
        "cdc",
        "register",
        FRESHLINE_POSTGRES_URL=settings.postgres_url,
        FRESHLINE_CONNECT_URL="http://127.0.0.1:9",
    )
    line = error_line(done)
    assert "Kafka Connect is not reachable at http://127.0.0.1:9" in line
    assert "scripts/stack up" in line
