"""The deploy commands: ``check``, ``warm``, ``deploy start|flip|cancel|status``, ``purge``.

Thin shells over :mod:`freshline.pipeline.core.lock`, :mod:`freshline.pipeline.deploy.pointer`,
:mod:`freshline.pipeline.deploy.warm` and :mod:`freshline.pipeline.deploy.purge`;
see ``docs/deploys.md`` for the runbook.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import TaskID

from freshline.pipeline.cli.app import console, out, progress_bar
from freshline.pipeline.core.lock import lock_path as repository_lock
from freshline.pipeline.core.repository import active
from freshline.pipeline.core.services import redis_client

POOL_THREADS = 40
"""Threads in an API worker's pool: anyio's default limiter, which Starlette's
``run_in_threadpool`` runs on (:mod:`freshline.pipeline.api.tenancy`)."""

LockOption = Annotated[
    Path | None, typer.Option("--lock", help="The lock file (default: the repository's)")
]

deploy_app = typer.Typer(help="Move readers to another schema version.", no_args_is_help=True)


def check(
    update_lock: Annotated[
        bool,
        typer.Option("--update-lock", help="Add FRESHLINE_SCHEMA_VERSION to the lock if it is new"),
    ] = False,
    lock_path: LockOption = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers", min=1, help="The API's worker processes on this host (serve --workers)"
        ),
    ] = 1,
) -> None:
    """Refuse feature definitions that changed without a FRESHLINE_SCHEMA_VERSION bump;
    warn about a Redis that may fill or evict, and about a per-tenant thread-pool share
    that, times the workers, could keep every CPU of this host busy."""
    from freshline.pipeline.core.lock import Lock, update
    from freshline.pipeline.core.lock import check as check_lock
    from freshline.pipeline.core.settings import load_settings

    version = load_settings().schema_version
    lock_path = lock_path or repository_lock()
    lock = Lock.load(lock_path)
    if update_lock:
        if update(lock, version, active().registry):
            lock.save(lock_path)
            console.print(f"added schema version {version} to {lock_path}")
        else:
            console.print(f"schema version {version} is already locked and matches")
        return
    if check_lock(lock, version, active().registry) == "new":
        console.print(
            f"[red]error:[/red] schema version {version} is not in {lock_path}; "
            "run `freshline check --update-lock` and commit the lock"
        )
        raise typer.Exit(1)
    console.print(f"feature definitions match the lock for schema version {version}")
    warn_about_redis_memory()
    warn_about_pool_share(workers)


def warn_about_redis_memory() -> None:
    """A warning, never a failure, when Redis has no ``maxmemory`` (or may evict)."""
    import redis as redis_errors

    from freshline.pipeline.core.budget import memory_problem
    from freshline.pipeline.core.settings import load_settings, redact_text

    try:
        client = redis_client(load_settings(), socket_connect_timeout=2, socket_timeout=5)
        try:
            problem = memory_problem(client)
        finally:
            client.close()
    except (redis_errors.RedisError, OSError) as exc:
        console.print(
            f"[yellow]warning:[/yellow] could not read Redis's maxmemory: {redact_text(str(exc))}"
        )
        return
    if problem:
        console.print(f"[yellow]warning:[/yellow] {problem}")


def warn_about_pool_share(workers: int) -> None:
    """A warning when one tenant's thread-pool share over ``workers`` processes could
    keep every CPU the API may run on busy (:func:`share_problem`)."""
    import os

    from freshline.pipeline.core.settings import load_settings

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = load_settings()
    problem = share_problem(
        settings.api_tenant_pool_share, settings.api_tenant_concurrency, workers, cpus or 1
    )
    if problem:
        console.print(f"[yellow]warning:[/yellow] {problem}")


def share_problem(share: float, concurrency: int, workers: int, cpus: int) -> str | None:
    """A warning when one tenant could keep all ``cpus`` busy with thread-pool work.

    In each of ``workers`` processes a tenant runs at most ``concurrency`` pool jobs at
    once and ``share`` seconds of them a second, whichever binds (0: that one does not),
    and never more than the pool's :data:`POOL_THREADS`; the workers add up. None when
    that stays below ``cpus``, or when neither limit is set (a deployment with one
    tenant's choice)."""
    limits = [limit for limit in (share, concurrency) if limit > 0]
    if not limits:
        return None
    per_worker = min(*limits, POOL_THREADS)
    taken = workers * per_worker
    if taken < cpus:
        return None
    return (
        f"one tenant may keep {taken:g} threads busy with pool work ({workers} worker(s) "
        f"x {per_worker:g}: FRESHLINE_API_TENANT_POOL_SHARE {share:g}, "
        f"FRESHLINE_API_TENANT_CONCURRENCY {concurrency}), as many as this host's {cpus} "
        f"CPU(s); with untrusted tenants, keep the share below {cpus / workers:g} "
        "(CPUs / workers)"
    )


# long: the signature is the command's option table; its body is 68 lines
def warm(
    version: Annotated[int, typer.Option("--version", min=1, help="Schema version to warm")],
    feature_set: Annotated[
        list[str] | None,
        typer.Option("--feature-set", help="Only these feature sets (repeatable); default all"),
    ] = None,
    top: Annotated[
        int | None, typer.Option("--top", min=1, help="The N most-read entities per feature set")
    ] = None,
    all_active: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Every active entity of each feature set's entity (its `active=` condition; "
            "default: every row of its table)",
        ),
    ] = False,
    tenant: Annotated[
        list[str] | None,
        typer.Option("--tenant", help="Only these tenants (repeatable); default all"),
    ] = None,
    rate: Annotated[
        float | None, typer.Option("--rate", min=1, help="At most this many entities per second")
    ] = 2000.0,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, max=10000)] = 500,
    lock_path: LockOption = None,
) -> None:
    """Materialize a schema version before flipping to it (marks it next first)."""

    from freshline.pipeline.cache.hot import HotReads
    from freshline.pipeline.cache.store import check_eviction_policy
    from freshline.pipeline.cache.versions import WRITE_VERSIONS_MAX_AGE_S, state
    from freshline.pipeline.core.db import make_engine
    from freshline.pipeline.core.lock import Lock
    from freshline.pipeline.core.settings import load_settings
    from freshline.pipeline.deploy.pointer import start, writing
    from freshline.pipeline.deploy.warm import active_entities, count_active, tenant_ids
    from freshline.pipeline.deploy.warm import warm as warm_version
    from freshline.pipeline.history.snapshots import keeper

    if (top is None) == (not all_active):
        raise typer.BadParameter("choose one of --top N or --all")
    settings = load_settings()
    client = redis_client(settings)
    check_eviction_policy(client)
    engine = make_engine(settings)
    lock_path = lock_path or repository_lock()
    lock = Lock.load(lock_path)
    repo = active()
    names = feature_set or repo.registry.names()
    for name in names:
        repo.registry[name]
    seen = state(client, settings, lock=lock)
    if version != seen.active:
        start(client, settings, version, lock)
        # Consumers cache write_versions this long: wait, so every change from now on
        # reaches the new namespace too and nothing warmed below can go stale.
        console.print(f"schema version {version} is next; consumers now write it too")
        time.sleep(2 * WRITE_VERSIONS_MAX_AGE_S)
    tenants = tenant or tenant_ids(engine)
    total = 0
    with progress_bar() as bar:
        for name in names:
            batches: Iterable[Sequence[tuple[str, str]]]
            if top is not None:
                refs = HotReads(client).top(seen.active, name, tenants, top)
                batches = [refs[i : i + batch_size] for i in range(0, len(refs), batch_size)]
                size = len(refs)
            else:
                entity = repo.registry[name].entity
                batches = active_entities(engine, entity, tenants, batch_size=batch_size)
                size = count_active(engine, entity, tenants)
            task = bar.add_task(f"warm {name} v{version}", total=size)

            def report(done: int, task: TaskID = task) -> None:
                bar.update(task, completed=done)

            def guard() -> None:
                writing(client, settings, version)

            result = warm_version(
                client,
                engine,
                version,
                name,
                batches,
                lock,
                rate=rate,
                progress=report,
                guard=guard,
                on_computed=keeper(engine) if repo.history.enabled else None,
                registry=repo.registry,
            )
            total += result.entities
    console.print(
        f"warmed {total:,} entities into schema version {version}; "
        f"flip with: freshline deploy flip {version}"
    )


@deploy_app.command("start")
def deploy_start(
    version: Annotated[int, typer.Argument(min=1)], lock_path: LockOption = None
) -> None:
    """Mark a version next: consumers write it alongside the active one."""
    _pointer_command("start", version, lock_path)


@deploy_app.command("flip")
def deploy_flip(
    version: Annotated[int, typer.Argument(min=1)],
    lock_path: LockOption = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Flip even while registered readers or consumers do not know the version",
        ),
    ] = False,
) -> None:
    """Make a version active, atomically; readers follow without a restart.

    Refused while a running reader or consumer does not know the version (it names
    them), unless forced; a rollback to the previous version is always accepted."""
    _pointer_command("flip", version, lock_path, force=force)


@deploy_app.command("cancel")
def deploy_cancel(lock_path: LockOption = None) -> None:
    """Stop writing the next version; it stays retired until its keys expire (or purge)."""
    _pointer_command("cancel", None, lock_path)


@deploy_app.command("status")
def deploy_status(lock_path: LockOption = None) -> None:
    """The active, next and previous schema versions, the locked ones, and the running
    readers and consumers with the versions each computes."""
    _pointer_command("status", None, lock_path)


def _pointer_command(
    action: str, version: int | None, lock_path: Path | None, *, force: bool = False
) -> None:

    from freshline.pipeline.cache.roster import roster
    from freshline.pipeline.cache.versions import state
    from freshline.pipeline.core.lock import Lock
    from freshline.pipeline.core.settings import load_settings
    from freshline.pipeline.deploy.pointer import cancel, flip, start

    settings = load_settings()
    client = redis_client(settings)
    lock_path = lock_path or repository_lock()
    lock = Lock.load(lock_path)
    if action == "start" and version is not None:
        start(client, settings, version, lock)
    elif action == "flip" and version is not None:
        flip(client, settings, version, lock, force=force, registry=active().registry)
    elif action == "cancel":
        cancel(client, settings, lock, registry=active().registry)
    seen = state(client, settings, lock=lock)
    previous = "-"
    if seen.previous is not None:
        previous = f"{seen.previous} (still written: a flip to it is a rollback)"
    out.print(
        f"active schema version:   {seen.active}"
        f"{'' if seen.active_raw else ' (pointer unset: FRESHLINE_SCHEMA_VERSION)'}"
    )
    out.print(f"next schema version:     {seen.next if seen.next is not None else '-'}")
    out.print(f"previous schema version: {previous}")
    out.print(f"locked versions:         {', '.join(map(str, sorted(lock.versions)))}")
    procs = roster(client)
    out.print(f"running processes:       {len(procs) or '-'}")
    for p in procs:
        serving = "" if p.serving is None else f", serves {p.serving}"
        out.print(
            f"  {p.name}: computes {', '.join(map(str, p.computes)) or '-'}, "
            f"knows {', '.join(map(str, p.knows)) or '-'}{serving}"
        )


def purge(
    version: Annotated[str, typer.Option("--version", help="Schema or model version")],
    model: Annotated[
        str | None, typer.Option("--model", help="Purge this model's cached predictions instead")
    ] = None,
    batch: Annotated[
        int, typer.Option("--batch", min=1, max=10000, help="Keys per SCAN step and UNLINK")
    ] = 500,
    force: Annotated[
        bool,
        typer.Option("--force", help="Purge the previous version too, giving up the rollback"),
    ] = False,
    lock_path: LockOption = None,
) -> None:
    """Remove an old schema version's keys (or a model version's predictions) in batches.

    Not needed for correctness: old keys expire by their TTL, and that remains the
    default. Purge frees the memory sooner, with SCAN + UNLINK in small batches
    (never KEYS or FLUSHDB); it refuses the active and next versions, and the previous
    one unless forced, and is safe to interrupt and run again.
    """

    from freshline.pipeline.cache.versions import state
    from freshline.pipeline.core.lock import Lock
    from freshline.pipeline.core.settings import load_settings
    from freshline.pipeline.deploy.pointer import retire
    from freshline.pipeline.deploy.purge import purge as purge_version
    from freshline.pipeline.deploy.purge import purgeable
    from freshline.pipeline.inference.models import purge_model

    settings = load_settings()
    client = redis_client(settings)
    result = None
    if model is None:
        if not version.isdigit():
            raise typer.BadParameter(f"a schema version is a number, got {version!r}")
        if force and state(client, settings).previous == int(version):
            lock = Lock.load(lock_path or repository_lock())
            retire(client, settings, int(version), lock, registry=active().registry)
            console.print(f"schema version {version} is no longer written: no rollback to it")
        purgeable(client, settings, int(version))
    with progress_bar() as bar:
        label = f"purge {model} {version}" if model else f"purge v{version}"
        task = bar.add_task(label, total=None)

        def report(done: int) -> None:
            bar.update(task, completed=done)

        if model is not None:
            removed = purge_model(client, model, version, count=batch, progress=report)
        else:
            result = purge_version(client, settings, int(version), count=batch, progress=report)
            removed = result.removed
    console.print(f"removed {removed:,} keys")
    if result is not None and result.retired_ms:
        # A write may have landed after the scan: the version stays retired.
        rerun = f"; purge again in {result.rerun_in_ms / 1000:,.0f} s to clear that sooner"
        console.print(
            f"schema version {version} stays retired for {result.retired_ms // 1000:,} s "
            f"(writes to it may have landed during this purge)"
            f"{rerun if result.rerun_in_ms else ''}"
        )


def register(app: typer.Typer) -> None:
    """Add the deploy commands to the ``freshline`` app."""
    app.command("check")(check)
    app.command("warm")(warm)
    app.command("purge")(purge)
    app.add_typer(deploy_app, name="deploy")
