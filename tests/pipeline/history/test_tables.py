"""The history table's DDL (golden: a change to it shows in review) and its name."""

from __future__ import annotations

from collections.abc import Callable

from freshline.pipeline.history.tables import MAX_NAME, history_ddl, history_table_name, layout
from tests.pipeline.history.conftest import History


def test_history_ddl_mirrors_the_table_and_its_indexes(
    history_factory: Callable[[], History],
) -> None:
    h = history_factory()
    with h.owner.connect() as conn:
        found = layout(conn, "public", h.table)
        ddl = [s.replace(h.table, "T") for s in history_ddl(conn, found)]
    assert found.key == ("id",)
    assert ddl == [
        'CREATE TABLE IF NOT EXISTS freshline."h_public__T" ("id" bigint, "note" text, '
        '"at_ts" timestamp without time zone, "at_ms" timestamp(3) without time zone, '
        '"at_tz" timestamp with time zone, "day" date, "blob" bytea, '
        '"amount" numeric(12,2), "span" interval, "big" text, _fl_xmin xid8 NOT NULL, '
        "_fl_xmax xid8, _fl_from_lsn pg_lsn NOT NULL, _fl_to_lsn pg_lsn, "
        "_fl_from timestamptz NOT NULL, _fl_to timestamptz, _fl_change pg_lsn NOT NULL)",
        'CREATE UNIQUE INDEX IF NOT EXISTS "h_public__T_v" ON freshline."h_public__T" '
        '("id", _fl_xmin)',
        'CREATE INDEX IF NOT EXISTS "h_public__T_o" ON freshline."h_public__T" ("id", _fl_change)',
        'CREATE INDEX IF NOT EXISTS "h_public__T_t" ON freshline."h_public__T" (_fl_from)',
        'CREATE INDEX IF NOT EXISTS "h_public__T_u0" ON freshline."h_public__T" USING btree (id)',
        'CREATE INDEX IF NOT EXISTS "h_public__T_u1" ON freshline."h_public__T" '
        "USING btree (day, note)",
    ]


def test_a_long_name_is_shortened_with_a_hash() -> None:
    name = history_table_name("public", "t" * 70)
    assert len(name.encode()) <= MAX_NAME
    assert name != history_table_name("public", "t" * 71)
    assert history_table_name("public", "transactions") == "h_public__transactions"
