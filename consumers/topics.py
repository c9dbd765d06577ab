"""Creating freshline's Kafka topics: ``ensure`` and the topic sets it is given.

Consumers never rely on broker-side auto-creation: ``freshline topics ensure`` creates
the active repository's domain-event topics and the invalidation and dead-letter topics
with the configured partition count before anything produces to them. Debezium's CDC topics
(``freshline.public.<table>``) are created by Kafka Connect, not here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from confluent_kafka.cimpl import NewTopic

from freshline.pipeline.core.errors import FreshlineError
from freshline.pipeline.core.repository import Repository, active
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.core.topics import CDC_PREFIX, DLQ, INVALIDATIONS, SERVED, qualified

ADMIN_TIMEOUT_S = 15.0
WRITER_OPERATIONS = (AclOperation.WRITE, AclOperation.DESCRIBE)
"""What :func:`allow_writer` grants a login on each topic it may write."""
READER_OPERATIONS = (AclOperation.READ, AclOperation.DESCRIBE)
"""What :func:`allow_consumer` grants on each topic and group it may read or join."""


class TopicError(FreshlineError):
    """The broker refused to create a topic."""


@dataclass
class EnsureReport:
    """What :func:`ensure` found: topics it created and topics that already existed."""

    created: list[str] = field(default_factory=list)
    existing: dict[str, int] = field(default_factory=dict)
    """Existing topic -> its partition count (which may differ from the configured one)."""


def auto_replication(broker_count: int) -> tuple[int, dict[str, str]]:
    """The replication factor and topic config for a cluster of ``broker_count``:
    3 replicas and ``min.insync.replicas`` 2 from three brokers on (an acknowledged
    write survives one broker lost), else one replica per broker."""
    if broker_count >= 3:
        return 3, {"min.insync.replicas": "2"}
    return max(1, broker_count), {}


def ensure(
    admin: AdminClient,
    partitions: int,
    *,
    replication_factor: int | None = None,
    topics: Iterable[str],
    config: dict[str, str] | None = None,
) -> EnsureReport:
    """Create each of ``topics`` that does not exist yet; leave existing ones alone.

    Idempotent and safe to run concurrently with another ``ensure``: a topic created
    by someone else between the listing and the creation is reported as existing.
    ``replication_factor`` None: :func:`auto_replication` of the brokers the cluster has.
    """
    wanted = list(dict.fromkeys(topics))
    metadata = admin.list_topics(timeout=ADMIN_TIMEOUT_S)
    if replication_factor is None:
        replication_factor, auto = auto_replication(len(metadata.brokers))
        config = {**auto, **(config or {})}
    report = EnsureReport()
    missing: list[NewTopic] = []
    listed = [n for n in wanted if (t := metadata.topics.get(n)) is not None and t.error is None]
    partitions_of = _await_partitions(admin, listed)
    for name in wanted:
        if name in partitions_of:
            report.existing[name] = partitions_of[name]
        else:
            missing.append(
                NewTopic(
                    name,
                    num_partitions=partitions,
                    replication_factor=replication_factor,
                    config=dict(config or {}),
                )
            )
    if not missing:
        return report
    futures: dict[str, Any] = admin.create_topics(missing, request_timeout=ADMIN_TIMEOUT_S)
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            err = exc.args[0]
            if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                report.existing[name] = partition_count(admin, name)
                continue
            raise TopicError(f"could not create topic {name!r}: {err}") from exc
        report.created.append(name)
    _await_partitions(admin, report.created)
    return report


def _await_partitions(
    admin: AdminClient, topics: list[str], deadline_s: float = ADMIN_TIMEOUT_S
) -> dict[str, int]:
    """``{topic: partitions}`` once the metadata shows partitions for each of ``topics``.

    A topic created a moment ago (here or by another ``ensure``) can be listed before its
    partitions have reached the broker's metadata cache, with none: waiting until they
    have means a topic ``ensure`` reports is one a producer or consumer can use.
    """
    deadline = time.monotonic() + deadline_s
    counts: dict[str, int] = {}
    pending = list(topics)
    while pending:
        for name in list(pending):
            if (count := partition_count(admin, name)) > 0:
                counts[name] = count
                pending.remove(name)
        if pending and time.monotonic() > deadline:
            raise TopicError(
                f"topic(s) {', '.join(pending)} show no partitions after {deadline_s:.0f} s"
            )
        if pending:
            time.sleep(0.05)  # polling the broker's metadata, which has no notification
    return counts


def partition_count(admin: AdminClient, topic: str) -> int:
    """The number of partitions of ``topic``, 0 if it does not exist."""
    found = admin.list_topics(topic, timeout=ADMIN_TIMEOUT_S).topics.get(topic)
    if found is None or found.error is not None:
        return 0
    return len(found.partitions)


def event_topics(repo: Repository | None = None) -> list[str]:
    """The domain-event topics ``repo`` (the active repository) declares."""
    return [e.topic for e in (repo or active()).events]


def managed(repo: Repository | None = None) -> list[str]:
    """The topics ``freshline topics ensure`` creates: the repository's domain events,
    the invalidations, the dead letters and the served log (contract names, unprefixed)."""
    return [*event_topics(repo), INVALIDATIONS, DLQ, SERVED]


def managed_topics(settings: Settings, repo: Repository | None = None) -> list[str]:
    """:func:`managed`, with the settings' topic prefix."""
    return [qualified(settings, t) for t in managed(repo)]


def subscription(settings: Settings, repo: Repository | None = None) -> list[str]:
    """What ``freshline consume`` reads by default: ``repo``'s (the active repository's)
    domain events and every CDC topic."""
    cdc = rf"^{re.escape(settings.topic_prefix + CDC_PREFIX)}\.public\..*"
    return [*(qualified(settings, t) for t in event_topics(repo)), cdc]


def ensure_from_settings(
    settings: Settings, *, replication_factor: int | None = None
) -> EnsureReport:
    """:func:`ensure` with the partition count, broker and prefix from ``settings``."""
    from freshline.consumers.kafka import admin_client

    return ensure(
        admin_client(settings),
        settings.topic_partitions,
        replication_factor=replication_factor,
        topics=managed_topics(settings),
    )


def ensure_cdc_topics(settings: Settings, topics: Iterable[str]) -> list[str]:
    """Create Debezium's CDC topics with ``FRESHLINE_TOPIC_PARTITIONS``; return the new.

    Made before the connector runs, not left to broker auto-creation: they get the
    configured partition count (consumers scale out by partition), and a consumer's
    regex subscription finds them at once instead of at its next metadata refresh.
    With ``FRESHLINE_KAFKA_CONNECT_USER`` set, Connect's login may then write them
    (:func:`allow_writer`; :func:`remove_cdc_acls` takes that back).
    """
    from freshline.consumers.kafka import admin_client

    wanted = list(topics)
    admin = admin_client(settings)
    created = ensure(admin, settings.topic_partitions, topics=wanted).created
    if settings.kafka_connect_user:
        allow_writer(admin, settings.kafka_connect_user, wanted)
    return created


def remove_cdc_acls(settings: Settings, prefix: str) -> list[str]:
    """Delete the ACLs :func:`ensure_cdc_topics` made for ``FRESHLINE_KAFKA_CONNECT_USER``
    on the CDC topics named ``prefix...`` (:func:`revoke_writer`); returns those topics.
    None without that setting, which made none."""
    from freshline.consumers.kafka import admin_client

    if not settings.kafka_connect_user:
        return []
    return revoke_writer(admin_client(settings), settings.kafka_connect_user, prefix)


def allow_writer(admin: AdminClient, user: str, topics: Iterable[str]) -> None:
    """Allow the SASL login ``user`` to write ``topics``: an ALLOW ACL for WRITE and
    DESCRIBE on each topic's literal name (adding one that exists is a no-op).

    Nothing to do on a broker without an authorizer, where every client may write.
    """
    bindings = _bindings(ResourceType.TOPIC, topics, LITERAL, user, WRITER_OPERATIONS)
    _create_acls(admin, bindings, "create the CDC topics as a login that may manage ACLs")


def allow_consumer(
    admin: AdminClient, user: str, settings: Settings, repo: Repository | None = None
) -> list[str]:
    """Allow the consumers' SASL login ``user`` what ``settings``' topic prefix needs:
    to write the invalidations, dead letters and the served log (WRITE, DESCRIBE; literal
    names; the read API logs with this login), to read the domain-event topics of
    ``repo`` (else the active repository) and the served log (literal; its sink) and
    every CDC topic of the prefix (``<prefix>freshline.public.``, prefixed), and to join
    the consumer group (READ, DESCRIBE on ``consumer_group``, prefixed: its ``.dlq``
    replay group too). Adding an ACL that exists is a no-op; returns the resources, for
    the operator to read.

    Nothing to do on a broker without an authorizer.
    """
    writes = [qualified(settings, t) for t in (INVALIDATIONS, DLQ, SERVED)]
    reads = [qualified(settings, t) for t in event_topics(repo)]
    cdc = f"{qualified(settings, CDC_PREFIX)}.public."
    group = settings.consumer_group
    bindings = [
        *_bindings(ResourceType.TOPIC, writes, LITERAL, user, WRITER_OPERATIONS),
        *_bindings(ResourceType.TOPIC, reads, LITERAL, user, READER_OPERATIONS),
        # The served log's sink reads what the read API wrote (DESCRIBE is above).
        *_bindings(
            ResourceType.TOPIC, [qualified(settings, SERVED)], LITERAL, user, (AclOperation.READ,)
        ),
        *_bindings(ResourceType.TOPIC, [cdc], PREFIXED, user, READER_OPERATIONS),
        *_bindings(ResourceType.GROUP, [group], PREFIXED, user, READER_OPERATIONS),
    ]
    _create_acls(admin, bindings, "grant them as a login that may manage ACLs")
    return [
        f"write {', '.join(writes)}",
        f"read {', '.join([*reads, cdc + '*'])}",
        f"join group {group}*",
    ]


LITERAL, PREFIXED = ResourcePatternType.LITERAL, ResourcePatternType.PREFIXED


def _bindings(
    kind: ResourceType,
    names: Iterable[str],
    pattern: ResourcePatternType,
    user: str,
    operations: Iterable[AclOperation],
) -> list[AclBinding]:
    return [
        AclBinding(kind, name, pattern, f"User:{user}", "*", operation, AclPermissionType.ALLOW)
        for name in names
        for operation in operations
    ]


def _create_acls(admin: AdminClient, bindings: list[AclBinding], remedy: str) -> None:
    """Create ``bindings``; a refusal raises :class:`TopicError` naming the first one."""
    if not bindings:
        return
    for binding, future in admin.create_acls(bindings, request_timeout=ADMIN_TIMEOUT_S).items():
        try:
            future.result()
        except KafkaException as exc:
            if _security_disabled(exc):
                return
            user = binding.principal.removeprefix("User:")
            operation, kind = binding.operation, binding.restype
            what = f"{getattr(operation, 'name', operation)} {getattr(kind, 'name', kind)}"
            raise TopicError(
                f"could not allow {user!r} to {what.lower()} {binding.name!r}: "
                f"{exc.args[0]}; {remedy}"
            ) from exc


def revoke_writer(admin: AdminClient, user: str, prefix: str) -> list[str]:
    """Delete what :func:`allow_writer` granted ``user`` on the topics whose names start
    with ``prefix``: the ALLOW ACLs for WRITE and DESCRIBE on each one's literal name,
    whichever topics they were made for. Returns those topics (none once deleted:
    idempotent); ``user``'s other ACLs, prefixed ones included, are left alone.

    Nothing to do on a broker without an authorizer.
    """
    try:
        owned = [
            AclBindingFilter(
                b.restype,
                b.name,
                b.resource_pattern_type,
                b.principal,
                b.host,
                b.operation,
                b.permission_type,
            )
            for b in topic_acls(admin, user, prefix)
            if b.operation in WRITER_OPERATIONS
        ]
        if not owned:
            return []
        for future in admin.delete_acls(owned, request_timeout=ADMIN_TIMEOUT_S).values():
            future.result()
    except KafkaException as exc:
        if _security_disabled(exc):
            return []
        raise TopicError(
            f"could not delete the ACLs of {user!r} on {prefix}*: {exc.args[0]}; "
            "remove the connector as a login that may manage ACLs"
        ) from exc
    return sorted({f.name for f in owned})


def topic_acls(
    admin: AdminClient,
    user: str,
    prefix: str,
    pattern: ResourcePatternType = ResourcePatternType.LITERAL,
) -> list[AclBinding]:
    """The ALLOW ACLs, of any operation, the login ``user`` holds on topic names of
    ``pattern`` (``ANY``: literal and prefixed alike) that start with ``prefix``."""
    wanted = AclBindingFilter(
        ResourceType.TOPIC,
        None,  # type: ignore[arg-type]  # None matches any name (describe_acls)
        pattern,
        f"User:{user}",
        None,  # type: ignore[arg-type]  # any host
        AclOperation.ANY,
        AclPermissionType.ALLOW,
    )
    found = admin.describe_acls(wanted, request_timeout=ADMIN_TIMEOUT_S).result()
    return [b for b in found if b.name.startswith(prefix)]


def _security_disabled(exc: KafkaException) -> bool:
    """Whether the broker refused for having no authorizer (no ACLs to manage)."""
    err = exc.args[0]
    return isinstance(err, KafkaError) and err.code() == KafkaError.SECURITY_DISABLED
