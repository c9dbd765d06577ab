"""CLI command of the read path: ``serve``, with its connection limits, timeouts and TLS.

``serve`` runs the API's workers and, apart from them, one process for the operator's
endpoints (``/metrics``, ``/status``, ``/status.json`` and the probes) on the ops port
(``FRESHLINE_OPS_HOST``, ``_PORT``; :mod:`freshline.pipeline.api.ops`). Both read the workers'
counters from ``PROMETHEUS_MULTIPROC_DIR``, which ``serve`` sets for them.

Registered on the main app by :func:`register`, called from :mod:`freshline.pipeline.cli.app`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from freshline.pipeline.cli.app import console
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.settings import Settings, load_settings


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What the HTTP server bounds before the app sees a request.

    ``max_connections`` is per worker: granian's backpressure (connections served at
    once; others wait in the ``backlog``), uvicorn's ``limit_concurrency`` (503 past
    it). ``header_timeout_s`` closes a connection that sends no complete request head
    in time, idle keep-alive connections included, so silent connections cannot pile
    up. The body's own timeout is the app's (``FRESHLINE_API_BODY_TIMEOUT_S``).
    """

    max_connections: int = 4096
    backlog: int = 4096
    header_timeout_s: float = 10.0
    keep_alive: bool = True
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> ServerLimits:
        return cls(
            settings.api_max_connections,
            settings.api_backlog,
            settings.api_header_timeout_s,
            True,
            settings.api_tls_cert,
            settings.api_tls_key,
        )

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"


# long: the signature is the command's option table (45 lines of typer options)
def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind [FRESHLINE_API_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="Port [FRESHLINE_API_PORT]")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes")] = 1,
    server: Annotated[str, typer.Option(help="granian or uvicorn")] = "granian",
    max_connections: Annotated[
        int | None,
        typer.Option(
            min=1, help="Connections served at once per worker [FRESHLINE_API_MAX_CONNECTIONS]"
        ),
    ] = None,
    header_timeout: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Seconds for a request head, and for an idle keep-alive "
            "connection [FRESHLINE_API_HEADER_TIMEOUT_S]",
        ),
    ] = None,
    keep_alive: Annotated[bool, typer.Option(help="HTTP/1.1 keep-alive")] = True,
    ssl_certificate: Annotated[
        Path | None,
        typer.Option(help="PEM certificate (chain): serve HTTPS [FRESHLINE_API_TLS_CERT]"),
    ] = None,
    ssl_keyfile: Annotated[
        Path | None, typer.Option(help="PEM private key of the certificate [FRESHLINE_API_TLS_KEY]")
    ] = None,
    ops_port: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=65535,
            help="Port of /metrics, /status and the probes, on FRESHLINE_OPS_HOST; "
            "0: not served [FRESHLINE_OPS_PORT]",
        ),
    ] = None,
    reuse_port: Annotated[
        bool,
        typer.Option(
            "--reuse-port",
            help="Share the port with listeners already on it (SO_REUSEPORT): the "
            "kernel then splits the connections between them",
        ),
    ] = False,
) -> None:
    """Serve the HTTP read API (Starlette) with granian or uvicorn, and the operator's
    endpoints on the ops port."""
    from freshline.pipeline.core.db import make_engine, ping

    settings = load_settings()
    ping(make_engine(settings))
    host = host or settings.api_host
    port = port or settings.api_port
    ops_port = settings.ops_port if ops_port is None else ops_port
    if server not in ("granian", "uvicorn"):
        raise typer.BadParameter("choose granian or uvicorn", param_hint="--server")
    base = ServerLimits.from_settings(settings)
    limits = ServerLimits(
        max_connections or base.max_connections,
        max(base.backlog, max_connections or 0),
        header_timeout or base.header_timeout_s,
        keep_alive,
        str(ssl_certificate) if ssl_certificate else base.tls_cert,
        str(ssl_keyfile) if ssl_keyfile else base.tls_key,
    )
    if bool(limits.tls_cert) != bool(limits.tls_key):
        raise typer.BadParameter(
            "give both a certificate and its key", param_hint="--ssl-certificate/--ssl-keyfile"
        )
    for path in (limits.tls_cert, limits.tls_key):
        if path and not Path(path).is_file():
            raise typer.BadParameter(
                f"no such file: {path}", param_hint="--ssl-certificate/--ssl-keyfile"
            )
    if not reuse_port:
        check_port_free(host, port)
    metrics_dir: str | None = None
    if (workers > 1 or ops_port) and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Set before any worker imports prometheus_client, which reads it on import.
        metrics_dir = tempfile.mkdtemp(prefix="freshline-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    console.print(
        f"serving the read API on {limits.scheme}://{host}:{port} with {server}, "
        f"{workers} worker(s), up to {limits.max_connections} connections each"
    )
    ops = start_ops(settings.ops_host, ops_port) if ops_port else None
    try:
        if server == "granian":
            run_granian("freshline.pipeline.api:app_from_env", host, port, workers, limits)
        else:
            try:
                import uvicorn
            except ImportError:
                raise typer.BadParameter(
                    "uvicorn is not installed: pip install 'freshline[uvicorn]'",
                    param_hint="--server",
                ) from None
            uvicorn.run(
                "freshline.pipeline.api:app_from_env",
                host=host,
                port=port,
                workers=workers,
                factory=True,
                access_log=False,
                limit_concurrency=limits.max_connections,
                backlog=limits.backlog,
                timeout_keep_alive=int(max(1, limits.header_timeout_s)),
                ssl_certfile=limits.tls_cert or None,
                ssl_keyfile=limits.tls_key or None,
            )
    finally:
        if ops is not None:
            ops.terminate()  # SIGTERM: granian stops its worker and exits
            ops.join(timeout=10)
            if ops.is_alive():
                ops.kill()
                ops.join(timeout=5)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another listener holds, with one line.

    granian binds with ``SO_REUSEPORT`` and has no setting to leave it out: beside a
    listener that set it too (a second ``freshline serve``) it binds anyway and the two
    split the traffic; beside one that did not, it panics. A bind without
    ``SO_REUSEPORT`` fails in both cases, so it is tried first. (Another process may
    still take the port between this check and granian's bind.)
    """
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{host}:{port} is already in use ({exc.strerror or exc}): stop what listens "
            "there, or serve on another port (--port, FRESHLINE_API_PORT); --reuse-port "
            "shares it on purpose"
        ) from exc


OPS_LIMITS = ServerLimits(max_connections=64, backlog=64, header_timeout_s=10.0)
"""The ops port serves operators and scrapers: a few connections at a time."""


def start_ops(host: str, port: int) -> multiprocessing.process.BaseProcess | None:
    """The ops port's server (:func:`freshline.pipeline.api.app.ops_app_from_env`, one granian
    worker) in a process of its own; None, with a warning, if the port is taken.

    The API is served all the same when the ops port cannot be: a port clash must not
    take the API down. The process is spawned, not forked, so it shares no thread or
    connection with this one.
    """
    try:
        with socket.create_server((host, port)):
            pass  # free now; granian binds it in the child
    except OSError as exc:
        console.print(
            f"[yellow]warning:[/yellow] the ops port {host}:{port} cannot be bound ({exc}): "
            "/metrics and /status are not served; set FRESHLINE_OPS_PORT (0: off)"
        )
        return None
    process = multiprocessing.get_context("spawn").Process(
        target=run_granian,
        args=("freshline.pipeline.api.app:ops_app_from_env", host, port, 1, OPS_LIMITS),
        name="freshline-ops",
    )
    process.start()
    console.print(f"serving /metrics, /status and the probes on http://{host}:{port}")
    return process


def run_granian(
    target: str, host: str, port: int, workers: int, limits: ServerLimits | None = None
) -> None:
    """Serve the ASGI app factory ``target`` with granian, as ``freshline serve`` does.

    The benchmarks launch their minimal reference app through this too, so both
    servers run with the same settings.
    """
    from granian.constants import HTTPModes, Interfaces
    from granian.http import HTTP1Settings
    from granian.server import Server as Granian

    limits = limits or ServerLimits()
    Granian(
        target,
        address=host,
        port=port,
        workers=workers,
        interface=Interfaces.ASGI,
        factory=True,
        log_access=False,
        http=HTTPModes.http1,
        backlog=limits.backlog,
        backpressure=limits.max_connections,
        http1_settings=HTTP1Settings(
            header_read_timeout=int(limits.header_timeout_s * 1000), keep_alive=limits.keep_alive
        ),
        ssl_cert=Path(limits.tls_cert) if limits.tls_cert else None,
        ssl_key=Path(limits.tls_key) if limits.tls_key else None,
    ).serve()


def register(app: typer.Typer) -> None:
    """Add this command to the ``freshline`` app."""
    app.command("serve")(serve)
