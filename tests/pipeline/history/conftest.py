"""Fixtures of the history tests: the fraud tables captured (history tables made per
the contract, :mod:`tests.pipeline.history.recording`), the API role's engine, a tenant
of the test's own and a moment in the past."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine

from pipeline.core.settings import Settings
from tests.helpers import role_engine
from tests.pipeline.history import recording

FRAUD_TABLES = ("transactions", "users", "user_devices", "devices", "geoip")
HOUR = dt.timedelta(hours=1)


@pytest.fixture(scope="module")
def captured(engine: Engine) -> Iterator[None]:
    with engine.begin() as conn:
        for table in FRAUD_TABLES:
            recording.capture(conn, table)
    yield
    with engine.begin() as conn:
        for table in FRAUD_TABLES:
            recording.uncapture(conn, table)


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[Engine]:
    eng = role_engine(settings, "FRESHLINE_STACK_POSTGRES_API_URL")
    yield eng
    eng.dispose()


@pytest.fixture
def tenant() -> str:
    return f"h{uuid.uuid4().hex[:10]}"


@pytest.fixture
def t() -> dt.datetime:
    """The moment asked about: two hours ago, to the microsecond."""
    return (dt.datetime.now(dt.UTC) - 2 * HOUR).replace(microsecond=123456)
