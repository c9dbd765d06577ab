"""The /status document ships as package data and is found from an installed layout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import orjson
import pytest

from freshline.pipeline.api.status_page import page

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("freshline", "pipeline", "consumers", "schemas", "migrations")


def test_page_embeds_the_report_so_it_cannot_end_the_script() -> None:
    html = page({"note": "</script><b>"})
    assert html.startswith(b"<!doctype html>") and html.rstrip().endswith(b"</html>")
    assert b"__DATA__" not in html
    embedded = html.split(b'type="application/json">')[1].split(b"</script>")[0]
    assert orjson.loads(embedded) == {"note": "</script><b>"}


@pytest.mark.slow
def test_an_installed_wheel_serves_the_page(tmp_path: Path) -> None:
    """Built as a wheel (from a copy, so the shared tree gets no build/ or egg-info) and
    unpacked as pip would, the page module finds its document."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", "dist"]
    built = subprocess.run(build, cwd=source, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (source / "dist").glob("*.whl")
    installed = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)

    script = (
        "import freshline.pipeline.api.status_page as m; print(m.__file__); print(len(m.page({})))"
    )
    env = {**os.environ, "PYTHONPATH": str(installed)}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    where, size = run.stdout.split()
    assert Path(where).is_relative_to(installed)
    assert int(size) > 10_000
