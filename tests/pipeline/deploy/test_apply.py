"""``freshline apply`` is all or nothing for the user's tables: it makes what it can
(topics, the ACLs a topic prefix needs, freshline's schema) before it changes them, so a
step that fails leaves them as they were, and says which steps ran; running it again
once the cause is fixed finishes the job. Run as the roles the README gives: the owner
in Postgres, and in Kafka first the consumers' login (which may not create topics),
then the admin.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from freshline.pipeline.core.settings import Settings
from tests.helpers import ROOT, cli, forget_repository, need

pytestmark = [pytest.mark.kafka, pytest.mark.connect, pytest.mark.slow]


@pytest.fixture
def database(base_settings: Settings) -> Iterator[tuple[str, str]]:
    """A database of the user's with the README's tables; its name and owner URL."""
    name = f"qs_apply_{uuid.uuid4().hex[:6]}"
    owner = make_url(base_settings.postgres_url)
    admin = sa.create_engine(
        owner.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = owner.set(database=name).render_as_string(hide_password=False)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql((ROOT / "docs" / "quickstart.sql").read_text())
    engine.dispose()
    try:
        yield name, url
    finally:
        forget_repository(base_settings, name)


def untouched(url: str) -> list[str]:
    """What apply changed on the user's side: replica identity, grants, publication."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    changed = []
    with engine.connect() as conn:
        if (
            conn.execute(
                sa.text("SELECT relreplident FROM pg_class WHERE relname = 'loans'")
            ).scalar()
            != "d"
        ):
            changed.append("replica identity of loans")
        if conn.execute(
            sa.text("SELECT has_table_privilege('freshline_consumer', 'loans', 'SELECT')")
        ).scalar():
            changed.append("a grant on loans")
        if conn.execute(sa.text("SELECT 1 FROM pg_publication")).first():
            changed.append("a publication")
    engine.dispose()
    return changed


def test_apply_changes_no_table_until_kafka_allows_it_and_a_rerun_finishes(
    database: tuple[str, str], tmp_path: Path
) -> None:
    name, url = database
    repo = tmp_path / "myrepo"
    env: dict[str, str | None] = {
        "FRESHLINE_POSTGRES_URL": url,
        "FRESHLINE_TOPIC_PREFIX": f"{name}.",
        "FRESHLINE_REPO": str(repo),
        "FRESHLINE_KAFKA_CONSUMER_USER": need("FRESHLINE_STACK_KAFKA_CONSUMER_USER"),
        # The consumers' own login: it may neither create topics nor grant ACLs.
        "FRESHLINE_KAFKA_SASL_USERNAME": need("FRESHLINE_STACK_KAFKA_CONSUMER_USER"),
        "FRESHLINE_KAFKA_SASL_PASSWORD": need("FRESHLINE_STACK_KAFKA_CONSUMER_PASSWORD"),
        "FRESHLINE_POSTGRES_ADMIN_URL": None,
    }

    def freshline(*args: str) -> subprocess.CompletedProcess[str]:
        return cli(*args, **env)

    assert freshline("init", str(repo)).returncode == 0
    # Without the flag, apply refuses to touch the user's tables, and changes nothing.
    refused = freshline("apply")
    assert refused.returncode == 1 and "--alter-tables" in refused.stderr, refused.stderr
    assert untouched(url) == []
    failed = freshline("apply", "--alter-tables")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "Traceback" not in failed.stderr, failed.stderr
    assert untouched(url) == [], failed.stdout + failed.stderr
    assert not (repo / "features.lock.json").exists()
    said = " ".join(failed.stderr.split())
    assert "TOPIC_AUTHORIZATION_FAILED" in said, said
    assert "your tables are unchanged" in said, said
    assert "run freshline apply again" in said, said

    env["FRESHLINE_KAFKA_SASL_USERNAME"] = need("FRESHLINE_STACK_KAFKA_ADMIN_USER")
    env["FRESHLINE_KAFKA_SASL_PASSWORD"] = need("FRESHLINE_STACK_KAFKA_ADMIN_PASSWORD")
    done = freshline("apply", "--alter-tables")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RUNNING" in done.stderr, done.stderr
    assert untouched(url) == ["replica identity of loans", "a grant on loans", "a publication"]
    assert (repo / "features.lock.json").exists()
    again = freshline("apply", "--alter-tables")  # nothing left to do: still fine
    assert again.returncode == 0, again.stdout + again.stderr


def test_a_connector_refused_after_the_tables_changed_says_how_to_undo_or_finish(
    database: tuple[str, str], tmp_path: Path
) -> None:
    name, url = database
    repo = tmp_path / "myrepo"
    env: dict[str, str | None] = {
        "FRESHLINE_POSTGRES_URL": url,
        "FRESHLINE_TOPIC_PREFIX": f"{name}.",
        "FRESHLINE_REPO": str(repo),
        "FRESHLINE_POSTGRES_ADMIN_URL": None,
    }

    def freshline(*args: str) -> subprocess.CompletedProcess[str]:
        return cli(*args, **env)

    assert freshline("init", str(repo)).returncode == 0
    # Connect cannot reach Postgres under this name: the last step fails.
    failed = freshline("apply", "--alter-tables", "--database-host", "nowhere.invalid")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "Traceback" not in failed.stderr, failed.stderr
    said = " ".join(failed.stderr.split())
    assert "apply stopped at the connector" in said, said
    assert "done: topics, ACLs, Kafka Connect, freshline schema, your tables, the lock" in said
    assert "your tables were changed" in said, said
    for undo in (
        "ALTER TABLE loans REPLICA IDENTITY DEFAULT",
        "REVOKE SELECT ON books, loans, members FROM freshline_consumer",
        "DROP PUBLICATION freshline",
    ):
        assert undo in said, said
    assert "run freshline apply again" in said, said
    done = freshline("apply", "--alter-tables")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RUNNING" in done.stderr, done.stderr
