"""The endpoints. Each is a few lines: authenticate, validate, read, answer.

Feature hits are read on the event loop with the asyncio Redis client; other blocking
work (misses that reach Postgres, the model, auth lookups) runs in Starlette's thread
pool.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress
from typing import Any, Final, cast

import orjson
import redis
from sqlalchemy.engine import Engine
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from freshline.pipeline.api import freshness, metrics, served
from freshline.pipeline.api.auth import Authenticator, Principal, bearer_token
from freshline.pipeline.api.contracts import (
    batch_size,
    feature_selection,
    predict_entities,
    predict_request,
)
from freshline.pipeline.api.errors import ApiError, JSONResponse, error_response, status_of
from freshline.pipeline.api.reader import (
    MODES,
    FeatureReader,
    Lookup,
    Mode,
    parse_entities,
    parse_entity,
)
from freshline.pipeline.api.splice import Spliced
from freshline.pipeline.api.tenancy import admit_rows, in_pool, tenant_pool
from freshline.pipeline.core.errors import FreshlineError, ModelError
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.keys import validate_name
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.inference.models import ModelRegistry, feature_inputs, input_row
from freshline.pipeline.inference.predictions import InferenceCache, non_finite_rows
from freshline.pipeline.observe.served import ServedLog

Handler = Callable[[Request], Awaitable[Response]]

MAX_JSON_DEPTH: Final = 64
"""How deeply a request body's arrays and objects may nest (the body itself is level 1).

orjson parses up to 1024 levels but serialises at most 254 (``TypeError: Recursion limit
reached``), and the semantic cache serialises ``params`` to digest them: anything
between was a 500. No request needs more than a few levels."""
_CONTAINERS: Final = frozenset({dict, list})


@dataclass(slots=True)
class Services:
    """Everything the endpoints use, built once per app (see
    :func:`freshline.pipeline.api.create_app`)."""

    settings: Settings
    redis: redis.Redis
    engine: Engine
    registry: Registry
    reader: FeatureReader
    auth: Authenticator
    models: ModelRegistry
    inference: InferenceCache
    queries: dict[bytes, tuple[Mode, freshness.Demand | None]] = field(default_factory=dict)
    """The feature route's parsed query strings (:func:`read_options`)."""
    served: ServedLog | None = None
    """The served log (:mod:`freshline.pipeline.api.served`); ``None``: off."""


def services(request: Request) -> Services:
    return cast(Services, request.app.state.services)


async def authenticate(request: Request) -> str:
    """The caller's tenant, from its API key alone.

    :mod:`freshline.pipeline.api.authentication` has checked the key (and
    :mod:`freshline.pipeline.api.limits` its limits) before any ``/v1`` endpoint runs:
    ``request.user``; this is only the fallback for an app without them.
    """
    user = request.scope.get("user")
    if isinstance(user, Principal):
        return user.tenant
    key = bearer_token(request.headers.get("authorization"))
    principal = await run_in_threadpool(services(request).auth.principal, key)
    return principal.tenant


def entity_ids(
    registry: Registry, feature_sets: Sequence[str], values: Sequence[object]
) -> list[str]:
    """``values`` as keys of the entities of ``feature_sets``: each id is checked for each.

    Integer keys take the fast path of :func:`parse_entities`; ``text`` and ``uuid`` keys
    are checked by their entity (:meth:`freshline.pipeline.core.features.Entity.validate`), which
    takes only their canonical spelling, so every check gives the same text.
    """
    entities = {registry[name].entity.type: registry[name].entity for name in feature_sets}
    if set(entities) == {"bigint"}:
        return parse_entities(values)
    ids = [entities[kind].validate(v) for v in values for kind in entities]
    return ids[:: len(entities)]


async def read_json(request: Request) -> Any:
    """The body parsed as JSON, refusing more than ``api_body_limit_bytes`` before parsing."""
    limit = services(request).settings.api_body_limit_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "bad_request", "Content-Length is not a number")
        if int(declared) > limit:
            raise ApiError(413, "body_too_large", f"request body over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body_too_large", f"request body over {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body:
        raise ApiError(400, "invalid_json", "the request body is empty; send a JSON object")
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson's own limit (1024 levels) is told apart only by its message; the
        # 2000-level bodies of tests/pipeline/api/test_abuse.py fail if that changes.
        if exc.msg == "depth limit exceeded":
            raise _too_deep() from None
        raise ApiError(400, "invalid_json", f"the request body is not JSON: {exc}") from exc
    # A body with no more brackets than the limit cannot nest deeper: nearly every one.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and nests_deeper(value, MAX_JSON_DEPTH):
        raise _too_deep()
    return value


def nests_deeper(value: object, limit: int) -> bool:
    """Whether ``value``'s lists and dicts nest more than ``limit`` levels deep.

    Level by level, without recursion; each level's children are sorted out by C-level
    calls, with no Python step per scalar.
    """
    level: list[Any] = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        kids: list[Any] = list(
            chain.from_iterable(x.values() if type(x) is dict else x for x in level)
        )
        level = list(compress(kids, map(_CONTAINERS.__contains__, map(type, kids))))
    return False


def _too_deep() -> ApiError:
    return ApiError(
        400, "json_too_deep", f"the request body nests more than {MAX_JSON_DEPTH} levels deep"
    )


# The query strings nearly every feature request sends, answered without parsing.
_MODES_BY_QUERY: dict[bytes, Mode] = {
    b"": "read-through",
    b"mode=read-through": "read-through",
    b"mode=cache-only": "cache-only",
}


def query_of(request: Request) -> Mapping[str, str]:
    """The query's parameters, the last value of a name winning (as Starlette's
    ``query_params`` has it). A query with nothing to unescape (no ``%`` or ``+``: a
    token is base64url) is split here, without the general parser's work."""
    raw: bytes = request.scope.get("query_string", b"")
    if b"%" in raw or b"+" in raw:
        return request.query_params
    return dict(part.partition("=")[::2] for part in raw.decode("latin-1").split("&") if part)


def mode_of(request: Request, query: Mapping[str, str] | None = None) -> Mode:
    known = _MODES_BY_QUERY.get(request.scope.get("query_string", b""))
    if known is not None:
        return known
    mode = (query_of(request) if query is None else query).get("mode", "read-through")
    if mode not in MODES:
        raise ApiError(400, "invalid_mode", f"mode must be one of {', '.join(MODES)}")
    return mode


def body_demand(
    body: dict[str, Any], svc: Services, feature_sets: Sequence[str]
) -> freshness.Demand | None:
    """The freshness a body asks for, or else the one ``feature_sets`` declare."""
    return freshness.defaulted(
        freshness.from_body(body, svc.settings),
        freshness.declared_default(svc.registry, feature_sets),
        svc.settings,
    )


QUERIES_KEPT: Final = 1024
"""Query strings :func:`read_options` keeps parsed: a reader sends the same token with
each of its reads after a write, so each token's query is parsed once."""


def read_options(
    request: Request,
    settings: Settings,
    kept: dict[bytes, tuple[Mode, freshness.Demand | None]] | None = None,
) -> tuple[Mode, freshness.Demand | None]:
    """The mode, and the freshness the query asks for (``None``: a plain read); with
    ``kept``, parsed once per query string (the last :data:`QUERIES_KEPT` parsed; one
    the parsing refuses is not kept). The token itself is checked by the read."""
    raw: bytes = request.scope.get("query_string", b"")
    known = _MODES_BY_QUERY.get(raw)
    if known is not None:
        return known, None
    if kept is not None and (options := kept.get(raw)) is not None:
        return options
    query = query_of(request)
    options = mode_of(request, query), freshness.from_query(query, settings)
    if kept is not None:
        if len(kept) >= QUERIES_KEPT:
            del kept[next(iter(kept))]  # the oldest
        kept[raw] = options
    return options


AFTER_RESPONSE = "freshline.after_response"


def after_response(request: Request, fn: Callable[..., None], *args: Any) -> None:
    """Call ``fn(*args)`` once the response is sent (in a :func:`timed` handler), or as
    soon as the handler fails: metrics wait, the caller does not."""
    request.scope.setdefault(AFTER_RESPONSE, []).append((fn, args))


Calls = list[tuple[Callable[..., None], tuple[Any, ...]]]


class AfterResponse(BackgroundTask):
    """The calls :func:`after_response` gathered, then the response's own background."""

    def __init__(self, calls: Calls, then: BackgroundTask | None) -> None:
        self.calls = calls
        self.then = then

    async def __call__(self) -> None:
        for fn, args in self.calls:
            fn(*args)
        if self.then is not None:
            await self.then()


def timed(endpoint: str) -> Callable[[Handler], Handler]:
    """Observe the handler's latency, labelled with ``request.state.feature_set``.

    The observation, and those the handler deferred with :func:`after_response`, are
    made once the response is sent (its background task): the caller does not wait
    for metrics. A handler that raises has them made at once.
    """

    def wrap(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            started = time.perf_counter()
            try:
                response = await handler(request)
            except BaseException as exc:
                status = status_of(exc)[0] if isinstance(exc, FreshlineError) else 500
                for fn, args in _observations(request, endpoint, status, started):
                    fn(*args)
                raise
            if (rid := served.request_id(request)) is not None:
                response.headers["x-request-id"] = rid
            response.background = AfterResponse(
                _observations(request, endpoint, response.status_code, started), response.background
            )
            return response

        run.__name__ = handler.__name__
        run.__doc__ = handler.__doc__
        return run

    return wrap


def _observations(request: Request, endpoint: str, status: int, started: float) -> Calls:
    calls: Calls = request.scope.pop(AFTER_RESPONSE, [])
    fs = request.scope.get("state", {}).get("feature_set", "")
    calls.append((metrics.observe, (endpoint, fs, status, time.perf_counter() - started)))
    return calls


@timed("features")
async def get_features(request: Request) -> Response:
    """One entity's features for one feature set."""
    tenant = await authenticate(request)
    svc = services(request)
    feature_set = request.path_params["feature_set"]
    of = svc.registry[feature_set].entity
    request.state.feature_set = feature_set
    raw = request.path_params["entity_id"]
    entity = parse_entity(raw) if of.type == "bigint" else of.validate(raw)
    mode, demand = read_options(request, svc.settings, svc.queries)
    default_ms = svc.registry[feature_set].max_staleness_ms
    if default_ms is not None:
        demand = freshness.defaulted(demand, default_ms, svc.settings)
    lookup = Lookup(tenant, (feature_set,), (entity,))
    logged = served.begin(request, svc.served, svc.registry, [feature_set], tenant, "features")
    started = time.perf_counter()
    if demand is not None:
        answers = await freshness.read(
            svc.reader, lookup, mode, demand, tenant_pool(request, tenant)
        )
    else:
        cached = await svc.reader.cached(lookup, mode)
        answers = (
            cached
            if cached is not None
            else await in_pool(request, tenant, svc.reader.read, lookup, mode)
        )
    [answer] = answers
    after_response(request, metrics.record_answer, answer, time.perf_counter() - started)
    if logged:
        after_response(request, served.finish, request, lookup, answers)
    if answer["values"] is None:
        return error_response(
            404, "miss", f"{feature_set}/{entity} is not cached (mode=cache-only)"
        )
    return JSONResponse(answer)


@timed("batch")
async def batch(request: Request) -> Response:
    """Every combination of the given feature sets and entities."""
    tenant = await authenticate(request)
    svc = services(request)
    mode = mode_of(request)
    body = await read_json(request)
    feature_sets, entities = feature_selection(
        body, svc.settings.api_batch_limit, svc.registry.__getitem__
    )
    request.state.feature_set = "*"
    await admit_rows(request, tenant, len(feature_sets) * len(entities))
    if request.scope.get("query_string", b"") not in _MODES_BY_QUERY and any(
        name in request.query_params for name in freshness.FIELDS
    ):
        raise ApiError(
            400, "invalid_parameter", "a batch takes after, max_staleness_ms, wait_ms in its body"
        )
    demand = body_demand(body, svc, feature_sets)
    # JSON has one number type: 7.0 is the integer 7, as the OpenAPI document says.
    lookup = Lookup(tenant, feature_sets, entity_ids(svc.registry, feature_sets, entities))
    logged = served.begin(request, svc.served, svc.registry, feature_sets, tenant, "batch")
    if demand is not None:
        answers = await freshness.read(
            svc.reader, lookup, mode, demand, tenant_pool(request, tenant)
        )
        after_response(request, metrics.record_answers, answers)
        if logged:
            after_response(request, served.finish, request, lookup, answers)
        return JSONResponse({"schema_version": answers[0]["schema_version"], "items": answers})
    found = await svc.reader.cached_batch(lookup, mode)
    if isinstance(found, Spliced):  # every entry a hit, spliced: the same bytes
        after_response(request, metrics.record_hits, feature_sets[0], len(lookup))
        if logged:
            after_response(request, served.finish, request, lookup, None)
        return Response(found.body, media_type="application/json")
    if found is None:
        found = await in_pool(request, tenant, svc.reader.read, lookup, mode)
    answers = found
    after_response(request, metrics.record_answers, answers)
    if logged:
        after_response(request, served.finish, request, lookup, answers)
    return JSONResponse({"schema_version": answers[0]["schema_version"], "items": answers})


@timed("predict")
async def predict(request: Request) -> Response:
    """Predictions of a registered model through the inference cache: of the rows given
    (``inputs``), or of the given entities' features (``entities``)."""
    tenant = await authenticate(request)
    svc = services(request)
    name = validate_name("model", request.path_params["name"])
    body = await read_json(request)
    if type(body) is dict and "entities" in body:
        return await _predict_entities(request, svc, tenant, name, body)
    inputs, arm = predict_request(body, svc.settings.api_batch_limit)
    await admit_rows(request, tenant, len(inputs))
    return JSONResponse(
        await in_pool(request, tenant, _predictions, svc, tenant, name, inputs, arm)
    )


async def _predict_entities(
    request: Request, svc: Services, tenant: str, name: str, body: dict[str, Any]
) -> Response:
    """The entity form: each entity's features that the model takes, read as a batch
    read reads them (with its freshness fields), then predicted on. Predictions are
    keyed by the rounded feature values, so a changed feature is a new key: an entity
    never gets a prediction made from older features (``docs/reading.md``)."""
    entities, arm = predict_entities(body)
    model = await in_pool(request, tenant, svc.models.get, name)
    try:
        inputs = feature_inputs(model.feature_names)
    except ModelError as exc:
        raise ApiError(409, "model_inputs_unknown", str(exc)) from None
    feature_sets = list(dict.fromkeys(fs for fs, _ in inputs))
    for fs, field_name in inputs:
        if fs not in svc.registry or field_name not in svc.registry[fs].field_names:
            raise ApiError(
                409,
                "model_inputs_unknown",
                f"model {name!r} takes {fs}.{field_name}, which no feature set here serves",
            )
    batch_size(len(feature_sets), len(entities), svc.settings.api_batch_limit)
    await admit_rows(request, tenant, len(entities) * (len(feature_sets) + 1))
    demand = body_demand(body, svc, feature_sets)
    lookup = Lookup(tenant, feature_sets, entity_ids(svc.registry, feature_sets, entities))
    logged = served.begin(request, svc.served, svc.registry, feature_sets, tenant, "predict")
    if demand is not None:
        answers = await freshness.read(
            svc.reader, lookup, "read-through", demand, tenant_pool(request, tenant)
        )
    else:
        answers = await in_pool(request, tenant, svc.reader.read, lookup, "read-through")
    k = len(feature_sets)
    rows = [
        input_row(inputs, {a["feature_set"]: a["values"] for a in answers[i : i + k]})
        for i in range(0, len(answers), k)
    ]
    out = await in_pool(request, tenant, _predictions, svc, tenant, name, rows, arm)
    for prediction, entity in zip(out["predictions"], lookup.entities, strict=True):
        prediction["entity"] = str(entity)
    if logged:
        after_response(request, served.finish, request, lookup, answers, out)
    return JSONResponse(out)


def _predictions(
    svc: Services, tenant: str, name: str, inputs: list[Any], arm: str | None
) -> dict[str, Any]:
    """``inputs`` predicted through the inference cache, as the API answers them."""
    model = svc.models.get(name)
    metrics.MODEL_DETERMINISTIC.labels(name).set(1 if model.deterministic else 0)
    started = time.perf_counter()
    out = svc.inference.predict(metrics.TimedModel(model), inputs, tenant=tenant, arm=arm)
    bad = non_finite_rows(out.values)
    if bad:
        raise ApiError(
            422,
            "non_finite_prediction",
            f"the model gave NaN or infinity for input row(s) "
            f"{', '.join(map(str, bad[:10]))}; such predictions are not cached",
        )
    hits = int(out.hit.sum())
    metrics.observe_read("model", name, hits == len(out), time.perf_counter() - started)
    metrics.record_predictions(name, hits, len(out) - hits)
    return {
        "model": out.model,
        "model_version": out.model_version,
        "arm": arm,
        "predictions": [
            {"value": value, "hit": bool(hit)}
            for value, hit in zip(out.values.tolist(), out.hit.tolist(), strict=True)
        ],
    }


async def openapi(request: Request) -> Response:
    """This API's OpenAPI document."""
    return JSONResponse(request.app.state.openapi)
