"""Feature repositories: a directory with ``freshline.toml`` and the definitions.

A repository is the user's own: their entities, tables and feature sets, written in
Python against the ``freshline`` package, kept in their git. ``freshline.toml``::

    [project]
    name = "library"                 # a lower-case identifier
    schema_version = 1               # FRESHLINE_SCHEMA_VERSION overrides it
    definitions = "features.py"      # relative to the repository
    lock = "features.lock.json"      # the feature lock, written by `freshline apply`
    migrations = "migrations"        # optional: Alembic revisions for the user's own
                                     # tables, run by `freshline db upgrade` after
                                     # freshline's (the fraud example keeps its here)
    commands = "library.cli:app"     # optional: a Typer app of the repository's own
                                     # chores, run as `freshline <name> ...`

    [history]                        # optional: every version of every captured row,
    enabled = true                   # recorded from the change stream (docs/training.md)
    retention = "400d"               # how long an ended version is kept (default: for ever)

Every command works on the *active* repository: ``--repo`` (which sets
``FRESHLINE_REPO``), else ``FRESHLINE_REPO``, else the current directory; a program
loads one explicitly, ``freshline.FeatureStore("path/to/repo")``. A definition
error names the file and line it was made at.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tomllib
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.events import Event
from freshline.pipeline.core.features import Entity, FeatureSet, Registry, Source, Table, seconds

CONFIG = "freshline.toml"
REPO_VARIABLE = "FRESHLINE_REPO"
SECTIONS: dict[str, frozenset[str]] = {
    "project": frozenset(
        {"name", "schema_version", "definitions", "lock", "migrations", "commands"}
    ),
    "history": frozenset({"enabled", "retention"}),
}
"""The tables ``freshline.toml`` may have, with the keys each may hold: anything else is
a typo, refused with its line rather than ignored."""


class DefinitionError(ConfigError):
    """A definition that cannot be used, with the ``file:line`` it was made at."""

    def __init__(self, where: str, problem: str) -> None:
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}" if where else problem)


@dataclass(frozen=True, slots=True)
class History:
    """The repository's ``[history]`` table: whether freshline records every version of
    every captured row (:mod:`freshline.pipeline.history`), and for how long it keeps an ended one
    (``None``: for ever)."""

    enabled: bool = False
    retention_s: int | None = None


@dataclass(frozen=True)
class Repository:
    """A loaded feature repository."""

    path: Path
    name: str
    schema_version: int
    definitions: Path
    lock_path: Path
    registry: Registry
    migrations: Path | None
    entities: tuple[Entity, ...]
    tables: tuple[Table, ...]
    events: tuple[Event, ...] = ()
    """The domain-event topics it declares (:class:`freshline.pipeline.core.events.Event`)."""
    history: History = History()
    """Its ``[history]`` settings."""

    def table(self, name: str) -> Table | None:
        return next((t for t in self.tables if t.name == name), None)

    def table_names(self) -> list[str]:
        """Every table a feature set reads changes from, sorted (what CDC captures)."""
        return sorted({s.table for fs in self.registry for s in fs.sources})

    def sources_of(self, table: str) -> list[tuple[FeatureSet, Source]]:
        return self.registry.affected_by(table)

    def tenant_column(self, table: str) -> str | None:
        """The column of ``table`` that holds the tenant, if its rows carry one."""
        tenants = {s.tenant for _, s in self.sources_of(table) if s.tenant}
        return tenants.pop() if len(tenants) == 1 else None

    def id_columns(self, table: str) -> dict[str, Entity]:
        """The columns of ``table`` whose values become entity keys, with their entity."""
        found: dict[str, Entity] = {}
        for fs, source in self.sources_of(table):
            for column in source.entity_columns:
                found[column] = fs.entity
        return found


def own_commands(root: Path) -> tuple[str, str] | None:
    """The repository's own command group as ``(name, "module:attribute")``, if the
    ``freshline.toml`` at ``root`` names one. Read without loading the definitions, so a
    definition error never hides the command line; ``None`` for anything unreadable."""
    try:
        project = tomllib.loads((root / CONFIG).read_text()).get("project")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    if not isinstance(project, dict):
        return None
    name, target = project.get("name"), project.get("commands")
    if isinstance(name, str) and name.isidentifier() and isinstance(target, str) and target:
        return name, target
    return None


def import_commands(root: Path, target: str) -> object:
    """Import ``module:attribute`` (``commands`` in ``freshline.toml``) from ``root``.

    The repository's directory is on ``sys.path`` only while it imports, as for the
    definitions: a folder of the repository named like one of freshline's packages
    (``migrations``) must never shadow it later. Modules of the commands' own package
    import later through the package (``fraud.seed`` once ``fraud.cli`` has).
    """
    module_name, _, attribute = target.partition(":")
    directory = str(root)
    sys.path.insert(0, directory)
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attribute or "app")
    except Exception as exc:  # the user's code: any error is a definition error
        raise DefinitionError(str(root / CONFIG), f"commands {target!r}: {exc}") from None
    finally:
        sys.path.remove(directory)


def _where(path: Path, exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc`` in ``path`` (the definitions)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if Path(frame.filename).resolve() == path.resolve():
            return f"{path}:{frame.lineno}"
    return str(path)


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"freshline_repo_{name}", path)
    if spec is None or spec.loader is None:
        raise DefinitionError(str(path), "cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    directory = str(path.parent)
    sys.path.insert(0, directory)  # the definitions may import their own modules
    try:
        spec.loader.exec_module(module)
    except ConfigError as exc:
        raise DefinitionError(_where(path, exc), str(exc)) from None
    except SyntaxError as exc:
        raise DefinitionError(f"{path}:{exc.lineno}", f"syntax error: {exc.msg}") from None
    except Exception as exc:  # the user's code: any error is a definition error
        raise DefinitionError(_where(path, exc), f"{type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(directory)
    return module


def load(path: Path | str) -> Repository:
    """Load the repository at ``path``: its ``freshline.toml`` and its definitions."""
    root = Path(path).resolve()
    config_path = root / CONFIG
    if not config_path.is_file():
        raise ConfigError(
            f"no feature repository at {root} (no {CONFIG}): point --repo or "
            f"{REPO_VARIABLE} at one, or make one with: freshline init DIRECTORY"
        )
    try:
        config = tomllib.loads(config_path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise DefinitionError(str(config_path), f"not valid TOML: {exc}") from None
    _check_keys(config_path, config)
    project = config.get("project")
    if not isinstance(project, dict):
        raise DefinitionError(str(config_path), "needs a [project] table")
    name = project.get("name")
    if not isinstance(name, str) or not name.isidentifier() or not name.islower():
        raise DefinitionError(
            str(config_path), f"project.name {name!r} is not a lower-case identifier"
        )
    version = project.get("schema_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= 999_999:
        raise DefinitionError(
            str(config_path), f"project.schema_version {version!r} is not 1..999999"
        )
    definitions = root / str(project.get("definitions", "features.py"))
    if not definitions.is_file():
        raise DefinitionError(str(config_path), f"project.definitions: no file {definitions}")
    lock_path = root / str(project.get("lock", "features.lock.json"))
    migrations = None
    if "migrations" in project:
        migrations = root / str(project["migrations"])
        if not (migrations / "versions").is_dir():
            raise DefinitionError(
                str(config_path), f"project.migrations: no folder {migrations / 'versions'}"
            )
    history = _history(config, str(config_path))
    registry, entities, tables, events = _declared(_import(definitions, name), definitions)
    return Repository(
        path=root,
        name=name,
        schema_version=version,
        definitions=definitions,
        lock_path=lock_path,
        registry=registry,
        migrations=migrations,
        entities=entities,
        tables=tables,
        events=events,
        history=history,
    )


def _declared(
    module: ModuleType, definitions: Path
) -> tuple[Registry, tuple[Entity, ...], tuple[Table, ...], tuple[Event, ...]]:
    """The feature sets, entities, tables and events ``module`` defines, checked: names
    and topics unique, at least one feature set, every event's table read by one."""
    feature_sets: dict[str, FeatureSet] = {}
    entities: dict[str, Entity] = {}
    tables: dict[str, Table] = {}
    events: dict[str, Event] = {}
    for value in vars(module).values():
        if isinstance(value, FeatureSet):
            other = feature_sets.get(value.name)
            if other is not None and other is not value:
                raise DefinitionError(
                    value.origin or str(definitions),
                    f"two feature sets are named {value.name!r} (the other at {other.origin})",
                )
            feature_sets[value.name] = value
        elif isinstance(value, Entity):
            entities.setdefault(value.name, value)
        elif isinstance(value, Table):
            tables.setdefault(value.name, value)
        elif isinstance(value, Event):
            other_event = events.setdefault(value.topic, value)
            if other_event is not value:
                raise DefinitionError(
                    value.origin,
                    f"two events have the topic {value.topic!r} "
                    f"(the other at {other_event.origin})",
                )
    if not feature_sets:
        raise DefinitionError(str(definitions), "defines no feature set")
    read = {s.table for fs in feature_sets.values() for s in fs.sources}
    for event in events.values():
        if event.table.name not in read:
            raise DefinitionError(
                event.origin,
                f"event {event.topic!r}: no feature set reads table {event.table.name!r}",
            )
    for fs in feature_sets.values():
        entities.setdefault(fs.entity.name, fs.entity)
    return (
        Registry(feature_sets.values()),
        tuple(entities.values()),
        tuple(tables.values()),
        tuple(events.values()),
    )


def _check_keys(path: Path, config: dict[str, object]) -> None:
    """Refuse a table or key of ``freshline.toml`` that :data:`SECTIONS` does not name,
    with the line it is on."""
    lines = path.read_text().splitlines()

    def line_of(pattern: str, after: int = 0) -> str:
        for number, text in enumerate(lines[after:], start=after + 1):
            if re.match(pattern, text):
                return f"{path}:{number}"
        return str(path)

    known = ", ".join(f"[{name}]" for name in SECTIONS)
    for name, value in config.items():
        if not isinstance(value, dict):
            where = line_of(rf"\s*{re.escape(name)}\s*=")
            raise DefinitionError(where, f"{name!r} is outside a table (known: {known})")
        header = line_of(rf"\s*\[\s*{re.escape(name)}\s*\]")
        if name not in SECTIONS:
            raise DefinitionError(header, f"unknown table [{name}] (known: {known})")
        after = int(header.rpartition(":")[2]) if header != str(path) else 0
        for key in value:
            if key not in SECTIONS[name]:
                raise DefinitionError(
                    line_of(rf"\s*{re.escape(key)}\s*=", after),
                    f"[{name}] has no key {key!r} (known: {', '.join(sorted(SECTIONS[name]))})",
                )


def _history(config: dict[str, object], where: str) -> History:
    table = config.get("history", {})
    if not isinstance(table, dict):
        raise DefinitionError(where, "[history] must be a table")
    unknown = set(table) - {"enabled", "retention"}
    if unknown:
        raise DefinitionError(where, f"[history] has unknown keys: {', '.join(sorted(unknown))}")
    enabled = table.get("enabled", False)
    if not isinstance(enabled, bool):
        raise DefinitionError(where, f"history.enabled {enabled!r} is not true or false")
    retention = table.get("retention")
    if retention is None:
        return History(enabled, None)
    if not isinstance(retention, int | str):
        raise DefinitionError(where, f"history.retention {retention!r} is not a duration")
    try:
        return History(enabled, seconds(retention, "history.retention"))
    except ConfigError as exc:
        raise DefinitionError(where, str(exc)) from None


_by_setting: dict[str, Repository] = {}
_loaded: dict[Path, Repository] = {}


def active_path() -> Path:
    """The active repository's directory: ``FRESHLINE_REPO``, else the current directory."""
    return Path(os.environ.get(REPO_VARIABLE) or ".").resolve()


def active() -> Repository:
    """The active repository, loaded once per process (per directory): how the CLI and
    :meth:`freshline.FeatureStore.from_env` find the repository to load. The library
    itself never asks: it is handed a repository or a registry.

    Looked up by the setting's text, not its resolved path, so asking again is a dict
    lookup. Without ``FRESHLINE_REPO``, the current directory is the one at first use.
    """
    setting = os.environ.get(REPO_VARIABLE) or ""
    repo = _by_setting.get(setting)
    if repo is None:
        path = active_path()
        repo = _loaded.get(path)
        if repo is None:
            repo = _loaded[path] = load(path)
        _by_setting[setting] = repo
    return repo
