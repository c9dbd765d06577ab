"""Who is on the other end of a connection: the client address, and the group its failed
authentications and probes are counted under (docs/security.md).

The client address is the TCP peer's, or, when the peer is one of
``FRESHLINE_API_TRUSTED_PROXIES``, the right-most address in ``X-Forwarded-For`` that
is not (:func:`proxy_headers`).
"""

from __future__ import annotations

import functools
import ipaddress
from typing import cast

from granian.utils.proxies import wrap_asgi_with_proxy_headers
from starlette.types import ASGIApp, Scope


def proxy_headers(app: ASGIApp, trusted: list[str]) -> ASGIApp:
    """``app``, seeing the client's address behind the ``trusted`` proxies rather than
    theirs (granian's ``wrap_asgi_with_proxy_headers`` does the rewriting); ``app``
    itself with none."""
    if not trusted:
        return app
    return cast(ASGIApp, wrap_asgi_with_proxy_headers(app, trusted))


def client_address(scope: Scope) -> str:
    """The client's address, ``-`` if the server gave none."""
    client = scope.get("client")
    return str(client[0]) if client else "-"


@functools.lru_cache(maxsize=4096)
def address_group(address: str) -> str:
    """The name an address's failed authentications are counted under: the address,
    or its /64 for IPv6 (one host's usual allocation, so rotating within it gains
    nothing); an IPv4-mapped IPv6 address counts as its IPv4 address. The last few
    thousand are kept: a flood of bad keys comes from few addresses, and parsing one
    cost a refusal more than the rest of it."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address  # not an IP (a Unix socket's peer, say): counted as itself
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return address
