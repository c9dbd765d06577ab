from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import cli, error_line, free_port, freshline


def test_unreachable_postgres_is_one_line_naming_it_and_the_fix() -> None:
    r = cli("db", "upgrade", FRESHLINE_POSTGRES_URL="postgresql+psycopg://u:pw@127.0.0.1:1/x")
    line = error_line(r)
    assert "Postgres" in line and "127.0.0.1:1" in line
    assert "scripts/stack up" in line
    assert "pw" not in line


def test_bad_arguments_give_a_usage_error() -> None:
    r = cli("fraud", "seed", "--users", "zero")
    assert r.returncode == 2
    assert "Usage" in r.stderr or "usage" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_setting_is_one_line() -> None:
    r = cli("db", "upgrade", FRESHLINE_SCHEMA_VERSION="-1")
    assert r.returncode == 1
    assert "FRESHLINE_SCHEMA_VERSION" in r.stderr
    assert "Traceback" not in r.stderr


def test_advise_with_no_api_running_says_to_start_the_api_not_the_stack() -> None:
    port = free_port()  # of the API's ops port, where its /metrics are
    r = cli(
        "advise", "--window", "1s", FRESHLINE_OPS_HOST="127.0.0.1", FRESHLINE_OPS_PORT=str(port)
    )
    line = error_line(r)
    assert f"http://127.0.0.1:{port}/metrics" in line
    assert (
        "the API is not running: start it with `freshline serve`, or pass `--from-metrics URL`"
    ) in line
    assert "scripts/stack up" not in line


def test_advise_from_a_dead_metrics_url_names_it_and_the_option() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    r = cli("advise", "--window", "1s", "--from-metrics", url)
    assert r.returncode == 1
    assert url in r.stderr and "--from-metrics" in r.stderr
    assert "scripts/stack up" not in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # five freshline processes
def test_a_repository_s_own_commands_run_under_its_name(tmp_path: Path) -> None:
    repo = tmp_path / "shop"
    assert freshline("init", str(repo)).returncode == 0
    config = repo / "freshline.toml"
    name = next(
        line.split("=", 1)[1].strip().strip('"')
        for line in config.read_text().splitlines()
        if line.startswith("name")
    )
    config.write_text(
        config.read_text().replace("[project]\n", '[project]\ncommands = "shop_cli:app"\n', 1)
    )
    (repo / "shop_cli.py").write_text(
        "import typer\n\napp = typer.Typer()\n\n\n"
        "@app.command()\ndef hello(who: str) -> None:\n    print(f'hello {who}')\n\n\n"
        "@app.command()\ndef bye() -> None:\n    print('bye')\n"
    )
    said = freshline("--repo", str(repo), name, "hello", "ada")
    assert said.returncode == 0, said.stderr
    assert said.stdout.strip() == "hello ada"
    assert name in freshline("--repo", str(repo), "--help").stdout
    # A group that cannot be imported fails the command line that asks for it, in one
    # line naming the file; every other command still runs.
    (repo / "shop_cli.py").write_text("raise ImportError('no such thing')\n")
    broken = freshline("--repo", str(repo), name, "hello", "ada")
    assert broken.returncode == 1
    assert "freshline.toml" in broken.stderr and "no such thing" in broken.stderr
    assert "Traceback" not in broken.stderr
    assert freshline("--repo", str(repo), "--help").returncode == 0


@pytest.mark.slow  # two freshline processes and a probe
def test_a_repository_folder_never_shadows_a_freshline_package(tmp_path: Path) -> None:
    """The fraud example keeps a migrations/ folder: mounting its commands puts the
    repository on the path, and freshline's migrations must still be its own (the
    repository's shadowed them once, when freshline installed a top-level
    ``migrations``: plan and apply broke with AttributeError)."""
    repo = tmp_path / "shop"
    assert freshline("init", str(repo)).returncode == 0
    config = repo / "freshline.toml"
    config.write_text(
        config.read_text().replace("[project]\n", '[project]\ncommands = "shop_cli:app"\n', 1)
    )
    (repo / "shop_cli.py").write_text("import typer\n\napp = typer.Typer()\n")
    (repo / "migrations" / "versions").mkdir(parents=True)
    probe = (
        "from freshline.pipeline.cli import mount_own_commands\n"
        f"mount_own_commands(['--repo', {str(repo)!r}])\n"
        "from freshline import migrations\n"
        "print(hasattr(migrations, 'upgrade'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert done.stdout.strip() == "True", done.stdout + done.stderr
