"""What the consumer's logins must be allowed, and the one line it stops with if not.

A consumer needs its Kafka login to join its group and read its topics, to write the
invalidations and dead-letter topics, and its Redis user to publish on the channel
``freshline:invalidations``. An ACL that refuses any of these does not go away by
waiting, so the consumer stops with :class:`~freshline.pipeline.core.errors.AccessRefused`, one
line naming the ACL and the setting, instead of retrying quietly (see
:mod:`freshline.consumers.failures` for what is retried).

:func:`check_kafka` asks the broker before the consumer joins its group (the writes
would otherwise fail only at the first invalidation); the run loop turns a refusal
seen later (:class:`freshline.consumers.kafka.NotAuthorized`, a refused delivery) into the same
line with :func:`kafka_refusal`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AclOperation, AdminClient

from freshline.consumers.kafka import client_config
from freshline.pipeline.core.errors import AccessRefused
from freshline.pipeline.core.keys import INVALIDATION_CHANNEL
from freshline.pipeline.core.settings import Settings

logger = logging.getLogger("freshline.consumer")

CHECK_TIMEOUT_S = 5.0
WRITES = frozenset({AclOperation.WRITE, AclOperation.ALL})


def login(settings: Settings) -> str:
    """The Kafka login, as the message names it."""
    user = settings.kafka_sasl_username
    return f"login {user!r} (FRESHLINE_KAFKA_SASL_USERNAME)" if user else "the anonymous login"


def group_refused(settings: Settings, group: str) -> AccessRefused:
    return AccessRefused(
        f"Kafka refused the consumer group {group!r} to {login(settings)} "
        "(GROUP_AUTHORIZATION_FAILED): name a group its ACLs allow (--group, "
        "FRESHLINE_CONSUMER_GROUP; the local stack's start with 'freshline'), or grant "
        "it READ on that group"
    )


def write_refused(settings: Settings, topic: str) -> AccessRefused:
    return AccessRefused(
        f"Kafka refused {login(settings)} writing topic {topic!r} "
        "(TOPIC_AUTHORIZATION_FAILED): grant it WRITE on that topic, or set "
        "FRESHLINE_TOPIC_PREFIX to the layout its ACLs allow (the local stack's: no "
        "prefix, freshline.invalidations and freshline.dlq)"
    )


def write_refusal(settings: Settings, topic: str, exists: bool) -> AccessRefused:
    """The line for a delivery to ``topic`` refused with TOPIC_AUTHORIZATION_FAILED: the
    broker says so for a topic that does not exist too (a login that may not create it)."""
    if exists:
        return write_refused(settings, topic)
    return AccessRefused(
        f"topic {topic!r} does not exist, and Kafka refused {login(settings)} creating it "
        "(TOPIC_AUTHORIZATION_FAILED): create the topics as the operator with: freshline "
        "topics ensure"
    )


def read_refused(settings: Settings, topic: str) -> AccessRefused:
    return AccessRefused(
        f"Kafka refused {login(settings)} reading topic {topic!r} "
        "(TOPIC_AUTHORIZATION_FAILED): grant it READ on that topic, or subscribe to "
        "topics its ACLs allow (--topics, FRESHLINE_TOPIC_PREFIX)"
    )


def kafka_refusal(
    settings: Settings, group: str, error: KafkaError, topic: str | None, *, writing: bool
) -> AccessRefused | None:
    """The line for a refusal the broker gave the running consumer; None if ``error``
    is not one."""
    code = error.code()
    if code == KafkaError.GROUP_AUTHORIZATION_FAILED:
        return group_refused(settings, group)
    if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        name = topic or "?"
        return write_refused(settings, name) if writing else read_refused(settings, name)
    return None


def publish_refused(settings: Settings, exc: Exception) -> AccessRefused:
    user = settings.redis_username or "default"
    return AccessRefused(
        f"Redis refused PUBLISH on channel {INVALIDATION_CHANNEL} to user {user!r} "
        f"(FRESHLINE_REDIS_USERNAME: {exc}): run the consumers as a user that may publish "
        "there (the local stack's is FRESHLINE_STACK_REDIS_WRITER_USER; the API's may "
        f"not), or allow it: ACL SETUSER {user} +publish &freshline:*"
    )


def check_kafka(settings: Settings, group: str, writes: Sequence[str]) -> None:
    """Raise :class:`AccessRefused` if the broker says the Kafka login may not use
    ``group`` or write the topics ``writes``.

    Advisory otherwise: a broker that does not answer, a topic that does not exist yet
    or a broker too old to report a topic's authorised operations is left to the run
    loop, which meets any refusal again.
    """
    admin = AdminClient(client_config(settings, "admin"))
    timeout = CHECK_TIMEOUT_S
    try:
        for future in admin.describe_consumer_groups([group], request_timeout=timeout).values():
            future.result()
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if isinstance(error, KafkaError) and error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
            raise group_refused(settings, group) from None
        logger.debug("could not check the group %r: %s", group, exc)
        return  # the broker is away or behind: the run loop meets any refusal
    topics = list(dict.fromkeys(writes))
    if not topics:
        return
    described = admin.describe_topics(
        TopicCollection(topics), include_authorized_operations=True, request_timeout=timeout
    )
    for topic, future in described.items():
        try:
            allowed = future.result().authorized_operations
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if (
                isinstance(error, KafkaError)
                and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
            ):
                raise write_refused(settings, topic) from None
            logger.debug("could not check topic %r: %s", topic, exc)
            continue
        if allowed is not None and not WRITES.intersection(allowed):
            raise write_refused(settings, topic)
