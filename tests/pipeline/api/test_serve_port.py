"""``freshline serve`` on a port already bound refuses to start, with one line.

granian binds with ``SO_REUSEPORT``: beside a listener that set it too (another
``freshline serve``) it bound anyway and the two split the traffic; beside one that did
not, it died with a Rust backtrace. ``serve`` now checks the port first and says which
it is; ``--reuse-port`` shares it on purpose. Logged in as the API (``.stack/env``).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from freshline.pipeline.core.settings import Settings
from tests.helpers import FRESHLINE, error_line, interrupt, need, role_url


@pytest.fixture(params=["reuse-port", "plain"])
def bound_port(request: pytest.FixtureRequest) -> Iterator[int]:
    """A port of 127.0.0.1 another listener holds: with ``SO_REUSEPORT`` (as another
    ``freshline serve`` holds it) or without."""
    with socket.socket() as held:
        if request.param == "reuse-port":
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


def test_serve_refuses_a_port_already_bound(settings: Settings, bound_port: int) -> None:
    env = {
        **os.environ,
        "FRESHLINE_POSTGRES_URL": role_url(settings, "FRESHLINE_STACK_POSTGRES_API_URL"),
        "FRESHLINE_REDIS_URL": settings.redis_url,
        "FRESHLINE_REDIS_USERNAME": need("FRESHLINE_STACK_REDIS_API_USER"),
        "FRESHLINE_REDIS_PASSWORD": need("FRESHLINE_STACK_REDIS_API_PASSWORD"),
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    command = [FRESHLINE, "serve", "--host", "127.0.0.1", "--port", str(bound_port)]
    proc = subprocess.Popen(
        [*command, "--ops-port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        interrupt(proc)  # granian's own shutdown stops its worker too
        pytest.fail(f"serve bound {bound_port} beside another listener")
    line = error_line(subprocess.CompletedProcess(command, proc.returncode, out, err))
    assert f"127.0.0.1:{bound_port}" in line and "already in use" in line, line
    assert "--reuse-port" in line, line
