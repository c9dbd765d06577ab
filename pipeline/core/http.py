"""One way to fetch a URL: the standard library's HTTP client behind :func:`fetch`.

Every HTTP call freshline makes goes through here: Kafka Connect's REST API, ``/metrics``
scrapes, Prometheus's query API, the demo's calls to the read API. Whatever status the
server answers with is returned, never raised, so each caller decides what a 404 means;
a server that does not answer at all (connection refused or reset, timeout, unknown
host) raises :class:`~freshline.pipeline.core.errors.ServiceUnavailable` naming the service and
the URL. Standard library only: the runtime has no HTTP client dependency.
"""

from __future__ import annotations

import base64
import http.client
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from freshline.pipeline.core.errors import STACK_HINT, ConfigError, ServiceUnavailable
from freshline.pipeline.core.settings import redact

TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Response:
    """A status and the whole body, read."""

    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        """The body decoded as JSON; ``None`` for an empty body."""
        return orjson.loads(self.body) if self.body else None

    def text(self) -> str:
        return self.body.decode()


def fetch(
    url: str,
    *,
    method: str = "GET",
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = TIMEOUT_S,
    service: str = "the HTTP server",
    hint: str = STACK_HINT,
) -> Response:
    """One request to an ``http(s)`` URL; the response whatever its status.

    A login in the URL (``http://user:password@host/``) is sent as HTTP Basic
    authentication, as curl does; urllib would take it for part of the host.

    Raises :class:`ServiceUnavailable` (``service``, the URL with any password masked,
    and ``hint`` as the remedy) when no answer comes within ``timeout`` seconds, and
    :class:`ConfigError` for a URL that is not ``http(s)``.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"not an http(s) URL: {redact(url)}")
    sent = dict(headers or {})
    target = url
    if parts.username is not None or parts.password is not None:
        login = f"{urllib.parse.unquote(parts.username or '')}:"
        login += urllib.parse.unquote(parts.password or "")
        sent["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
        target = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    request = urllib.request.Request(  # noqa: S310 (the scheme is checked above)
        target, data=body, method=method, headers=sent
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return Response(response.status, response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return Response(exc.code, exc.read())
    except (OSError, http.client.HTTPException) as exc:
        # URLError (refused, unknown host), timeouts and resets are all OSErrors.
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise ServiceUnavailable(
            service, redact(url), str(reason) or type(reason).__name__, hint
        ) from exc
