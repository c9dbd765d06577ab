"""``freshline semantic stats | purge | tune`` as a person runs them."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from freshline.pipeline.core.settings import Settings
from freshline.pipeline.semantic import prior
from freshline.pipeline.semantic.cache import Scope, SemanticCache
from freshline.pipeline.semantic.embed import local_model
from freshline.pipeline.semantic.extra import MODULES
from tests.helpers import cli


def test_stats_then_purge(settings: Settings, redis_client: redis.Redis) -> None:
    tenant = f"t{uuid.uuid4().hex[:12]}"
    env = {"FRESHLINE_REDIS_URL": settings.redis_url}
    cache = SemanticCache(redis_client, local_model())
    for version in ("v1", "v2"):
        cache.store(
            Scope(tenant, "bot", version, "t1"), "Where is order 12?", {"temperature": 0}, "shipped"
        )
    cache.lookup(Scope(tenant, "bot", "v1", "t1"), "where is order 12", {"temperature": 0})
    cache.close()

    r = cli("semantic", "stats", "--tenant", tenant, **env)
    assert r.returncode == 0, r.stderr
    assert f"{tenant} bot  version v1, template t1" in r.stdout
    assert "1 entries; hit rate 100.0% (1 hits, 0 misses)" in r.stdout
    assert "explored 0.0% of lookups (0, 0 audits); labels 0 right, 0 wrong" in r.stdout
    assert "error of hits: estimated -, flagged 0.0%, audited - (0 labelled)" in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    rows = json.loads(cli("semantic", "stats", "--tenant", tenant, "--json", **env).stdout)
    assert [(row["model_version"], row["entries"]) for row in rows] == [("v1", 1), ("v2", 1)]
    assert (rows[0]["exploration_rate"], rows[0]["observed_error"], rows[0]["explored"]) == (
        0.0,
        0.0,
        0,
    )

    r = cli("semantic", "purge", "--tenant", tenant, "--model-version", "v1", **env)
    assert r.returncode == 0, r.stderr
    assert "purged 1 namespace(s)" in r.stdout
    rows = json.loads(cli("semantic", "stats", "--tenant", tenant, "--json", **env).stdout)
    assert [row["model_version"] for row in rows] == ["v2"]

    r = cli("semantic", "purge", **env)
    assert r.returncode == 2 and "--tenant" in r.stderr and "Traceback" not in r.stderr
    assert cli("semantic", "purge", "--tenant", tenant, **env).returncode == 0
    assert "no semantic cache entries" in cli("semantic", "stats", "--tenant", tenant, **env).stderr


@pytest.mark.slow  # embeds every pair with the local model
def test_tune_prints_both_rates_at_each_threshold(tmp_path: Path) -> None:
    pairs = [
        {"a": "Where is order 12?", "b": "Where is order 12 ?", "label": "paraphrase"},
        {"a": "Cancel order 12.", "b": "Cancel order 13.", "label": "different"},
        {
            "a": "Block the card ending 1234.",
            "b": "Block the card ending in 1234.",
            "label": "paraphrase",
        },
        {"a": "Is Maria Lopez high risk?", "b": "Is Mario Lopez high risk?", "label": "different"},
    ]
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps({"pairs": pairs}))
    r = cli("semantic", "tune", "--pairs", str(path))
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip()[:2] == "0."]
    assert [row[0] for row in rows] == [f"{0.85 + i / 100:.2f}" for i in range(13)]
    assert "<- configured" not in r.stdout
    assert "max error 2.0%): a fresh entry is served from 0.885" in r.stdout  # the prior's
    assert rows[0][1] == "100.0%"  # both paraphrases at 0.85
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    static = cli("semantic", "tune", "--pairs", str(path), FRESHLINE_SEMANTIC_DECISION="static")
    assert any("<- configured" in line for line in static.stdout.splitlines() if "0.93" in line)

    written = tmp_path / "prior.json"
    r = cli("semantic", "tune", "--pairs", str(path), "--write-prior", str(written))
    assert r.returncode == 0, r.stderr
    fitted = prior.load(written)
    assert fitted.embedding_model == "all-MiniLM-L6-v2" and fitted.groups == 3
    # The path wraps at 80 columns wherever the temporary directory is long (xdist's).
    assert f"-> {written}" in r.stdout.replace("\n", "")

    path.write_text(json.dumps([{"a": "x", "label": "same"}]))
    r = cli("semantic", "tune", "--pairs", str(path))
    assert r.returncode == 1 and "pair 0" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["stats", "purge", "tune"])
def test_without_the_extra_each_command_says_what_to_install(command: str) -> None:
    # As if it were not installed: importing its modules fails.
    absent = "".join(f"sys.modules[{name!r}] = None; " for name in MODULES)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; {absent}sys.argv = ['freshline', 'semantic', {command!r}]; "
            "from freshline.pipeline.cli import main; main()",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "error: freshline semantic needs the semantic extra, which is not installed "
        "(no faiss, tokenizers, safetensors): pip install 'freshline[semantic]'"
    ]
