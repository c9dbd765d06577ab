"""Sessions of :func:`pipeline.core.db.make_engine`: what Postgres does with one that
a stopped or cut-off process leaves inside a transaction."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from pipeline.core import db
from pipeline.core.settings import Settings
from tests.conftest import wait_until


def test_a_session_idle_in_a_transaction_is_ended_and_its_locks_go(
        settings: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    default = db.make_engine(settings)
    with default.connect() as conn:
        assert conn.execute(sa.text("SHOW idle_in_transaction_session_timeout")).scalar() \
            == f"{db.IDLE_IN_TRANSACTION_S // 60}min"
    default.dispose()
    monkeypatch.setattr(db, "IDLE_IN_TRANSACTION_S", 1)
    short = db.make_engine(settings)
    try:
        stuck = short.connect()
        stuck.execute(sa.text("SELECT pg_advisory_xact_lock(424242)"))
        pid = stuck.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()

        def lock_free() -> bool:  # then this process stops talking, as a stopped one would
            with engine.connect() as other:
                return bool(other.execute(sa.text(
                    "SELECT pg_try_advisory_lock(424242) AND pg_advisory_unlock(424242)")
                ).scalar_one())

        assert not lock_free()
        assert wait_until(lock_free, 15)
        with engine.connect() as other:
            assert other.execute(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
            ).scalar_one() == 0
        with pytest.raises(sa.exc.DBAPIError, match="idle-in-transaction timeout"):
            stuck.execute(sa.text("SELECT 1"))
        stuck.invalidate()
        stuck.close()
    finally:
        short.dispose()
