"""What gets installed (issue 53): site-packages gets one top-level name, ``freshline``,
so a project with packages of its own named ``pipeline`` or ``migrations`` keeps them.

The wheel is built as CI builds it (``pip wheel --no-deps --no-build-isolation``, with
the locked setuptools of ``.venv``) from a copy of the files it is built from, so no
``build/`` left by an earlier build can slip into it. Each install goes into a fresh
venv with no pip of its own, beside two dummy packages named ``pipeline`` and
``migrations`` on ``PYTHONPATH``. Its dependencies are ``.venv``'s: one ``.pth`` line
adds that site-packages directory to ``sys.path``, and Python does not process ``.pth``
files inside a directory a ``.pth`` line added, so ``.venv``'s editable finder for the
checkout never runs there (``test_the_venvs_see_dependencies_but_not_the_checkout``).
Nothing is fetched (``--no-index``); the editable install writes ``freshline.egg-info``
in the checkout, as ``scripts/bootstrap``'s does.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import venv
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.cache.recompute import compute
from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.types import EntityRef
from tests.helpers import REGISTRY, ROOT

pytestmark = pytest.mark.slow

FOLDERS = ("pipeline", "consumers", "schemas", "migrations")
"""The repository's folders that the wheel installs under ``freshline``."""
BUILT_FROM = ("pyproject.toml", "README.md", "freshline", *FOLDERS)
DATA = (
    "freshline/pipeline/api/status.html",
    "freshline/migrations/script.py.mako",
    "freshline/migrations/env.py",
    "freshline/pipeline/semantic/data/pairs.json",
)
"""Files the installed library opens at run time (package data and Alembic's scripts)."""

DUMMY = "I am the project's own {name}, not freshline's"

PROBE = """\
import json, sys, importlib.util
import pipeline, migrations
import freshline, freshline.pipeline.cli, freshline.migrations
print(json.dumps({
    "dummies": [pipeline.WHO, migrations.WHO],
    "freshline": freshline.__file__,
    "cli": freshline.pipeline.cli.__file__,
    "migrations": freshline.migrations.__file__,
    "editable_finders": sorted(
        m for m in (getattr(f, "__module__", "") for f in sys.meta_path) if "editable" in m
    ),
    "path": sys.path,
}))
"""
"""What a venv's Python reports: the dummies it imports and where freshline's modules
come from."""

READ = """\
import json, sys
import freshline

repo, tenant, entity = sys.argv[1], sys.argv[2], sys.argv[3]
with freshline.FeatureStore(repo) as store:  # settings from FRESHLINE_*
    got = store.client(follow_deploys=False).get("txn_90d", tenant, entity)
print(json.dumps(None if got is None else {"values": got.values, "watermark": got.watermark}))
"""
"""A read through the installed package's entry object, as a scoring service makes it."""


def run(*argv: str | Path, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        [str(a) for a in argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the dummies, the venvs and the wheel; the processes run in it,
    so the checkout is not on their ``sys.path`` as the current directory."""
    root = tmp_path_factory.mktemp("install")
    for name in ("pipeline", "migrations"):
        (root / "dummies" / name).mkdir(parents=True)
        (root / "dummies" / name / "__init__.py").write_text(f"WHO = {DUMMY.format(name=name)!r}\n")
    return root


def locked_site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def fresh_venv(where: Path) -> Path:
    """A venv with no packages, whose Python sees ``.venv``'s site-packages through one
    ``.pth`` line; returns its Python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    python = where / "bin" / "python"
    purelib = run(
        python,
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        env={},
        cwd=where,
    ).strip()
    (Path(purelib) / "locked-dependencies.pth").write_text(f"{locked_site_packages()}\n")
    return python


def env_for(place: Path) -> dict[str, str]:
    """This process's environment, less Python's and pytest's variables, with the
    dummies on ``PYTHONPATH``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "PYTEST_", "VIRTUAL_ENV"))
    }
    env["PYTHONPATH"] = str(place / "dummies")
    return env


def pip(python: Path, *args: str | Path, env: dict[str, str], cwd: Path) -> None:
    """``.venv``'s pip, installing into ``python``'s environment."""
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "--no-input",
        "--disable-pip-version-check",
        *args,
        "--no-index",
        env=env,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def wheel(place: Path) -> Path:
    source = place / "source"
    source.mkdir()
    for name in BUILT_FROM:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(
                src,
                source / name,
                symlinks=True,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )
        else:
            shutil.copy2(src, source / name)
    out = place / "dist"
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--disable-pip-version-check",
        "-w",
        out,
        source,
        env=env_for(place),
        cwd=place,
    )
    [built] = out.glob("freshline-*.whl")
    return built


@pytest.fixture(scope="module")
def from_wheel(place: Path, wheel: Path) -> Path:
    python = fresh_venv(place / "wheel-venv")
    pip(python, "install", "--no-deps", wheel, env=env_for(place), cwd=place)
    return python


@pytest.fixture(scope="module")
def editable(place: Path) -> Path:
    python = fresh_venv(place / "editable-venv")
    pip(
        python,
        "install",
        "--no-deps",
        "--no-build-isolation",
        "-e",
        ROOT,
        env=env_for(place),
        cwd=place,
    )
    return python


def probe(python: Path, place: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(run(python, "-c", PROBE, env=env_for(place), cwd=place))
    return found


def test_the_wheel_holds_freshline_only_as_real_files(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        infos = whl.infolist()
        tops = {info.filename.split("/")[0] for info in infos}
        assert tops == {"freshline", "freshline-0.1.0.dist-info"}
        links = [i.filename for i in infos if stat.S_ISLNK(i.external_attr >> 16)]
        assert links == []
        names = {i.filename for i in infos}
        for data in DATA:
            assert data in names, data
            assert whl.read(data) == (ROOT / data).read_bytes(), data
        for folder in FOLDERS:
            for path in sorted((ROOT / folder).rglob("*.py")):
                if "__pycache__" in path.parts:
                    continue
                name = f"freshline/{path.relative_to(ROOT).as_posix()}"
                assert whl.read(name) == path.read_bytes(), name
        versions = [n for n in names if n.startswith("freshline/migrations/versions/")]
        assert len(versions) == len(list((ROOT / "migrations" / "versions").glob("*.py")))


def test_the_venvs_see_dependencies_but_not_the_checkout(place: Path, from_wheel: Path) -> None:
    """The premise of the other tests: ``.venv`` holds an editable install of the
    checkout (its ``.pth`` and finder), and the wheel's venv does not run it."""
    locked = locked_site_packages()
    assert list(locked.glob("__editable__*freshline*.pth")), "the premise: .venv is editable"
    found = probe(from_wheel, place)
    assert str(locked) in found["path"]
    assert found["editable_finders"] == []
    from_checkout = [p for p in found["path"] if Path(p).is_relative_to(ROOT) and Path(p) != locked]
    assert from_checkout == []


@pytest.mark.parametrize("install", ["from_wheel", "editable"])
def test_freshline_lives_beside_packages_named_pipeline_and_migrations(
    request: pytest.FixtureRequest, place: Path, install: str
) -> None:
    python: Path = request.getfixturevalue(install)
    found = probe(python, place)
    assert bool(found["editable_finders"]) == (install == "editable")
    assert found["dummies"] == [DUMMY.format(name="pipeline"), DUMMY.format(name="migrations")]
    venv_dir = python.parents[1]
    for module in ("freshline", "cli", "migrations"):
        where = Path(str(found[module]))
        if install == "from_wheel":
            assert where.is_relative_to(venv_dir), (module, where)
        else:
            assert where.is_relative_to(ROOT / "freshline"), (module, where)
    helped = run(venv_dir / "bin" / "freshline", "--help", env=env_for(place), cwd=place)
    assert "Usage" in helped and "serve" in helped


def test_the_installed_wheel_reads_features_from_the_stack(
    place: Path,
    from_wheel: Path,
    settings: Settings,
    redis_client: redis.Redis,
    engine: Engine,
    version: int,
    tenant_factory: Callable[..., SeedSummary],
) -> None:
    tenant = tenant_factory(users=3, transactions=60).tenants[0]
    store = EntryStore(redis_client, version, registry=REGISTRY)
    store.write(compute(engine, REGISTRY["txn_90d"], [(tenant, "2")]))
    [entry] = store.read([EntityRef("txn_90d", tenant, "2")])
    assert entry is not None
    out = run(
        from_wheel,
        "-c",
        READ,
        ROOT / "examples" / "fraud",
        tenant,
        "2",
        env=env_for(place)
        | {"FRESHLINE_SCHEMA_VERSION": str(version), "FRESHLINE_REDIS_URL": settings.redis_url},
        cwd=place,
    )
    assert json.loads(out) == {
        "values": json.loads(json.dumps(entry.values)),
        "watermark": entry.watermark,
    }
