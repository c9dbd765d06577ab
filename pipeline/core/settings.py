"""One frozen settings object, read from ``FRESHLINE_*`` environment variables.

:class:`Settings` composes groups (:class:`PostgresSettings`, :class:`RedisSettings`,
...) by inheritance: every field stays ``settings.<name>`` and one ``FRESHLINE_<NAME>``
variable, while each group is a section of ``docs/settings.md``, generated from the
fields' docstrings by :mod:`pipeline.core.settings_doc`.

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

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pipeline.core.errors import ConfigError

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
    :func:`pipeline.core.repository.active_path`), or 1 where it names none; a bad
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


class SettingsGroup(BaseModel):
    """A group of settings: its fields' docstrings are their descriptions, from which
    ``docs/settings.md`` is generated (:mod:`pipeline.core.settings_doc`)."""

    model_config = ConfigDict(use_attribute_docstrings=True)


class PostgresSettings(SettingsGroup):
    """Postgres: the source database freshline computes features from."""

    postgres_url: str = "postgresql+psycopg://freshline:freshline@127.0.0.1:5432/freshline"
    postgres_admin_url: str = ""
    """The owner's URL, for migrations and CDC registration; empty: ``postgres_url``."""
    postgres_replica_url: str = ""
    """A hot standby for the read API's feature queries; empty: ``postgres_url``. Its
    results are stored only once it has replayed past the primary's position (see
    :mod:`pipeline.cache.readthrough`); while it lags they are served uncached."""
    postgres_durable_wait_ms: int = Field(default=2000, ge=0)
    """How long a batch waits for Postgres to flush its WAL past the batch's snapshot
    before it writes (asynchronous commits are visible before they are durable); then
    the batch is retried. 0: no wait, only if every writer commits synchronously."""

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
    """Redis: the feature store, the inference and semantic caches."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """``redis://`` or ``rediss://`` (TLS); credentials may sit in it or below."""
    redis_username: str = ""
    redis_password: SecretStr = SecretStr("")
    redis_tls_ca: str = ""
    """A CA file to verify the server with (``rediss://`` only); empty: the system's."""
    redis_tls_cert: str = ""
    redis_tls_key: str = ""
    """A client certificate and key, for servers that require one (``tls-auth-clients``)."""
    redis_cluster: bool = False
    """Redis Cluster: ``redis_url`` names one node of it, the client finds the rest."""
    redis_wait_replicas: int = Field(default=0, ge=0)
    """Replicas that must acknowledge a batch's Redis writes (``WAIT``) before the
    consumer commits its offsets; fewer within ``redis_wait_timeout_ms`` holds the batch
    and retries it. 0: no wait (a failover may then lose acknowledged writes). Not on
    Redis Cluster."""
    redis_wait_timeout_ms: int = Field(default=1000, ge=1)
    """How long one ``WAIT`` may block; below ``consumer_redis_timeout_s``."""


class KafkaSettings(SettingsGroup):
    """Kafka, its topics, and Kafka Connect (Debezium)."""

    kafka_bootstrap: str = "127.0.0.1:9092"
    kafka_security_protocol: Literal["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"] = "plaintext"
    kafka_sasl_mechanism: Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = ""
    kafka_sasl_username: str = ""
    kafka_sasl_password: SecretStr = SecretStr("")
    kafka_ssl_ca: str = ""
    topic_prefix: str = Field(default="", pattern=r"^[A-Za-z0-9_.\-]*$")
    topic_partitions: int = Field(default=6, ge=1, le=1000)
    connect_url: str = "http://127.0.0.1:8083"
    connect_secrets_file: str = ""
    """A properties file on the Connect worker with ``database.password``, read by its
    FileConfigProvider; empty: the password goes into the connector config in clear."""


class ConsumerSettings(SettingsGroup):
    """The consumers: batches, offsets, recompute paths, their Redis timeouts."""

    consumer_group: str = "freshline"
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    batch_max_events: int = Field(default=2000, ge=1)
    batch_max_wait_ms: int = Field(default=50, ge=1)
    max_message_bytes: int = Field(default=1_000_000, ge=1024)
    consumer_metrics_host: str = "127.0.0.1"
    consumer_metrics_port: int = Field(default=9464, ge=0, le=65535)
    consumer_redis_timeout_s: float = Field(default=5.0, gt=0)
    """How long a consumer waits for a Redis reply; then the command fails, and the
    batch is retried (recomputed) like any transient failure."""
    consumer_redis_connect_timeout_s: float = Field(default=2.0, gt=0)
    """How long a consumer waits for a connection to Redis."""
    recompute_paths: dict[str, Literal["full", "incremental"]] = Field(default_factory=dict)
    """Per feature set, JSON: ``{"txn_90d": "full"}``; others keep their declared path."""
    bucket_fold_interval_ms: int = Field(default=1000, ge=0)
    """How often each consumer folds pending bucket deltas into the buckets (0: never;
    then run ``freshline buckets fold --follow``)."""


class CacheSettings(SettingsGroup):
    """Feature entries: the key namespace, read-through leases, freshness tokens, the
    write fence, and the in-process tier."""

    schema_version: int = Field(default_factory=repository_schema_version, ge=1, le=999_999)
    """The version this code writes and reads: ``FRESHLINE_SCHEMA_VERSION``, else the
    active repository's ``project.schema_version`` (``freshline.toml``), else 1."""
    lease_ms: int = Field(default=5000, ge=10)
    read_wait_ms: int = Field(default=2000, ge=0)
    token_wait_ms: int = Field(default=100, ge=0)
    """How long a read ``after`` a freshness token waits for the consumer's write before
    it computes, unless the request says (``wait_ms``)."""
    token_wait_max_ms: int = Field(default=2000, ge=0)
    """The most a request's ``wait_ms`` may ask; more is cut to this."""
    tombstone_ttl_s: int = Field(default=300, ge=1)
    local_cache_size: int = Field(default=100_000, ge=0)
    subscription_silence_ms: int = Field(default=1000, ge=50, le=60_000)


class ApiSettings(SettingsGroup):
    """The read API: its address, limits, authentication and TLS."""

    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=1, le=65535)
    api_batch_limit: int = Field(default=500, ge=1)
    api_body_limit_bytes: int = Field(default=1_000_000, ge=1024)
    api_rate_per_s: float = Field(default=1000.0, ge=0)
    """Requests per second per API key and worker (token bucket; 0: no limit)."""
    api_rate_burst: int = Field(default=2000, ge=1)
    api_tenant_concurrency: int = Field(default=4, ge=0)
    """Thread-pool jobs (misses, predictions, semantic calls) one tenant may run at
    once per worker; more wait their turn on the event loop (0: no limit)."""
    api_auth_failures_per_min: float = Field(default=30.0, ge=0)
    """Failed authentications per client address and worker (0: no limit)."""
    api_auth_failures_burst: int = Field(default=20, ge=1)
    api_trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Proxies (addresses or CIDRs, comma-separated) whose ``X-Forwarded-For`` names the
    client: its right-most address that is not one of them; empty: the TCP peer."""
    api_key_index_refresh_s: float = Field(default=1.0, gt=0)
    """How often a worker may re-read key hashes while an address is locked out; a
    key not yet read waits for the next read (see :class:`pipeline.api.limits.KeyIndex`)."""
    api_key_cache_s: float = Field(default=60.0, ge=0)
    api_key_last_used_s: float = Field(default=60.0, gt=0)
    api_max_connections: int = Field(default=4096, ge=1)
    api_backlog: int = Field(default=4096, ge=1)
    api_header_timeout_s: float = Field(default=10.0, gt=0)
    api_body_timeout_s: float = Field(default=30.0, gt=0)
    api_tls_cert: str = ""
    api_tls_key: str = ""
    audit_log: str = ""
    api_probe_rate_per_s: float = Field(default=10.0, ge=0)
    """``/healthz`` and ``/readyz`` requests per second per client address and worker on
    the API port (token bucket; 0: no limit). The ops port's probes are not limited."""
    api_probe_burst: int = Field(default=20, ge=1)
    api_ready_cache_s: float = Field(default=1.0, ge=0)
    """How long ``/readyz`` reuses its Redis and Postgres check (one check at a time)."""

    @field_validator("api_trusted_proxies", mode="before")
    @classmethod
    def _proxies_comma_separated(cls, value: object) -> object:
        return _comma_separated(value)

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
    """The operator's endpoints: ``/metrics``, ``/status`` and the probes."""

    ops_host: str = "127.0.0.1"
    ops_port: int = Field(default=9465, ge=0, le=65535)
    """Where ``freshline serve`` serves ``/metrics``, ``/status`` and ``/status.json`` (and
    the probes), apart from the API port; 0: not served apart."""
    ops_key: SecretStr = SecretStr("")
    """An operator key: with it, the API port serves ``/metrics``, ``/status`` and
    ``/status.json`` too, to ``Authorization: Bearer <key>`` only; empty: not there."""
    ops_cache_s: float = Field(default=5.0, ge=0)
    """How long ``/metrics`` and ``/status`` reuse their Redis sample and broker lag: requests
    drive at most one sample (a SCAN of Redis) per period. 0: sample every request."""


class InferenceSettings(SettingsGroup):
    """The inference cache of model predictions."""

    inference_decimals: int = Field(default=4, ge=0, le=12)
    inference_ttl_s: int = Field(default=3600, ge=1)
    inference_tenant_max_keys: int = Field(default=100_000, ge=1)
    """Cached predictions one tenant may hold; past it, that tenant's oldest go."""
    inference_tenant_max_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """Bytes one tenant's cached predictions may take (keys, values, bookkeeping);
    past it, that tenant's oldest go."""


class SemanticSettings(SettingsGroup):
    """The semantic cache of LLM responses (``freshline[semantic]``)."""

    semantic_enabled: bool = False
    """Serve the semantic cache of LLM responses (``/v1/llm/cache/*``); needs the
    ``freshline[semantic]`` extra. Off, the API imports none of it."""
    semantic_decision: Literal["learned", "static"] = "learned"
    """``learned``: serve each entry only while its estimated error, learned from its
    outcomes and the embedding model's prior, is within ``semantic_max_error``.
    ``static``: serve at or above ``semantic_threshold``, learning nothing."""
    semantic_max_error: float = Field(default=0.02, gt=0.0, lt=1.0)
    """The learned decision's bound on a served hit's estimated error (delta)."""
    semantic_prior: str = ""
    """A prior file from ``freshline semantic tune --write-prior`` for the embedding
    model; empty: the one shipped for the local model."""
    semantic_threshold: float = Field(default=0.93, gt=0.0, le=1.0)
    semantic_thresholds: dict[str, float] = Field(default_factory=dict)
    """Per-model thresholds, JSON: ``{"support-bot": 0.95}``; others use the default."""
    semantic_ttl_s: int = Field(default=86_400, ge=1)
    semantic_embeddings_url: str = ""
    """An OpenAI-compatible ``/v1/embeddings`` base URL; empty: the local model."""
    semantic_embeddings_model: str = "all-MiniLM-L6-v2"
    semantic_embeddings_api_key: SecretStr = SecretStr("")
    semantic_max_prompt_chars: int = Field(default=32_000, ge=1)
    semantic_max_entries: int = Field(default=200_000, ge=1)
    """Entries per namespace (tenant, model, versions); past it the oldest are evicted."""
    semantic_max_entries_per_model: dict[str, int] = Field(default_factory=dict)
    """Per model, JSON: ``{"support-bot": 1000000}``; others use the default."""
    semantic_max_namespaces: int = Field(default=16, ge=1)
    """Namespaces per tenant; past it, the one stored into least recently is purged."""
    semantic_index_max_vectors: int = Field(default=2_000_000, ge=1)
    """Vectors one API process's semantic indexes hold; least recently used dropped."""
    semantic_warm: bool = True
    """Build the semantic indexes of the namespaces in Redis when the API starts."""
    semantic_models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """LLM model names (comma-separated) the metrics name; with the models of
    ``semantic_thresholds`` and ``semantic_max_entries_per_model``. Any other model
    a request names is counted as ``other``: callers choose no label values."""

    @field_validator("semantic_models", mode="before")
    @classmethod
    def _models_comma_separated(cls, value: object) -> object:
        return _comma_separated(value)

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

    # A value refused is never echoed: it may hold a password.
    model_config = SettingsConfigDict(
        env_prefix="FRESHLINE_", frozen=True, extra="ignore", hide_input_in_errors=True
    )

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
