"""Alembic migrations for the source Postgres schema. Apply with ``freshline db upgrade``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import command
from alembic.config import Config

HERE = Path(__file__).resolve().parent


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at this folder, for ``url`` (a SQLAlchemy URL)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def revision_module(filename: str) -> ModuleType:
    """The revision file ``filename`` of ``versions/``, loaded as a module, for a later
    revision that reuses its SQL (file names start with a digit, so no import names them)."""
    path = HERE / "versions" / filename
    spec = importlib.util.spec_from_file_location(f"freshline_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
