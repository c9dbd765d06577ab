"""``freshline chaos``: run the fault-injection suite and write ``bench/CHAOS.md``.

A thin shell over :func:`freshline.pipeline.dev.chaos.run`, which runs pytest on ``tests/faults``
(from the source checkout) with the chosen profile and seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from freshline.pipeline.cli.app import console
from freshline.pipeline.core.errors import FreshlineError


def register(app: typer.Typer) -> None:
    """Add ``freshline chaos`` to the main CLI."""
    app.command("chaos")(chaos)


def chaos(
    profile: Annotated[
        str,
        typer.Option(
            help="short (CI: a few scenarios, one seed) or long (every scenario, three seeds)",
        ),
    ] = "long",
    seed: Annotated[int, typer.Option(help="Base seed: the profile runs seed, seed+1, ...")] = 1,
    scenario: Annotated[
        list[str] | None, typer.Option("--scenario", help="Run only this scenario (repeatable)")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Where to write CHAOS.md and chaos.json \\[default: bench/]")
    ] = None,
) -> None:
    """Inject real faults on a private stack under a seeded workload, and check the oracle.

    Writes one row per scenario and seed (pass/fail, mismatches, accounting, duration)
    to bench/CHAOS.md and bench/chaos.json. Exits with pytest's code.
    """
    from freshline.pipeline.dev.chaos import PROFILES, run

    root = Path(__file__).resolve().parents[2]
    if not (root / "tests" / "faults").is_dir():
        raise FreshlineError(
            "the fault-injection suite lives in the source checkout (tests/faults); run from it"
        )
    if profile not in PROFILES:
        raise typer.BadParameter(f"choose one of {', '.join(PROFILES)}", param_hint="--profile")
    target = out or root / "bench"
    code, results = run(
        root, profile_name=profile, seed=seed, out_dir=target, scenarios=scenario or ()
    )
    failed = [r for r in results if not r.passed]
    console.print(
        f"{len(results) - len(failed)} of {len(results)} cases passed; "
        f"report in {target / 'CHAOS.md'}"
    )
    for r in failed:
        console.print(f"[red]FAIL[/red] {r.scenario} seed {r.seed}: {r.failures[0]}")
    raise typer.Exit(code)
