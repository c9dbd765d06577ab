"""Errors as JSON: ``{"error": {"code": ..., "message": ...}}``, never a traceback.

Every :class:`freshline.pipeline.core.errors.FreshlineError` a handler raises maps to a status and a
code by its class (the most specific class in :data:`STATUS` wins); Starlette's own
404 and 405 become the same JSON; anything unexpected is logged and answered 500.

A server-side failure's own message names what the caller has no business knowing
(internal URLs and hosts, file paths, an upstream's answer): it is logged, with any
password masked, and the caller gets what failed, in words of the API's own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson
import redis
import sqlalchemy as sa
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ExceptionHandler

from freshline.pipeline.api.auth import Unauthorized
from freshline.pipeline.cache.readthrough import ReplicaBehind
from freshline.pipeline.cache.tokens import ForeignToken, InvalidToken, TokenAhead, TokenPending
from freshline.pipeline.core.errors import (
    FreshlineError,
    InvalidId,
    ModelError,
    SchemaVersionUnknown,
    ServiceUnavailable,
    UnknownFeatureSet,
)
from freshline.pipeline.core.settings import redact_text
from freshline.pipeline.inference.models import UnknownModel
from freshline.pipeline.inference.predictions import InvalidInput, NonDeterministicModel

log = logging.getLogger(__name__)


class JSONResponse(Response):
    """A JSON response rendered by orjson (numpy arrays included)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class ApiError(FreshlineError):
    """A bad request the API names itself: a status, a code and a message (and, for a
    refusal to retry later, the seconds to wait: its ``Retry-After``)."""

    def __init__(
        self, status: int, code: str, message: str, retry_after: int | None = None
    ) -> None:
        self.status = status
        self.code = code
        self.retry_after = retry_after
        super().__init__(message)


STATUS: dict[type[FreshlineError], tuple[int, str]] = {
    Unauthorized: (401, "unauthorized"),
    InvalidId: (400, "invalid_id"),
    InvalidToken: (400, "invalid_token"),
    ForeignToken: (403, "foreign_token"),
    TokenAhead: (400, "token_ahead"),
    TokenPending: (409, "token_pending"),
    UnknownFeatureSet: (404, "unknown_feature_set"),
    UnknownModel: (404, "unknown_model"),
    InvalidInput: (422, "invalid_input"),
    NonDeterministicModel: (409, "model_not_cacheable"),
    ModelError: (500, "model_error"),
    ServiceUnavailable: (503, "service_unavailable"),
    ReplicaBehind: (503, "replica_behind"),
    SchemaVersionUnknown: (503, "schema_version_unknown"),
}

_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}


def error_response(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message}}, status_code=status, headers=headers
    )


def status_of(exc: FreshlineError) -> tuple[int, str]:
    if isinstance(exc, ApiError):
        return exc.status, exc.code
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500, "internal"


def public_message(exc: FreshlineError, status: int) -> str:
    """What the caller is told of ``exc``: its message, unless the server failed."""
    if status < 500 or isinstance(exc, ApiError | SchemaVersionUnknown):  # for callers
        return str(exc)
    if isinstance(exc, ServiceUnavailable):
        return f"{exc.service} did not answer; retry later"
    if isinstance(exc, ModelError):
        return "the model could not make predictions; the server's log has the cause"
    return "internal error"


async def freshline_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, FreshlineError):
        return await unexpected_error(request, exc)
    status, code = status_of(exc)
    if isinstance(exc, SchemaVersionUnknown):
        from freshline.pipeline.api.metrics import (
            SCHEMA_VERSION_UNKNOWN,  # prometheus, on first use
        )

        SCHEMA_VERSION_UNKNOWN.inc()
    if status >= 500:
        cause = f" ({exc.__cause__})" if isinstance(exc.__cause__, FreshlineError) else ""
        log.error("%s %s: %s", request.method, request.url.path, redact_text(f"{exc}{cause}"))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    retry = exc.retry_after if isinstance(exc, ApiError) else None
    if retry is not None:
        headers = {"Retry-After": str(retry)}
    return error_response(status, code, public_message(exc, status), headers)


async def http_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, HTTPException):
        return await unexpected_error(request, exc)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    message = exc.detail
    if exc.status_code == 404:
        message = f"no such path: {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    return error_response(exc.status_code, code, message, exc.headers)


async def unavailable(request: Request, exc: Exception) -> Response:
    log.warning(
        "%s %s: backing service unavailable: %s",
        request.method,
        request.url.path,
        redact_text(str(exc)),
    )
    return error_response(
        503, "service_unavailable", "a backing service (Redis or Postgres) did not answer"
    )


async def unexpected_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal", "internal error")


HANDLERS: dict[Any, ExceptionHandler] = {
    FreshlineError: freshline_error,
    HTTPException: http_error,
    redis.exceptions.ConnectionError: unavailable,
    redis.exceptions.TimeoutError: unavailable,
    sa.exc.OperationalError: unavailable,
    Exception: unexpected_error,
}
