"""Sessions of :func:`freshline.pipeline.core.db.make_engine`: what Postgres does with one that
a stopped or cut-off process leaves inside a transaction, and how it plans their
statements."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.cache.recompute import feature_statement
from freshline.pipeline.core import db
from freshline.pipeline.core.features import Path
from freshline.pipeline.core.settings import Settings
from tests.helpers import REGISTRY, wait_until


def test_a_session_idle_in_a_transaction_is_ended_and_its_locks_go(
    settings: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = db.make_engine(settings)
    with default.connect() as conn:
        assert (
            conn.execute(sa.text("SHOW idle_in_transaction_session_timeout")).scalar()
            == f"{db.IDLE_IN_TRANSACTION_S // 60}min"
        )
    default.dispose()
    monkeypatch.setattr(db, "IDLE_IN_TRANSACTION_S", 1)
    short = db.make_engine(settings)
    try:
        stuck = short.connect()
        stuck.execute(sa.text("SELECT pg_advisory_xact_lock(424242)"))
        pid = stuck.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()

        def lock_free() -> bool:  # then this process stops talking, as a stopped one would
            with engine.connect() as other:
                return bool(
                    other.execute(
                        sa.text(
                            "SELECT pg_try_advisory_lock(424242) AND pg_advisory_unlock(424242)"
                        )
                    ).scalar_one()
                )

        assert not lock_free()
        assert wait_until(lock_free, 15)
        with engine.connect() as other:
            assert (
                other.execute(
                    sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
                ).scalar_one()
                == 0
            )
        with pytest.raises(sa.exc.DBAPIError, match="idle-in-transaction timeout"):
            stuck.execute(sa.text("SELECT 1"))
        stuck.invalidate()
        stuck.close()
    finally:
        short.dispose()


@pytest.mark.parametrize("path", ["incremental", "full"])
def test_feature_queries_are_never_jit_compiled(settings: Settings, path: Path) -> None:
    """A batch's feature query whose estimate passes jit_above_cost (as it does on a
    table without statistics) is planned without JIT: compiling it took 1.5-2.5 s
    for a query of tens of milliseconds, and stalled the consumers (issue 13)."""
    engine = db.make_engine(settings)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW jit")).scalar_one() == "off"
            # Every statement now costs more than the JIT thresholds.
            for knob in ("jit_above_cost", "jit_inline_above_cost", "jit_optimize_above_cost"):
                conn.execute(sa.text(f"SET {knob} = 0"))
            stmt = feature_statement(REGISTRY["txn_90d"], path)
            plan = conn.execute(
                sa.text(f"EXPLAIN (ANALYZE, FORMAT JSON) {stmt.text}"),
                {"tenants": ["t"] * 3, "ids": [1, 2, 3], "as_of": None, "txids": []},
            ).scalar_one()
            assert "JIT" not in plan[0], plan[0]["JIT"]
            # The same session with JIT allowed compiles it, where the server can.
            if conn.execute(sa.text("SELECT pg_jit_available()")).scalar_one():
                conn.execute(sa.text("SET jit = on"))
                plan = conn.execute(
                    sa.text(f"EXPLAIN (ANALYZE, FORMAT JSON) {stmt.text}"),
                    {"tenants": ["t"] * 3, "ids": [1, 2, 3], "as_of": None, "txids": []},
                ).scalar_one()
                assert "JIT" in plan[0]
            conn.rollback()
    finally:
        engine.dispose()


def test_a_feature_statement_is_made_once_and_kept_within_a_bound() -> None:
    fs = REGISTRY["txn_90d"]
    # Made once: every fill reuses it (making one scans the text for its parameters).
    assert feature_statement(fs) is feature_statement(fs)
    assert db.sql_text.cache_info().maxsize == 1024  # statements from definitions: few
