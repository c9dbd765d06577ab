"""Small helpers for scripts/demo."""

from __future__ import annotations

import sqlalchemy as sa

from pipeline.db import make_engine
from pipeline.settings import get_settings


def has_tenant(tenant: str) -> bool:
    engine = make_engine(get_settings())
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT 1 FROM tenants WHERE id = :t"), {"t": tenant})
        return found.first() is not None
