"""Fixtures of the semantic cache's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from freshline.pipeline.semantic.cache import SemanticCache


@pytest.fixture
def made() -> Iterator[list[SemanticCache]]:
    """The caches a test makes, appended by it: closed when it ends."""
    caches: list[SemanticCache] = []
    yield caches
    for c in caches:
        c.close()
