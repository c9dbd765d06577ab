"""``/v1/llm/cache/*``: the semantic response cache over HTTP.

The tenant comes from the API key, never from the body. The cache
(:class:`freshline.pipeline.semantic.cache.SemanticCache`) is made on the first request, or at
start-up when Redis holds namespaces to warm (``FRESHLINE_SEMANTIC_WARM``), so the
embedding model loads once per worker process and only in workers that use it;
concurrent requests are embedded together (:class:`BatchingEmbedder`).

A lookup may answer a miss that names a ``candidate_id``: an exploration
(:mod:`freshline.pipeline.semantic.decision`). The caller does nothing different: it calls its
model and stores the response, and that store labels the candidate (``agreed`` in
its answer). A flag with the ``prompt`` the hit was served for is a wrong outcome for
the entry at that prompt's similarity; without one, the entry is removed.

Metrics name a model only if the settings do (:meth:`SemanticService.label`): the
``model`` in a body is the caller's to choose, and a label value from it would let
any caller grow every scrape without bound, and show one tenant's model names to
whoever reads ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable
from typing import Any, cast

import redis
from prometheus_client import Counter, Histogram
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from freshline.pipeline.api import metrics
from freshline.pipeline.api.errors import ApiError, JSONResponse
from freshline.pipeline.api.routes import authenticate, read_json, timed
from freshline.pipeline.api.semantic_status import OTHER, named_models
from freshline.pipeline.api.tenancy import in_pool
from freshline.pipeline.core.budget import TenantBudget
from freshline.pipeline.core.keys import validate_id
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.semantic.cache import (
    EntryOverBudget,
    Flagged,
    InvalidPrompt,
    Limits,
    Lookup,
    NonDeterministicParams,
    Scope,
    SemanticCache,
    Stored,
    flag_keys,
)
from freshline.pipeline.semantic.decision import Learned
from freshline.pipeline.semantic.embed import (
    BatchingEmbedder,
    EmbeddingError,
    MiniLM,
    embedder_from_settings,
)
from freshline.pipeline.semantic.namespaces import live_namespaces
from freshline.pipeline.semantic.prior import for_model

log = logging.getLogger(__name__)

LOOKUPS = Counter(
    "freshline_semantic_lookups_total",
    "Semantic cache lookups by model and outcome (hit, miss, refused).",
    ["model", "outcome"],
)
STORED = Counter("freshline_semantic_stored_total", "Responses stored, by model.", ["model"])
FLAGGED = Counter(
    "freshline_semantic_flagged_total",
    "Hits a caller flagged as wrong (each removes its entry), by model.",
    ["model"],
)
EXPLORED = Counter(
    "freshline_semantic_explored_total",
    "Misses that named a candidate for the caller's store to label (audits included), by model.",
    ["model"],
)
AUDITED = Counter(
    "freshline_semantic_audited_total",
    "Explorations of a candidate that would have been served, by model.",
    ["model"],
)
LABELS = Counter(
    "freshline_semantic_labels_total",
    "Stores that labelled an explored candidate, by model and outcome (agreed: the "
    "model's response was the candidate's).",
    ["model", "outcome"],
)
ESTIMATED_ERROR = Counter(
    "freshline_semantic_estimated_error_total",
    "The estimated error of each hit served, summed (divide by hits: the mean), by model.",
    ["model"],
)
LOOKUP_SECONDS = Histogram(
    "freshline_semantic_lookup_seconds",
    "Semantic lookup latency, embedding excluded: index search, Redis, exact check.",
    ["model"],
    buckets=metrics.BUCKETS,
)
EMBED_SECONDS = Histogram(
    "freshline_semantic_embedding_seconds",
    "Time to embed one request's prompt (batched with concurrent requests).",
    ["model"],
    buckets=metrics.BUCKETS,
)


class SemanticService:
    """The process's semantic cache, made on first use or by the start-up warm-up."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.redis = client
        self._cache: SemanticCache | None = None
        self._embedder: BatchingEmbedder | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.decision: Learned | None = None
        if settings.semantic_decision == "learned":
            # At start-up: a missing or mismatched prior stops the API, naming the setting.
            embedding_model = (
                settings.semantic_embeddings_model
                if settings.semantic_embeddings_url
                else MiniLM.name
            )
            prior = for_model(embedding_model, settings.semantic_prior)
            self.decision = Learned(prior, settings.semantic_max_error)
        self._named = named_models(settings)

    def label(self, model: str) -> str:
        """``model`` as a metric label value: itself if the settings name it, else
        :data:`OTHER`."""
        return model if model in self._named else OTHER

    def cache(self) -> SemanticCache:
        with self._lock:
            return self._made()

    def start(self) -> None:
        """Warm the indexes of the namespaces in Redis in the background, so that no
        lookup waits for (or misses during) a build (``FRESHLINE_SEMANTIC_WARM``)."""
        if self.settings.semantic_warm:
            threading.Thread(target=self._warm, name="semantic-warm", daemon=True).start()

    def pool_ready(self, namespace: str) -> bool:
        """Whether this process holds a ready index of ``namespace`` (builds nothing)."""
        with self._lock:
            idx = self._cache.pool.peek(namespace) if self._cache is not None else None
        return idx is not None and idx.ready

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._cache is not None:
                self._cache.close()
            if self._embedder is not None:
                self._embedder.close()

    def _made(self) -> SemanticCache:
        if self._cache is None:
            s = self.settings
            self._embedder = BatchingEmbedder(
                embedder_from_settings(
                    s.semantic_embeddings_url,
                    s.semantic_embeddings_model,
                    s.semantic_embeddings_api_key.get_secret_value(),
                )
            )
            self._cache = SemanticCache(
                self.redis,
                self._embedder,
                threshold=s.semantic_threshold,
                thresholds=s.semantic_thresholds,
                ttl_s=s.semantic_ttl_s,
                max_prompt_chars=s.semantic_max_prompt_chars,
                limits=Limits(
                    s.semantic_max_entries,
                    s.semantic_max_entries_per_model,
                    s.semantic_max_namespaces,
                ),
                max_index_vectors=s.semantic_index_max_vectors,
                decision=self.decision,
                budget=TenantBudget(
                    self.redis,
                    max_keys=s.semantic_tenant_max_keys,
                    max_bytes=s.semantic_tenant_max_bytes,
                ),
            )
        return self._cache

    def _warm(self) -> None:
        try:
            found = live_namespaces(self.redis)
            if not found:
                return  # nothing to warm: the model loads on the first request
            with self._lock:
                if self._closed:
                    return
                cache = self._made()
            queued = cache.warm(found)
            log.info("semantic cache: warming %d of %d namespaces", queued, len(found))
        except Exception:  # a background thread has no caller to raise to
            log.exception("semantic cache: warming failed; namespaces build on first use")


def as_api_error(exc: Exception) -> Exception:
    """The semantic layer's errors as the API's: 422 for what the caller sent."""
    if isinstance(exc, NonDeterministicParams):
        return ApiError(422, "not_deterministic", str(exc))
    if isinstance(exc, InvalidPrompt):
        return ApiError(422, "invalid_request", str(exc))
    if isinstance(exc, EntryOverBudget):
        return ApiError(
            413,
            "semantic_entry_too_large",
            f"{exc}: FRESHLINE_SEMANTIC_TENANT_MAX_BYTES and _MAX_KEYS bound what one "
            "tenant keeps; a smaller entry evicts the tenant's oldest instead",
        )
    if isinstance(exc, EmbeddingError):
        # Its message names the endpoint and quotes its answer: for the log only
        # (:func:`freshline.pipeline.api.errors.freshline_error` logs the cause).
        return ApiError(502, "embedding_failed", "the embeddings endpoint failed; retry later")
    return exc


async def _call(fn: Any, *args: Any) -> Any:
    return await _answered(run_in_threadpool(fn, *args))


async def _in_share(request: Request, fn: Any, scope: Scope, *args: Any) -> Any:
    """``fn(scope, *args)`` in the thread pool within the scope's tenant's share."""
    return await _answered(in_pool(request, scope.tenant, fn, scope, *args))


async def _answered(work: Awaitable[Any]) -> Any:
    try:
        return await work
    except (NonDeterministicParams, InvalidPrompt, EntryOverBudget, EmbeddingError) as exc:
        raise as_api_error(exc) from exc


async def _cache(service: SemanticService) -> SemanticCache:
    """The process's cache. The first call makes it, and with an embeddings endpoint
    that embeds a probe (its dimension), which may fail like any embedding."""
    return cast(SemanticCache, await _call(service.cache))


def _service(request: Request) -> SemanticService:
    return cast(SemanticService, request.app.state.semantic)


def _text(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ApiError(422, "invalid_request", f"{field!r} must be a non-empty string")
    return value


async def _request(request: Request) -> tuple[Scope, dict[str, Any]]:
    tenant = await authenticate(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ApiError(422, "invalid_request", "the body must be a JSON object")
    for field in ("model", "model_version", "template_version"):
        if not isinstance(body.get(field), str):
            raise ApiError(422, "invalid_request", f"{field!r} must be a string")
    scope = Scope(
        tenant,
        validate_id("model", body["model"]),
        validate_id("model version", body["model_version"]),
        validate_id("template version", body["template_version"]),
    )
    params = body.get("params")
    if "params" in body and not isinstance(params, dict):
        raise ApiError(
            422, "invalid_request", "'params' must be an object, e.g. {\"temperature\": 0}"
        )
    return scope, body


@timed("llm_lookup")
async def lookup(request: Request) -> Response:
    """A cached response for a prompt close enough to a cached one, or a miss."""
    scope, body = await _request(request)
    prompt = _text(body, "prompt")
    params = body.get("params") or {}
    service = _service(request)
    model = service.label(scope.model)
    cache = await _cache(service)
    try:
        found: Lookup = await _in_share(request, cache.lookup, scope, prompt, params)
    except ApiError as exc:
        if exc.code == "not_deterministic":
            LOOKUPS.labels(model, "refused").inc()
        raise
    LOOKUPS.labels(model, "hit" if found.hit else "miss").inc()
    LOOKUP_SECONDS.labels(model).observe(found.lookup_s)
    EMBED_SECONDS.labels(model).observe(found.embed_s)
    metrics.observe_read("semantic", model, found.hit, found.lookup_s + found.embed_s)
    answer: dict[str, Any] = {
        "hit": found.hit,
        "similarity": found.similarity,
        "threshold": found.threshold,
    }
    if found.estimated_error is not None:
        answer["estimated_error"] = found.estimated_error
    if found.hit:
        answer.update(response=found.response, age_ms=found.age_ms, entry_id=found.entry_id)
        if found.estimated_error is not None:
            ESTIMATED_ERROR.labels(model).inc(found.estimated_error)
    elif found.candidate_id is not None:
        answer["candidate_id"] = found.candidate_id
        EXPLORED.labels(model).inc()
        if found.audit:
            AUDITED.labels(model).inc()
    return JSONResponse(answer)


@timed("llm_store")
async def store(request: Request) -> Response:
    """Cache a deterministic response; anything else is refused (422)."""
    scope, body = await _request(request)
    prompt = _text(body, "prompt")
    response = _text(body, "response")
    params = body.get("params") or {}
    generation_ms = body.get("generation_ms")
    if generation_ms is not None and (
        isinstance(generation_ms, bool)
        or not isinstance(generation_ms, int | float)
        or generation_ms < 0
    ):
        raise ApiError(422, "invalid_request", "'generation_ms' must be a number >= 0")
    service = _service(request)
    model = service.label(scope.model)
    cache = await _cache(service)
    started = time.perf_counter()
    stored: Stored = await _in_share(request, cache.store, scope, prompt, params, response)
    STORED.labels(model).inc()
    if stored.agreed is not None:
        LABELS.labels(model, "agreed" if stored.agreed else "disagreed").inc()
    EMBED_SECONDS.labels(model).observe(stored.embed_s)
    if generation_ms is not None:
        # The model call the cache saves on a hit: what `freshline advise` weighs.
        metrics.COMPUTE_SECONDS.labels("semantic", model).observe(generation_ms / 1000)
        metrics.CACHE_MISS_SECONDS.labels("semantic", model).observe(
            generation_ms / 1000 + time.perf_counter() - started
        )
    answer: dict[str, Any] = {"stored": True, "entry_id": stored.entry_id}
    if stored.agreed is not None:
        answer["agreed"] = stored.agreed
    return JSONResponse(answer, status_code=201)


async def _nothing_to_flag(request: Request, scope: Scope, entry: str) -> bool:
    """Whether Redis holds none of the keys a flag of ``entry`` could find
    (:func:`freshline.pipeline.semantic.cache.flag_keys`): told by one ``EXISTS`` on the event
    loop, with the reader's bound on it. False without the reader's asyncio client."""
    reader = request.app.state.services.reader
    if reader.aredis is None:
        return False
    try:
        keys = flag_keys(scope, entry)
    except InvalidPrompt as exc:
        raise as_api_error(exc) from exc
    try:
        async with asyncio.timeout(reader.timeout_s):
            found = await reader.aredis.exists(*keys)
    except TimeoutError:
        raise redis.exceptions.TimeoutError(
            f"Redis did not answer within {reader.timeout_s:g} s"
        ) from None
    return int(found) == 0


@timed("llm_flag")
async def flag(request: Request) -> Response:
    """A caller reports a bad hit: with the ``prompt`` it was served for, a wrong
    outcome for the entry at that similarity; without, the entry is removed. Counted.

    A flag in a namespace never stored into (none of its keys in Redis) is answered
    ``removed: false`` from one Redis command on the event loop: no thread-pool job,
    no share of the tenant's pool time, no key written, the model not loaded; with no
    namespace, it has no counters to be added to."""
    scope, body = await _request(request)
    entry = _text(body, "entry_id")
    prompt = _text(body, "prompt") if "prompt" in body else None  # null is no string
    service = _service(request)
    answer: dict[str, Any] = {"entry_id": entry}
    fits = prompt is None or len(prompt) <= service.settings.semantic_max_prompt_chars
    if fits and await _nothing_to_flag(request, scope, entry):
        answer["removed"] = False
    elif prompt is None:
        cache = await _cache(service)
        answer["removed"] = await _in_share(request, cache.flag, scope, entry)
    else:
        cache = await _cache(service)
        flagged: Flagged = await _in_share(request, cache.flag_for, scope, entry, prompt)
        answer["removed"] = flagged.removed
        if flagged.similarity is not None:
            answer["similarity"] = flagged.similarity
        if flagged.threshold is not None:
            answer["threshold"] = flagged.threshold
    FLAGGED.labels(service.label(scope.model)).inc()
    return JSONResponse(answer)
