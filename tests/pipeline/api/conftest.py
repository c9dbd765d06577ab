"""Fixtures of the API's tests."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def audit(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """The audit lines written during the test, parsed."""
    logger = logging.getLogger("freshline.audit")
    logger.addHandler(caplog.handler)
    previous = logger.level
    logger.setLevel(logging.INFO)

    def lines() -> list[dict[str, Any]]:
        return [json.loads(r.getMessage()) for r in caplog.records if r.name == logger.name]

    yield lines
    logger.removeHandler(caplog.handler)
    logger.setLevel(previous)
