"""What the status page and plan say about history: one row per recorded table, and a
broken table among the page's problems."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import sqlalchemy as sa

from freshline.pipeline.history.status import rows
from freshline.pipeline.observe.status import StatusBoard
from tests.pipeline.history.conftest import History, Txn, sample


def test_the_status_page_lists_history_and_a_broken_table(
    history_factory: Callable[[], History],
) -> None:
    h = history_factory()
    h.writer.commit(Txn().insert(sample(1)))
    h.enable()
    board = StatusBoard(cast(Any, None), history=lambda: rows(h.consumer))
    problems: list[str] = []
    [mine] = [r for r in board._history(problems) or [] if r["table"] == f"public.{h.table}"]
    assert mine["versions"] == 1 or mine["bytes"] > 0
    assert mine["broken"] is None and not problems
    with h.owner.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE freshline.history_tables SET broken_from = now(), "
                "broken_reason = 'a test' WHERE source_table = :t"
            ),
            {"t": h.table},
        )
    board._history(problems)
    assert f"history of public.{h.table} is broken: a test" in problems
