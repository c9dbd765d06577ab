"""One frozen settings object, read from ``FRESHLINE_*`` environment variables.

:class:`Settings` composes groups (:class:`PostgresSettings`, :class:`RedisSettings`,
...) by inheritance: every field stays ``settings.<name>`` and one ``FRESHLINE_<NAME>``
variable, while each group is a section of ``docs/settings.md``, generated from the
fields' docstrings by :mod:`freshline.pipeline.core.settings_doc`.

Nothing reads the environment at import time: call :func:`load_settings` once at
start-up and pass the object on, or build ``Settings()`` yourself in tests. Defaults
point at the local stack started by ``scripts/stack up``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from freshline.pipeline.core.errors import ConfigError

_SECRET_PARAM = re.compile(
    r"(?P<name>[?&](?:password|passwd|pwd|secret|token|api_key|apikey|access_token)=)[^&#]*",
    re.IGNORECASE,
)
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def redact(url: str) -> str:
    """``url`` with its password masked, for logs and error messages.

    The password runs from the first ``:`` after the user name to the *last* ``@``:
    a password may hold an unescaped ``@`` (redis-py and urllib read up to the last
    one). Should an ``@`` come later still, in a query, more is masked, never less.
    Password-like query parameters (``?password=...``) are masked too.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest = _SECRET_PARAM.sub(r"\g<name>***", rest)
    userinfo, at, host = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}:***@{host}" if at and colon else f"{scheme}://{rest}"


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact`."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group()), text)


def repository_schema_version() -> int:
    """``project.schema_version`` of the active repository's ``freshline.toml``
    (``FRESHLINE_REPO``, else the current directory, as
    :func:`freshline.pipeline.core.repository.active_path`), or 1 where it names none; a bad
    value is left for the repository's own load to report."""
    path = Path(os.environ.get("FRESHLINE_REPO") or ".") / "freshline.toml"
    try:
        version = tomllib.loads(path.read_text()).get("project", {}).get("schema_version", 1)
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return 1
    ok = isinstance(version, int) and not isinstance(version, bool) and 1 <= version <= 999_999
    return version if ok else 1


def _comma_separated(value: object) -> object:
    """A comma-separated variable's parts, blanks dropped; any other value as it is."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


CommaSeparated = Annotated[list[str], NoDecode, BeforeValidator(_comma_separated)]
"""A list read from one comma-separated variable (``NoDecode``: not as JSON)."""


class SettingsGroup(BaseModel):
    """A group of settings, one section of ``docs/settings.md``: its ``title`` names the
    section, its docstring introduces it, and each field's docstring becomes the field's
    description (pydantic's ``use_attribute_docstrings``), from which
    :mod:`freshline.pipeline.core.settings_doc` writes the table."""

    model_config = ConfigDict(use_attribute_docstrings=True)


class PostgresSettings(SettingsGroup):
    """The source database freshline computes features from, and how its writes must have
    reached disk before a batch stores their results."""

    model_config = ConfigDict(title="Postgres")

    postgres_url: str = "postgresql+psycopg://freshline:freshline@127.0.0.1:5432/freshline"
    """The source database (a SQLAlchemy URL, psycopg 3)."""
    postgres_admin_url: str = ""
    """The owner's URL, for ``freshline db upgrade``, ``freshline cdc register`` and other
    owner-only work; empty: ``postgres_url``."""
    postgres_replica_url: str = ""
    """A hot standby for the read API's feature queries; empty: ``postgres_url``. Its
    results are stored only once it has replayed past the primary's position (see
    :mod:`freshline.pipeline.cache.readthrough`); while it lags they are served uncached
    ([Scaling out](scaling.md))."""
    postgres_durable_wait_ms: int = Field(default=2000, ge=0)
    """How long a batch waits for Postgres to flush its WAL past the batch's snapshot
    before it writes (an asynchronous commit is visible before it is durable); then the
    batch is retried. 0: no wait, only if every writer commits synchronously."""

    @field_validator("postgres_url", "postgres_admin_url", "postgres_replica_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        """A database URL SQLAlchemy reads as written. It reads a password up to its
        first ``@`` and the rest as the host, which every connection error would then
        show: such a URL is refused, and the message never echoes it."""
        if not value:
            return value
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(value)
        except ArgumentError:
            raise ValueError(
                "not a database URL (postgresql+psycopg://user:password@host:port/database)"
            ) from None
        if "@" in (url.host or ""):
            raise ValueError(
                "its password holds an '@': write it as %40 (the URL's password ends at its "
                "first '@')"
            )
        return value

    @property
    def migration_url(self) -> str:
        """The URL migrations and other owner-only work run with."""
        return self.postgres_admin_url or self.postgres_url


class RedisSettings(SettingsGroup):
    """The feature store, which also holds the inference and semantic caches."""

    model_config = ConfigDict(title="Redis")

    redis_url: str = "redis://127.0.0.1:6379/0"
    """The feature store: ``redis://``, or ``rediss://`` for TLS; credentials may sit in
    it or in ``redis_username`` and ``redis_password``."""
    redis_username: str = ""
    """The Redis ACL user; wins over one in ``redis_url``."""
    redis_password: SecretStr = SecretStr("")
    """The Redis ACL user's password (masked when printed); wins over one in
    ``redis_url``."""
    redis_tls_ca: str = ""
    """A CA file to verify the server with (``rediss://`` only); empty: the system's."""
    redis_tls_cert: str = ""
    """A client certificate, for servers that require one (``tls-auth-clients``;
    ``rediss://`` only)."""
    redis_tls_key: str = ""
    """The client certificate's key."""
    redis_cluster: bool = False
    """Redis Cluster (redis-py's ``RedisCluster``): ``redis_url`` names one node of it,
    the client finds the rest."""
    redis_wait_replicas: int = Field(default=0, ge=0)
    """Replicas that must acknowledge a batch's Redis writes (``WAIT``) before the
    consumer commits its offsets; fewer within ``redis_wait_timeout_ms`` holds the batch
    and retries it. 0: no wait (a failover may then lose acknowledged writes). Not on
    Redis Cluster ([Guarantees](guarantees.md))."""
    redis_wait_timeout_ms: int = Field(default=1000, ge=1)
    """How long one ``WAIT`` may block; below ``consumer_redis_timeout_s``."""


class KafkaSettings(SettingsGroup):
    """The Kafka cluster, the topics freshline creates, and Kafka Connect (Debezium)."""

    model_config = ConfigDict(title="Kafka and Kafka Connect")

    kafka_bootstrap: str = "127.0.0.1:9092"
    """Kafka bootstrap servers (``host:port``, comma-separated)."""
    kafka_security_protocol: Literal["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"] = "plaintext"
    """How clients talk to the brokers (librdkafka's ``security.protocol``)."""
    kafka_sasl_mechanism: Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = ""
    """The SASL mechanism, for ``sasl_plaintext`` and ``sasl_ssl``."""
    kafka_sasl_username: str = ""
    """The SASL login's user name."""
    kafka_sasl_password: SecretStr = SecretStr("")
    """The SASL login's password (masked when printed)."""
    kafka_ssl_ca: str = ""
    """A CA file for ``ssl`` and ``sasl_ssl``; empty: the system's."""
    kafka_connect_user: str = ""
    """Kafka Connect's SASL user name. When set, creating the CDC topics (``freshline cdc
    register``) also allows that login to write them, one ACL per topic, so Debezium
    needs no wider grant; empty: no ACLs are made."""
    kafka_consumer_user: str = ""
    """The consumers' SASL user name. When set, ``freshline apply`` (run as a login that
    may manage ACLs) allows that login what the topic prefix needs: to write its
    invalidations and dead letters, read its CDC and domain-event topics and join its
    consumer group; empty: no ACLs are made."""
    topic_prefix: str = Field(default="", pattern=r"^[A-Za-z0-9_.\-]*$")
    """Prepended to every topic freshline reads or writes, so environments can share a
    cluster."""
    topic_partitions: int = Field(default=6, ge=1, le=1000)
    """Partitions for the topics freshline creates."""
    connect_url: str = "http://127.0.0.1:8083"
    """The Kafka Connect REST API; a login in the URL (``http://user:password@host:8083``)
    is sent as HTTP Basic authentication, and masked when printed."""
    connect_secrets_file: str = ""
    """A properties file on the Connect worker with ``database.user`` and
    ``database.password`` (Debezium's own login), read by its FileConfigProvider; empty:
    the owner's user and password go into the connector config in clear."""
    cdc_poll_interval_ms: int = Field(default=10, ge=1)
    """Debezium's ``poll.interval.ms`` for the connector ``freshline cdc register`` makes:
    its queue hands Connect a batch once it holds ``max.batch.size`` events or this long
    has passed, and its loop sleeps this long when the slot has nothing pending, so both
    waits are on every change's path (Debezium's default is 500). At a sustained 2,000
    writes/s on a 2-CPU host, 50 with the producer's default linger was faster end to end
    (``docs/cdc.md``)."""
    cdc_linger_ms: int = Field(default=0, ge=0)
    """``linger.ms`` of the connector's producer (``producer.override.linger.ms``; Kafka
    4's default is 5): 0 sends each batch Debezium hands it at once. Needs the Connect
    worker's ``connector.client.config.override.policy`` to allow it (``All``, Kafka's
    default)."""


class ConsumerSettings(SettingsGroup):
    """The Kafka consumers that recompute features: their group, batches, metrics, Redis
    timeouts and recompute paths."""

    model_config = ConfigDict(title="Consumers")

    consumer_group: str = "freshline"
    """The Kafka consumer group id; unset, ``<topic_prefix>freshline`` (with a topic
    prefix, each environment sharing a cluster has a group of its own)."""
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    """Where a new consumer group starts."""
    batch_max_events: int = Field(default=2000, ge=1)
    """Events per consumer batch at most."""
    batch_max_wait_ms: int = Field(default=50, ge=1)
    """How long a consumer with no record fetched waits for one (a poll), before it
    reports its lag and looks at Redis. A batch never waits to fill: it takes the records
    fetched when it starts, up to ``batch_max_events``."""
    max_message_bytes: int = Field(default=1_000_000, ge=1024)
    """Larger messages are dead-lettered."""
    consumer_metrics_host: str = "127.0.0.1"
    """The address a consumer's metrics server binds (``0.0.0.0`` in containers)."""
    consumer_metrics_port: int = Field(default=9464, ge=0, le=65535)
    """The Prometheus port of a consumer process (0: off)."""
    consumer_redis_timeout_s: float = Field(default=5.0, gt=0)
    """How long a consumer waits for a Redis reply; then the command fails, and the
    batch is retried (recomputed) like any transient failure. redis-py itself never sends
    a consumer's write again: a late resend would carry values of an older snapshot."""
    consumer_redis_connect_timeout_s: float = Field(default=2.0, gt=0)
    """How long a consumer waits for a connection to Redis."""
    recompute_paths: dict[str, Literal["full", "incremental"]] = Field(default_factory=dict)
    """Per feature set, JSON: ``{"txn_90d": "full"}``: the consumer recomputes those sets
    on that path; others keep their declared path."""
    bucket_fold_interval_ms: int = Field(default=1000, ge=0)
    """How often each consumer folds pending bucket deltas into the buckets, up to 500
    entities a time (0: never; then run ``freshline buckets fold --follow``). These
    folds leave a derived path's current UTC day and move its entities' heads instead
    (the day's partial before a cut, which reads take with the rows after it)."""
    bucket_fold_all_interval_ms: int = Field(default=60_000, ge=0)
    """How often a consumer's fold takes the current UTC day too (0: every fold), so
    that its log stays short while writes keep changing it; once the day is over, the
    next fold takes it whatever this says."""


class CacheSettings(SettingsGroup):
    """How feature entries are keyed, computed on a miss and fenced: the key namespace,
    read-through leases, freshness tokens, the write fence, and the API's in-process
    tier."""

    model_config = ConfigDict(title="Feature entries")

    schema_version: int = Field(default_factory=repository_schema_version, ge=1, le=999_999)
    """The feature schema version (the key namespace) this code writes and reads:
    ``FRESHLINE_SCHEMA_VERSION``, else the active repository's ``project.schema_version``
    (``freshline.toml``), else 1."""
    lease_ms: int = Field(default=5000, ge=10)
    """The read-through lease's lifetime."""
    read_wait_ms: int = Field(default=2000, ge=0)
    """How long a reader waits for another's computation of the same entry."""
    token_wait_ms: int = Field(default=100, ge=0)
    """How long a read ``after`` a freshness token waits for the consumer's write before
    it computes, unless the request's ``wait_ms`` says; made only while such waits get
    their writes ([Freshness on request](freshness.md))."""
    token_wait_max_ms: int = Field(default=2000, ge=0)
    """The most a request's ``wait_ms`` may ask; more is cut to this."""
    tombstone_ttl_s: int = Field(default=300, ge=1)
    """The fence: how long every write's compare-and-set state outlives it (tombstones,
    the floor of an entry gone at its horizon); a write that finds no state is refused
    when its query is more than half this old
    ([Keys and entries](keys.md#writes-watermarks-and-leases))."""
    local_cache_size: int = Field(default=100_000, ge=0)
    """In-process tier entries per API worker (0: off); about 90 MB of ``txn_90d``
    entries at the default."""
    subscription_silence_ms: int = Field(default=1000, ge=50, le=60_000)
    """The longest the in-process tier, the deploy listener and the API-key cache rely on
    their Redis subscription without confirmed contact (heartbeats every quarter of it)."""


class ApiSettings(SettingsGroup):
    """The read API (``freshline serve``): its address, limits, authentication, TLS and
    audit log."""

    model_config = ConfigDict(title="Read API")

    api_host: str = "127.0.0.1"
    """The read API's address."""
    api_port: int = Field(default=8000, ge=1, le=65535)
    """The read API's port."""
    api_batch_limit: int = Field(default=500, ge=1)
    """Entities times feature sets per batch request, at most."""
    api_body_limit_bytes: int = Field(default=1_000_000, ge=1024)
    """The request body limit."""
    api_rate_per_s: float = Field(default=1000.0, ge=0)
    """Requests per second per tenant and worker, all its API keys together (token
    bucket; 0: no limit). A tenant may have its own (``freshline tenants limits``), as
    for the burst, concurrency and pool share below."""
    api_rate_burst: int = Field(default=2000, ge=1)
    """The token bucket of ``api_rate_per_s``: requests one tenant's keys may make at once."""
    api_rate_hold_s: float = Field(default=1.0, ge=0)
    """A request over its tenant's ``api_rate_per_s`` waits up to this long for its turn and
    is then served; one that would wait longer is held this long, then refused with 429
    ``rate_limited`` (a refusal at once would be asked again at once, and the refusals
    would take the worker in the work's place)."""
    api_tenant_concurrency: int = Field(default=4, ge=0)
    """Thread-pool jobs (read-through misses, predictions, semantic cache calls) one
    tenant may run at once per worker; its other such requests wait on the event loop,
    holding no thread, so one tenant cannot take the pool (0: no limit, as a deployment
    with one tenant may prefer). For a tenant you do not trust, 1 of its own (``freshline
    tenants limits``) keeps more of the workers for the others (``bench/abuse.py``)."""
    api_tenant_pool_share: float = Field(default=1.0, ge=0)
    """Seconds of thread-pool work (read-through misses, predictions, semantic cache
    calls) one tenant may spend per second per worker, charged by each job's time: a
    batch of 100 ids with no source row weighs what it costs, not one request. A tenant
    over it waits, holding no thread, until it is back within it (0: no limit). Per
    worker: with N workers a tenant may spend N times it; ``freshline check --workers N``
    warns when that could keep every CPU of the host busy."""
    api_tenant_pool_burst_s: float = Field(default=5.0, gt=0)
    """The token bucket of ``api_tenant_pool_share``: pool seconds one tenant may spend
    at once before it waits. A tenant with a pool share of its own (``freshline tenants
    limits --pool-share``) has this burst in proportion to its share over
    ``api_tenant_pool_share``."""
    api_tenant_pool_wait_s: float = Field(default=2.0, ge=0)
    """How far over its ``api_tenant_pool_share`` (in seconds of waiting) a tenant may
    be and still have its requests wait; further over, each is held this long, then
    refused with 429 ``tenant_over_budget`` before its body is read (a refusal at once
    would only be asked again at once)."""
    api_rows_per_s: float = Field(default=0.0, ge=0)
    """Rows per second per tenant and worker that reads and predictions may ask for: the
    entities times feature sets of a read, the rows or entities of a prediction (token
    bucket; 0: no limit). A request's rate counts it once, whatever it asks for; this
    counts what it costs the servers, a batch of 100 ids 100 times one. A request that
    would wait longer than ``api_rate_hold_s`` for its rows is held that long, then
    refused with 429 ``rows_limited``; one asking for more than the burst, with 413
    ``over_rows_burst``. Meant for a tenant you do not trust, as its own (``freshline
    tenants limits --rows``)."""
    api_rows_burst: int = Field(default=2000, ge=1)
    """The token bucket of ``api_rows_per_s``: rows one tenant may ask for at once."""
    api_auth_failures_per_min: float = Field(default=30.0, ge=0)
    """Failed authentications per client address (per /64 for IPv6) and worker before an
    unknown key gets 401 without a lookup; valid keys are still served (0: no limit)."""
    api_auth_failures_burst: int = Field(default=20, ge=1)
    """The token bucket of ``api_auth_failures_per_min``: failures allowed at once."""
    api_trusted_proxies: CommaSeparated = Field(default_factory=list)
    """Proxies (addresses or CIDRs, comma-separated) whose ``X-Forwarded-For`` names the
    client: its right-most address that is not one of them; empty: the TCP peer."""
    api_key_index_refresh_s: float = Field(default=1.0, gt=0)
    """While an address is locked out, how often a worker may read the API keys made
    since its last read; a key it has not read waits for the next
    ([Security](security.md); :class:`freshline.pipeline.api.authentication.KeyIndex`)."""
    api_key_cache_s: float = Field(default=60.0, ge=0)
    """How long a worker caches an API key (revocations drop it at once)."""
    api_key_last_used_s: float = Field(default=60.0, gt=0)
    """How often a worker writes its API keys' last-use times."""
    api_max_connections: int = Field(default=4096, ge=1)
    """Connections served at once per worker."""
    api_backlog: int = Field(default=4096, ge=1)
    """The accept queue's length."""
    api_header_timeout_s: float = Field(default=10.0, gt=0)
    """Time for a request head, and for an idle keep-alive connection."""
    api_body_timeout_s: float = Field(default=30.0, gt=0)
    """Time for a request body (408 past it; checked every tenth of it, so within 1.1
    times)."""
    api_tls_cert: str = ""
    """A PEM certificate: with ``api_tls_key``, serve HTTPS."""
    api_tls_key: str = ""
    """The PEM key of ``api_tls_cert``."""
    audit_log: str = ""
    """A file the audit log's JSON lines are appended to; empty: stderr."""
    api_probe_rate_per_s: float = Field(default=10.0, ge=0)
    """``/healthz`` and ``/readyz`` requests per second per client address and worker on
    the API port (token bucket; 429 past it; 0: no limit). The ops port's probes are not
    limited."""
    api_probe_burst: int = Field(default=20, ge=1)
    """The token bucket of ``api_probe_rate_per_s``: probes allowed at once."""
    api_ready_cache_s: float = Field(default=1.0, ge=0)
    """How long ``/readyz`` reuses its Redis and Postgres check; callers meanwhile wait
    for the one check."""
    api_redis_timeout_s: float = Field(default=5.0, gt=0)
    """How long the API waits for a Redis reply; then the read fails (503). Its reads on
    the event loop are checked every tenth of it, so they fail within 1.1 times
    (:mod:`freshline.pipeline.api.fastpath`)."""
    api_redis_connect_timeout_s: float = Field(default=2.0, gt=0)
    """How long the API waits for a connection to Redis."""

    @field_validator("api_trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        networks = []
        for proxy in value:
            try:
                networks.append(str(ipaddress.ip_network(proxy, strict=False)))
            except ValueError:
                raise ValueError(f"{proxy!r} is not an IP address or CIDR network") from None
        return networks


class OpsSettings(SettingsGroup):
    """The operator's endpoints: ``/metrics``, ``/status``, ``/status.json`` and the
    probes."""

    model_config = ConfigDict(title="Operations")

    ops_host: str = "127.0.0.1"
    """Where ``freshline serve`` serves the operator's endpoints, apart from the API
    port."""
    ops_port: int = Field(default=9465, ge=0, le=65535)
    """The port of ``ops_host``: ``/metrics``, ``/status``, ``/status.json`` and the
    probes, with no key, in a process of its own (0: not served apart; a taken port is a
    warning)."""
    ops_key: SecretStr = SecretStr("")
    """An operator key (32 random characters or more): with it, the API port serves
    ``/metrics``, ``/status`` and ``/status.json`` too, to ``Authorization: Bearer <key>``
    only; empty: 404 there ([Security](security.md))."""
    ops_cache_s: float = Field(default=5.0, ge=0)
    """How long ``/metrics`` and ``/status`` reuse their Redis sample (a SCAN) and broker
    lag: any number of requests drive at most one sample per period. 0: sample every
    request."""
    served_log_buffer: int = Field(default=10_000, ge=0)
    """Records of logged reads the API holds for Kafka (``freshline.served``); one past
    it is dropped and counted, never waited for. 0: no served log
    ([Observability](observability.md#the-served-log))."""
    served_log_sample: float = Field(default=0.0, ge=0.0, le=1.0)
    """The share of every feature set's reads the served log keeps, whatever the feature
    sets' own ``log_sample`` (the larger wins): logging turned on without a repository
    change. 0: only what the feature sets and callers ask for."""
    served_log_dir: str = "served"
    """Where ``freshline served sink`` writes the served log: day-partitioned Parquet
    files (``day=YYYY-MM-DD/``)."""
    served_log_retention_days: int = Field(default=30, ge=1)
    """Days of the served log ``freshline served sink`` keeps; older days are deleted."""


class InferenceSettings(SettingsGroup):
    """The inference cache of model predictions."""

    model_config = ConfigDict(title="Inference cache")

    inference_decimals: int = Field(default=4, ge=0, le=12)
    """Inputs are rounded to this many decimals before hashing."""
    inference_ttl_s: int = Field(default=3600, ge=1)
    """The lifetime of a cached prediction."""
    inference_tenant_max_keys: int = Field(default=100_000, ge=1)
    """Cached predictions one tenant may hold; past it, that tenant's oldest go."""
    inference_tenant_max_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """Bytes (32 MiB by default) one tenant's cached predictions may take: keys, values
    and Redis's overhead; past it, that tenant's oldest go
    ([Security](security.md#redis-memory-per-tenant-budgets-and-maxmemory))."""


class SemanticSettings(SettingsGroup):
    """The semantic cache of LLM responses (``pip install 'freshline[semantic]'``)."""

    model_config = ConfigDict(title="Semantic cache")

    semantic_enabled: bool = False
    """Serve the semantic cache of LLM responses (``/v1/llm/cache/*``); needs the
    ``freshline[semantic]`` extra, and the API refuses to start without it. Off, the API
    imports none of it."""
    semantic_decision: Literal["learned", "static"] = "learned"
    """``learned``: serve each entry only while its estimated error, learned from its
    outcomes and the embedding model's prior, is within ``semantic_max_error``
    ([how](reading.md#when-an-entry-is-served)). ``static``: serve at or above
    ``semantic_threshold``, learning nothing."""
    semantic_max_error: float = Field(default=0.02, gt=0.0, lt=1.0)
    """The learned decision's bound on a served hit's estimated error (delta)."""
    semantic_prior: str = ""
    """A prior file from ``freshline semantic tune --write-prior FILE`` for the embedding
    model in use; empty: the one shipped for the local model. With an endpoint's model and
    no prior, the API refuses to start unless ``semantic_decision`` is ``static``."""
    semantic_threshold: float = Field(default=0.93, gt=0.0, le=1.0)
    """With the ``static`` decision: the cosine similarity a cached response must reach to
    be served."""
    semantic_thresholds: dict[str, float] = Field(default_factory=dict)
    """With the ``static`` decision: per-model thresholds, JSON:
    ``{"support-bot": 0.95}``; others use ``semantic_threshold``."""
    semantic_ttl_s: int = Field(default=86_400, ge=1)
    """The lifetime of a semantic cache entry (and of its namespace's keys)."""
    semantic_embeddings_url: str = ""
    """An OpenAI-compatible embeddings base URL (``<url>/embeddings``); empty: the local
    model."""
    semantic_embeddings_model: str = "all-MiniLM-L6-v2"
    """The embedding model's name at ``semantic_embeddings_url``."""
    semantic_embeddings_api_key: SecretStr = SecretStr("")
    """The bearer key for ``semantic_embeddings_url`` (masked when printed)."""
    semantic_max_prompt_chars: int = Field(default=32_000, ge=1)
    """The longest prompt or response accepted."""
    semantic_max_entries: int = Field(default=200_000, ge=1)
    """Entries per namespace (tenant, model, model version, template version); a store
    past it evicts the namespace's oldest stored entries."""
    semantic_max_entries_per_model: dict[str, int] = Field(default_factory=dict)
    """Per model, JSON: ``{"support-bot": 1000000}``; others use the default."""
    semantic_max_namespaces: int = Field(default=16, ge=1)
    """Namespaces per tenant; past it, the one stored into least recently is purged."""
    semantic_tenant_max_keys: int = Field(default=200_000, ge=1)
    """Entries one tenant may hold in all its namespaces; a store past it evicts that
    tenant's oldest, never another's."""
    semantic_tenant_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    """Bytes (256 MiB by default) one tenant's entries may take (prompts, responses,
    vectors, keys and Redis's overhead); a store past it evicts that tenant's oldest. A
    store larger than all of it is refused (413 ``semantic_entry_too_large``)."""
    semantic_index_max_vectors: int = Field(default=2_000_000, ge=1)
    """Vectors one API process's semantic indexes hold (about 0.6 KB each at 384
    dimensions, measured: 2,000,000 is about 1.2 GB); past it, the least recently used
    indexes are dropped."""
    semantic_warm: bool = True
    """Build, in the background when the API starts, the semantic indexes of the
    namespaces in Redis (most recently stored first, within
    ``semantic_index_max_vectors``)."""
    semantic_models: CommaSeparated = Field(default_factory=list)
    """LLM model names (comma-separated) that the semantic cache's metrics (and
    ``/status``, ``freshline advise``) show by name, with the models of
    ``semantic_thresholds`` and ``semantic_max_entries_per_model``. Any other model a
    request names is counted as ``other``: callers choose no label values."""

    @field_validator("semantic_thresholds")
    @classmethod
    def _thresholds_in_range(cls, value: dict[str, float]) -> dict[str, float]:
        for model, threshold in value.items():
            if not 0.0 < threshold <= 1.0:
                raise ValueError(f"threshold {threshold} for {model!r} is not in (0, 1]")
        return value

    @field_validator("semantic_max_entries_per_model")
    @classmethod
    def _entries_positive(cls, value: dict[str, int]) -> dict[str, int]:
        for model, n in value.items():
            if n < 1:
                raise ValueError(f"max entries {n} for {model!r} is not at least 1")
        return value

    def semantic_threshold_for(self, model: str) -> float:
        """The similarity a cached response must reach to be served for ``model``."""
        return self.semantic_thresholds.get(model, self.semantic_threshold)


# pydantic orders inherited fields from the last base to the first: the groups are
# listed last-first so that fields (in repr, model_dump) keep the order read above.
class Settings(
    SemanticSettings,
    InferenceSettings,
    OpsSettings,
    ApiSettings,
    CacheSettings,
    ConsumerSettings,
    KafkaSettings,
    RedisSettings,
    PostgresSettings,
    BaseSettings,
):
    """Every knob freshline has, composed of the groups above: each field is one
    ``FRESHLINE_<NAME>`` variable, documented in ``docs/settings.md``."""

    # A value refused is never echoed: it may hold a password. The title is set here,
    # else the last group's would be inherited.
    model_config = SettingsConfigDict(
        title="Settings",
        env_prefix="FRESHLINE_",
        frozen=True,
        extra="ignore",
        hide_input_in_errors=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _group_of_prefix(cls, data: Any) -> Any:
        """The consumer group, unless set, follows the topic prefix."""
        if isinstance(data, dict) and data.get("topic_prefix") and "consumer_group" not in data:
            return {**data, "consumer_group": f"{data['topic_prefix']}freshline"}
        return data

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        """What ``repr()`` and ``str()`` show: URLs with their passwords masked (and
        ``SecretStr`` fields, as pydantic masks them)."""
        for name, value in super().__repr_args__():
            yield name, redact(value) if isinstance(value, str) and "://" in value else value

    def redacted(self) -> dict[str, object]:
        """The settings as a dict with passwords masked, safe to print."""
        out: dict[str, object] = {}
        for name, value in self.model_dump().items():
            out[name] = redact(value) if isinstance(value, str) and "://" in value else value
        return out


def load_settings() -> Settings:
    """Settings read from the environment now; a bad value raises :class:`ConfigError`.

    Not cached: a process builds its settings once at start-up and passes them on.
    """
    try:
        return Settings()
    except ValidationError as exc:
        problems = "; ".join(
            f"FRESHLINE_{'_'.join(str(p) for p in err['loc']).upper()}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc
