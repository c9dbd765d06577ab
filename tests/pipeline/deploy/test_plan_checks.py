"""What ``freshline plan`` catches before it goes stale or fails at run time: a windowed
query with no horizon, a horizon that does not compile, an entity's own table that no
feature set reads, and a ``freshline.toml`` with a key it does not know."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from freshline.consumers.failures import cause, remedy
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cdc.connect import PUBLICATION
from freshline.pipeline.cli import app
from freshline.pipeline.core.errors import DefinitionFailed
from freshline.pipeline.core.features import IMPLICIT_TENANT
from freshline.pipeline.core.repository import DefinitionError, Repository, load
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.deploy.plan import plan
from tests.helpers import role_url
from tests.test_repository import BROKEN, library  # noqa: F401  (the tables' fixture)

DEFINITIONS = str(BROKEN / "definitions.py")


@pytest.fixture(scope="module")
def broken(library: Repository) -> Repository:  # noqa: F811
    return load(BROKEN)


def test_a_windowed_query_without_a_horizon_is_warned_with_the_fix(
    broken: Repository, engine: Engine
) -> None:
    result = plan(broken, engine, 1, PUBLICATION)
    warned = [w for w in result.warnings if w.startswith(f"{DEFINITIONS}:45: ")]
    assert len(warned) == 1, result.warnings
    assert "feature set 'windowed'" in warned[0] and "as_of" in warned[0]
    assert "horizon=" in warned[0]  # the fix is named
    # A set that reads no moment gets no warning.
    assert not [w for w in result.warnings if "'swapped'" in w]


def test_a_horizon_with_a_typo_is_a_problem_with_its_line(
    broken: Repository, engine: Engine
) -> None:
    problems = plan(broken, engine, 1, PUBLICATION).problems
    found = [p for p in problems if p.startswith(f"{DEFINITIONS}:59: ")]
    assert len(found) == 1, problems
    assert "feature set 'misspelt_horizon'" in found[0] and "horizon" in found[0]
    assert "membr_id" in found[0]


def test_an_entity_table_no_feature_set_reads_is_checked_not_unknown(
    broken: Repository, engine: Engine
) -> None:
    problems = plan(broken, engine, 1, PUBLICATION).problems
    assert not [p for p in problems if "unknown table 'lib_members'" in p], problems


@pytest.mark.parametrize(
    ("toml", "line", "named"),
    [
        ("[project]\nname = 'x'\n\n[histroy]\nenabled = true\n", 4, "[histroy]"),
        ("[project]\nname = 'x'\nschema_verison = 2\n", 3, "schema_verison"),
    ],
)
def test_an_unknown_toml_key_names_its_line(
    tmp_path: Path, toml: str, line: int, named: str
) -> None:
    (tmp_path / "freshline.toml").write_text(toml)
    (tmp_path / "features.py").write_text((BROKEN / "definitions.py").read_text())
    with pytest.raises(DefinitionError) as caught:
        load(tmp_path)
    assert caught.value.where == f"{tmp_path / 'freshline.toml'}:{line}"
    assert named in caught.value.problem


def test_a_statement_that_fails_at_run_time_names_its_definition(
    broken: Repository, engine: Engine
) -> None:
    fs = broken.registry["misspelt_horizon"]
    with pytest.raises(DefinitionFailed) as caught:
        compute(engine, fs, [(IMPLICIT_TENANT, str(uuid.uuid4()))])
    assert caught.value.origin == f"{DEFINITIONS}:59"
    assert "membr_id" in str(caught.value) and "db upgrade" not in str(caught.value)
    # The consumer holds its batch on it, naming the definition, not `db upgrade`.
    assert cause(caught.value) == "definition"
    assert remedy(caught.value).startswith("feature set 'misspelt_horizon' (")


def test_plan_as_the_api_login_checks_as_the_owner_and_lists_the_grants(
    tmp_path: Path, settings: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = f"plan_role_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {table} (member_id uuid PRIMARY KEY, n int)"))
        # The test database grants by default what a user's database does not.
        conn.execute(sa.text(f"REVOKE ALL ON {table} FROM freshline_api, freshline_consumer"))
    (tmp_path / "freshline.toml").write_text("[project]\nname = 'roles'\n")
    (tmp_path / "features.py").write_text(
        "from freshline import Entity, FeatureSet, Field, Table\n"
        "member = Entity('member', key='member_id', type='uuid')\n"
        f"rows = Table({table!r}, entities={{member: 'member_id'}})\n"
        "n = FeatureSet('n', entity=member, ttl='1h', sources=(rows,),\n"
        "               fields=(Field('n', 'int'),),\n"
        f"               query='SELECT k.member_id, r.n FROM keys k LEFT JOIN {table} r "
        "ON r.member_id = k.member_id')\n"
    )
    # The README's environment: the service URL is the API's login, the owner's beside it.
    monkeypatch.setenv(
        "FRESHLINE_POSTGRES_URL", role_url(settings, "FRESHLINE_STACK_POSTGRES_API_URL")
    )
    monkeypatch.setenv("FRESHLINE_POSTGRES_ADMIN_URL", settings.postgres_url)
    monkeypatch.setenv("FRESHLINE_REPO", str(tmp_path))
    result = CliRunner().invoke(app, ["plan"])
    assert result.exit_code == 0, result.output
    assert f"GRANT SELECT ON {table} TO freshline_api" in result.output
    assert "plan: ok" in result.output
