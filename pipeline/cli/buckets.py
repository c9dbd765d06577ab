"""``freshline buckets build | fold | status | prune`` and ``freshline reconcile``: the
active repository's incremental paths (:mod:`freshline.pipeline.core.incremental`).

``buckets build`` fills the partial aggregates for rows that existed before the path
did, a batch of keys per transaction, with a progress bar; interrupted (Ctrl-C, a
crash), it resumes after the last committed batch. ``buckets fold`` applies the pending
changes to the aggregates (the consumers do it too, every
``FRESHLINE_BUCKET_FOLD_INTERVAL_MS``). ``reconcile`` compares the incremental path
with the full one on sampled entities and repairs drifted aggregates. ``buckets prune``
drops the derived paths the repository no longer declares. (A declared
aggregation's derived path, such as the fraud example's ``txn_90d``, keeps per-day
partials and a log of changed days: :mod:`freshline.pipeline.core.maintenance`.)
"""

from __future__ import annotations

from functools import partial
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text
from sqlalchemy.engine import Engine

from freshline.pipeline.cli.app import console, out, progress_bar
from freshline.pipeline.core.errors import ConfigError
from freshline.pipeline.core.incremental import IncrementalPath

buckets_app = typer.Typer(help="Partial aggregates for the incremental path.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add ``freshline buckets ...`` and ``freshline reconcile`` to the main CLI."""
    app.add_typer(buckets_app, name="buckets")
    app.command("reconcile")(reconcile_cmd)


def _engine() -> Engine:
    from freshline.pipeline.core.db import make_engine, ping
    from freshline.pipeline.core.settings import load_settings

    engine = make_engine(load_settings())
    ping(engine)
    return engine


def _paths(feature_set: str | None) -> list[tuple[str, IncrementalPath]]:
    """The repository's incremental paths, each with the feature sets it serves (or the
    one of ``feature_set``)."""
    from freshline.pipeline.core.repository import active

    found = [
        (", ".join(fs.name for fs in active().registry if fs.maintenance is path), path)
        for path in active().registry.maintenances()
    ]
    if not found:
        raise ConfigError("this repository has no incremental path: nothing to build or fold")
    if feature_set is None:
        return found
    chosen = [(name, path) for name, path in found if feature_set in name.split(", ")]
    if not chosen:
        names = ", ".join(name for name, _ in found)
        raise typer.BadParameter(
            f"{feature_set!r} has no incremental path (those with one: {names})",
            param_hint="--set",
        )
    return chosen


FeatureSetOption = Annotated[
    str | None,
    typer.Option("--set", help="Only this feature set's path \\[default: every path]"),
]


@buckets_app.command("build")
def build_cmd(
    batch: Annotated[
        int, typer.Option("--batch", min=1, max=100_000, help="Users per transaction")
    ] = 2000,
    restart: Annotated[
        bool,
        typer.Option(
            "--restart", help="Rebuild every entity's buckets, not only those not yet built"
        ),
    ] = False,
    feature_set: FeatureSetOption = None,
) -> None:
    """Build the buckets of existing rows, in batches; safe to interrupt and resume.

    Each batch holds the path's lock on its source table while it runs (SHARE mode, so
    writers wait for it; a batch takes well under a second). A declared aggregation's
    path is built whole by ``freshline apply --alter-tables``: nothing is left here.
    """
    engine = _engine()
    for name, path in _paths(feature_set):
        if restart:
            path.restart(engine)
        st = path.state(engine, count=True)
        if st.complete:
            console.print(f"buckets of {name}: complete, nothing to build")
            continue
        where = f", resuming after {st.cursor[0]}/{st.cursor[1]}" if st.cursor else ""
        console.print(f"buckets of {name}: {st.remaining:,} entities to build{where}")
        with progress_bar() as bar:
            task = bar.add_task(name, total=st.remaining)
            built = path.build(engine, batch=batch, progress=partial(bar.advance, task))
        console.print(f"buckets of {name}: built {built:,} entities; complete")


@buckets_app.command("fold")
def fold_cmd(
    entities: Annotated[
        int, typer.Option("--entities", min=1, max=1_000_000, help="Entities per transaction")
    ] = 1000,
    follow: Annotated[
        bool,
        typer.Option("--follow", help="Keep folding every --interval seconds until interrupted"),
    ] = False,
    interval: Annotated[
        float,
        typer.Option("--interval", min=0.05, max=3600, help="Seconds between folds with --follow"),
    ] = 1.0,
    feature_set: FeatureSetOption = None,
) -> None:
    """Fold the pending bucket deltas into the buckets, a batch of entities per transaction.

    Values are the same before and after (the incremental path reads pending deltas
    too); folding keeps that read short. Safe beside the consumers' own folds: one
    fold runs at a time.
    """
    import time

    engine, paths = _engine(), _paths(feature_set)
    for name, path in paths:
        deltas, owners = path.pending(engine)
        console.print(f"buckets of {name}: {deltas:,} pending deltas of {owners:,} entities")
        with progress_bar() as bar:
            task = bar.add_task(name, total=owners)
            folded = path.fold_all(engine, max_keys=entities, progress=partial(bar.advance, task))
        console.print(f"buckets of {name}: folded the deltas of {folded:,} entities")
    try:
        while follow:
            time.sleep(interval)  # the cadence of the follow loop, not synchronisation
            for _, path in paths:
                path.fold_all(engine, max_keys=entities)
    except KeyboardInterrupt:
        console.print("buckets: stopped")


@buckets_app.command("status")
def status_cmd(feature_set: FeatureSetOption = None) -> None:
    """Per incremental path: whether its buckets cover every entity, their size, and
    the changes not yet folded."""

    engine = _engine()
    report = Table.grid(padding=(0, 1, 0, 0))
    report.add_column(min_width=9)
    report.add_column(overflow="fold")
    for name, path in _paths(feature_set):
        report.add_row("path", Text(name))
        st = path.state(engine, count=True)
        if st.complete:
            report.add_row("build", "complete")
        else:
            where = f" after {st.cursor[0]}/{st.cursor[1]}" if st.cursor else ""
            report.add_row(
                "build", f"{st.remaining:,} entities left{where} (run: freshline buckets build)"
            )
        summary = path.summary(engine)
        if summary:
            report.add_row(Text(path.name), Text(summary))
        deltas, owners = path.pending(engine)
        report.add_row(
            "pending",
            f"{deltas:,} deltas of {owners:,} entities"
            + (" (folded by the consumers, or: freshline buckets fold)" if deltas else ""),
        )
    out.print(report)


@buckets_app.command("prune")
def prune_cmd(
    yes: Annotated[
        bool, typer.Option("--yes", help="Drop them (without it: list them only)")
    ] = False,
) -> None:
    """Drop the derived paths this repository no longer declares: those of an earlier
    schema version or an earlier freshline. Their triggers keep logging every write
    until dropped. Run it once no running consumer or API of an older version reads
    them (after a deploy's old version is gone)."""
    from freshline.pipeline.core.maintenance import DerivedPath, superseded
    from freshline.pipeline.core.repository import active

    engine = _engine()
    keep = [p for p in active().registry.maintenances() if isinstance(p, DerivedPath)]
    with engine.begin() as conn:
        found = superseded(conn, keep)
        if not found:
            console.print("buckets: no derived path to prune")
            return
        report = Table.grid(padding=(0, 1, 0, 0))
        report.add_column()
        report.add_column(overflow="fold")
        for item in found:
            on = sorted({table for _, table in item.triggers})
            report.add_row(
                Text(item.prefix),
                Text(
                    f"{len(item.tables)} tables, {len(item.triggers)} triggers on "
                    f"{', '.join(on) or 'no table'}, {item.logged:,} logged rows"
                ),
            )
        out.print(report)
        if not yes:
            console.print("buckets: not dropped (run again with --yes to drop them)")
            return
        for item in found:
            item.drop(conn)
    console.print(f"buckets: dropped {len(found)} derived path(s)")


def reconcile_cmd(
    sample: Annotated[
        int, typer.Option("--sample", min=1, max=1_000_000, help="Random entities to compare")
    ] = 1000,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Sample only this tenant")] = None,
    repair: Annotated[
        bool, typer.Option("--repair/--no-repair", help="Rebuild the buckets of drifted entities")
    ] = True,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, max=10_000)] = 500,
) -> None:
    """Compare the incremental path with the full one on sampled entities; repair drift.

    Both paths run on one snapshot per batch, so a difference is drift, never a race.
    Exit status 1 when drift remains after repair (or was found, with --no-repair).
    """
    from freshline.pipeline.core.keys import validate_id
    from freshline.pipeline.observe.reconcile import ReconcileReport, reconcile
    from freshline.pipeline.observe.reconcile import sample as draw

    if tenant is not None:
        try:
            validate_id("tenant", tenant)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--tenant") from exc
    from freshline.pipeline.core.repository import active

    engine = _engine()
    registry = active().registry
    entities = list(dict.fromkeys(fs.entity for fs in registry if fs.incremental is not None))
    drawn = [(entity, draw(engine, entity, sample, tenant=tenant)) for entity in entities]
    if not any(refs for _, refs in drawn):
        raise ConfigError("no entities to sample" + (f" in tenant {tenant}" if tenant else ""))
    total = ReconcileReport()
    with progress_bar() as bar:
        task = bar.add_task("reconcile", total=sum(len(refs) for _, refs in drawn))
        for entity, refs in drawn:
            for i in range(0, len(refs), batch_size):
                chunk = refs[i : i + batch_size]
                report = reconcile(
                    engine, chunk, repair=repair, entity=entity, registry=active().registry
                )
                total.checked += report.checked
                total.drifted += report.drifted
                total.repaired += report.repaired
                total.still_drifted += report.still_drifted
                bar.advance(task, len(chunk))
    out.print(f"checked   {total.checked:,} entities")
    out.print(f"drifted   {len(total.drifted):,}")
    for d in total.drifted[:20]:
        fields = ", ".join(f"{k} {v[0]!r} != {v[1]!r}" for k, v in d.fields.items())
        out.print(f"  {d.feature_set} {d.tenant}/{d.entity}: {fields}"[:80])
    if repair:
        out.print(f"repaired  {total.repaired:,}")
    if total.still_drifted:
        raise typer.Exit(1)
