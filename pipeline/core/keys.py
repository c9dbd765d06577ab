"""Every Redis key and channel freshline uses, made in one place.

Feature keys::

    feat:<schema_version>:<feature_set>:{<tenant>:<entity>}

The braces are a Redis Cluster hash tag: every key of one entity (all feature sets,
its lease) lands in the same slot, so one entity's keys can be read and written in
one round trip on a cluster too. Tenant and entity ids are validated before they can
reach a key: see :func:`validate_id`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TypeGuard, cast

from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.types import EntityRef, Item
from freshline.schemas.ids import ID_PATTERN, MAX_ID_LENGTH, id_problem

FEATURE_PREFIX = "feat"
LEASE_PREFIX = "lease"
INFERENCE_PREFIX = "infer"
HOT_PREFIX = "hot"
FLOOR_PREFIX = "floor"
RANK_PREFIX = "rank"
META_PREFIX = "freshline"

INVALIDATION_CHANNEL = "freshline:invalidations"
APIKEY_CHANNEL = "freshline:apikeys:revoked"
"""API key ids whose cached answers must go: published by ``freshline apikey revoke``
(the key is revoked) and ``freshline tenants limits`` (its tenant's limits changed); each
API worker drops the key from its cache on the message and looks it up again."""
# The deploy pointer's keys and channel share the hash tag {deploy}: its script moves
# them together, and publishes the flip on a sharded channel of the same slot.
ACTIVE_SCHEMA_KEY = "freshline:{deploy}:active_schema_version"
NEXT_SCHEMA_KEY = "freshline:{deploy}:next_schema_version"
PREVIOUS_SCHEMA_KEY = "freshline:{deploy}:previous_schema_version"
RETIRED_SCHEMA_KEY = "freshline:{deploy}:retired_schema_version"
DEPLOY_CHANNEL = "freshline:{deploy}"
FIELDS_KEY = "freshline:{deploy}:fields"
"""``<FIELDS_KEY>:<version>``: a version's locked field lists, published by ``apply`` and
the deploy commands for readers whose lock lacks it. No TTL, as the pointer's keys: a
version's entry is never rewritten and holds a few hundred bytes."""
PROCS_KEY = "freshline:{deploy}:procs"
"""``<PROCS_KEY>:<role>:<id>``: a running process's registration (a TTL, renewed), and
``<PROCS_KEY>:<role>``: the role's index of them (:mod:`freshline.pipeline.cache.roster`)."""
MODELS_KEY = "freshline:models"
DLQ_REPLAYED_PREFIX = "freshline:dlq:replayed"
UNEXPIRING: tuple[str, ...] = (
    ACTIVE_SCHEMA_KEY,
    NEXT_SCHEMA_KEY,
    f"{ACTIVE_SCHEMA_KEY}:*",  # a scoped pointer (Pointer.scoped): one per deployment
    f"{NEXT_SCHEMA_KEY}:*",
    f"{FIELDS_KEY}:*",  # one per schema version, never rewritten
    MODELS_KEY,
    f"{DLQ_REPLAYED_PREFIX}:*",
)
"""The only keys (``fnmatch`` patterns) freshline writes without a TTL: small control
keys that hold no tenant's data and do not grow with traffic (docs/guarantees.md)."""

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def is_plain_id(value: object) -> TypeGuard[str]:
    """Whether ``value`` is an id by the rule's common cases, in a C call or two:
    alphanumeric ASCII, or the pattern. Anything else takes :func:`validate_id`'s path."""
    return (
        type(value) is str
        and len(value) <= MAX_ID_LENGTH
        and ((value.isascii() and value.isalnum()) or ID_PATTERN.fullmatch(value) is not None)
    )


def validate_id(kind: str, value: object) -> str:
    """Return ``value`` as text if it is safe inside a key, else raise :class:`InvalidId`.

    The rule is the contracts' (:mod:`freshline.schemas.ids`): letters, digits, ``_``, ``.`` and
    ``-``, starting alphanumeric, at most 64 characters.
    """
    if is_plain_id(value):
        return value
    problem = id_problem(value)
    if problem is not None:
        raise InvalidId(kind, value, problem)
    return str(value)


def validate_ids(kind: str, values: Sequence[object]) -> list[str]:
    """:func:`validate_id` of each value, checked together where it can be.

    Ids that are all non-empty ASCII alphanumeric strings of at most 64 characters
    pass in a few C-level calls over the lot (their concatenation is alphanumeric
    exactly when each is); any other list is checked id by id, for the exact error.
    """
    if values and set(map(type, values)) == {str}:
        texts = cast(Sequence[str], values)
        joined = "".join(texts)
        lengths = list(map(len, texts))
        if (
            joined.isascii()
            and joined.isalnum()
            and min(lengths) >= 1
            and max(lengths) <= MAX_ID_LENGTH
        ):
            return list(texts)
    return [validate_id(kind, v) for v in values]


def validate_name(kind: str, value: str) -> str:
    """Feature-set and model names: lower-case identifiers."""
    if not isinstance(value, str) or len(value) > MAX_ID_LENGTH or not _NAME.fullmatch(value):
        raise InvalidId(kind, value, "must be a lower-case identifier ([a-z][a-z0-9_]*)")
    return value


def entity_tag(tenant: str, entity: str) -> str:
    return f"{{{tenant}:{entity}}}"


def feature_key(schema_version: int, ref: EntityRef) -> str:
    """The Redis key of one entity's entry for one feature set."""
    tenant = validate_id("tenant", ref.tenant)
    entity = validate_id("entity", ref.entity)
    return f"{FEATURE_PREFIX}:{schema_version}:{ref.feature_set}:{entity_tag(tenant, entity)}"


def feature_keys(schema_version: int, refs: Iterable[EntityRef]) -> list[str]:
    """:func:`feature_key` of each ref, validating each tenant once per call."""
    return item_keys(schema_version, [(r.feature_set, r.tenant, r.entity) for r in refs])


def item_keys(schema_version: int, items: Iterable[Item]) -> list[str]:
    """:func:`feature_key` of each ``(feature_set, tenant, entity)``, each tenant
    validated once per call."""
    heads: dict[tuple[str, str], str] = {}
    out: list[str] = []
    append = out.append
    for feature_set, tenant, entity in items:
        head = heads.get((feature_set, tenant))
        if head is None:
            head = heads[(feature_set, tenant)] = (
                f"{FEATURE_PREFIX}:{schema_version}:{feature_set}:"
                f"{{{validate_id('tenant', tenant)}:"
            )
        append(f"{head}{validate_id('entity', entity)}}}")
    return out


def grid_keys(
    schema_version: int, tenant: str, feature_sets: Sequence[str], entities: Sequence[str]
) -> list[str]:
    """:func:`feature_key` of every (entity, feature set) pair of one tenant, entity-major
    (``entities[0]`` with each feature set, then ``entities[1]``...), each id validated once."""
    tenant = validate_id("tenant", tenant)
    if len(feature_sets) == 1 and len(entities) == 1:  # a GET's one key, without the lists
        return [
            f"{FEATURE_PREFIX}:{schema_version}:{feature_sets[0]}:"
            f"{{{tenant}:{validate_id('entity', entities[0])}}}"
        ]
    heads = [f"{FEATURE_PREFIX}:{schema_version}:{fs}:{{{tenant}:" for fs in feature_sets]
    ids = validate_ids("entity", entities)
    if len(heads) == 1:
        [head] = heads
        return [f"{head}{e}}}" for e in ids]
    return [f"{head}{e}}}" for e in ids for head in heads]


def parse_feature_key(key: str | bytes) -> tuple[int, EntityRef]:
    """``(schema_version, ref)`` of a feature key: :func:`feature_key` inverted.

    Anything :func:`feature_key` would not have made (another prefix, a malformed
    version or tag, an id it would refuse) raises :class:`InvalidId`.
    """
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    parts = text.split(":", 3)
    tenant, sep, entity = parts[3][1:-1].partition(":") if len(parts) == 4 else ("", "", "")
    if not sep or parts[0] != FEATURE_PREFIX or not parts[1].isascii() or not parts[1].isdigit():
        raise InvalidId(
            "feature key",
            text,
            f"not {FEATURE_PREFIX}:<schema_version>:<feature_set>:{{<tenant>:<entity>}}",
        )
    version = int(parts[1])
    ref = EntityRef(validate_name("feature set", parts[2]), tenant, entity)
    if feature_key(version, ref) != text:
        raise InvalidId("feature key", text, "not in canonical form")
    return version, ref


def lease_key(schema_version: int, ref: EntityRef) -> str:
    """The read-through lease of one entity's entry (same hash tag as the entry)."""
    tenant = validate_id("tenant", ref.tenant)
    entity = validate_id("entity", ref.entity)
    return f"{LEASE_PREFIX}:{schema_version}:{ref.feature_set}:{entity_tag(tenant, entity)}"


def floor_key(schema_version: int, feature_set: str) -> str:
    """``floor:<version>:<feature_set>``: the watermark below which its entries are void.

    Set when a source table is truncated: every entry of an affected feature set that
    was computed before the truncate is then stale, whatever its entity.
    """
    return f"{FLOOR_PREFIX}:{schema_version}:{validate_name('feature set', feature_set)}"


SERVER_KEY = f"{FLOOR_PREFIX}:server"
"""``floor:server``: the run id and replication id of the Redis server the consumers
last wrote to (``<run_id>:<replid>``). A consumer that finds another server's there (a
failover, a restart that may have lost writes) raises every floor
(:mod:`freshline.consumers.processor`). Under ``floor:`` so that the consumers' login may write
it and in-process tiers, which track ``floor:``, flush when it changes."""


def source_key(schema_version: int) -> str:
    """``floor:<version>:{source}``: the Postgres history (``<system identifier>:
    <timeline>``) the version's entries were computed from (:mod:`freshline.consumers.source`).

    Under ``floor:`` so that the consumers' login may write it; with a hash tag, so that
    in-process tiers ignore its renewals (as an entity floor's) and every version's
    record shares one slot. No feature set is named ``{source}``."""
    return f"{FLOOR_PREFIX}:{int(schema_version)}:{{source}}"


def entity_floor_key(schema_version: int, ref: EntityRef) -> str:
    """``floor:<version>:<feature_set>:{<tenant>:<entity>}``: one entity's own floor.

    The watermark of a write whose entry goes sooner than the store's fence (it
    expires at its horizon): kept that long, so that a write no newer than it is
    still refused once the entry is gone (see :mod:`freshline.pipeline.cache.store`). It shares
    the entity's hash tag, and the prefix of :func:`floor_key`, whose keys have no tag.
    """
    tenant = validate_id("tenant", ref.tenant)
    entity = validate_id("entity", ref.entity)
    return f"{FLOOR_PREFIX}:{schema_version}:{ref.feature_set}:{entity_tag(tenant, entity)}"


def token_rank_key(xid: int) -> str:
    """Where readers share the rank they first found for a transaction's freshness token
    (:meth:`freshline.pipeline.cache.tokens.Tokens.resolve`)."""
    return f"{RANK_PREFIX}:{int(xid)}"


def dlq_replayed_key(topic: str) -> str:
    """``freshline:dlq:replayed:<topic>``: the records of the dead-letter topic ``topic``
    (its name on the broker) that ``freshline dlq replay`` sent back, a hash."""
    return f"{DLQ_REPLAYED_PREFIX}:{topic}"


def feature_pattern(schema_version: int, feature_set: str | None = None) -> str:
    """A SCAN MATCH pattern for one schema version's namespace."""
    return f"{FEATURE_PREFIX}:{schema_version}:{feature_set or '*'}:*"


def inference_key(
    model: str, version: str, digest: str, tenant: str | None = None, arm: str | None = None
) -> str:
    """``infer:<model>:<version>:<tenant>:<arm>:{<digest>}``; absent tenant/arm are empty.

    The digest is the Redis Cluster hash tag: one input row's predictions (every model
    version, tenant and arm) share a slot, and different rows spread over all of them.
    """
    return f"{inference_prefix(model, version, tenant, arm)}{{{digest}}}"


def inference_prefix(
    model: str, version: str, tenant: str | None = None, arm: str | None = None
) -> str:
    """:func:`inference_key` up to the digest's tag, each part validated once."""
    name = validate_name("model", model)
    ver = validate_id("model version", version)
    ten = validate_id("tenant", tenant) if tenant is not None else ""
    arm_id = validate_id("arm", arm) if arm is not None else ""
    return f"{INFERENCE_PREFIX}:{name}:{ver}:{ten}:{arm_id}:"


def inference_pattern(model: str, version: str) -> str:
    name, ver = validate_name("model", model), validate_id("model version", version)
    return f"{INFERENCE_PREFIX}:{name}:{ver}:*"


def inference_budget_keys(tenant: str) -> tuple[str, str]:
    """``infer:_own:{<tenant>}`` and ``infer:_bytes:{<tenant>}``: the tenant's cached
    predictions, a sorted set scored by expiry (ms), and the bytes they take.

    Under ``infer:`` (the prefix the API's Redis user may write), and never a prediction
    key nor matched by :func:`inference_pattern`: a model name cannot start with ``_``.
    The tenant is the hash tag, so :class:`freshline.pipeline.core.budget.TenantBudget` updates
    both in one script.
    """
    tag = "{" + validate_id("tenant", tenant) + "}"
    return f"{INFERENCE_PREFIX}:_own:{tag}", f"{INFERENCE_PREFIX}:_bytes:{tag}"


def hot_key(schema_version: int, feature_set: str, tenant: str) -> str:
    """A sorted set of sampled read counts per entity, for warming the hottest."""
    return f"{HOT_PREFIX}:{schema_version}:{feature_set}:{validate_id('tenant', tenant)}"


SEMANTIC_PREFIX = "sem"


def semantic_namespace(tenant: str, model: str, model_version: str, template_version: str) -> str:
    """``{<tenant>:<model>:<model_version>:<template_version>}``: one semantic-cache space.

    A Redis Cluster hash tag, so a namespace's entries, id set, change stream and
    counters share a slot. Every part is validated as an id, so none can hold the
    separator, a brace or a wildcard.
    """
    parts = (
        validate_id("tenant", tenant),
        validate_id("model", model),
        validate_id("model version", model_version),
        validate_id("template version", template_version),
    )
    return "{" + ":".join(parts) + "}"


def parse_semantic_namespace(namespace: str) -> tuple[str, str, str, str]:
    """``(tenant, model, model_version, template_version)`` of a namespace tag."""
    parts = namespace[1:-1].split(":") if namespace[:1] == "{" and namespace[-1:] == "}" else []
    if len(parts) != 4:
        raise InvalidId(
            "semantic namespace",
            namespace,
            "not {<tenant>:<model>:<model_version>:<template_version>}",
        )
    tenant, model, model_version, template_version = parts
    if semantic_namespace(tenant, model, model_version, template_version) != namespace:
        raise InvalidId("semantic namespace", namespace, "not in canonical form")
    return tenant, model, model_version, template_version


def semantic_entry_key(namespace: str, entry_id: int) -> str:
    """``sem:e:<namespace>:<id as 16 hex digits>``: one cached response and its vector."""
    return f"{SEMANTIC_PREFIX}:e:{namespace}:{entry_id:016x}"


def semantic_ids_key(namespace: str) -> str:
    """``sem:ids:<namespace>``: a sorted set of the entry ids, scored by expiry (ms)."""
    return f"{SEMANTIC_PREFIX}:ids:{namespace}"


def semantic_log_key(namespace: str) -> str:
    """``sem:log:<namespace>``: a stream of adds and removals that keeps indexes in step."""
    return f"{SEMANTIC_PREFIX}:log:{namespace}"


def semantic_stats_key(namespace: str) -> str:
    """``sem:stats:<namespace>``: counters (hits, misses, stored, flagged, refused)."""
    return f"{SEMANTIC_PREFIX}:stats:{namespace}"


def semantic_outcomes_key(namespace: str, entry_id: int) -> str:
    """``sem:o:<namespace>:<id as 16 hex digits>``: an entry's labelled outcomes (the
    similarities it was, or would have been, served at and whether that was right)."""
    return f"{SEMANTIC_PREFIX}:o:{namespace}:{entry_id:016x}"


def semantic_probes_key(namespace: str) -> str:
    """``sem:x:<namespace>``: explorations awaiting their store, by the explored prompt's
    id: the candidate entry, the similarity and the parameters digest."""
    return f"{SEMANTIC_PREFIX}:x:{namespace}"


def semantic_registry_key(tenant: str) -> str:
    """``sem:ns:<tenant>``: a tenant's namespaces, scored by their last store (ms)."""
    return f"{SEMANTIC_PREFIX}:ns:{validate_id('tenant', tenant)}"


def semantic_budget_keys(tenant: str) -> tuple[str, str]:
    """``sem:_own:{<tenant>}`` and ``sem:_bytes:{<tenant>}``: the tenant's semantic
    entries, a sorted set scored by expiry (ms), and the bytes they take
    (:class:`freshline.pipeline.core.budget.TenantBudget`).

    Under ``sem:``, in the tenant's own hash tag, and never matched by
    :func:`semantic_pattern`: a namespace's tag always holds four parts.
    """
    tag = "{" + validate_id("tenant", tenant) + "}"
    return f"{SEMANTIC_PREFIX}:_own:{tag}", f"{SEMANTIC_PREFIX}:_bytes:{tag}"


def semantic_pattern(
    tenant: str | None = None,
    model: str | None = None,
    model_version: str | None = None,
    template_version: str | None = None,
    kind: str = "*",
) -> str:
    """A SCAN MATCH pattern for semantic keys of ``kind`` (``e``, ``ids``, ``log``,
    ``stats``, ``o``, ``x`` or ``*``), narrowed to whichever parts are given."""
    parts = [
        validate_id("tenant", tenant) if tenant else "*",
        validate_id("model", model) if model else "*",
        validate_id("model version", model_version) if model_version else "*",
        validate_id("template version", template_version) if template_version else "*",
    ]
    tag = "\\{" + ":".join(parts) + "\\}"
    return f"{SEMANTIC_PREFIX}:{kind}:{tag}*"
