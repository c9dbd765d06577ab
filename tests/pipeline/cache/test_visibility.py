"""Which events' transactions a snapshot sees, in every epoch of transaction ids.

Debezium reports a transaction id in 32 bits; the snapshot statement widens it to an
``xid8`` against its own snapshot (:mod:`freshline.pipeline.cache.recompute`). A transaction held
open is what a change not yet visible looks like to every other snapshot. The stack's
Postgres is in epoch 0; later epochs, and the end of one, are on a private cluster that
``pg_resetwal`` has moved there.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.cache.recompute import take_snapshot
from tests.helpers import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")
"""Where ``scripts/stack`` runs Postgres from."""
EPOCH = 1 << 32
LOW = EPOCH - 1
NEXT = EPOCH - 32
"""The private cluster's next id in its epoch: a few dozen before the epoch ends."""
CLOG_SEGMENT = 32 * 32768
"""Transaction ids per file of ``pg_xact``: 32 pages of 32,768 (8 kB, 2 bits an id)."""
XMAX = sa.text("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")


def held(engine: Engine) -> tuple[Connection, int]:
    """A transaction given an id and left open; and that id."""
    conn = engine.connect()
    xid = conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
    return conn, int(xid)


def committed(engine: Engine) -> int:
    """The id of a transaction that has committed."""
    conn, xid = held(engine)
    conn.commit()
    conn.close()
    return xid


def invisible(engine: Engine, *xids: int) -> set[int]:
    """Which of ``xids``, sent in 32 bits as Debezium does, a new snapshot cannot see."""
    with engine.connect() as conn:
        return set(take_snapshot(conn, [xid & LOW for xid in xids]).invisible)


def test_a_transaction_is_invisible_until_it_commits(engine: Engine) -> None:
    old = committed(engine)
    conn, xid = held(engine)
    try:
        assert invisible(engine, old, xid) == {xid & LOW}
        conn.commit()
    finally:
        conn.close()
    assert invisible(engine, old, xid) == set()


def test_an_id_more_than_2_30_ahead_of_xmax_reads_as_visible(engine: Engine) -> None:
    # No running transaction is that far ahead: it widens to one behind xmax instead (in
    # epoch 0, below id 0: no transaction has had it, no change of it can be waiting).
    with engine.connect() as conn:
        xmax = conn.execute(XMAX).scalar_one()
    assert invisible(engine, xmax + (1 << 30) + 5, xmax + (3 << 30)) == set()


def postgres(*args: str, log: Path | None = None) -> None:
    """Run a program of ``PG_BIN`` as the postgres user (Postgres refuses root)."""
    command = [str(PG_BIN / args[0]), *args[1:]]
    if os.geteuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        logged = log.read_text() if log and log.is_file() else ""
        pytest.fail(f"{args[0]} failed: {done.stdout}{done.stderr}{logged}", pytrace=False)


def private_cluster(prefix: str, program: str) -> tuple[Path, Path, Path, int]:
    """Where a private Postgres cluster is to live: its root (owned by the postgres user
    when the tests run as root), data directory, log file and a free port. A machine
    without ``program`` in ``PG_BIN`` fails the test."""
    if not (PG_BIN / program).is_file():
        pytest.fail(f"Postgres is not installed in {PG_BIN}: scripts/stack up installs it")
    root = Path(tempfile.mkdtemp(prefix=prefix))
    user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    if user:
        os.chown(root, user.pw_uid, user.pw_gid)
    return root, root / "data", root / "postgres.log", free_port()


def initdb(data: Path) -> None:
    """A new cluster in ``data``: the postgres superuser, trusted, UTF-8, locale C."""
    postgres(
        "initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C"
    )


@pytest.fixture(scope="module")
def late_epoch() -> Iterator[Engine]:
    """A private Postgres in epoch 1, ``EPOCH - NEXT`` ids before epoch 2 begins."""
    root, data, log, port = private_cluster("freshline-epoch-", "pg_resetwal")
    user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    # Autovacuum off: the tests' transactions are the only ones given ids.
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c autovacuum=off"
    start = ["pg_ctl", "-D", str(data), "-l", str(log), "-o", options, "-w", "start"]
    stop = ["pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop"]

    def connect(database: str) -> Engine:
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/{database}"
        return sa.create_engine(url, poolclass=sa.pool.NullPool)

    try:
        initdb(data)
        postgres(*start, log=log)
        # Moving more than 2**31 ids ahead turns every unfrozen row's id into one from the
        # future, and the row vanishes: first freeze the rows of the databases in use.
        for database in ("postgres", "template1"):
            frozen = connect(database)
            with frozen.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                conn.execute(sa.text("VACUUM FREEZE"))
            frozen.dispose()
        postgres(*stop)
        # -u: no id before NEXT is left unfrozen, so no vacuum against wraparound starts.
        postgres("pg_resetwal", "-e", "1", "-x", str(NEXT), "-u", str(NEXT), "-D", str(data))
        # At start the server reads the page of pg_xact that holds the next id, and
        # pg_resetwal -x makes none (an id at a file's start, as its docs pick, needs
        # none): make the file, all zeros (no id in it has ended), as Postgres would.
        segment = data / "pg_xact" / f"{NEXT // CLOG_SEGMENT:04X}"
        segment.write_bytes(bytes(CLOG_SEGMENT // 4))
        segment.chmod(0o600)
        if user:
            os.chown(segment, user.pw_uid, user.pw_gid)
        postgres(*start, log=log)
        engine = connect("postgres")
        yield engine
        engine.dispose()
    finally:
        if (data / "postmaster.pid").exists():
            postgres(*stop)
        shutil.rmtree(root)


def test_in_a_later_epoch_a_transaction_is_invisible_until_it_commits(
    late_epoch: Engine,
) -> None:
    earlier = committed(late_epoch)
    long_ago = earlier - (1 << 30)  # a billion ids before, in the same epoch
    # An event replayed after more than 2**31 transactions is still read as old.
    replayed = (earlier - (1 << 31) - 10) & LOW
    conn, xid = held(late_epoch)
    try:
        assert xid >= EPOCH  # the cluster really is past epoch 0
        assert invisible(late_epoch, replayed, long_ago, earlier, xid) == {xid & LOW}
        conn.commit()
    finally:
        conn.close()
    assert invisible(late_epoch, replayed, long_ago, earlier, xid) == set()


def test_across_the_end_of_an_epoch_each_id_widens_into_its_own(late_epoch: Engine) -> None:
    # a and b held open at the end of epoch 1, c at the start of epoch 2: xmax stays
    # below the end while the newest id is past it.
    while (before := committed(late_epoch)) < 2 * EPOCH - 3:
        pass
    opened = [held(late_epoch) for _ in range(3)]
    (conn_a, a), (conn_b, b), (conn_c, c) = opened
    try:
        # Ids 0-2 of an epoch are never given out.
        assert (before, a, b, c) == (2 * EPOCH - 3, 2 * EPOCH - 2, 2 * EPOCH - 1, 2 * EPOCH + 3)
        assert invisible(late_epoch, before, a, b, c) == {a & LOW, b & LOW, c & LOW}
        conn_a.commit()
        conn_b.commit()
        # xmax is now in epoch 2: a and b widen back into epoch 1, c stays ahead.
        assert invisible(late_epoch, before, a, b, c) == {c & LOW}
        conn_c.commit()
    finally:
        for conn, _ in opened:
            conn.close()
    assert invisible(late_epoch, before, a, b, c) == set()
