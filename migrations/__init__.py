"""Alembic migrations: freshline's own schema, and a repository's, if it carries any.

``freshline db upgrade`` runs freshline's chain (this folder's ``versions/``: the
``freshline`` schema and nothing outside it), then the active repository's chain when
its ``freshline.toml`` names one (``[project] migrations = "migrations"``, a folder
with a ``versions/`` of Alembic revisions: the fraud example keeps its source tables
and its incremental path's triggers there). Each chain has its own version table in
the ``freshline`` schema, so the two never mix. Downgrades run in the other order.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from freshline.pipeline.core.errors import ConfigError

if TYPE_CHECKING:
    from freshline.pipeline.core.repository import Repository

HERE = Path(__file__).resolve().parent
SCHEMA = "freshline"


def alembic_config(url: str, repo: Chain | None = None) -> Config:
    """An Alembic config for ``url`` (a SQLAlchemy URL): freshline's chain, or ``repo``'s."""
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if repo is not None:
        cfg.set_main_option("path_separator", "os")
        cfg.set_main_option("version_locations", str(repo.versions))
        cfg.set_main_option("version_table", f"alembic_version_{repo.name}")
    return cfg


@dataclass(frozen=True)
class Chain:
    """A repository's migrations: its ``versions/`` folder and the repository's name,
    which names the chain's version table (``freshline.alembic_version_<name>``)."""

    versions: Path
    name: str

    @classmethod
    def of(cls, folder: Path, name: str) -> Chain:
        versions = folder / "versions"
        if not versions.is_dir():
            raise ConfigError(f"{folder}: a repository's migrations need a versions/ folder")
        return cls(versions, name)

    @classmethod
    def of_repository(cls, repo: Repository) -> Chain | None:
        """``repo``'s chain, or ``None`` if its ``freshline.toml`` names no migrations."""
        return cls.of(repo.migrations, repo.name) if repo.migrations else None


def _preflight(url: str) -> None:
    """Refuse, in one line, a database this layout cannot migrate safely:

    - one an earlier freshline made, with tenants and API keys in ``public`` beside the
      fraud tables under one chain (a pre-release layout with no upgrade path);
    - a login whose ``search_path`` would find the ``freshline`` schema first: Postgres's
      default begins with ``"$user"``, so a role named ``freshline`` would resolve the
      user's unqualified table names in freshline's schema once it exists.
    """
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            old, user, path = conn.execute(
                sa.text(
                    "SELECT to_regclass('public.api_keys') IS NOT NULL "
                    "AND to_regclass('freshline.api_keys') IS NULL, "
                    "current_user, current_setting('search_path')"
                )
            ).one()
    finally:
        engine.dispose()
    if old:
        raise ConfigError(
            "this database holds tables of an earlier freshline in public (api_keys, "
            "tenants), a layout with no upgrade path: migrate a new database"
        )
    names = [p.strip().strip('"') for p in str(path).split(",")]
    if SCHEMA in names or (user == SCHEMA and "$user" in names):
        raise ConfigError(
            f"the login {user!r} has search_path {path!r}, which finds freshline's schema "
            f"first: log in as another role, or run: ALTER ROLE {user} SET search_path = public"
        )


def head() -> str:
    """The revision freshline's own chain is at when up to date."""
    from alembic.script import ScriptDirectory

    found = ScriptDirectory.from_config(alembic_config("")).get_current_head()
    assert found is not None
    return found


def upgrade(
    url: str, revision: str = "head", *, repo: Chain | None = None, repo_revision: str = "head"
) -> None:
    """Bring freshline's schema to ``revision``, then ``repo``'s chain to ``repo_revision``."""
    _preflight(url)
    command.upgrade(alembic_config(url), revision)
    if repo is not None:
        command.upgrade(alembic_config(url, repo), repo_revision)


def downgrade(
    url: str, revision: str | None, *, repo: Chain | None = None, repo_revision: str = "base"
) -> None:
    """Take ``repo``'s chain back to ``repo_revision`` first, then freshline's to
    ``revision`` (``None``: leave freshline's where it is)."""
    if repo is not None:
        command.downgrade(alembic_config(url, repo), repo_revision)
    if revision is not None:
        command.downgrade(alembic_config(url), revision)


def sibling_revision(revision_file: str, filename: str) -> ModuleType:
    """The revision ``filename`` beside ``revision_file`` (a revision's ``__file__``),
    loaded as a module, for a later revision that reuses its SQL (file names start with a
    digit, so no import names them)."""
    path = Path(revision_file).resolve().parent / filename
    spec = importlib.util.spec_from_file_location(f"freshline_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
