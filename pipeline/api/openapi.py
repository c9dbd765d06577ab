"""The OpenAPI 3.1 document: the paths written here, the bodies' schemas generated from
:mod:`freshline.pipeline.api.contracts`, the limits and names of the server that serves it.

A test checks that every route of the app appears here with its methods, and that the
committed document of the fraud example (``examples/fraud/schemas/openapi.json``) is
the generated one; ``scripts/contracts`` writes it (:func:`main`).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from freshline.pipeline.api.contracts import (
    LLM_MODELS,
    MAX_MS,
    MODELS,
    TOKEN_PATTERN,
    Freshness,
    component_schemas,
)
from freshline.pipeline.api.reader import MAX_USER_ID
from freshline.pipeline.api.routes import MAX_JSON_DEPTH
from freshline.pipeline.core.features import Registry
from freshline.pipeline.core.settings import Settings
from freshline.schemas.ids import ID_PATTERN, MAX_ID_LENGTH

_ERROR = {"$ref": "#/components/schemas/Error"}


def _errors(*statuses: int, override: dict[int, str] | None = None) -> dict[str, Any]:
    reasons = {
        400: "Invalid id or mode, a body that is not JSON, or one nested more than "
        f"{MAX_JSON_DEPTH} levels deep (json_too_deep)",
        401: "Missing, unknown, revoked or expired API key, or too many failed "
        "authentications from this address",
        403: "Refused",
        404: "Unknown feature set or model, or a miss in cache-only mode",
        409: "The model is marked non-deterministic and cannot be cached",
        413: "Body over the size limit",
        422: "Body of the wrong shape, a batch over the limit, or bad model inputs",
        502: "The embeddings endpoint failed",
        503: "Redis or Postgres did not answer",
    }
    return {
        str(s): {
            "description": (override or {}).get(s, reasons[s]),
            "content": {"application/json": {"schema": _ERROR}},
        }
        for s in statuses
    }


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


# Ids that reach keys (schemas/ids.py): the rule every tenant, entity and arm follows.
ID = {"type": "string", "pattern": f"^{ID_PATTERN.pattern}$", "maxLength": MAX_ID_LENGTH}
# An entity id as the server takes it, per key type (freshline.pipeline.core.features.validate_key;
# the read API's fast path for bigint keys, freshline.pipeline.api.reader.parse_entity, takes ids
# below MAX_USER_ID): the canonical spelling only; as JSON, bigint ids may be integers.
_BIGINT_DIGITS = len(str(MAX_USER_ID - 1))
_KEY_TEXT: dict[str, dict[str, Any]] = {
    "bigint": {
        "type": "string",
        "pattern": f"^(0|[1-9][0-9]{{0,{_BIGINT_DIGITS - 1}}})$",
        "maxLength": _BIGINT_DIGITS,
        "description": f"A bigint key below {MAX_USER_ID}, no leading zeros.",
    },
    "uuid": {
        "type": "string",
        "pattern": (
            "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
        ),
        "maxLength": 36,
        "description": "A uuid key, either case; answered in lower case.",
    },
}
_BIGINT_JSON = {"type": "integer", "minimum": 0, "maximum": MAX_USER_ID - 1}


def entity_id_schemas(key_types: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schemas of an entity id for the repository's key types: in a path, and in a
    JSON body (where a bigint id may also be a number)."""
    kinds = sorted(set(key_types)) or ["bigint"]
    texts = [_KEY_TEXT.get(kind, ID) for kind in kinds]
    path = texts[0] if len(texts) == 1 else {"anyOf": texts}
    if "bigint" not in kinds:
        return path, path
    # One string schema and the integer are disjoint; strings of several types may overlap.
    return path, {"oneOf" if len(texts) == 1 else "anyOf": [*texts, _BIGINT_JSON]}


_NAME = {"type": "string", "pattern": "^[a-z][a-z0-9_]*$", "maxLength": MAX_ID_LENGTH}

# Reads that ask for freshness (freshline.pipeline.api.freshness): the GET's query parameters say
# what the batch body's fields say. document() states the server's wait default and maximum.
_MS = {"type": "integer", "minimum": 0, "maximum": MAX_MS}
_AFTER_TEXT = Freshness.model_fields["after"].description
_STALENESS_TEXT = Freshness.model_fields["max_staleness_ms"].description
_FRESHNESS_400 = (
    "Invalid id or mode; a freshness token that is malformed (invalid_token) or names a "
    "state the database has not reached (token_ahead); max_staleness_ms or wait_ms not "
    "an integer from 0 to 10^12 (invalid_parameter)"
)
_FRESHNESS_403 = (
    "A freshness token of the right shape that this database did not sign: forged, "
    "altered or another database's (foreign_token)"
)
_TOKEN = {"type": "string", "pattern": TOKEN_PATTERN}
_FRESHNESS_409 = (
    "The token names a transaction that has not committed within wait_ms (token_pending)"
)

_MODE = {
    "name": "mode",
    "in": "query",
    "required": False,
    "description": "read-through (default): compute misses from Postgres and cache them; "
    "cache-only: never compute, report misses (404 for a single read).",
    "schema": {"type": "string", "enum": ["read-through", "cache-only"]},
}

# The bodies' schemas, generated from their models (freshline.pipeline.api.contracts).
_SCHEMAS = component_schemas(MODELS)
_LLM_SCHEMAS = component_schemas(LLM_MODELS)


def _llm(summary: str, request: str, response: str, status: str = "200") -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": _SECURED,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                status: _json(_ref(response), summary),
                **_errors(
                    400,
                    401,
                    413,
                    422,
                    502,
                    503,
                    override={
                        422: "Body of the wrong shape, or params that are not "
                        "deterministic (temperature above 0, not declared "
                        "deterministic): code not_deterministic"
                    },
                ),
            },
        }
    }


_SECURED: list[dict[str, list[str]]] = [{"bearer": []}]


def document(
    feature_sets: list[str],
    *,
    batch_limit: int = 500,
    body_limit: int = 1_000_000,
    prompt_limit: int = 32_000,
    key_types: Iterable[str] = ("bigint",),
    semantic: bool = True,
    token_wait_ms: int = 100,
    token_wait_max_ms: int = 2000,
    operator_pages: bool = False,
) -> dict[str, Any]:
    """The OpenAPI document, naming the feature sets this server knows, the ids of their
    entities (``key_types``) and the limits it enforces (``FRESHLINE_API_BATCH_LIMIT``,
    ``FRESHLINE_API_BODY_LIMIT_BYTES``, ``FRESHLINE_TOKEN_WAIT_MS`` and ``_MAX_MS``); the
    semantic cache's routes (``/v1/llm/``) and their schemas only if ``semantic``
    (``FRESHLINE_SEMANTIC_ENABLED``); ``/metrics``, ``/status`` and ``/status.json`` only
    if ``operator_pages`` (an operator key is set: ``FRESHLINE_OPS_KEY``), for that key."""
    schemas = copy.deepcopy({**_SCHEMAS, **(_LLM_SCHEMAS if semantic else {})})
    wait = (
        f"With after: how long to wait for the consumer's write before recomputing, in ms "
        f"(default {token_wait_ms}; more than {token_wait_max_ms} is cut to it: "
        "FRESHLINE_TOKEN_WAIT_MS, FRESHLINE_TOKEN_WAIT_MAX_MS)."
    )
    entity_path, entity_body = entity_id_schemas(key_types)
    batch = schemas["BatchRequest"]
    batch["properties"]["wait_ms"]["description"] = wait
    batch["properties"]["entities"]["items"] = entity_body
    most = min(len(feature_sets), batch_limit)
    batch["properties"]["feature_sets"].update(
        items={"type": "string", "enum": feature_sets}, maxItems=most, uniqueItems=True
    )
    batch["properties"]["entities"]["maxItems"] = batch_limit
    # The limit is on the product; one branch per number of feature sets says it.
    batch["anyOf"] = [
        {
            "properties": {
                "feature_sets": {"minItems": k, "maxItems": k},
                "entities": {"maxItems": batch_limit // k},
            }
        }
        for k in range(1, most + 1)
    ]
    batch["description"] = (
        f"len(feature_sets) x len(entities) must not exceed {batch_limit} "
        "(FRESHLINE_API_BATCH_LIMIT; 422 batch_too_large otherwise); a feature set may "
        "appear once. Other fields are ignored: the tenant always comes from the API key."
    )
    schemas["PredictRequest"]["properties"]["inputs"]["maxItems"] = batch_limit
    by_entity = schemas["PredictEntitiesRequest"]["properties"]
    by_entity["wait_ms"]["description"] = wait
    by_entity["entities"].update(items=entity_body, maxItems=batch_limit)
    if semantic:
        for name, fields in (
            ("LlmLookupRequest", ("prompt",)),
            ("LlmStoreRequest", ("prompt", "response")),
            ("LlmFlagRequest", ("prompt",)),
        ):
            for field in fields:
                schemas[name]["properties"][field]["maxLength"] = prompt_limit
    doc = _document(feature_sets, schemas, entity_path, wait)
    if not semantic:
        doc["paths"] = {p: v for p, v in doc["paths"].items() if not p.startswith("/v1/llm/")}
    if not operator_pages:
        doc["paths"] = {p: v for p, v in doc["paths"].items() if p not in OPERATOR_PAGES}
        del doc["components"]["securitySchemes"]["operator"]
    for item in doc["paths"].values():
        for operation in item.values():
            _limits(operation, body_limit)
    return doc


OPERATOR_PAGES = frozenset({"/metrics", "/status", "/status.json"})
_OPERATOR: list[dict[str, list[str]]] = [{"operator": []}]
_OPERATOR_401 = _json(_ERROR, "Not the operator key (FRESHLINE_OPS_KEY)")
_PROBE_429 = {
    **_json(_ERROR, "Over FRESHLINE_API_PROBE_RATE_PER_S probes from this address"),
    "headers": {
        "Retry-After": {
            "description": "Seconds to wait",
            "schema": {"type": "integer", "minimum": 1},
        }
    },
}


_LIMIT_RESPONSES = {
    "408": _json(_ERROR, "The request body did not arrive within FRESHLINE_API_BODY_TIMEOUT_S"),
    "429": {
        **_json(
            _ERROR,
            "Over this API key's request rate (FRESHLINE_API_RATE_PER_S: rate_limited), its "
            "tenant's pool share (tenant_over_budget) or rows (rows_limited)",
        ),
        "headers": {
            "Retry-After": {
                "description": "Seconds to wait",
                "schema": {"type": "integer", "minimum": 1},
            }
        },
    },
}


def _limits(operation: dict[str, Any], body_limit: int) -> None:
    """Add what the guard and the body limit answer to an operation for API keys."""
    if operation.get("security") != _SECURED:
        return
    responses = operation["responses"]
    responses["429"] = _LIMIT_RESPONSES["429"]
    if "requestBody" in operation:
        responses["408"] = _LIMIT_RESPONSES["408"]
        responses["413"] = _json(
            _ERROR,
            f"Body over {body_limit} bytes (FRESHLINE_API_BODY_LIMIT_BYTES), or more rows "
            "than the tenant may ask for at once (over_rows_burst)",
        )
        operation["requestBody"]["description"] = (
            f"At most {body_limit} bytes, nested at most {MAX_JSON_DEPTH} levels deep."
        )


def _document(
    feature_sets: list[str],
    schemas: dict[str, Any],
    entity_path: dict[str, Any],
    wait: str,
) -> dict[str, Any]:
    freshness_errors = {400: _FRESHNESS_400, 403: _FRESHNESS_403, 409: _FRESHNESS_409}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "freshline read API",
            "version": "1",
            "description": "Fresh, versioned ML features and cached model predictions. "
            "Every /v1 endpoint needs 'Authorization: Bearer <api key>'; "
            "the key alone decides the tenant.",
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "operator": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The operator key, FRESHLINE_OPS_KEY (not an API key)",
                },
            },
            "schemas": schemas,
        },
        "paths": {
            **_feature_paths(feature_sets, entity_path, wait, freshness_errors),
            **_service_paths(),
        },
    }


def _param(
    name: str, where: str, schema: dict[str, Any], description: str | None = None
) -> dict[str, Any]:
    """One parameter of an operation: a path one is required, a query one is not."""
    param: dict[str, Any] = {"name": name, "in": where, "required": where == "path"}
    if description is not None:
        param["description"] = description
    return param | {"schema": schema}


def _feature_paths(
    feature_sets: list[str],
    entity_path: dict[str, Any],
    wait: str,
    freshness_errors: dict[int, str],
) -> dict[str, Any]:
    """The read endpoints: features, predictions and the LLM cache."""
    return {
        "/v1/features/{feature_set}/{entity_id}": {
            "get": {
                "summary": "One entity's features",
                "security": _SECURED,
                "parameters": [
                    _param("feature_set", "path", {"type": "string", "enum": feature_sets}),
                    _param("entity_id", "path", entity_path),
                    _MODE,
                    _param("after", "query", _TOKEN, _AFTER_TEXT),
                    _param("max_staleness_ms", "query", _MS, _STALENESS_TEXT),
                    _param("wait_ms", "query", _MS, wait),
                ],
                "responses": {
                    "200": _json(_ref("Features"), "The features"),
                    **_errors(400, 401, 403, 404, 409, 503, override=freshness_errors),
                },
            }
        },
        "/v1/features/batch": {
            "post": {
                "summary": "Many entities and feature sets in one request",
                "security": _SECURED,
                "parameters": [_MODE],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("BatchRequest")}},
                },
                "responses": {
                    "200": _json(_ref("BatchResponse"), "Every combination"),
                    **_errors(400, 401, 403, 404, 409, 413, 422, 503, override=freshness_errors),
                },
            }
        },
        "/v1/models/{name}/predict": {
            "post": {
                "summary": "Predictions through the inference cache",
                "security": _SECURED,
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": _NAME}],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "oneOf": [
                                    _ref("PredictRequest"),
                                    _ref("PredictEntitiesRequest"),
                                ]
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json(_ref("PredictResponse"), "One per input row or entity"),
                    **_errors(400, 401, 404, 409, 413, 422, 503),
                },
            }
        },
        "/v1/llm/cache/lookup": _llm(
            "A cached LLM response for a close enough prompt",
            "LlmLookupRequest",
            "LlmLookupResponse",
        ),
        "/v1/llm/cache/store": _llm(
            "Cache a deterministic LLM response", "LlmStoreRequest", "LlmStoreResponse", "201"
        ),
        "/v1/llm/cache/flag": _llm(
            "Flag a bad hit: its entry is removed and counted",
            "LlmFlagRequest",
            "LlmFlagResponse",
        ),
    }


def _service_paths() -> dict[str, Any]:
    """The probes, the metrics, this document and the status page."""
    return {
        "/healthz": {
            "get": {
                "summary": "The process is up",
                "responses": {
                    "200": _json({"type": "object"}, "Up"),
                    "429": _PROBE_429,
                },
            }
        },
        "/readyz": {
            "get": {
                "summary": "Redis and Postgres answer (checked at most once a second)",
                "responses": {
                    "200": _json({"type": "object"}, "Ready"),
                    "429": _PROBE_429,
                    "503": _json({"type": "object"}, "Not ready; 'checks' says which"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (the ops port serves them with no key)",
                "security": _OPERATOR,
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition",
                        "content": {"text/plain": {}},
                    },
                    "401": _OPERATOR_401,
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")},
            }
        },
        "/status": {
            "get": {
                "summary": ("Status page: hit rate, staleness and lag per feature set, last hour"),
                "security": _OPERATOR,
                "responses": {
                    "200": {
                        "description": "A self-contained HTML page",
                        "content": {"text/html": {}},
                    },
                    "401": _OPERATOR_401,
                },
            }
        },
        "/status.json": {
            "get": {
                "summary": "The status page's data: current figures and per-minute series",
                "security": _OPERATOR,
                "responses": {
                    "200": _json({"type": "object"}, "The status report"),
                    "401": _OPERATOR_401,
                },
            }
        },
    }


def reference_document(registry: Registry) -> dict[str, Any]:
    """The document a server of ``registry`` (the active repository's) serves with the
    default settings, the semantic cache on and an operator key set: every route."""
    defaults = Settings.model_construct()  # the defaults alone, not the environment
    return document(
        registry.names(),
        batch_limit=defaults.api_batch_limit,
        body_limit=defaults.api_body_limit_bytes,
        prompt_limit=defaults.semantic_max_prompt_chars,
        key_types={fs.entity.type for fs in registry},
        token_wait_ms=defaults.token_wait_ms,
        token_wait_max_ms=defaults.token_wait_max_ms,
        semantic=True,
        operator_pages=True,
    )


def reference_text(registry: Registry) -> str:
    """:func:`reference_document` as the text of its committed file."""
    return json.dumps(reference_document(registry), indent=2) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """``[--out FILE]``: write the active repository's reference document to FILE or
    standard output (``scripts/contracts`` calls it)."""
    parser = argparse.ArgumentParser(prog="freshline.pipeline.api.openapi")
    parser.add_argument("--out", type=Path, help="write it here [default: standard output]")
    args = parser.parse_args(argv)
    from freshline.pipeline.core.repository import active

    text = reference_text(active().registry)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
