"""`nobackfill traffic export`: the sampled (old, new) query pairs of the configured store, as a folder `fit` reads.

The store is the one the service writes (service/traffic/, settings `traffic.*`): the Redis stream when
a Redis URL is set, the local shards otherwise.  The folder is what `fit --add-query-pairs` takes
(docs/traffic-learning.md has the whole rollout: export, refit, compare, reload).
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("export")
def export(
    out: Path = typer.Option(..., "--out", help="Folder to write old_query.npy, new_query.npy and models.json into."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Export the newest N pairs (default: all)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out."),
) -> None:
    """Export the stored traffic pairs of the models served now; pairs of other models are refused."""
    from service.errors import ArtifactError, NobackfillError
    from service.settings import Settings
    from service.traffic.export import export_pairs
    from service.traffic.sampler import create_store

    settings = Settings()
    store = create_store(settings)
    try:
        done = export_pairs(store, out, limit=limit, force=force)
    except NobackfillError:
        raise
    except Exception as exc:  # redis, OSError, a malformed entry: one line, exit 2
        raise ArtifactError(f"the {store.kind} traffic store could not be read: {exc}") from exc
    finally:
        store.close()
    for models, n in done.refused.items():
        typer.echo(f"warning: refused {n} stored pair(s) of models {models} (not the newest pairs' models)", err=True)
    modalities = ", ".join(f"{n} {m}" for m, n in done.modalities.items())
    typer.echo(
        f"wrote {done.pairs} pairs ({modalities} queries) of {done.old.model_id} -> {done.new.model_id} "
        f"from the {store.kind} store to {out}"
    )


def profile_compare(
    current: Path = typer.Argument(..., help="The profile being served."),
    candidate: Path = typer.Argument(..., help="The profile that would replace it (e.g. refitted with traffic)."),
    test_dir: Path = typer.Argument(..., help="Labelled test folder (the `eval` layout)."),
    traffic: Path | None = typer.Option(
        None, "--traffic", help="Exported traffic folder: shadow agreement of the two profiles on its queries."
    ),
    query_modality: str | None = typer.Option(None, help="Modality to score (default: the current profile's one)."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as one JSON object."),
    strict: bool = typer.Option(False, help="Refuse all-zero rows instead of dropping their pairs."),
) -> None:
    """The rollout gate: exit 0 when the candidate is compatible and not worse than the current beyond noise, else 1."""
    import json

    from service.compat.compare import compare
    from service.compat.io import load_split
    from service.compat.profile import load_profile
    from service.traffic.export import load_query_pairs

    cur, cand = load_profile(current), load_profile(candidate)
    test = load_split(test_dir, old_dim=cur.old_dim, new_dim=cur.new_dim, strict=strict)
    pairs = None
    if traffic is not None:
        loaded = load_query_pairs(traffic)
        pairs = (loaded.old, loaded.new)
    result = compare(cur, cand, test, traffic=pairs, modality=query_modality)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        _print_comparison(result)
    if not result["passed"]:
        raise typer.Exit(1)


def _print_comparison(result: dict[str, object]) -> None:
    """The comparison as a table and a few lines, ending with the verdict."""
    import sys
    from typing import Any

    from rich.console import Console
    from rich.table import Table

    r: dict[str, Any] = dict(result)
    # The terminal's width, or 200 columns when piped, so the table never wraps its cells.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    if "current" in r:
        table = Table(title=f"profile compare on {r['test']} ({r['queries']} {r['modality']} queries)")
        for col in ("profile", "head", "alpha", "R@1", "R@5", "R@10", "compatible", "pfr", "nfr"):
            table.add_column(col, justify="left" if col in ("profile", "head") else "right")
        table.add_row("old->old", "old", "0", *(f"{r['old'][f'recall@{k}']:.4f}" for k in (1, 5, 10)), "-", "-", "-")
        for name in ("current", "candidate"):
            p = r[name]
            alpha = "-" if p["alpha"] is None else f"{p['alpha']:.2f}"
            recalls = [f"{p[f'recall@{k}']:.4f}" for k in (1, 5, 10)]
            table.add_row(
                f"{name} {p['profile_id'][:12]}",
                p["head"],
                alpha,
                *recalls,
                "yes" if p["compatible"] else "no",
                f"{p['pfr']:.4f}",
                f"{p['nfr']:.4f}",
            )
        console.print(table)
        d = r["difference"]
        console.print(
            f"candidate - current: R@1 {d['recall@1']:+.4f} (paired standard error {d['se@1']:.4f}); it fixes "
            f"{d['fixed']} and breaks {d['broken']} queries at R@1 (sign test, P(this many broken | equally good) = "
            f"{d['p_worse']:.2g}; worse beyond the noise below {r['p_worse']:g})"
        )
    if "traffic" in r:
        t = r["traffic"]
        angles = t["residual_angle_deg"]
        angle_text = ", ".join(
            f"{name} median {a['median']:.1f} (p95 {a['p95']:.1f})" for name, a in angles.items() if a is not None
        )
        console.print(
            f"traffic shadow ({t['pairs']} queries over {t['gallery']}): overlap@10 {t['overlap@10']:.3f} "
            f"(p5 {t['overlap@10_p5']:.2f}); residual angle, degrees: {angle_text or '-'}"
        )
    if r["passed"]:
        console.print("PASS: the candidate is compatible and not worse than the current profile beyond the noise")
    else:
        for reason in r["reasons"]:
            console.print(f"FAIL: {reason}")
