"""``freshline serve``'s own limits, for real on loopback: idle connections neither starve
the server nor stay open for ever, and it serves TLS.

How fast ``/healthz`` answers with 2,000 idle connections open is a figure, so it is
measured by ``bench/idle_connections.py``; here only the behaviour is asserted.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from freshline.pipeline.core.settings import Settings
from freshline.pipeline.dev import processes
from tests.helpers import FRESHLINE, free_port, self_signed_certificate, wait_until

IDLE = 1500  # past granian's default of 1,024 connections per worker


@contextmanager
def serving(
    settings: Settings, log: Path, *args: str, verify: ssl.SSLContext | bool = False
) -> Iterator[tuple[str, int]]:
    """``freshline serve`` on a free port until the block ends; yields (url, port)."""
    port = free_port()
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_OPS_PORT": "0",  # the API port's limits only; no ops server
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    scheme = "https" if "--ssl-certificate" in args else "http"
    argv = [FRESHLINE, "serve", "--port", str(port), *args]
    with log.open("w+b") as sink:
        try:
            with processes.serving(
                argv, port, env=env, log=sink, scheme=scheme, verify=verify
            ) as url:
                yield url, port
        except processes.DidNotStart as exc:
            pytest.fail(f"serve did not come up: {exc}")


@pytest.mark.slow
def test_idle_connections_do_not_starve_healthz(settings: Settings, tmp_path: Path) -> None:
    with serving(settings, tmp_path / "serve.log", "--workers", "1") as (url, port):
        idle: list[socket.socket] = []
        try:
            for _ in range(IDLE):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            # Every idle connection is open and silent; a real request still gets in.
            answer = httpx.get(f"{url}/healthz", timeout=10)
            assert answer.status_code == 200 and answer.json() == {"status": "ok"}
        finally:
            for s in idle:
                s.close()


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.slow
def test_silent_and_idle_keep_alive_connections_are_closed(
    settings: Settings, tmp_path: Path
) -> None:
    with serving(settings, tmp_path / "serve.log", "--header-timeout", "0.5") as (_url, port):
        silent = socket.create_connection(("127.0.0.1", port))
        kept = socket.create_connection(("127.0.0.1", port))
        with silent, kept:
            kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            head = kept.recv(4096)
            assert head.startswith(b"HTTP/1.1 200")
            silent.settimeout(0.2)
            kept.settimeout(0.2)
            # A connection that sends nothing, and one idle after a request, are closed.
            assert wait_until(lambda: _closed_by_server(silent), timeout=20)
            assert wait_until(lambda: _closed_by_server(kept), timeout=20)


@pytest.mark.slow
def test_serve_speaks_tls(settings: Settings, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    self_signed_certificate(cert, key, "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1")
    trust = ssl.create_default_context(cafile=str(cert))
    with serving(
        settings,
        tmp_path / "serve.log",
        "--ssl-certificate",
        str(cert),
        "--ssl-keyfile",
        str(key),
        verify=trust,
    ) as (url, port):
        assert url.startswith("https://")
        assert httpx.get(f"{url}/healthz", verify=trust, timeout=10).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)  # no plaintext


def test_serve_refuses_half_a_tls_configuration(settings: Settings, tmp_path: Path) -> None:
    env = {**os.environ, "FRESHLINE_POSTGRES_URL": settings.postgres_url}
    out = subprocess.run(
        [FRESHLINE, "serve", "--ssl-certificate", str(tmp_path / "c.pem")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "certificate" in out.stderr
