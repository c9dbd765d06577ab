"""The feature-definition lock: what each schema version's feature sets look like.

The repository's lock (``features.lock.json`` beside its ``freshline.toml``) records,
for every schema version ever deployed, each
feature set's fingerprint (:meth:`freshline.pipeline.core.features.FeatureSet.fingerprint`: fields,
types, query, TTL, mode) and its fields in order. The field list is also the
reference for readers in other languages: an entry's values are positional, in this
order (see :mod:`freshline.pipeline.core.codec`).

The rule it enforces: a definition never changes under an existing version. If the
code's registry differs from the lock entry of ``FRESHLINE_SCHEMA_VERSION``,
:func:`check` raises :class:`LockMismatch`; the fix is a version bump and
``freshline check --update-lock``, which adds the new version and never rewrites an
existing one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import orjson

from freshline.pipeline.core.errors import LockMismatch
from freshline.pipeline.core.features import Entity, FeatureSet, Field, FieldType, Registry


def lock_path() -> Path:
    """The active repository's lock file."""
    from freshline.pipeline.core.repository import active

    return active().lock_path


LOCK_FORMAT = 1
_DOC = (
    "freshline feature-definition lock. One entry per schema version, never rewritten. "
    "An entry's values are positional, in the order of 'fields' here (pipeline/core/codec.py). "
    "Update with: freshline check --update-lock"
)


@dataclass(frozen=True, slots=True)
class LockedSet:
    """One feature set as locked for one schema version."""

    name: str
    fingerprint: str
    fields: tuple[Field, ...]
    ttl_s: int
    entity: str

    @classmethod
    def of(cls, fs: FeatureSet) -> LockedSet:
        return cls(fs.name, fs.fingerprint(), fs.fields, fs.ttl_s, fs.entity.name)

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "entity": self.entity,
            "ttl_s": self.ttl_s,
            "fields": [{"name": f.name, "type": f.type} for f in self.fields],
        }

    @classmethod
    def from_json(cls, name: str, doc: Mapping[str, Any]) -> LockedSet:
        fields = tuple(Field(f["name"], cast(FieldType, f["type"])) for f in doc["fields"])
        return cls(name, doc["fingerprint"], fields, int(doc["ttl_s"]), doc["entity"])

    def decoder(self) -> FeatureSet:
        """A feature set that can decode this version's entries (its query is empty)."""
        return FeatureSet(
            name=self.name,
            fields=self.fields,
            ttl_s=self.ttl_s,
            query="",
            sources=(),
            entity=Entity(self.entity),
        )


Status = Literal["ok", "new"]


class Lock:
    """The lock file's contents: schema version -> feature set name -> :class:`LockedSet`."""

    def __init__(self, versions: Mapping[int, Mapping[str, LockedSet]] | None = None) -> None:
        self.versions: dict[int, dict[str, LockedSet]] = {
            v: dict(sets) for v, sets in (versions or {}).items()
        }

    @classmethod
    def load(cls, path: Path | None = None) -> Lock:
        """Read a lock file (the active repository's by default); missing, it is empty."""
        path = path or lock_path()
        if not path.exists():
            return cls()
        doc = orjson.loads(path.read_bytes())
        if doc.get("format") != LOCK_FORMAT:
            raise LockMismatch(f"{path}: unknown lock format {doc.get('format')!r}")
        return cls(
            {
                int(version): {name: LockedSet.from_json(name, body) for name, body in sets.items()}
                for version, sets in doc["versions"].items()
            }
        )

    def save(self, path: Path | None = None) -> None:
        """Write the lock with versions in numeric order, so diffs stay small."""
        path = path or lock_path()
        doc = {
            "_doc": _DOC,
            "format": LOCK_FORMAT,
            "versions": {
                str(v): {name: s.to_json() for name, s in self.versions[v].items()}
                for v in sorted(self.versions)
            },
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
        tmp.replace(path)

    def __contains__(self, version: object) -> bool:
        return version in self.versions

    def entry(self, version: int) -> dict[str, LockedSet]:
        try:
            return self.versions[version]
        except KeyError:
            raise LockMismatch(
                f"schema version {version} is not in the lock "
                f"(locked: {', '.join(map(str, sorted(self.versions))) or 'none'})"
            ) from None

    def decoders(self, version: int) -> Registry:
        """A registry that decodes ``version``'s entries, whatever the code defines now."""
        return Registry(s.decoder() for s in self.entry(version).values())

    def compatible(self, version: int, registry: Registry, feature_set: str | None = None) -> bool:
        """Whether the code's definitions produce ``version``'s entries (all sets, or one)."""
        locked = self.versions.get(version)
        if locked is None:
            return False
        names = [feature_set] if feature_set else sorted(set(locked) | set(registry.names()))
        return all(
            n in locked and n in registry and locked[n].fingerprint == registry[n].fingerprint()
            for n in names
        )


def check(lock: Lock, version: int, registry: Registry) -> Status:
    """``"ok"`` if the registry matches ``version``'s entry, ``"new"`` if there is none.

    Raises :class:`LockMismatch`, naming every feature set that differs, if the
    registry changed under a locked version.
    """
    locked = lock.versions.get(version)
    if locked is None:
        return "new"
    problems: list[str] = []
    for fs in registry:
        if fs.name not in locked:
            problems.append(f"feature set {fs.name!r} is new")
        elif locked[fs.name].fingerprint != fs.fingerprint():
            problems.append(
                f"feature set {fs.name!r} changed (locked fingerprint "
                f"{locked[fs.name].fingerprint}, code {fs.fingerprint()})"
            )
    problems += [f"feature set {name!r} was removed" for name in locked if name not in registry]
    if problems:
        raise LockMismatch(
            f"feature definitions differ from the lock for schema version {version}: "
            f"{'; '.join(problems)}. A definition must not change under a deployed version: "
            f"bump FRESHLINE_SCHEMA_VERSION (to {max(lock.versions) + 1}) "
            "and run `freshline check --update-lock`."
        )
    return "ok"


def update(lock: Lock, version: int, registry: Registry) -> bool:
    """Add ``version`` from the registry; ``False`` if it is already locked and matches.

    Never rewrites an existing version: a mismatch raises as :func:`check` does.
    """
    if check(lock, version, registry) == "ok":
        return False
    lock.versions[version] = {fs.name: LockedSet.of(fs) for fs in registry}
    return True
