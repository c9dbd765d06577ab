"""fetch, the one HTTP client, and its callers: against real servers on real sockets.

A small standard-library HTTP server (in a thread) stands in for a metrics endpoint, so
that a test controls what it answers; Kafka Connect is the real worker of the stack.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from freshline.pipeline.cdc.connect import ConnectClient, ConnectError
from freshline.pipeline.core.errors import ConfigError, ServiceUnavailable
from freshline.pipeline.core.http import fetch
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.observe.status import scrape_freshness
from tests.helpers import free_port, http_server

CONSUMER_METRICS = b"""\
# TYPE freshline_freshness_lag_seconds histogram
freshline_freshness_lag_seconds_bucket{le="+Inf"} 4
freshline_freshness_lag_seconds_count 4
freshline_freshness_lag_seconds_sum 0.5
# TYPE freshline_events_dead_lettered_total counter
freshline_events_dead_lettered_total{reason="undecodable"} 2
"""

PAGES: dict[str, tuple[int, bytes]] = {
    "/json": (200, b'{"ok": true}'),
    "/empty": (204, b""),
    "/missing": (404, b'{"message": "no such thing"}'),
    "/metrics": (200, CONSUMER_METRICS),
}


class Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        sent = self.rfile.read(length) if length else b""
        if self.path == "/echo":
            status, body = (
                200,
                (
                    self.command.encode()
                    + b" "
                    + sent
                    + b" "
                    + (self.headers.get("X-Test") or "").encode()
                ),
            )
        else:
            status, body = PAGES.get(self.path, (404, b""))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep the test output quiet


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with http_server(Handler) as url:
        yield url


def dead_url(path: str = "/") -> str:
    """A URL on a port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}{path}"


def test_every_status_is_returned_with_its_body(server: str) -> None:
    ok = fetch(f"{server}/json")
    assert (ok.status, ok.ok, ok.json()) == (200, True, {"ok": True})
    empty = fetch(f"{server}/empty")
    assert (empty.status, empty.body, empty.json()) == (204, b"", None)
    missing = fetch(f"{server}/missing")
    assert (missing.status, missing.ok) == (404, False)
    assert missing.json() == {"message": "no such thing"}


def test_method_body_and_headers_are_sent(server: str) -> None:
    echoed = fetch(f"{server}/echo", method="PUT", body=b"payload", headers={"X-Test": "yes"})
    assert echoed.text() == "PUT payload yes"


def test_no_answer_is_service_unavailable_naming_the_service_and_url() -> None:
    url = dead_url("/metrics")
    with pytest.raises(ServiceUnavailable) as info:
        fetch(url, service="the thing")
    message = str(info.value)
    assert message.startswith(f"the thing is not reachable at {url} (")
    assert message.endswith("; start the local stack with: scripts/stack up")
    with pytest.raises(ServiceUnavailable, match=r"start it yourself$"):
        fetch(url, hint="start it yourself")


def test_a_password_in_the_url_is_never_shown() -> None:
    url = dead_url("/").replace("http://", "http://user:secret@")
    with pytest.raises(ServiceUnavailable) as info:
        fetch(url)
    assert "secret" not in str(info.value) and info.value.url.startswith("http://user:")


def test_only_http_urls_are_fetched() -> None:
    with pytest.raises(ConfigError, match="not an http"):
        fetch("file:///etc/passwd")


def test_freshness_scrapes_add_up_and_skip_what_does_not_answer(server: str) -> None:
    urls = [f"{server}/metrics", f"{server}/metrics", dead_url("/metrics"), f"{server}/nope"]
    assert scrape_freshness(urls) == ((1.0, 8.0), 4.0)
    assert scrape_freshness([dead_url("/metrics")]) == (None, None)


@pytest.mark.connect
def test_the_connect_client_on_the_real_worker(base_settings: Settings) -> None:
    client = ConnectClient(base_settings.connect_url)
    client.ping()
    assert client.status(f"no-such-{uuid.uuid4().hex}") is None  # a 404 is an answer
    with pytest.raises(ConnectError) as info:
        client.put_config(f"bad-{uuid.uuid4().hex}", {"connector.class": "no.such.Connector"})
    assert info.value.status >= 400 and info.value.message
    with pytest.raises(ServiceUnavailable, match=r"^Kafka Connect is not reachable"):
        ConnectClient(dead_url()).ping()
