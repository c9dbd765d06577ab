"""The tiers of tests/conftest.py: chosen from a test's fixtures, and a unit test that
reaches for a service fails at once."""

from __future__ import annotations

import psycopg
import pytest
import redis

from freshline.pipeline.core.settings import Settings


def test_a_test_without_a_service_fixture_is_unit(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("stack") is None


def test_a_test_with_a_service_fixture_is_stack(
    request: pytest.FixtureRequest, base_settings: Settings
) -> None:
    assert request.node.get_closest_marker("stack") is not None
    assert request.node.get_closest_marker("unit") is None


def test_a_unit_test_reaching_for_a_service_is_refused_at_once() -> None:
    settings = Settings()  # what a unit test that forgot its fixture would build
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5).ping()
    url = settings.postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=5).close()
