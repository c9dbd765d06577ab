"""``freshline semantic stats | purge | tune``: the semantic response cache.

Each needs the ``freshline[semantic]`` extra; without it, one line says how to install it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from freshline.pipeline.cli.app import console, out
from freshline.pipeline.core.services import redis_client
from freshline.pipeline.core.settings import load_settings
from freshline.pipeline.semantic.extra import require_extra

semantic_app = typer.Typer(
    help="The semantic response cache for LLM pipelines.", no_args_is_help=True
)


@semantic_app.callback()
def _installed() -> None:
    require_extra("freshline semantic")


def register(app: typer.Typer) -> None:
    """Add ``freshline semantic ...`` to the main CLI."""
    app.add_typer(semantic_app, name="semantic")


@semantic_app.command("stats")
def stats(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Live entries, hit rate, explorations, estimated and observed error, stores,
    evictions, flagged hits and refusals per namespace."""

    from freshline.pipeline.semantic.namespaces import stats as namespace_stats

    settings = load_settings()
    client = redis_client(settings)
    rows = namespace_stats(client, tenant, model)
    if json_out:
        typer.echo(
            json.dumps(
                [
                    {
                        "tenant": r.tenant,
                        "model": r.model,
                        "model_version": r.model_version,
                        "template_version": r.template_version,
                        "entries": r.entries,
                        "hit_rate": r.hit_rate,
                        "exploration_rate": r.exploration_rate,
                        "estimated_error": r.estimated_error,
                        "observed_error": r.observed_error,
                        "audited_error": r.audited_error,
                        **r.counts,
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return
    if not rows:
        console.print(
            "no semantic cache entries or counters"
            + (" for that selection" if tenant or model else "")
        )
        return

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    for r in rows:
        rate = pct(r.hit_rate)
        c = r.counts
        out.print(
            Text.assemble(
                (f"{r.tenant} {r.model}", "bold"),
                f"  version {r.model_version}, template {r.template_version}",
            )
        )
        out.print(
            f"  {r.entries:,} entries; hit rate {rate} ({c['hits']:,} hits, {c['misses']:,} misses)"
        )
        out.print(
            f"  explored {pct(r.exploration_rate)} of lookups ({c['explored']:,}, "
            f"{c['audited']:,} audits); labels {c['right']:,} right, {c['wrong']:,} wrong"
        )
        audits = c["audit_right"] + c["audit_wrong"]
        out.print(
            f"  error of hits: estimated {pct(r.estimated_error)}, flagged "
            f"{pct(r.observed_error)}, audited {pct(r.audited_error)} ({audits:,} labelled)"
        )
        out.print(
            f"  {c['stored']:,} stored, {c['evicted']:,} evicted (the oldest, over the limit)"
        )
        out.print(f"  {c['flagged']:,} flagged, {c['refused']:,} refused (not deterministic)")


@semantic_app.command("purge")
def purge(
    tenant: Annotated[str | None, typer.Option(help="Every entry of this tenant")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model")] = None,
    model_version: Annotated[str | None, typer.Option(help="Only this model version")] = None,
    template_version: Annotated[
        str | None, typer.Option(help="Only this prompt-template version")
    ] = None,
) -> None:
    """Remove the matching entries (SCAN + UNLINK in batches); every worker's index
    empties through the namespace's stream. Give a tenant, a version, or both."""

    from freshline.pipeline.semantic.namespaces import purge_keys

    if not (tenant or model_version or template_version):
        raise typer.BadParameter(
            "give --tenant, --model-version or --template-version (with --model to narrow)",
            param_hint="--tenant",
        )
    settings = load_settings()
    client = redis_client(settings)
    removed = purge_keys(
        client,
        tenant=tenant,
        model=model,
        model_version=model_version,
        template_version=template_version,
    )
    if not removed:
        console.print("nothing to purge")
        return
    for ns, n in sorted(removed.items()):
        out.print(f"{ns}: {n:,} keys removed")
    out.print(f"purged {len(removed)} namespace(s), {sum(removed.values()):,} keys")


# long: the signature is the command's option table; its body is 58 lines
@semantic_app.command("tune")
def tune(
    pairs: Annotated[
        Path | None, typer.Option(help="Labelled pairs (JSON) \\[default: the shipped set]")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Mark this model's configured threshold \\[default: the default threshold]"
        ),
    ] = None,
    show_false_hits: Annotated[
        bool, typer.Option(help="List the different pairs that would hit at the marked threshold")
    ] = False,
    write_prior: Annotated[
        Path | None,
        typer.Option(
            help="Fit the learned decision's prior for the embedding model on these pairs "
            "and write it here (then set FRESHLINE_SEMANTIC_PRIOR to it)"
        ),
    ] = None,
) -> None:
    """Hit rate and false-hit rate at each threshold from 0.85 to 0.97, and where the
    learned decision starts a fresh entry."""
    from freshline.pipeline.semantic import prior as priors
    from freshline.pipeline.semantic.decision import Learned
    from freshline.pipeline.semantic.embed import embedder_from_settings
    from freshline.pipeline.semantic.tune import PAIRS, false_hits, load_pairs, similarities, sweep

    settings = load_settings()
    path = pairs or PAIRS
    labelled = load_pairs(path)
    paraphrases = sum(p.label == "paraphrase" for p in labelled)
    embedder = embedder_from_settings(
        settings.semantic_embeddings_url,
        settings.semantic_embeddings_model,
        settings.semantic_embeddings_api_key.get_secret_value(),
    )
    console.print(
        f"embedding {len(labelled)} pairs ({paraphrases} paraphrases, "
        f"{len(labelled) - paraphrases} different) with {embedder.name} ..."
    )
    sims = similarities(embedder, labelled)
    static = settings.semantic_decision == "static"
    current = settings.semantic_threshold_for(model) if model else settings.semantic_threshold
    out.print(f"pairs: {path}")
    out.print("threshold   hit rate   false hits   (similarity alone)")
    for row in sweep(labelled, sims):
        mark = "  <- configured" if static and abs(row.threshold - current) < 1e-9 else ""
        out.print(
            f"     {row.threshold:.2f}     {row.hit_rate:6.1%}     "
            f"{row.false_hit_rate:6.1%}           {row.unguarded_false_hit_rate:6.1%}"
            f"{mark}"
        )
    out.print(
        "hit rate: paraphrases served; false hits: different questions served "
        "(numbers must match, as the cache checks); similarity alone: without "
        "that check"
    )
    fitted = None
    if write_prior is not None:
        fitted = priors.fit(embedder.name, labelled, sims)
        write_prior.write_bytes(fitted.to_json() + b"\n")
        out.print(
            f"prior for {fitted.embedding_model}: ceiling mean {fitted.mean:.3f}, sd "
            f"{fitted.sd:.3f} ({fitted.pairs} pairs in {fitted.groups} groups) -> {write_prior}"
        )
    if not static:
        try:
            prior = fitted or priors.for_model(embedder.name, settings.semantic_prior)
        except priors.InvalidPrior as exc:
            console.print(f"learned decision: {exc}")
            return
        learned = Learned(prior, settings.semantic_max_error)
        current = learned.start
        out.print(
            f"learned decision (max error {settings.semantic_max_error:.1%}): a fresh entry "
            f"is served from {learned.start:.3f}, then each from its own outcomes"
        )
    if show_false_hits:
        for pair, sim in false_hits(labelled, sims, current):
            out.print(f"{sim:.3f}  {pair.a!r} / {pair.b!r}")
