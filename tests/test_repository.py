"""Feature repositories: loading, definition errors, and the core guarantees on a
repository shaped unlike the fraud example (tests/repos/library: one tenant, uuid keys,
a reverse lookup, a feature set in invalidate mode), against the real Postgres and Redis.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from consumers.routing import Router
from pipeline.cache.recompute import compute
from pipeline.cache.store import FeatureStore
from pipeline.cdc.connect import PUBLICATION
from pipeline.core.errors import ConfigError, InvalidId
from pipeline.core.features import IMPLICIT_TENANT
from pipeline.core.repository import Repository, load
from pipeline.core.settings import Settings
from pipeline.core.types import ChangeEvent, EntityRef
from pipeline.deploy.plan import plan
from pipeline.deploy.warm import active_entities, count_active

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "tests" / "repos" / "library"
BROKEN = ROOT / "tests" / "repos" / "broken"
FRESHLINE = str(Path(sys.executable).with_name("freshline"))
T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)

TABLES = """
CREATE TABLE IF NOT EXISTS lib_members (member_id uuid PRIMARY KEY, name text NOT NULL,
                                        suspended boolean);
CREATE TABLE IF NOT EXISTS lib_books (book_id text PRIMARY KEY, title text NOT NULL,
                                      lost boolean NOT NULL DEFAULT false);
CREATE TABLE IF NOT EXISTS lib_loans (id bigserial PRIMARY KEY, member_id uuid NOT NULL,
                                      book_id text NOT NULL, loaned_at timestamptz NOT NULL,
                                      returned_at timestamptz);
"""


@pytest.fixture(scope="module")
def library(engine: Engine) -> Repository:
    with engine.begin() as conn:
        for statement in TABLES.split(";"):
            if statement.strip():
                conn.execute(sa.text(statement))
    return load(LIBRARY)


def member(engine: Engine, name: str, loans: list[tuple[str, bool]]) -> str:
    """A new member with ``loans`` of (book id, returned); its uuid."""
    key = str(uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO lib_members (member_id, name) VALUES (:m, :n)"),
            {"m": key, "n": name},
        )
        for i, (book, returned) in enumerate(loans):
            conn.execute(
                sa.text(
                    "INSERT INTO lib_books (book_id, title) VALUES (:b, :b) ON CONFLICT DO NOTHING"
                ),
                {"b": book},
            )
            conn.execute(
                sa.text(
                    "INSERT INTO lib_loans (member_id, book_id, loaned_at, returned_at) "
                    "VALUES (:m, :b, :at, :back)"
                ),
                {
                    "m": key,
                    "b": book,
                    "at": T0 + timedelta(days=i),
                    "back": T0 if returned else None,
                },
            )
    return key


# -- loading ----------------------------------------------------------------------------


def test_a_repository_loads_its_entities_tables_and_feature_sets(library: Repository) -> None:
    assert library.name == "library" and library.schema_version == 3
    assert library.registry.names() == ["loans_now", "standing"]
    entity = library.registry["loans_now"].entity
    assert (entity.name, entity.type, entity.tenant, entity.columns) == (
        "member",
        "uuid",
        None,
        ("member_id",),
    )
    assert library.table_names() == ["lib_books", "lib_loans", "lib_members"]
    assert library.registry["standing"].mode == "invalidate"
    assert library.registry["loans_now"].ttl_s == 600
    assert library.registry["loans_now"].origin.startswith(f"{LIBRARY / 'definitions.py'}:")


def write_repo(tmp_path: Path, body: str) -> Path:
    (tmp_path / "freshline.toml").write_text('[project]\nname = "scratch"\n')
    (tmp_path / "features.py").write_text(
        "from freshline import Entity, Event, EventField, FeatureSet, Field, Table\n" + body
    )
    return tmp_path


@pytest.mark.parametrize(
    ("body", "line", "message"),
    [
        ('m = Entity("m", key="id", type="int")\n', 2, "key type 'int' is not one of"),
        (
            'm = Entity("m")\nf = FeatureSet("f", entity=m, ttl="1h",\n'
            '    fields=[Field("x", "decimal")], query="SELECT 1")\n',
            4,
            "type 'decimal' is not one of",
        ),
        (
            'm = Entity("m")\nf = FeatureSet("f", entity=m, ttl="soon", query="")\n',
            3,
            "expected a duration",
        ),
        (
            'm = Entity("m")\nt = Table("t")\nf = FeatureSet("f", entity=m, ttl=1, sources=[t])\n',
            4,
            "table 't' routes no change to entity 'm'",
        ),
    ],
)
def test_a_bad_definition_names_its_file_and_line(
    tmp_path: Path, body: str, line: int, message: str
) -> None:
    repo = write_repo(tmp_path, body)
    with pytest.raises(ConfigError) as raised:
        load(repo)
    assert str(raised.value).startswith(f"{repo / 'features.py'}:{line}: "), raised.value
    assert message in str(raised.value)


def test_two_feature_sets_with_one_name_are_refused(tmp_path: Path) -> None:
    repo = write_repo(
        tmp_path,
        'm = Entity("m")\na = FeatureSet("same", entity=m, ttl=1, query="")\n'
        'b = FeatureSet("same", entity=m, ttl=1, query="")\n',
    )
    with pytest.raises(
        ConfigError,
        match=r"features.py:4: two feature sets are named 'same' "
        r"\(the other at .*features.py:3\)",
    ):
        load(repo)


EVENTS = (
    'm = Entity("m", tenant="org")\nt = Table("t", entities={m: "m_id"})\n'
    'u = Table("u", reverse={m: "SELECT org, m_id FROM t WHERE org = :org AND u = :u_id"},\n'
    '    tenant="org")\n'
    'f = FeatureSet("f", entity=m, ttl=1, sources=[t, u], query="")\n'
)


def test_a_repository_collects_its_events(tmp_path: Path) -> None:
    repo = load(
        write_repo(
            tmp_path,
            EVENTS + 'e = Event("t.made", table=t, op="c")\n'
            'g = Event("u.changed", table=u, fields={"u_key": EventField("u_id", "uuid")})\n',
        )
    )
    assert [(e.topic, e.op, e.required) for e in repo.events] == [
        ("t.made", "c", ("tenant", "m_id")),
        ("u.changed", "u", ("tenant", "u_key")),
    ]
    assert repo.events[0].origin == f"{tmp_path / 'features.py'}:7"


@pytest.mark.parametrize(
    ("body", "line", "message"),
    [
        (
            'e = Event("t.made", table=t)\ng = Event("t.made", table=t, op="c")\n',
            8,
            "two events have the topic 't.made' (the other at ",
        ),
        (
            'v = Table("v", entities={m: "m_id"})\ne = Event("v.made", table=v)\n',
            8,
            "event 'v.made': no feature set reads table 'v'",
        ),
        ('e = Event("u.changed", table=u)\n', 7, "reverse queries take :u_id; declare each"),
        ('e = Event("t.made", table=t, op="d")\n', 7, "op 'd' is not 'c' or 'u'"),
    ],
)
def test_a_bad_event_names_its_file_and_line(
    tmp_path: Path, body: str, line: int, message: str
) -> None:
    repo = write_repo(tmp_path, EVENTS + body)
    with pytest.raises(ConfigError) as raised:
        load(repo)
    assert str(raised.value).startswith(f"{repo / 'features.py'}:{line}: "), raised.value
    assert message in str(raised.value)


def test_no_repository_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no feature repository at .*freshline init"):
        load(tmp_path)


# -- computing and routing --------------------------------------------------------------


def test_uuid_keys_of_the_one_tenant_are_computed_and_others_refused(
    library: Repository, engine: Engine
) -> None:
    fs = library.registry["loans_now"]
    ada = member(engine, "ada", [("b-1", False), ("b-2", True), ("b-3", False)])
    nobody = str(uuid.uuid4())
    batch = compute(engine, fs, [(IMPLICIT_TENANT, ada), (IMPLICIT_TENANT, nobody)])
    assert batch.values[(IMPLICIT_TENANT, ada)] == {
        "open_loans": 2,
        "lost_books": 0,
        "last_loan_at": int((T0 + timedelta(days=2)).timestamp() * 1000),
    }
    assert batch.values[(IMPLICIT_TENANT, nobody)]["open_loans"] == 0
    with pytest.raises(InvalidId, match="uuid"):
        compute(engine, fs, [(IMPLICIT_TENANT, ada.upper())])
    with pytest.raises(InvalidId, match="single-tenant"):
        compute(engine, fs, [("acme", ada)])


def test_a_change_reaches_the_old_and_new_member_and_a_book_its_borrowers(
    library: Repository, engine: Engine
) -> None:
    first = member(engine, "first", [("shared-1", False)])
    second = member(engine, "second", [("shared-1", True)])
    router = Router(library.registry)
    moved = ChangeEvent(
        table="lib_loans",
        op="u",
        tenant=None,
        row={"id": 1, "member_id": second},
        before={"member_id": first},
    )
    lost = ChangeEvent(
        table="lib_books", op="u", tenant=None, row={"book_id": "shared-1", "lost": True}
    )
    renamed = ChangeEvent(
        table="lib_members", op="u", tenant=None, row={"member_id": first, "name": "x"}
    )
    with engine.connect() as conn:
        assert router.route(conn, [moved]) == {
            "loans_now": {(IMPLICIT_TENANT, first), (IMPLICIT_TENANT, second)}
        }
        assert router.route(conn, [lost]) == {
            "loans_now": {(IMPLICIT_TENANT, first), (IMPLICIT_TENANT, second)}
        }
        assert router.route(conn, [renamed]) == {
            "loans_now": {(IMPLICIT_TENANT, first)},
            "standing": {(IMPLICIT_TENANT, first)},
        }


def test_writes_are_conditional_and_reads_return_the_newest(
    library: Repository, engine: Engine, redis_client: redis.Redis
) -> None:
    fs = library.registry["loans_now"]
    key = member(engine, "cond", [("c-1", False)])
    store = FeatureStore(
        redis_client, 900_000 + uuid.uuid4().int % 90_000, registry=library.registry
    )
    ref = EntityRef(fs.name, IMPLICIT_TENANT, key)
    older = compute(engine, fs, [(IMPLICIT_TENANT, key)])
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE lib_loans SET returned_at = now() WHERE member_id = :m"), {"m": key}
        )
    newer = compute(engine, fs, [(IMPLICIT_TENANT, key)])
    assert newer.watermark > older.watermark
    assert store.write(newer).written == 1
    assert store.write(older).written == 0  # the stale one never replaces the fresh one
    (entry,) = store.read([ref])
    assert entry is not None and entry.values["open_loans"] == 0
    assert redis_client.pttl(store.key(ref)) > 0  # every key has a TTL
    store.invalidate([ref], newer.watermark + 1)
    assert store.read([ref]) == [None]


# -- plan -------------------------------------------------------------------------------


def test_plan_passes_the_library_and_lists_what_it_needs(
    library: Repository, engine: Engine
) -> None:
    result = plan(library, engine, library.schema_version, PUBLICATION)
    assert result.problems == []
    assert result.lock == "new"  # tests/repos/library has no lock yet
    assert result.tables == ["lib_books", "lib_loans", "lib_members"]
    # lib_loans routes by member_id, not its primary key: a delete's before-image needs it;
    # lib_books routes by its primary key (the reverse lookup's :book_id), which it has
    assert result.replica_identity == {"lib_loans": "ALTER TABLE lib_loans REPLICA IDENTITY FULL"}
    assert set(result.publication_missing) == set(result.tables)


def test_plan_names_each_bad_definition_with_its_line(library: Repository, engine: Engine) -> None:
    broken = load(BROKEN)
    problems = plan(broken, engine, 1, PUBLICATION).problems
    where = str(BROKEN / "definitions.py")
    assert any(
        p.startswith(f"{where}:10: feature set 'swapped'") and "in order" in p for p in problems
    ), problems
    assert any(
        p.startswith(f"{where}:18: feature set 'mistyped'")
        and "declared int but the query returns text" in p
        for p in problems
    ), problems
    assert any(
        p.startswith(f"{where}:26: ") and "unknown table 'lib_ghosts'" in p for p in problems
    ), problems
    assert any(
        p.startswith(f"{where}:34: ") and "has no column 'owner_id'" in p for p in problems
    ), problems


def test_warming_lists_the_active_entities_of_a_single_tenant_uuid_entity(
    library: Repository, engine: Engine
) -> None:
    entity = library.registry["loans_now"].entity
    active = {member(engine, f"active-{i}", []) for i in range(3)}
    suspended = member(engine, "suspended", [])
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE lib_members SET suspended = true WHERE member_id = :m"),
            {"m": suspended},
        )
    batches = list(active_entities(engine, entity, [IMPLICIT_TENANT], batch_size=2))
    flat = [ref for batch in batches for ref in batch]
    assert all(len(batch) <= 2 for batch in batches)
    assert len(flat) == len(set(flat)) == count_active(engine, entity, [IMPLICIT_TENANT])
    assert {(IMPLICIT_TENANT, m) for m in active} <= set(flat)
    assert (IMPLICIT_TENANT, suspended) not in flat


@pytest.fixture
def freshline(settings: Settings) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the freshline CLI against the test database."""
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_POSTGRES_ADMIN_URL": settings.postgres_url,
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [FRESHLINE, *args], capture_output=True, text=True, env=env, timeout=60
        )

    return run


def test_init_makes_a_repository_that_plan_checks(
    tmp_path: Path, freshline: Callable[..., subprocess.CompletedProcess[str]], library: Repository
) -> None:
    repo = tmp_path / "myrepo"
    made = freshline("init", str(repo))
    assert made.returncode == 0, made.stderr
    assert (repo / "freshline.toml").is_file() and (repo / "features.py").is_file()
    again = freshline("init", str(repo))
    assert again.returncode == 2 and "already exist" in again.stderr
    # Its example names tables this database does not have: plan says so and fails.
    planned = freshline("--repo", str(repo), "plan")
    assert planned.returncode == 1
    assert "unknown table 'members'" in planned.stderr and "Traceback" not in planned.stderr
    good = freshline("--repo", str(LIBRARY), "plan")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "plan: ok" in good.stdout and "REPLICA IDENTITY FULL" in good.stdout


# -- the incremental extension point ---------------------------------------------------


def test_an_incremental_query_needs_its_maintenance_and_recomputes_go_through_it() -> None:
    from freshline import IncrementalPath
    from pipeline.core.features import Entity, FeatureSet, Field, Registry, Source

    class Recorded(IncrementalPath):
        """Records the statements asked of it; the SQL it returns is the full query."""

        def __init__(self) -> None:
            self.asked: list[str] = []

        def statement(self, fs: Any) -> str:
            self.asked.append(fs.name)
            return f"-- via the path\n{fs.query}"

        def rebuild(self, conn: Any, keys: Any) -> None:
            raise AssertionError("not called here")

        def fold(self, db: Any, *, max_keys: int, wait: bool) -> int | None:
            return 0

        def pending(self, db: Any) -> tuple[int, int]:
            return 0, 0

    thing = Entity("thing", key="thing_id", type="text")
    shape = dict(
        entity=thing,
        ttl="1h",
        sources=[Source("things", ("thing_id",))],
        fields=[Field("n", "int")],
        query="SELECT k.thing_id, 1 AS n FROM keys k",
    )
    with pytest.raises(ConfigError, match="go together"):
        FeatureSet("a", incremental="SELECT 1", **shape)  # type: ignore[arg-type]
    path = Recorded()
    a = FeatureSet("a", incremental="SELECT 1", maintenance=path, **shape)  # type: ignore[arg-type]
    b = FeatureSet("b", incremental="SELECT 2", maintenance=path, **shape)  # type: ignore[arg-type]
    plain = FeatureSet("c", **shape)  # type: ignore[arg-type]
    assert Registry([a, b, plain]).maintenances() == [path]  # each path once
    assert a.sql("full") == a.statement.text and path.asked == []
    assert a.sql("incremental").startswith("-- via the path") and path.asked == ["a"]
    with pytest.raises(ConfigError, match="no incremental path"):
        plain.sql("incremental")
