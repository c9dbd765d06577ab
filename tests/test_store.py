"""``freshline.FeatureStore``, the entry object: one per repository, explicit, so one
process holds two repositories (the fraud example and tests/repos/library) and reads
both, as the API's least-privilege logins of ``.stack/env``, on the real Postgres and
Redis."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import freshline
from fraud.seed import SeedSummary
from freshline import IMPLICIT_TENANT, FeatureStore
from freshline.pipeline.api.accounts import TenantExists, create_api_key, create_tenant
from freshline.pipeline.core.errors import UnknownFeatureSet
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import ROOT, as_user, fresh_version, need, role_url, running
from tests.test_repository import LIBRARY, create_tables, member

FRAUD = ROOT / "examples" / "fraud"


def as_the_api(settings: Settings) -> Settings:
    """``settings`` with the read API's Postgres role and Redis user, on a schema version
    of their own."""
    api = as_user(
        settings, need("FRESHLINE_STACK_REDIS_API_USER"), need("FRESHLINE_STACK_REDIS_API_PASSWORD")
    )
    return api.model_copy(
        update={
            "postgres_url": role_url(settings, "FRESHLINE_STACK_POSTGRES_API_URL"),
            "schema_version": fresh_version(),
            "local_cache_size": 0,
        }
    )


def library_key(engine: Engine) -> str:
    """An API key of the library's one tenant."""
    try:
        return create_tenant(engine, IMPLICIT_TENANT)
    except TenantExists:  # another module of the session made it
        return create_api_key(engine, IMPLICIT_TENANT)


def test_two_repositories_in_one_process_are_each_read_through_their_own_store(
    settings: Settings, engine: Engine, tenant_factory: Callable[..., SeedSummary]
) -> None:
    create_tables(engine)
    # The operator: the library's plan, and the grants it lists for freshline's roles.
    with FeatureStore(LIBRARY, settings) as operator:
        plan = operator.plan()
        assert plan.problems == [] and plan.tables == ["lib_books", "lib_loans", "lib_members"]
        with engine.begin() as conn:
            for grant in plan.grants:
                conn.execute(sa.text(grant))
    [tenant] = tenant_factory(users=5, transactions=100).tenants
    ada = member(engine, "two-stores", [(f"two-stores-{uuid.uuid4().hex[:8]}", False)])

    fraud, library = (
        FeatureStore(FRAUD, as_the_api(settings)),
        FeatureStore(LIBRARY, as_the_api(settings)),
    )
    with fraud, library:
        assert "txn_90d" in fraud.registry and "txn_90d" not in library.registry
        # A miss is computed as the API's role and stored in Redis as its user.
        txn = fraud.read_through().get(EntityRef("txn_90d", tenant, "1"))
        loans = library.read_through().get(EntityRef("loans_now", IMPLICIT_TENANT, ada))
        assert txn.source == "computed" and loans.source == "computed"
        assert loans.values is not None and loans.values["open_loans"] == 1

        # Each store's client reads its own repository's entries, and knows no other's.
        read_fraud = fraud.client(follow_deploys=False)
        read_library = library.client(follow_deploys=False)
        got = read_fraud.get("txn_90d", tenant, 1)
        assert got is not None and got.values == txn.values
        got = read_library.get("loans_now", IMPLICIT_TENANT, ada)
        assert got is not None and got.values == loans.values
        with pytest.raises(UnknownFeatureSet):
            read_fraud.get("loans_now", IMPLICIT_TENANT, ada)

        # Over HTTP: each store's app serves its repository.
        with running(fraud.app(follow_deploys=False), create_api_key(engine, tenant)) as api:
            answer = api.get("/v1/features/txn_90d/1?mode=cache-only")
            assert answer.status_code == 200, answer.text
            assert answer.json()["values"] == txn.values
        with running(library.app(follow_deploys=False), library_key(engine)) as api:
            answer = api.get(f"/v1/features/loans_now/{ada}?mode=cache-only")
            assert answer.status_code == 200, answer.text
            assert answer.json()["values"] == loans.values
            assert api.get("/v1/features/txn_90d/1").status_code == 404


@pytest.mark.unit
def test_a_store_takes_its_schema_version_from_its_repository_unless_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FRESHLINE_SCHEMA_VERSION", raising=False)
    assert FeatureStore(LIBRARY).settings.schema_version == 3  # its freshline.toml
    assert FeatureStore(FRAUD).settings.schema_version == 4
    monkeypatch.setenv("FRESHLINE_SCHEMA_VERSION", "7")
    assert FeatureStore(LIBRARY).settings.schema_version == 7
    assert FeatureStore(LIBRARY, Settings(schema_version=5)).settings.schema_version == 5


@pytest.mark.unit
def test_importing_freshline_imports_no_service_client() -> None:
    """``import freshline`` stays as light as the definitions: the store imports Redis,
    Starlette, Kafka and pyarrow on first use."""
    code = (
        "import sys, freshline; "
        "print(','.join(m for m in ('redis', 'starlette', 'confluent_kafka', 'pyarrow') "
        "if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == ""


@pytest.mark.unit
def test_help_reads_as_a_manual() -> None:
    """Every public method says what it returns."""
    assert freshline.FeatureStore.__doc__ and ">>>" in freshline.FeatureStore.__doc__
    for name in (
        "from_env",
        "client",
        "read_through",
        "app",
        "worker",
        "consume",
        "plan",
        "apply",
        "training_set",
        "compute",
        "history",
        "bulk_load",
        "close",
    ):
        assert getattr(FeatureStore, name).__doc__, name


@pytest.mark.unit
def test_the_model_names_are_freshlines_and_imported_on_first_use() -> None:
    """``freshline.LogisticModel`` and ``freshline.input_row`` are the served model's,
    imported when first asked for, so ``import freshline`` stays light."""
    from freshline.pipeline.inference import models

    assert freshline.LogisticModel is models.LogisticModel
    assert freshline.input_row is models.input_row
    with pytest.raises(AttributeError, match="no_such_name"):
        freshline.no_such_name


def test_a_bulk_load_pauses_the_derived_paths_and_rebuilds_the_loaded_keys(
    settings: Settings, engine: Engine, tenant_factory: Callable[..., SeedSummary]
) -> None:
    """The fraud seed loads ``transactions`` inside ``store.bulk_load``: the installed
    derived paths over it have their insert triggers off in the block and on after it,
    and the partials the seed rebuilds from the rows give the defining query's values."""
    [tenant] = tenant_factory(users=30, transactions=900).tenants
    refs = [(tenant, str(user)) for user in range(1, 31)]
    with FeatureStore(FRAUD, settings) as store:
        full = store.compute("txn_90d", refs, path="full", db=engine)
        assert len(full) > 1 and any(v["txn_count"] for v in full.values())
        assert store.compute("txn_90d", refs, path="incremental", db=engine) == full
        assert store.compute(store.registry["txn_90d"], refs) == full  # the store's engine

        with engine.connect() as conn:
            enabled = sa.text("SELECT tgenabled FROM pg_trigger WHERE tgname = :t")
            names = list(
                conn.execute(
                    sa.text(
                        "SELECT tgname FROM pg_trigger WHERE tgrelid = 'transactions'::regclass "
                        "AND tgname LIKE 'freshline\\_%\\_i' ORDER BY tgname"
                    )
                ).scalars()
            )
            before = [conn.execute(enabled, {"t": n}).scalar() for n in names]
            with store.bulk_load(conn, "transactions") as paths:
                assert paths  # txn_90d's path is installed
                paused = sorted(f"{p.trigger}_i" for p in paths)  # type: ignore[attr-defined]
                assert paused == names
                states = [conn.execute(enabled, {"t": n}).scalar() for n in names]
                assert states == ["D"] * len(names)
            assert [conn.execute(enabled, {"t": n}).scalar() for n in names] == before
            conn.rollback()


def test_seeding_leaves_the_derived_paths_triggers_firing_in_every_session(
    engine: Engine, tenant_factory: Callable[..., SeedSummary]
) -> None:
    """The derived paths' triggers fire ALWAYS, also in replica-role sessions (as
    ``apply`` installs them); a bulk load that pauses them leaves them so, not firing
    in origin sessions only (which ``plan`` reports as a fix to make)."""
    insert_triggers = sa.text(
        "SELECT tgname, tgenabled FROM pg_trigger WHERE tgrelid = 'transactions'::regclass "
        "AND tgname LIKE 'freshline\\_%\\_i' ORDER BY tgname"
    )
    with engine.begin() as conn:
        names = [name for name, _ in conn.execute(insert_triggers)]
        assert names  # the fraud example's derived paths are installed
        for name in names:
            conn.execute(sa.text(f"ALTER TABLE transactions ENABLE ALWAYS TRIGGER {name}"))
    tenant_factory(users=5, transactions=50)
    with engine.connect() as conn:
        assert [state for _, state in conn.execute(insert_triggers)] == ["A"] * len(names)
