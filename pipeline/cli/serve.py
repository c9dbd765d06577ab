"""CLI commands of the read path: ``serve``, ``tenants create``, ``apikey create``.

Registered on the main app by :func:`register`, called from :mod:`pipeline.cli.app`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Annotated

import typer

from pipeline.cli.app import console
from pipeline.core.settings import load_settings

tenants_app = typer.Typer(help="Tenants and their API keys.", no_args_is_help=True)
apikey_app = typer.Typer(help="API keys of the read API.", no_args_is_help=True)


def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind [FRESHLINE_API_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="Port [FRESHLINE_API_PORT]")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes")] = 1,
    server: Annotated[str, typer.Option(help="granian or uvicorn")] = "granian",
) -> None:
    """Serve the HTTP read API (Starlette) with granian or uvicorn."""
    from pipeline.core.db import make_engine, ping

    settings = load_settings()
    ping(make_engine(settings))
    host = host or settings.api_host
    port = port or settings.api_port
    if server not in ("granian", "uvicorn"):
        raise typer.BadParameter("choose granian or uvicorn", param_hint="--server")
    metrics_dir: str | None = None
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Set before any worker imports prometheus_client, which reads it on import.
        metrics_dir = tempfile.mkdtemp(prefix="freshline-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    console.print(f"serving the read API on http://{host}:{port} with {server}, "
                  f"{workers} worker(s)")
    try:
        if server == "granian":
            run_granian("pipeline.api:app_from_env", host, port, workers)
        else:
            try:
                import uvicorn
            except ImportError:
                raise typer.BadParameter("uvicorn is not installed: pip install "
                                         "'freshline[uvicorn]'", param_hint="--server") from None
            uvicorn.run("pipeline.api:app_from_env", host=host, port=port, workers=workers,
                        factory=True, access_log=False)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def run_granian(target: str, host: str, port: int, workers: int) -> None:
    """Serve the ASGI app factory ``target`` with granian, as ``freshline serve`` does.

    The benchmarks launch their minimal reference app through this too, so both
    servers run with the same settings.
    """
    from granian.constants import Interfaces
    from granian.server import Server as Granian

    Granian(target, address=host, port=port, workers=workers, interface=Interfaces.ASGI,
            factory=True, log_access=False).serve()


@tenants_app.command("create")
def tenants_create(
    tenant: Annotated[str, typer.Argument(help="Tenant id: letters, digits, '_', '.', '-'")],
    name: Annotated[str | None, typer.Option(help="Display name (default: the id)")] = None,
) -> None:
    """Create a tenant and print its first API key (shown only this once)."""
    from pipeline.api.auth import create_tenant
    from pipeline.core.db import make_engine

    key = create_tenant(make_engine(load_settings()), tenant, name)
    console.print(f"created tenant {tenant}; its API key (stored hashed, shown only now):")
    typer.echo(key)


@apikey_app.command("create")
def apikey_create(
    tenant: Annotated[str, typer.Option("--tenant", help="An existing tenant id")],
) -> None:
    """Add an API key for a tenant and print it (shown only this once)."""
    from pipeline.api.auth import create_api_key
    from pipeline.core.db import make_engine

    key = create_api_key(make_engine(load_settings()), tenant)
    console.print(f"new API key for tenant {tenant} (stored hashed, shown only now):")
    typer.echo(key)


def register(app: typer.Typer) -> None:
    """Add these commands to the ``freshline`` app."""
    app.command("serve")(serve)
    app.add_typer(tenants_app, name="tenants")
    app.add_typer(apikey_app, name="apikey")
