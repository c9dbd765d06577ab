"""A small client for Toxiproxy's HTTP API: proxies between freshline and a service.

The private stack runs ``toxiproxy-server`` (``scripts/stack start toxiproxy``). A
scenario creates a proxy per dependency (consumer -> Redis, consumer -> Postgres),
points the consumers at the proxy's listen address, and then degrades the link:

    proxy = Toxiproxy(url).create("redis", listen=port, upstream="127.0.0.1:6379")
    toxic = proxy.latency(200)        # every reply 200 ms late
    proxy.remove(toxic)
    proxy.disable()                   # a partition: connections closed, new ones refused
    proxy.enable()
    proxy.timeout(0)                  # a black hole: data dropped, connections kept open

API reference: https://github.com/Shopify/toxiproxy#http-api
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Literal

Stream = Literal["upstream", "downstream"]


class ToxiproxyError(Exception):
    """Toxiproxy refused a request."""


class Toxiproxy:
    """The server's HTTP API (``http://127.0.0.1:8474`` by default)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: object = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise ToxiproxyError(
                f"{method} {path} -> {exc.code}: {exc.read().decode(errors='replace')}"
            ) from exc
        return json.loads(raw) if raw.strip() else None

    def version(self) -> str:
        with urllib.request.urlopen(self.url + "/version", timeout=self.timeout_s) as resp:
            body: bytes = resp.read()
        return body.decode().strip()

    def create(self, name: str, *, listen: int | str, upstream: str) -> Proxy:
        """Create (or replace) proxy ``name`` listening on ``listen`` (a port or host:port)."""
        address = f"127.0.0.1:{listen}" if isinstance(listen, int) else listen
        if name in self.request("GET", "/proxies"):
            self.request("DELETE", f"/proxies/{name}")
        self.request(
            "POST",
            "/proxies",
            {"name": name, "listen": address, "upstream": upstream, "enabled": True},
        )
        return Proxy(self, name, address, upstream)

    def reset(self) -> None:
        """Enable every proxy and remove every toxic."""
        self.request("POST", "/reset")


@dataclass
class Proxy:
    api: Toxiproxy
    name: str
    listen: str
    upstream: str

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    def add(
        self,
        kind: str,
        attributes: dict[str, Any],
        *,
        stream: Stream = "downstream",
        toxicity: float = 1.0,
        name: str | None = None,
    ) -> str:
        """Add a toxic; returns its name (for :meth:`remove`)."""
        toxic = name or f"{kind}_{stream}"
        self.api.request(
            "POST",
            f"/proxies/{self.name}/toxics",
            {
                "name": toxic,
                "type": kind,
                "stream": stream,
                "toxicity": toxicity,
                "attributes": attributes,
            },
        )
        return toxic

    def latency(self, ms: int, jitter_ms: int = 0, *, stream: Stream = "downstream") -> str:
        """Delay data by ``ms`` (plus up to ``jitter_ms``)."""
        return self.add("latency", {"latency": ms, "jitter": jitter_ms}, stream=stream)

    def timeout(self, ms: int, *, stream: Stream = "upstream") -> str:
        """Drop all data; close the connection after ``ms`` (0: never, a black hole)."""
        return self.add("timeout", {"timeout": ms}, stream=stream)

    def reset_peer(self, ms: int = 0, *, stream: Stream = "upstream") -> str:
        """Reset connections (TCP RST) after ``ms``."""
        return self.add("reset_peer", {"timeout": ms}, stream=stream)

    def remove(self, toxic: str) -> None:
        self.api.request("DELETE", f"/proxies/{self.name}/toxics/{toxic}")

    def clear(self) -> None:
        """Remove every toxic of this proxy."""
        for toxic in self.api.request("GET", f"/proxies/{self.name}/toxics") or []:
            self.remove(toxic["name"])

    def disable(self) -> None:
        """A partition: close every connection through the proxy and refuse new ones."""
        self.api.request("POST", f"/proxies/{self.name}", {"enabled": False})

    def enable(self) -> None:
        self.api.request("POST", f"/proxies/{self.name}", {"enabled": True})

    def retarget(self, upstream: str) -> None:
        """Point the proxy at another server (its connections are closed); clients that
        reconnect reach ``upstream``, as after a DNS or virtual-IP move in a failover."""
        self.api.request("POST", f"/proxies/{self.name}", {"upstream": upstream})
        self.upstream = upstream

    def delete(self) -> None:
        self.api.request("DELETE", f"/proxies/{self.name}")
