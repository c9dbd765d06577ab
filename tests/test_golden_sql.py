"""Golden SQL: what the derived incremental path generates for the fraud example and
``tests/repos/shop``, compared with the files under ``tests/golden/``, so that a change
to the generated SQL shows in review as a change to those files.

Regenerate them (then read the diff) with::

    FRESHLINE_GOLDEN_UPDATE=1 .venv/bin/pytest tests/test_golden_sql.py

Unit tier: what generation asks of the database (the source tables' qualified names,
column types and collations, freshline's roles, partitions) is answered from the
tables as the fraud example's migrations and ``tests/test_aggregations.py`` make them
(:class:`Catalog`). Per feature set, one file per piece: ``tables`` (the partials, the
log, the heads), ``triggers`` (the trigger functions, then the triggers), ``fold`` (the
fold function), ``grants``, ``build`` (the fill of the partials at install),
``rebuild`` (of some keys) and ``query`` (the incremental read statement).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.core.declarations import AggKind
from freshline.pipeline.core.maintenance import DerivedPath, catalog
from freshline.pipeline.core.maintenance.kinds import KINDS
from freshline.pipeline.core.repository import load
from tests.test_aggregations import TABLES as SHOP_DDL

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
UPDATE = os.environ.get("FRESHLINE_GOLDEN_UPDATE") == "1"

FRAUD_TABLES = {
    "public.transactions": {
        "tenant_id": "text",
        "id": "bigint",
        "user_id": "bigint",
        "amount": "numeric(12,2)",
        "currency": "text",
        "merchant_id": "text",
        "device_id": "text",
        "ip": "inet",
        "status": "text",
        "created_at": "timestamp with time zone",
        "updated_at": "timestamp with time zone",
    },
    "public.geoip": {
        "ip_from": "inet",
        "ip_to": "inet",
        "country": "text",
        "city": "text",
        "asn": "integer",
    },
}
SHOP_TABLES = {
    "public.shop_orders": {
        "id": "bigint",
        "shop_id": "text",
        "customer_id": "text",
        "amount": "numeric(12,2)",
        "sku": "text",
        "status": "text",
        "placed_at": "timestamp with time zone",
    },
}
REPOSITORIES = {
    "fraud": (ROOT / "examples" / "fraud", FRAUD_TABLES, ["txn_90d", "geo"]),
    "shop": (ROOT / "tests" / "repos" / "shop", SHOP_TABLES, ["orders_30d"]),
}
PIECES = ["tables", "triggers", "fold", "grants", "build", "rebuild", "query"]


class Result:
    """The little of SQLAlchemy's ``Result`` that generation uses."""

    def __init__(self, rows: Sequence[tuple[Any, ...]]) -> None:
        self.rows = list(rows)

    def scalar(self) -> Any:
        return self.rows[0][0] if self.rows else None

    def scalar_one(self) -> Any:
        (row,) = self.rows
        return row[0]

    def scalars(self) -> Iterator[Any]:
        return iter([row[0] for row in self.rows])

    def all(self) -> list[tuple[Any, ...]]:
        return self.rows


@dataclass
class Catalog:
    """A connection that answers generation's catalog queries from ``tables`` (every
    ``text`` column collated, every type with a default btree equality, freshline's two
    roles, no partitions) and records every other statement it is given."""

    tables: dict[str, dict[str, str]]
    executed: list[str] = field(default_factory=list)

    def execute(self, clause: Any, params: dict[str, Any] | None = None) -> Result:
        sql, params = str(clause), params or {}
        if "to_regclass(:t)::text" in sql:
            name = str(params["t"])
            qualified = name if "." in name else f"public.{name}"
            return Result([(name,)] if qualified in self.tables else [])
        if "format_type(atttypid, atttypmod)" in sql:
            return Result(list(self.tables[str(params["t"])].items()))
        if "pg_opclass" in sql:
            return Result([(True,)])
        if "attcollation <> 0" in sql:
            columns = self.tables[str(params["t"])]
            return Result([(c,) for c in params["c"] if columns.get(c) == "text"])
        if "FROM pg_roles" in sql:
            return Result([("freshline_api",), ("freshline_consumer",)])
        if "pg_partition_tree(to_regclass(:t))" in sql:
            return Result([])
        self.executed.append(sql)
        return Result([])


def piece_of(statement: str) -> str:
    """Which golden file a statement of :meth:`DerivedPath.ddl` goes to."""
    if statement.startswith(("CREATE TABLE", "CREATE INDEX")):
        return "tables"
    if statement.startswith("CREATE OR REPLACE FUNCTION"):
        return (
            "fold" if re.match(r"CREATE OR REPLACE FUNCTION \S+_fold\(", statement) else "triggers"
        )
    if statement.startswith(("REVOKE", "GRANT")):
        return "grants"
    if statement.startswith(("DROP TRIGGER", "CREATE TRIGGER", "ALTER TABLE")):
        return "triggers"
    return "build"


# The order ddl() gives the pieces in: a piece's statements are contiguous but for the
# trigger functions, which come before the fold and the grants, and their triggers after.
DDL_ORDER = ["tables", "triggers", "fold", "grants", "triggers", "build"]


def generated(repo: str, name: str) -> dict[str, str]:
    """Each piece's text for feature set ``name`` of ``repo``."""
    root, tables, _ = REPOSITORIES[repo]
    path = load(root).registry[name].maintenance
    assert isinstance(path, DerivedPath)
    conn = Catalog(tables)
    ddl: list[str] = path.ddl(conn)  # type: ignore[arg-type]
    runs = [piece_of(s) for i, s in enumerate(ddl) if i == 0 or piece_of(ddl[i - 1]) != piece_of(s)]
    assert runs == DDL_ORDER, runs
    pieces: dict[str, list[str]] = {p: [] for p in PIECES}
    for statement in ddl:
        pieces[piece_of(statement)].append(statement)
    path.rebuild(conn, [("t1", "42"), ("t2", "7")])  # type: ignore[arg-type]
    pieces["rebuild"] = conn.executed
    fs = load(root).registry[name]
    pieces["query"] = [path.statement(fs)]
    return {p: _header(repo, name, p) + _joined(pieces[p]) for p in PIECES}


def _header(repo: str, name: str, piece: str) -> str:
    return (
        f"-- The {piece} of {repo}'s {name}, as freshline.pipeline.core.maintenance writes it.\n"
        "-- Generated: FRESHLINE_GOLDEN_UPDATE=1 pytest tests/test_golden_sql.py rewrites it.\n\n"
    )


def _joined(statements: list[str]) -> str:
    return "".join(f"{s.strip()};\n\n" for s in statements).rstrip("\n") + "\n"


CASES = [(repo, name) for repo, (_, _, names) in REPOSITORIES.items() for name in names]


@pytest.mark.parametrize(("repo", "name"), CASES, ids=[f"{r}-{n}" for r, n in CASES])
def test_generated_sql_is_the_golden_files(repo: str, name: str) -> None:
    """Every piece of feature set ``name``'s generated SQL equals its golden file, byte
    for byte (``FRESHLINE_GOLDEN_UPDATE=1`` writes them instead)."""
    for piece, text in generated(repo, name).items():
        golden = GOLDEN / repo / f"{name}.{piece}.sql"
        if UPDATE:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
            continue
        assert golden.exists(), f"{golden} is missing: FRESHLINE_GOLDEN_UPDATE=1 writes it"
        assert text == golden.read_text(), (
            f"the generated {piece} of {repo}/{name} differs from {golden.relative_to(ROOT)}: "
            "if the change is meant, FRESHLINE_GOLDEN_UPDATE=1 rewrites it (review the diff)"
        )


def test_every_aggregation_kind_has_its_class() -> None:
    assert sorted(KINDS) == sorted(get_args(AggKind))


@pytest.mark.parametrize(("repo", "name"), CASES, ids=[f"{r}-{n}" for r, n in CASES])
def test_the_recorded_catalog_is_what_postgres_says(repo: str, name: str, engine: Engine) -> None:
    """The answers the golden files are generated from are the database's own, for the
    tables as the fraud migrations and tests/test_aggregations.py make them (stack tier)."""
    root, tables, _ = REPOSITORIES[repo]
    path = load(root).registry[name].maintenance
    assert isinstance(path, DerivedPath)
    with engine.begin() as conn:
        if repo == "shop":
            for statement in SHOP_DDL.split(";"):
                if statement.strip():
                    conn.execute(sa.text(statement))
        real = catalog.source(conn, path)
        assert catalog.partitions(conn, real.table) == []
    assert real == catalog.source(Catalog(tables), path)  # type: ignore[arg-type]
