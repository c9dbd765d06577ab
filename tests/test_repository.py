"""Feature repositories: loading, definition errors, and the core guarantees on a
repository shaped unlike the fraud example (tests/repos/library: one tenant, uuid keys,
a reverse lookup, a feature set in invalidate mode), against the real Postgres and Redis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.consumers.kafka import admin_client
from freshline.consumers.processor import Processor
from freshline.consumers.routing import Router
from freshline.consumers.topics import ensure, ensure_cdc_topics, managed
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import TenantExists, create_api_key, create_tenant
from freshline.pipeline.cache.readthrough import Hooks, ReadThrough
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.versions import Pointer, VersionResolver, WriteVersions
from freshline.pipeline.cdc.connect import (
    PUBLICATION,
    ConnectClient,
    connector_config,
    drop_slot,
    names,
    streaming,
)
from freshline.pipeline.core.db import make_engine
from freshline.pipeline.core.errors import ConfigError, InvalidId
from freshline.pipeline.core.features import IMPLICIT_TENANT
from freshline.pipeline.core.keys import feature_key
from freshline.pipeline.core.lock import Lock, LockedSet
from freshline.pipeline.core.repository import Repository, load
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import qualified
from freshline.pipeline.core.types import ChangeEvent, EntityRef
from freshline.pipeline.deploy.plan import plan
from freshline.pipeline.deploy.pointer import flip, start
from freshline.pipeline.deploy.warm import active_entities, count_active, warm
from tests.helpers import (
    FRESHLINE,
    cli,
    drop_database,
    fresh_version,
    paused_reader,
    recreate_database,
    running,
    wait_until,
)
from tests.pipeline.cache.test_readthrough import read_at_once
from tests.pipeline.deploy.test_deploy import under_load

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "tests" / "repos" / "library"
BROKEN = ROOT / "tests" / "repos" / "broken"
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


def create_tables(engine: Engine) -> None:
    with engine.begin() as conn:
        for statement in TABLES.split(";"):
            if statement.strip():
                conn.execute(sa.text(statement))


@pytest.fixture(scope="module")
def library(engine: Engine) -> Repository:
    create_tables(engine)
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
        compute(engine, fs, [(IMPLICIT_TENANT, ada[:-1])])
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
    store = EntryStore(redis_client, 900_000 + uuid.uuid4().int % 90_000, registry=library.registry)
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
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_POSTGRES_ADMIN_URL": settings.postgres_url,
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return cli(*args, **env)

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
    from freshline.pipeline.core.features import Entity, FeatureSet, Field, Registry, Source

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


# -- the core guarantees on the library ---------------------------------------------------
#
# The same public pieces the fraud example's tests drive (read-through, processor, store,
# deploy, API, consumer), each given the library's registry: nothing here depends on the
# active repository, except the consumer process, which is pointed at the library.


def loan_change(key: str) -> ChangeEvent:
    """A change to one of ``key``'s loans, as the decoder hands it to the processor."""
    return ChangeEvent(table="lib_loans", op="u", tenant=None, row={"member_id": key})


def member_change(key: str) -> ChangeEvent:
    return ChangeEvent(table="lib_members", op="u", tenant=None, row={"member_id": key})


@pytest.mark.parametrize(
    ("feature_set", "change", "event", "field", "old", "new"),
    [
        (
            "loans_now",
            "UPDATE lib_loans SET returned_at = now() WHERE member_id = :m",
            loan_change,
            "open_loans",
            1,
            0,
        ),
        (
            "standing",
            "UPDATE lib_members SET suspended = true WHERE member_id = :m",
            member_change,
            "suspended",
            False,
            True,
        ),
    ],
)
def test_no_stale_set_when_a_change_lands_mid_read_through(
    library: Repository,
    engine: Engine,
    redis_client: redis.Redis,
    feature_set: str,
    change: str,
    event: Callable[[str], ChangeEvent],
    field: str,
    old: object,
    new: object,
) -> None:
    """A reader holds its lease and has queried Postgres; a change commits and the
    consumer applies it (a recompute, or a tombstone in invalidate mode); the reader's
    older result goes to its caller, never into Redis."""
    key = member(engine, f"race-{feature_set}", [(f"race-{uuid.uuid4().hex[:8]}", False)])
    version = fresh_version()
    store = EntryStore(redis_client, version, registry=library.registry)
    rt = ReadThrough(store, engine, early_refresh=False)
    ref = EntityRef(feature_set, IMPLICIT_TENANT, key)
    reader = paused_reader(rt, ref)
    with engine.begin() as conn:
        conn.execute(sa.text(change), {"m": key})
    processor = Processor(
        engine, redis_client, versions=lambda: [version], registry=library.registry
    )
    processor.apply([event(key)])
    answer = reader.finish()
    assert answer.source == "computed" and answer.values[field] == old
    assert (rt.counters.stored, rt.counters.refused) == (0, 1)
    [served] = store.read([ref])
    rt.hooks.after_compute = None
    if library.registry[feature_set].mode == "recompute":
        assert served is not None and served.values[field] == new  # the consumer's stands
        assert rt.get(ref).source == "hit"
    else:
        assert served is None and redis_client.exists(store.key(ref))  # a tombstone
        fresh = rt.get(ref)  # the next read computes after the change, and stores it
        assert fresh.source == "computed" and fresh.values[field] == new
        assert rt.counters.stored == 1


def test_sixteen_threads_on_one_missing_uuid_key_compute_once(
    library: Repository, engine: Engine, redis_client: redis.Redis
) -> None:
    key = member(engine, "stampede", [(f"stampede-{uuid.uuid4().hex[:8]}", False)])
    calls: list[int] = []
    lock = threading.Lock()

    def count(group: list[EntityRef]) -> None:
        with lock:
            calls.append(len(group))

    store = EntryStore(redis_client, fresh_version(), registry=library.registry)
    rt = ReadThrough(store, engine, hooks=Hooks(before_compute=count), early_refresh=False)
    results = read_at_once(rt, EntityRef("loans_now", IMPLICIT_TENANT, key))
    assert calls == [1]
    assert len(results) == 16 and {r.values["open_loans"] for r in results} == {1}


@pytest.fixture(scope="module")
def implicit_tenant_key(engine: Engine) -> str:
    """An API key of the library's one tenant (``default``): a user of a single-tenant
    repository creates that tenant and its keys as any other."""
    try:
        return create_tenant(engine, IMPLICIT_TENANT)
    except TenantExists:  # another module of the session made it
        return create_api_key(engine, IMPLICIT_TENANT)


def test_the_api_serves_the_one_tenant_and_a_key_of_another_gets_nothing(
    library: Repository,
    engine: Engine,
    redis_client: redis.Redis,
    settings: Settings,
    implicit_tenant_key: str,
) -> None:
    """Over HTTP: uuid ids are served to a key of the implicit tenant; a key of any other
    tenant gets nothing of it (docs/repositories.md: "a key of another tenant gets
    nothing")."""
    version = fresh_version()
    local = settings.model_copy(update={"schema_version": version, "local_cache_size": 0})
    ada = member(engine, "api", [(f"api-{uuid.uuid4().hex[:8]}", False)] * 2)
    truth = compute(engine, library.registry["loans_now"], [(IMPLICIT_TENANT, ada)])
    stranger = f"lib-other-{uuid.uuid4().hex[:8]}"
    other = create_tenant(engine, stranger)
    app = create_app(
        local,
        engine=engine,
        redis_client=redis_client,
        registry=library.registry,
        follow_deploys=False,
    )
    with running(app, implicit_tenant_key) as api:
        first = api.get(f"/v1/features/loans_now/{ada}")
        assert first.status_code == 200, first.text
        assert first.json()["values"] == truth.values[(IMPLICIT_TENANT, ada)]
        assert first.json()["values"]["open_loans"] == 2
        again = api.get(f"/v1/features/loans_now/{ada}?mode=cache-only")
        assert again.status_code == 200 and again.json()["source"] == "hit"
        batch = api.post(
            "/v1/features/batch",
            json={"feature_sets": ["loans_now", "standing"], "entities": [ada]},
        )
        assert batch.status_code == 200, batch.text
        assert [i["values"] is not None for i in batch.json()["items"]] == [True, True]
        # The entries are the implicit tenant's: that is the key space served.
        stored = EntityRef("loans_now", IMPLICIT_TENANT, ada)
        assert redis_client.exists(feature_key(version, stored))
        # The API's own document describes these ids: uuids, not the fraud example's.
        doc = api.get("/openapi.json").json()
        (param,) = [
            p
            for p in doc["paths"]["/v1/features/{feature_set}/{entity_id}"]["get"]["parameters"]
            if p["name"] == "entity_id"
        ]
        assert re.fullmatch(param["schema"]["pattern"], ada)
        assert not re.fullmatch(param["schema"]["pattern"], "7")
        items = doc["components"]["schemas"]["BatchRequest"]["properties"]["entities"]["items"]
        assert items == param["schema"]  # no integers: this repository has no bigint keys

        # A key of any other tenant reads nothing: refused where it would compute,
        # a miss where it may only read the cache, and nothing stored for it.
        refused = api.get(f"/v1/features/loans_now/{ada}", key=other)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "invalid_id"
        assert "single-tenant" in refused.json()["error"]["message"]
        missed = api.get(f"/v1/features/loans_now/{ada}?mode=cache-only", key=other)
        assert missed.status_code == 404 and missed.json()["error"]["code"] == "miss"
        foreign_batch = api.post(
            "/v1/features/batch?mode=cache-only",
            json={"feature_sets": ["loans_now", "standing"], "entities": [ada]},
            key=other,
        )
        assert "open_loans" not in foreign_batch.text
        assert foreign_batch.status_code == 200, foreign_batch.text
        assert [i["values"] for i in foreign_batch.json()["items"]] == [None, None]
        assert not redis_client.exists(
            *(
                feature_key(version, EntityRef(fs, stranger, ada))
                for fs in ("loans_now", "standing")
            )
        )
        # Ids are checked as the entity's type: a uuid in either case reads the entry of
        # its lower-case spelling; anything else that is not a uuid is refused.
        upper = api.get(f"/v1/features/loans_now/{ada.upper()}")
        assert upper.status_code == 200, upper.text
        lower = api.get(f"/v1/features/loans_now/{ada}")
        assert upper.json()["values"] == lower.json()["values"]
        short = api.get(f"/v1/features/loans_now/{ada[:-1]}")
        assert short.status_code == 400 and short.json()["error"]["code"] == "invalid_id"


def test_a_deploy_warms_the_new_version_and_readers_move_to_it_whole(
    library: Repository, engine: Engine, redis_client: redis.Redis, settings: Settings
) -> None:
    sets = library.registry.names()
    a, b = fresh_version(), fresh_version()
    entry = {fs.name: LockedSet.of(fs) for fs in library.registry}
    lock = Lock({a: entry, b: entry})
    pointer = Pointer.scoped(uuid.uuid4().hex)
    local = settings.model_copy(update={"schema_version": a})
    r, reg = redis_client, library.registry
    keys = [
        member(engine, f"deploy-{i}", [(f"dep-{uuid.uuid4().hex[:8]}", False)]) for i in range(4)
    ]
    refs = [EntityRef(fs, IMPLICIT_TENANT, k) for k in keys for fs in sets]
    resolver = VersionResolver(r, local, pointer=pointer, lock=lock, max_age_s=0)
    rt = ReadThrough(EntryStore(r, a, registry=reg), engine, early_refresh=False, versions=resolver)
    writes = WriteVersions(r, local, pointer=pointer, lock=lock, registry=reg, max_age_s=0)
    processor = Processor(engine, r, versions=writes, registry=reg)
    try:
        flip(r, local, a, lock, pointer=pointer, registry=reg)
        assert {x.schema_version for x in rt.get_many(refs)} == {a}
        assert all(x.hit for x in rt.get_many(refs))

        start(r, local, b, lock, pointer=pointer)
        assert writes() == [a, b]
        entity = reg["loans_now"].entity
        for name in sets:
            batches = active_entities(engine, entity, [IMPLICIT_TENANT], batch_size=50)
            warmed = warm(r, engine, b, name, batches, lock, registry=reg)
            assert (
                warmed.written == warmed.entities == count_active(engine, entity, [IMPLICIT_TENANT])
            )
        # A change during the deploy: the consumer writes both namespaces.
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE lib_loans SET returned_at = now() WHERE member_id = :m"),
                {"m": keys[0]},
            )
        assert processor.apply([loan_change(keys[0])]).writes.written == 2
        changed = EntityRef("loans_now", IMPLICIT_TENANT, keys[0])
        for version in (a, b):
            [found] = EntryStore(r, version, registry=reg).read([changed])
            assert found is not None and found.values["open_loans"] == 0

        def read() -> list[tuple[int, bool]]:
            return [(x.schema_version, x.hit) for x in rt.get_many(refs)]

        def deploy() -> None:
            flip(r, local, b, lock, pointer=pointer, registry=reg)

        rounds, before = under_load(read, deploy)
        assert all(len({v for v, _ in answer}) == 1 for answer in rounds)  # never mixed
        assert rounds[0][0][0] == a and {v for v, _ in rounds[-1]} == {b}
        assert all(v == b for answer in rounds[before + 1 :] for v, _ in answer)
        assert all(hit for answer in rounds for _, hit in answer)  # warmed: no miss storm
        assert writes() == [b, a]  # the old one stays written for a TTL: a rollback is safe
        served = {x.ref: x.values for x in rt.get_many(refs)}
        assert served[changed]["open_loans"] == 0
        truth = {
            name: compute(engine, reg[name], [(IMPLICIT_TENANT, k) for k in keys]).values
            for name in sets
        }
        assert served == {ref: truth[ref.feature_set][(ref.tenant, ref.entity)] for ref in refs}
    finally:
        r.delete(
            pointer.active_key,
            pointer.next_key,
            pointer.previous_key,
            pointer.retired_key(a),
            pointer.retired_key(b),
        )


@pytest.fixture(scope="module")
def own_engine(base_settings: Settings) -> Iterator[Engine]:
    """A database of the module's own with the library's tables: a TRUNCATE, and the
    CDC test's publication and replication slot, stay out of the session's database."""
    name = f"freshline_library_{uuid.uuid4().hex[:8]}"
    url = recreate_database(base_settings, name)
    own = make_engine(base_settings.model_copy(update={"postgres_url": url}))
    create_tables(own)
    yield own
    own.dispose()
    drop_database(base_settings, name)


def test_a_truncate_of_loans_voids_the_sets_it_feeds_and_later_entries_serve(
    library: Repository, own_engine: Engine, redis_client: redis.Redis
) -> None:
    version = fresh_version()
    store = EntryStore(redis_client, version, registry=library.registry)
    loans_now, standing = library.registry["loans_now"], library.registry["standing"]
    keys = [member(own_engine, f"trunc-{i}", [(f"trunc-{i}", False)]) for i in range(3)]
    pairs = [(IMPLICIT_TENANT, k) for k in keys]
    before = compute(own_engine, loans_now, pairs)
    assert store.write(before).written == 3
    assert store.write(compute(own_engine, standing, pairs)).written == 3
    with own_engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE lib_loans"))
    processor = Processor(
        own_engine, redis_client, versions=lambda: [version], registry=library.registry
    )
    # What the decoder makes of Debezium's truncate envelope: no row, op "t".
    report = processor.apply([ChangeEvent(table="lib_loans", op="t", tenant=None, row={})])
    assert {(i.feature_set, i.entity) for i in report.invalidations} == {("loans_now", "*")}
    loans = [EntityRef("loans_now", t, k) for t, k in pairs]
    assert store.read(loans) == [None] * 3  # every entry computed before it
    assert None not in store.read([EntityRef("standing", t, k) for t, k in pairs])
    assert store.write(before).written == 0  # a result from before it is refused
    after = compute(own_engine, loans_now, pairs)
    assert store.write(after).written == 3
    assert [e.values["open_loans"] if e else None for e in store.read(loans)] == [0, 0, 0]


CDC_DEADLINE_S = 90.0


@pytest.mark.kafka
@pytest.mark.connect
def test_plain_sql_reaches_the_served_entries_through_debezium(
    library: Repository,
    own_engine: Engine,
    settings: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    """Changes made with plain SQL, captured by a Debezium connector of the test's own,
    applied by ``freshline consume`` on the library repository: a recompute reaches the
    served value, a reverse lookup reaches every borrower of a book, the invalidate-mode
    set is tombstoned, and a TRUNCATE voids what the table feeds."""
    tag = uuid.uuid4().hex[:8]
    version = fresh_version()
    local = settings.model_copy(
        update={
            "postgres_url": own_engine.url.render_as_string(hide_password=False),
            "topic_prefix": f"lib{tag}.",
            "consumer_group": f"test-lib-{tag}",
            "schema_version": version,
            "topic_partitions": 2,
        }
    )
    owned = dataclasses.replace(names(local), publication=f"lib_{tag}")
    tables = library.table_names()
    topics = [owned.topic(t) for t in tables]
    managed_topics = [qualified(local, t) for t in managed(library)]
    admin = admin_client(local)
    connect = ConnectClient(local.connect_url)
    with own_engine.begin() as conn:
        conn.execute(
            sa.text(f"CREATE PUBLICATION {owned.publication} FOR TABLE {', '.join(tables)}")
        )
        conn.execute(sa.text("ALTER TABLE lib_loans REPLICA IDENTITY FULL"))  # as plan says
    ensure(admin, 2, topics=managed_topics)
    ensure_cdc_topics(local, topics)
    store = EntryStore(redis_client, version, registry=library.registry)
    log = tmp_path / "consume.log"
    consumer: subprocess.Popen[bytes] | None = None

    def served(feature_set: str, key: str) -> dict[str, Any] | None:
        [entry] = store.read([EntityRef(feature_set, IMPLICIT_TENANT, key)])
        return None if entry is None else dict(entry.values)

    def until(condition: Callable[[], bool], what: str) -> None:
        if not wait_until(condition, CDC_DEADLINE_S):
            pytest.fail(f"timed out waiting for {what}; consumer log:\n{log.read_text()[-3000:]}")

    try:
        connect.put_config(
            owned.connector,
            connector_config(local, owned, snapshot_mode="no_data", tables=tables),
        )
        # Commits after the slot exists are captured; the consumer reads from the start.
        until(
            lambda: streaming(connect, own_engine, owned),
            "the connector to run and create its slot",
        )
        with log.open("wb") as out:
            consumer = subprocess.Popen(
                [FRESHLINE, "consume", "--metrics-port", "0"],
                env={
                    **os.environ,
                    "FRESHLINE_REPO": str(LIBRARY),
                    "FRESHLINE_POSTGRES_URL": local.postgres_url,
                    "FRESHLINE_REDIS_URL": local.redis_url,
                    "FRESHLINE_TOPIC_PREFIX": local.topic_prefix,
                    "FRESHLINE_CONSUMER_GROUP": local.consumer_group,
                    "FRESHLINE_SCHEMA_VERSION": str(version),
                    "FRESHLINE_BATCH_MAX_WAIT_MS": "20",
                },
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        book, shared = f"cdc-{tag}-1", f"cdc-{tag}-2"
        ada = member(own_engine, "ada", [(book, False), (shared, False)])
        bob = member(own_engine, "bob", [(shared, True)])

        # Inserts: the recomputed entry is served.
        until(lambda: (served("loans_now", ada) or {}).get("open_loans") == 2, "ada's loans")
        bobs = compute(own_engine, library.registry["loans_now"], [(IMPLICIT_TENANT, bob)])
        until(lambda: served("loans_now", bob) == bobs.values[(IMPLICIT_TENANT, bob)], "bob's")

        # An update of a loan: recomputed.
        with own_engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE lib_loans SET returned_at = now() WHERE book_id = :b"), {"b": book}
            )
        until(lambda: (served("loans_now", ada) or {}).get("open_loans") == 1, "the return")

        # A book marked lost: the reverse lookup reaches every member who borrowed it.
        with own_engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE lib_books SET lost = true WHERE book_id = :b"), {"b": shared}
            )
        until(
            lambda: all((served("loans_now", m) or {}).get("lost_books") == 1 for m in (ada, bob)),
            "the lost book to reach both borrowers",
        )

        # Invalidate mode: the insert of ada's row tombstoned her `standing` key; an entry
        # written after it is served until her row changes, then tombstoned, not recomputed.
        standing = EntityRef("standing", IMPLICIT_TENANT, ada)
        until(lambda: redis_client.exists(store.key(standing)) == 1, "ada's standing tombstone")
        computed = compute(own_engine, library.registry["standing"], [(IMPLICIT_TENANT, ada)])
        assert store.write(computed).written == 1
        assert served("standing", ada) == {"name": "ada", "suspended": False}
        with own_engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE lib_members SET suspended = true WHERE member_id = :m"), {"m": ada}
            )
        until(lambda: served("standing", ada) is None, "ada's standing to be invalidated")
        assert (
            redis_client.exists(store.key(standing)) and redis_client.pttl(store.key(standing)) > 0
        )
        fresh = ReadThrough(store, own_engine, early_refresh=False).get(standing)
        assert fresh.source == "computed" and fresh.values["suspended"] is True

        # TRUNCATE: every loans_now entry from before it reads as absent.
        stale = compute(own_engine, library.registry["loans_now"], [(IMPLICIT_TENANT, ada)])
        with own_engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE lib_loans"))
        until(
            lambda: served("loans_now", ada) is None and served("loans_now", bob) is None,
            "the truncate to void the loans_now entries",
        )
        assert served("standing", ada) is not None  # lib_loans does not feed standing
        assert store.write(stale).written == 0
        after = compute(own_engine, library.registry["loans_now"], [(IMPLICIT_TENANT, ada)])
        assert store.write(after).written == 1
        assert (served("loans_now", ada) or {}).get("open_loans") == 0
    finally:
        if consumer is not None:
            consumer.terminate()  # SIGTERM: finish the batch, commit, print the totals
            try:
                consumer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                consumer.kill()
                consumer.wait(timeout=30)
        connect.delete(owned.connector)
        drop_slot(own_engine, owned.slot)
        with own_engine.begin() as conn:
            conn.execute(sa.text(f"DROP PUBLICATION IF EXISTS {owned.publication}"))
        leftovers = [*topics, *managed_topics, owned.heartbeat_topic]
        for future in admin.delete_topics(leftovers, operation_timeout=10).values():
            with contextlib.suppress(Exception):  # a topic never created (no heartbeat yet)
                future.result()
    assert consumer is not None and consumer.returncode == 0, log.read_text()[-3000:]
    assert ", dead-lettered 0," in log.read_text(), log.read_text()[-3000:]
