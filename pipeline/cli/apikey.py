"""CLI commands for tenants and API keys: ``tenants create|limits``,
``apikey create|list|revoke``.

Registered on the main app by :func:`register`. Each administrative action writes an
audit line (``FRESHLINE_AUDIT_LOG``, else stderr) with the key's id, never the key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from freshline.pipeline.cli.app import console, print_rows
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import Settings, load_settings

if TYPE_CHECKING:
    from freshline.pipeline.api.accounts import KeyInfo

tenants_app = typer.Typer(help="Tenants and their API keys.", no_args_is_help=True)
apikey_app = typer.Typer(help="API keys of the read API.", no_args_is_help=True)

_DURATION = re.compile(r"(\d+)([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_duration(text: str) -> timedelta:
    """``90d``, ``12h``, ``30m``, ``45s``: a positive duration, or a usage error."""
    match = _DURATION.fullmatch(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise typer.BadParameter(
            f"{text!r} is not a duration like 90d, 12h, 30m or 45s", param_hint="--expires-in"
        )
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


def _settings() -> Settings:
    from freshline.pipeline.api import audit_log

    settings = load_settings()
    audit_log.configure(settings.audit_log)
    return settings


def _when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M") if value else "-"


def key_table(keys: Iterable[KeyInfo], now: datetime) -> Table:
    """Keys as ``apikey list`` shows them (:func:`freshline.pipeline.cli.app.print_rows`)."""
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("id", no_wrap=True)
    table.add_column("tenant", overflow="fold")
    table.add_column("state", no_wrap=True)
    for time in ("created", "expires", "last used"):
        table.add_column(time, overflow="fold")  # under 16 columns, the time goes under
    table.add_column("label", overflow="fold")
    for k in keys:
        times = (_when(k.created_at), _when(k.expires_at), _when(k.last_used_at))
        table.add_row(k.key_id, k.tenant, k.state(now), *times, Text(k.label))
    return table


@tenants_app.command("create")
def tenants_create(
    tenant: Annotated[str, typer.Argument(help="Tenant id: letters, digits, '_', '.', '-'")],
    name: Annotated[str | None, typer.Option(help="Display name (default: the id)")] = None,
) -> None:
    """Create a tenant and print its first API key (shown only this once)."""
    from freshline.pipeline.api.accounts import register_tenant
    from freshline.pipeline.core.db import make_owner_engine

    issued = register_tenant(make_owner_engine(_settings()), tenant, name)
    console.print(
        f"created tenant {tenant}; its API key {issued.key_id} (stored hashed, shown only now):"
    )
    typer.echo(issued.key)


_LIMIT_SETTINGS = {
    "rate_per_s": "api_rate_per_s",
    "rate_burst": "api_rate_burst",
    "concurrency": "api_tenant_concurrency",
    "pool_share": "api_tenant_pool_share",
    "rows_per_s": "api_rows_per_s",
    "rows_burst": "api_rows_burst",
}
"""Each of a tenant's own limits, and the setting it stands in for."""


# long: the signature is the command's option table (one option per limit)
@tenants_app.command("limits")
def tenants_limits(
    tenant: Annotated[str, typer.Argument(help="An existing tenant id")],
    rate: Annotated[
        float | None,
        typer.Option(
            "--rate", min=0, help="Requests/s per worker, all its keys together (0: no limit)"
        ),
    ] = None,
    burst: Annotated[
        int | None,
        typer.Option("--burst", min=1, help="Requests its keys may make at once, together"),
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency", min=0, help="Thread-pool jobs at once per worker (0: no limit)"
        ),
    ] = None,
    pool_share: Annotated[
        float | None,
        typer.Option(
            "--pool-share", min=0, help="Pool seconds per second per worker (0: no limit)"
        ),
    ] = None,
    rows: Annotated[
        float | None,
        typer.Option(
            "--rows",
            min=0,
            help="Entities and prediction rows/s per worker its requests may ask for (0: no limit)",
        ),
    ] = None,
    rows_burst: Annotated[
        int | None,
        typer.Option("--rows-burst", min=1, help="Rows its requests may ask for at once"),
    ] = None,
    reset: Annotated[
        list[str] | None,
        typer.Option(
            "--reset",
            help="Back to the server's setting: rate, burst, concurrency, pool-share, rows "
            "or rows-burst (repeatable), or all",
        ),
    ] = None,
) -> None:
    """Show or set a tenant's own API limits, over the servers' settings.

    A trusted scoring service can be given more than the default and a tenant you do
    not trust less, on the same servers. Every API worker applies a change on the
    tenant's next request. With no option, shows the limits.
    """
    from freshline.pipeline.api.accounts import LIMIT_NAMES, set_tenant_limits
    from freshline.pipeline.core.db import make_owner_engine

    names = {"rate": "rate_per_s", "burst": "rate_burst", "concurrency": "concurrency"}
    names |= {"pool-share": "pool_share", "rows": "rows_per_s", "rows-burst": "rows_burst"}
    changes: dict[str, float | int | None] = {}
    for option in reset or []:
        if option == "all":
            changes.update(dict.fromkeys(LIMIT_NAMES))
        elif option in names:
            changes[names[option]] = None
        else:
            raise typer.BadParameter(
                f"{option!r} is none of: {', '.join(names)}, all", param_hint="--reset"
            )
    given = {"rate_per_s": rate, "rate_burst": burst, "concurrency": concurrency}
    given |= {"pool_share": pool_share, "rows_per_s": rows, "rows_burst": rows_burst}
    changes.update({n: v for n, v in given.items() if v is not None})
    settings = _settings()
    client = redis_client(settings, socket_connect_timeout=2, socket_timeout=5) if changes else None
    try:
        limits = set_tenant_limits(make_owner_engine(settings), client, tenant, changes)
    finally:
        if client is not None:
            client.close()
    if changes:
        console.print(f"tenant {tenant}'s limits set; every API worker applies them now")
    table = Table(show_edge=False, pad_edge=False)
    for column in ("limit", "tenant", "server", "setting"):
        table.add_column(column, no_wrap=True)
    for name, setting in _LIMIT_SETTINGS.items():
        own = getattr(limits, name)
        table.add_row(
            name,
            "-" if own is None else f"{own:g}",
            f"{getattr(settings, setting):g}",
            f"FRESHLINE_{setting.upper()}",
        )
    print_rows(table)
    console.print(
        f"each limit holds in each API worker; rate_per_s and rate_burst count the "
        f"requests of all tenant {tenant}'s API keys together"
    )


@apikey_app.command("create")
def apikey_create(
    tenant: Annotated[str, typer.Option("--tenant", help="An existing tenant id")],
    label: Annotated[str, typer.Option(help="What the key is for (shown by list)")] = "",
    expires_in: Annotated[
        str | None,
        typer.Option("--expires-in", help="Lifetime, e.g. 90d, 12h (default: no expiry)"),
    ] = None,
) -> None:
    """Add an API key for a tenant and print it (shown only this once)."""
    from freshline.pipeline.api.accounts import issue_api_key
    from freshline.pipeline.core.db import make_owner_engine

    expires_at = datetime.now(UTC) + parse_duration(expires_in) if expires_in else None
    try:
        issued = issue_api_key(
            make_owner_engine(_settings()), tenant, label=label, expires_at=expires_at
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--label") from None
    until = f", expires {_when(expires_at)} UTC" if expires_at else ""
    console.print(
        f"new API key {issued.key_id} for tenant {tenant}{until} (stored hashed, shown only now):"
    )
    typer.echo(issued.key)


@apikey_app.command("list")
def apikey_list(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's keys")] = None,
) -> None:
    """List keys: id, tenant, state, label and times (UTC). Never the keys themselves."""
    from freshline.pipeline.api.accounts import list_api_keys
    from freshline.pipeline.core.db import make_engine

    keys = list_api_keys(make_engine(load_settings()), tenant)
    if not keys:
        console.print("no API keys" + (f" for tenant {tenant}" if tenant else ""))
        return
    print_rows(key_table(keys, datetime.now(UTC)))


@apikey_app.command("revoke")
def apikey_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id, as apikey list shows it")],
) -> None:
    """Revoke a key: every API worker refuses it within FRESHLINE_SUBSCRIPTION_SILENCE_MS.

    If the revocation cannot be published on Redis, the key is revoked in Postgres all
    the same and the command fails (exit 1) saying so: run it again once Redis answers.
    """

    from freshline.pipeline.api.accounts import revoke_api_key
    from freshline.pipeline.core.db import make_owner_engine

    settings = _settings()
    client = redis_client(settings, socket_connect_timeout=2, socket_timeout=5)
    try:
        info = revoke_api_key(make_owner_engine(settings), client, key_id)
    finally:
        client.close()
    console.print(
        f"revoked API key {info.key_id} of tenant {info.tenant} (at {_when(info.revoked_at)} UTC)"
    )


def register(app: typer.Typer) -> None:
    """Add these commands to the ``freshline`` app."""
    app.add_typer(tenants_app, name="tenants")
    app.add_typer(apikey_app, name="apikey")
