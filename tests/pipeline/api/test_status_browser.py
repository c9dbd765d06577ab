"""The /status page in a real headless Chromium: it loads, shows the figures, no errors.

Chromium comes from Debian (``apt-get install chromium``); the fixture installs it when
missing and apt is there (CI runs as root on Debian), and skips with the reason
otherwise. The screenshot is kept: under ``$FRESHLINE_TEST_ARTIFACTS`` if set, else in
the test's tmp directory; its path is printed.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy.engine import Engine

from fraud.seed import SeedSummary
from freshline.pipeline.api import create_app
from freshline.pipeline.api.accounts import create_api_key
from freshline.pipeline.core.settings import Settings
from freshline.pipeline.observe.staleness import Staleness
from freshline.pipeline.observe.status import Snapshot, StatusBoard
from tests.helpers import REGISTRY, fresh_version, serving

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=5000",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def chromium() -> str:
    """The chromium binary. Missing, it is installed if apt-get and root allow; failing
    that the test skips, or fails under CI (CI=true), where scripts/test installs it."""
    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "chromium"],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=900,
        )
        found = shutil.which("chromium")
    if found is None:
        message = (
            "chromium is not installed and could not be (needs root and apt-get): "
            "apt-get install chromium"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


def run_chromium(binary: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp / f"profile-{time.monotonic_ns()}"
    return subprocess.run(
        [binary, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def console_errors(stderr: str) -> list[str]:
    """Console messages and uncaught exceptions Chromium logged from the page."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


@pytest.fixture
def served(
    settings: Settings,
    engine: Engine,
    redis_client: redis.Redis,
    tenant_factory: Callable[..., SeedSummary],
) -> Iterator[tuple[str, str, str, StatusBoard]]:
    """The app and its ops-port app on real sockets (uvicorn in threads): (API URL,
    ops URL, API key, status board)."""
    tenant = tenant_factory(users=10, transactions=200).tenants[0]
    local = settings.model_copy(
        update={"schema_version": fresh_version(), "consumer_metrics_port": 0}
    )
    app = create_app(
        local, engine=engine, redis_client=redis_client, follow_deploys=False, registry=REGISTRY
    )
    with serving(app) as port, serving(app.state.ops_app) as ops_port:
        key = create_api_key(engine, tenant)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ops_port}", key, app.state.status


def backfill(board: StatusBoard, minutes: int = 55) -> None:
    """An hour-like history before the baseline, ending at the baseline's counters, so
    the charts have lines to draw and the current figures still count only the test's
    own reads."""
    base = board.history[0]
    names = ("txn_90d", "device_risk", "geo")
    ks = list(range(minutes, 5, -1))
    # Per-minute reads with a hit rate that drifts between 15% and 85%, accumulated
    # backwards from the baseline's counters.
    rates = [0.5 + 0.35 * math.sin(k / 6) for k in ks]
    hits_after = [sum(60 * r for r in rates[i + 1 :]) for i in range(len(ks))]
    misses_after = [sum(60 * (1 - r) for r in rates[i + 1 :]) for i in range(len(ks))]
    points: list[Snapshot] = []
    for i, k in enumerate(ks):
        hits = {n: base.hits.get(n, 0.0) - hits_after[i] for n in names}
        misses = {n: base.misses.get(n, 0.0) - misses_after[i] for n in names}
        ages = {n: Staleness(n, 3600, 50, 1200 + 25 * (minutes - k), 600, 0, 0) for n in names}
        lag = {n: int(400 + 300 * math.cos(k / 5)) for n in names}
        fresh = (0.12 * (minutes - k) * 100, 100.0 * (minutes - k) + 1)
        points.append(Snapshot(base.at - 60 * k, hits, misses, ages, lag, fresh))
    # The last point carries the baseline's counters: the 5-minute window starts there.
    board.history = deque([*points, *board.history], maxlen=board.history.maxlen)


def test_status_page_in_headless_chromium(
    served: tuple[str, str, str, StatusBoard], chromium: str, tmp_path: Path
) -> None:
    url, ops_url, key, board = served
    backfill(board)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client:
        for _ in range(5):  # one miss, four hits: 80%
            assert client.get("/v1/features/txn_90d/2").status_code == 200
        for _ in range(4):  # one miss, three hits: 75%
            assert client.get("/v1/features/geo/2").status_code == 200
        report = httpx.get(f"{ops_url}/status.json").json()
    current = {s["name"]: s["current"] for s in report["feature_sets"]}
    assert current["txn_90d"]["hit_rate"] == pytest.approx(0.8)
    assert current["geo"]["hit_rate"] == pytest.approx(0.75)

    dom = run_chromium(chromium, tmp_path, "--dump-dom", f"{ops_url}/status")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert "data-rendered=" in html, "the page's script did not finish rendering"
    figure = r'data-metric="hit_rate" data-set="{}">([^<]+)<'
    assert re.search(figure.format("txn_90d"), html).group(1) == "80.0%"  # type: ignore[union-attr]
    assert re.search(figure.format("geo"), html).group(1) == "75.0%"  # type: ignore[union-attr]
    assert html.count("<svg") >= 10  # three charts per feature set and the freshness chart
    assert "no data yet" not in html.split('id="set-txn_90d"')[1].split("</section>")[0]
    assert not console_errors(dom.stderr), console_errors(dom.stderr)

    artifacts = Path(os.environ.get("FRESHLINE_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "status.png"
    taken = run_chromium(
        chromium,
        tmp_path,
        f"--screenshot={shot}",
        "--window-size=1280,1900",
        "--hide-scrollbars",
        f"{ops_url}/status",
    )
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    assert not console_errors(taken.stderr), console_errors(taken.stderr)
    print(f"status page screenshot: {shot}")


def test_console_errors_are_caught(chromium: str, tmp_path: Path) -> None:
    """The check above would see an error: a page that logs one is caught."""
    page = tmp_path / "broken.html"
    page.write_text("<script>console.error('boom'); undefinedFunction();</script>")
    out = run_chromium(chromium, tmp_path, "--dump-dom", page.as_uri())
    errors = console_errors(out.stderr)
    assert any("boom" in e for e in errors) and any("Uncaught" in e for e in errors), out.stderr
