"""No password reaches an error message, a log line or a ``repr`` (issue 30, item 12).

Each ``freshline`` command runs as a user would run it, in a process of its own, with
every secret freshline takes set (the Postgres URLs' passwords, the Redis password in
the URL and on its own, the Kafka SASL password, the embeddings URL's password and
API key) and every service unreachable (ports nothing listens on), so each fails on a
connection and says so. No secret, nor any part of one between ``@`` signs (a URL
parser that stops at the first ``@`` shows the rest as a host), may appear in what it
prints or logs.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from freshline.pipeline.core.db import make_engine, ping
from freshline.pipeline.core.errors import ServiceUnavailable
from freshline.pipeline.core.settings import Settings, load_settings
from tests.helpers import FRESHLINE, free_port

REPO = Path(__file__).resolve().parents[1]

PG = "Pg5ecret@Fr4gmentPg"
PG_ADMIN = "Adm5ecret@Fr4gmentAdm"
PG_REPLICA = "Rep5ecret@Fr4gmentRep"
REDIS_IN_URL = "RedisUrl5ecret@Fr4gmentRu"
REDIS = "Redis5ecret@Fr4gmentR"
KAFKA = "Kafka5ecret@Fr4gmentK"
CONNECT = "Connect5ecret"
EMBEDDINGS_IN_URL = "EmbUrl5ecret"
EMBEDDINGS_KEY = "EmbKey5ecret@Fr4gmentE"
SECRETS = (
    PG,
    PG_ADMIN,
    PG_REPLICA,
    REDIS_IN_URL,
    REDIS,
    KAFKA,
    CONNECT,
    EMBEDDINGS_IN_URL,
    EMBEDDINGS_KEY,
)


def fragments() -> Iterator[str]:
    for secret in SECRETS:
        yield secret
        yield from secret.split("@")


def unreachable(*, percent_encoded: bool = True) -> dict[str, str]:
    """Settings naming closed ports, every secret set. Postgres passwords with an
    ``@`` are percent-encoded as a database URL needs (``%40``) unless not asked to."""

    def pg(password: str) -> str:
        return password.replace("@", "%40") if percent_encoded else password

    return {
        "FRESHLINE_REPO": str(REPO / "examples" / "fraud"),
        "FRESHLINE_POSTGRES_URL": f"postgresql+psycopg://svc:{pg(PG)}@127.0.0.1:{free_port()}/app",
        "FRESHLINE_POSTGRES_ADMIN_URL": (
            f"postgresql+psycopg://owner:{pg(PG_ADMIN)}@127.0.0.1:{free_port()}/app"
        ),
        "FRESHLINE_POSTGRES_REPLICA_URL": (
            f"postgresql+psycopg://rep:{pg(PG_REPLICA)}@127.0.0.1:{free_port()}/app"
        ),
        "FRESHLINE_REDIS_URL": f"redis://api:{REDIS_IN_URL}@127.0.0.1:{free_port()}/0",
        "FRESHLINE_REDIS_USERNAME": "api",
        "FRESHLINE_REDIS_PASSWORD": REDIS,
        "FRESHLINE_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
        "FRESHLINE_KAFKA_SECURITY_PROTOCOL": "sasl_plaintext",
        "FRESHLINE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "FRESHLINE_KAFKA_SASL_USERNAME": "consumer",
        "FRESHLINE_KAFKA_SASL_PASSWORD": KAFKA,
        "FRESHLINE_CONNECT_URL": f"http://connect:{CONNECT}@127.0.0.1:{free_port()}",
        "FRESHLINE_SEMANTIC_EMBEDDINGS_URL": (
            f"http://embed:{EMBEDDINGS_IN_URL}@127.0.0.1:{free_port()}/v1"
        ),
        "FRESHLINE_SEMANTIC_EMBEDDINGS_API_KEY": EMBEDDINGS_KEY,
    }


def environment(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment without any login of the stack's, plus ``settings``."""
    kept = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FRESHLINE_", "PG", "REDISCLI")) and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    return {**kept, **settings}


def assert_no_secret(text: str) -> None:
    for part in fragments():
        assert part not in text, f"{part!r} appears in:\n{text}"


COMMANDS = [
    ["plan"],
    ["apikey", "list"],
    ["db", "upgrade"],
    ["cdc", "status"],
    ["deploy", "flip", "2"],
    ["semantic", "stats"],
    ["semantic", "tune"],
    ["topics", "ensure"],
    ["serve", "--workers", "1"],
]


@pytest.mark.parametrize("percent_encoded", [True, False], ids=["%40", "raw @"])
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_failing_command_shows_no_password(command: list[str], percent_encoded: bool) -> None:
    if command[0] == "serve":
        command = [*command, "--port", str(free_port())]
    done = subprocess.run(
        [FRESHLINE, *command],
        env=environment(unreachable(percent_encoded=percent_encoded)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "error" in out.lower(), out  # it failed, and said so
    assert "Traceback" not in out, out
    assert_no_secret(out)


@pytest.mark.slow  # a consumer process against a dead stack
def test_the_consumers_log_lines_show_no_password() -> None:
    """A consumer that cannot reach Kafka keeps trying and logs each failure: read its
    log until the first failure, then stop it."""
    proc = subprocess.Popen(
        [FRESHLINE, "consume", "--max-messages", "1", "--metrics-port", "0"],
        env=environment(unreachable()),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Connection refused" in line or "error" in line.lower():
                break
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rest, _ = proc.communicate(timeout=10)
    out = "".join(lines) + (rest or "")
    assert "refused" in out.lower() or "error" in out.lower(), out
    assert_no_secret(out)


def test_settings_texts_and_a_failed_ping_show_no_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in unreachable().items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    texts = [str(settings), repr(settings), str(settings.redacted())]
    engine = make_engine(settings)
    texts.append(repr(engine))
    with pytest.raises(ServiceUnavailable) as failed:
        ping(engine)
    engine.dispose()
    texts += [str(failed.value), repr(failed.value)]
    for text in texts:
        assert_no_secret(text)


@pytest.mark.parametrize(
    "variable",
    ["FRESHLINE_POSTGRES_URL", "FRESHLINE_POSTGRES_ADMIN_URL", "FRESHLINE_POSTGRES_REPLICA_URL"],
)
def test_a_database_url_whose_password_holds_a_raw_at_is_refused_by_name(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database URL parser reads a password up to its first ``@`` and takes the
    rest as the host, which then shows in every connection error: such a URL is
    refused when the settings load, naming the setting, never echoing it."""
    settings = unreachable()
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(variable, settings[variable].replace("%40", "@"))
    with pytest.raises(Exception) as refused:
        load_settings()
    assert variable in str(refused.value)
    assert "%40" in str(refused.value)
    assert_no_secret(str(refused.value))
    with pytest.raises(Exception) as direct:
        Settings()
    assert_no_secret(str(direct.value))
