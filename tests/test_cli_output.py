"""What the CLI prints reads in an 80-column terminal and in a pipe.

Each command runs as a real ``freshline`` process against the real services, with
``COLUMNS=80``, once with its output piped and once on a pseudo-terminal of 80 columns;
no line may be wider than 80 and nothing may be cut short with an ellipsis. The
renderers are also given worst cases (long names, Java traces, big figures) directly.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import termios
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from rich.console import Console, RenderableType
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.cdc.connect import CdcStatus, Names, SlotState, TaskState
from freshline.pipeline.cli.advise import report
from freshline.pipeline.cli.cdc import status_report
from freshline.pipeline.cli.db import summary_table
from freshline.pipeline.cli.models import model_block
from freshline.pipeline.core.http import fetch
from freshline.pipeline.core.keys import MODELS_KEY
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.inference.models import LogisticModel, ModelRecord, ModelRegistry
from freshline.pipeline.observe.advisor import Figures, advise
from tests.helpers import FRESHLINE, REGISTRY, fresh_version, serving

WIDTH = 80
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def check_width(text: str) -> None:
    """No line wider than 80 columns, no ellipsis: everything shown, nothing cut."""
    lines = ANSI.sub("", text).replace("\r\n", "\n").split("\n")
    too_wide = [line for line in lines if len(line) > WIDTH]
    assert not too_wide, "\n".join(too_wide)
    assert "…" not in text, text


def run_piped(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FRESHLINE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env, "COLUMNS": str(WIDTH)},
    )


def run_tty(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """``freshline args`` with stdout on an 80-column pseudo-terminal: (exit code, output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, WIDTH, 0, 0))
    proc = subprocess.Popen(
        [FRESHLINE, *args],
        stdout=slave,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env, "COLUMNS": str(WIDTH), "TERM": "xterm-256color"},
    )
    os.close(slave)
    chunks: list[bytes] = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode()


def check_command(
    args: list[str], env: dict[str, str], *, expect: int = 0, styled: bool = True
) -> str:
    """Run ``args`` piped and on a terminal; check both; return the piped output.

    ``styled``: the output has colour or bold somewhere, so the terminal run shows
    escape codes (proof that it really ran on a terminal).
    """
    piped = run_piped(args, env)
    assert piped.returncode == expect, piped.stdout + piped.stderr
    assert piped.stdout.strip(), piped.stderr
    check_width(piped.stdout)
    code, shown = run_tty(args, env)
    assert code == expect, shown
    assert ("\x1b[" in shown) == styled, shown
    check_width(shown)
    return piped.stdout


def render(renderable: RenderableType, *, terminal: bool) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=WIDTH, force_terminal=terminal).print(renderable)
    return buffer.getvalue()


# -- the renderers, given worst cases -------------------------------------------------

TRACE = (
    "org.apache.kafka.connect.errors.ConnectException: An exception occurred in the "
    "change event producer. This connector will be stopped. [Worker clientId=connect-1, "
    "groupId=connect-cluster] io.debezium.jdbc.JdbcConnectionException: "
    + "x" * 120
    + "\n\tat io.debezium.Foo.bar(Foo.java:42)"
)


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_the_renderers_fit_80_columns_with_worst_case_content(terminal: bool) -> None:
    figures = [
        Figures(
            "txn_90d",
            "feature_set",
            123_456.7,
            0.8123,
            0.0005,
            1.2345,
            0.003,
            ttl_s=86_400,
            oldest_age_s=100_000,
            mean_age_s=300,
        ),
        Figures(
            "a_feature_set_with_a_rather_long_name_indeed",
            "feature_set",
            2.0,
            0.1,
            0.0002,
            0.002,
            notes=("no miss measured: miss overhead taken as 0",),
        ),
        Figures("fraud_logistic_regression_model_v2", "model", 400.0, 0.75, 0.0004, 0.05),
        Figures("dice", "model", 50.0, 0.9, 0.0001, 0.01, deterministic=False),
    ]
    check_width(render(report([advise(f) for f in figures]), terminal=terminal))

    names = Names(
        "cdc0123456789abcdef.freshline-postgres",
        "cdc0123456789abcdef_freshline_cdc",
        "cdc0123456789abcdef.freshline_cdc",
    )
    task = TaskState(0, "FAILED", "connect-worker-with-a-long-host-name.example:8083", TRACE)
    state = CdcStatus(
        names,
        TaskState(-1, "RUNNING", task.worker, TRACE),
        [task],
        SlotState(names.slot, True, "0/1A2B3C4D", "0/1A2B3C4E", 5 << 30),
        ["devices", "geoip", "transactions", "user_devices", "users"],
    )
    shown, code = status_report(state, 1 << 30)
    assert code == 1
    check_width(render(shown, terminal=terminal))
    missing = CdcStatus(names, None)
    check_width(render(status_report(missing, 1 << 30)[0], terminal=terminal))

    rows = [
        ("acme", [1_000, 1_523, 25_000, 2_012]),
        (
            "t123abcdef-" + "a-very-long-tenant-id" * 3,
            [10_000_000, 15_230_000, 250_000_000, 24_012_000],
        ),
    ]
    tables = ["devices", "transactions", "user_devices", "users"]
    check_width(render(summary_table(tables, rows), terminal=terminal))

    record = ModelRecord(
        "fraud_example_with_a_long_name",
        "lr-" + "f" * 40,
        "/home/someone/" + "deeply/nested/" * 8 + "model.json",
        ("a", "b", "c", "d"),
        True,
    )
    check_width(render(model_block(record), terminal=terminal))


# -- the commands, on the real services -----------------------------------------------


def service_env(settings: Settings) -> dict[str, str]:
    return {
        "FRESHLINE_POSTGRES_URL": settings.postgres_url,
        "FRESHLINE_REDIS_URL": settings.redis_url,
    }


def test_db_summary(settings: Settings, tenant_factory: Callable[..., SeedSummary]) -> None:
    tenant = tenant_factory(users=20, transactions=300).tenants[0]
    shown = check_command(["db", "summary"], service_env(settings))
    assert tenant in shown.replace("\n", "")  # a long id may fold, never be cut
    assert "transactions" in shown and "geoip:" in shown  # per tenant, and a total


def test_models_list(settings: Settings, redis_client: redis.Redis, tmp_path: Path) -> None:
    name = f"m_{uuid.uuid4().hex[:12]}_with_a_name_long_enough_to_matter"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4))
    y = (x[:, 0] > 0).astype(np.float64)
    model = LogisticModel.fit(
        x, y, version="v1", feature_names=("a", "b", "c", "d"), epochs=5, name=name
    )
    path = tmp_path.joinpath(*["nested"] * 8) / "model.json"
    path.parent.mkdir(parents=True)
    ModelRegistry(redis_client).register(model.save(path))
    try:
        shown = check_command(["models", "list"], service_env(settings))
        assert name in shown and "model.json" in shown
    finally:
        redis_client.hdel(MODELS_KEY, name)


@pytest.mark.connect
def test_cdc_status_of_a_connector_not_registered(settings: Settings) -> None:
    shown = check_command(
        ["cdc", "status", "--name", f"no-such-{uuid.uuid4().hex}"], service_env(settings), expect=1
    )
    assert "not registered" in shown


def test_deploy_status(settings: Settings) -> None:
    check_command(["deploy", "status"], service_env(settings), styled=False)


@pytest.fixture
def api_url(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant_factory: Callable[..., SeedSummary],
) -> Iterator[str]:
    """The read API's ops port (its ``/metrics``), on real sockets (uvicorn in threads),
    after a few reads on the API port."""
    tenant = tenant_factory(users=10, transactions=200).tenants[0]
    local = settings.model_copy(
        update={"schema_version": fresh_version(), "consumer_metrics_port": 0}
    )
    app = create_app(
        local, engine=engine, redis_client=redis_client, follow_deploys=False, registry=REGISTRY
    )
    key = create_api_key(engine, tenant)
    with serving(app) as port, serving(app.state.ops_app) as ops_port:
        base = f"http://127.0.0.1:{port}"
        for user in (1, 2, 1, 1, 3):
            for feature_set in ("txn_90d", "geo"):
                answer = fetch(
                    f"{base}/v1/features/{feature_set}/{user}",
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert answer.status == 200, answer.body
        yield f"http://127.0.0.1:{ops_port}"


def test_advise(api_url: str) -> None:
    shown = check_command(["advise", "--window", "1s", "--from-metrics", f"{api_url}/metrics"], {})
    assert "txn_90d (feature set): " in shown
