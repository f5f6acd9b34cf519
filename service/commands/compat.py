"""`nobackfill fit`, `nobackfill eval` and `nobackfill profile show`: the offline side of the compat layer.

Heavy imports (numpy, torch, matplotlib, service.compat) happen inside the commands so `nobackfill --help`
stays fast.  Every failure is a service.errors exception, which service.cli turns into one line and exit 2;
a failing `fit` writes nothing (the profile folder appears in one rename at the very end).
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from service.errors import ArtifactError

if TYPE_CHECKING:
    from service.compat.profile import CompatProfile

PLOT_NAME = "fit_recall.png"


class Head(StrEnum):
    """Default head a profile serves."""

    slerp = "slerp"
    nlerp = "nlerp"
    adaptive = "adaptive"
    aligned = "aligned"


class FitOn(StrEnum):
    """Which paired rows R is fitted on."""

    query = "query"
    target = "target"
    both = "both"


class Modality(StrEnum):
    """Query modality the weight is chosen for."""

    text = "text"
    image = "image"


def _fmt(x: Any) -> str:
    """Table cell text: 4 decimals for floats, '-' for missing."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4f}"
    return str(x)


def _recall_table(report: dict[str, Any], title: str) -> Any:
    """Rich table of support Recall@1/5/10 per alpha for SLERP and NLERP."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("alpha", justify="right")
    for mode in ("slerp", "nlerp"):
        for k in (1, 5, 10):
            table.add_column(f"{mode} R@{k}", justify="right")
    chosen = {mode: report["chosen"][mode]["alpha"] for mode in ("slerp", "nlerp")}
    curves = report["support_recall"]
    for i, alpha in enumerate(report["alpha_grid"]):
        cells = [f"{alpha:.1f}"]
        for mode in ("slerp", "nlerp"):
            mark = "*" if chosen[mode] == alpha else ""
            cells += [f"{curves[mode][i][f'recall@{k}']:.4f}{mark if k == 1 else ''}" for k in (1, 5, 10)]
        table.add_row(*cells)
    return table


def _plot_png(report: dict[str, Any], title: str) -> bytes:
    """Recall@1 vs alpha for SLERP and NLERP, chosen weights marked, as PNG bytes (Agg backend)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        for mode, style in (("slerp", "o-"), ("nlerp", "s--")):
            rows = report["support_recall"][mode]
            ax.plot([r["alpha"] for r in rows], [r["recall@1"] for r in rows], style, label=mode)
            best = report["chosen"][mode]
            ax.axvline(best["alpha"], linestyle=":", alpha=0.5, color=ax.lines[-1].get_color())
        ax.set_xlabel("alpha (0 = old query, 1 = aligned new query)")
        ax.set_ylabel(f"support Recall@1 ({report['selection']})")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()
    finally:
        plt.close(fig)


def _refuse_existing(out: Path, force: bool) -> None:
    """An existing non-empty --out is only replaced with --force."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ArtifactError(f"{out}: exists and is not empty (use --force to replace it)")


def fit(
    support_dir: Path = typer.Argument(..., help="Folder with old_query.npy, new_query.npy, old_target.npy, ..."),
    out: Path = typer.Option(..., "--out", help="Profile folder to write."),
    head: Head = typer.Option(Head.slerp, help="Default head the profile serves."),
    fit_on: FitOn = typer.Option(FitOn.both, help="Paired rows R is fitted on."),
    folds: int = typer.Option(5, help="Cross-fitting folds for choosing alpha."),
    query_modality: Modality = typer.Option(Modality.text, help="Query modality the weight is chosen for."),
    same_set: bool = typer.Option(False, help="Paper's rule: fit R and choose alpha on the same support set."),
    old_model_id: str = typer.Option("synthetic-old", help="Old model id recorded in the profile."),
    new_model_id: str = typer.Option("synthetic-new", help="New model id recorded in the profile."),
    eval_queries: int = typer.Option(5000, min=1, help="Held-out queries scored per fold (a seeded sample)."),
    seed: int = typer.Option(0, help="Seed of the fold assignment and the query sample."),
    force: bool = typer.Option(False, help="Replace a non-empty --out."),
) -> None:
    """Fit the Procrustes map, choose the blend weights on the support set, write a compat profile."""
    from service.compat.io import load_split

    # Cheap checks first: bad arguments or files are refused before torch is even imported.
    _refuse_existing(out, force)
    split = load_split(support_dir, require_new_target=fit_on is FitOn.target)

    from rich.console import Console

    from service.compat import selection
    from service.compat.profile import CompatProfile, save_profile

    result = selection.fit(
        split,
        fit_on=fit_on.value,
        folds=folds,
        same_set=same_set,
        max_eval_queries=eval_queries,
        seed=seed,
    )
    modality = query_modality.value
    head_alpha = 1.0 if head is Head.aligned else result.params[head.value].get("alpha", result.params["adaptive"]["a"])
    profile = CompatProfile(
        head=head.value,
        old_model_id=old_model_id,
        new_model_id=new_model_id,
        old_dim=split.old_dim,
        new_dim=split.new_dim,
        alphas={modality: float(head_alpha)},
        params={modality: result.params},
        fit_on=fit_on.value,
        folds=int(result.report["folds"]),
        fit_report={**result.report, "query_modality": modality},
        tensors={"R": result.rotation},
    )
    title = f"{split.new_dim} -> {split.old_dim}, {modality} queries, fit on {fit_on.value}"
    png = _plot_png(result.report, title)
    saved = save_profile(profile, out, overwrite=force, extra_files={PLOT_NAME: png})

    console = Console(soft_wrap=True)
    console.print(_recall_table(result.report, f"support recall ({result.report['selection']}, * = chosen)"))
    ad = result.params["adaptive"]
    console.print(
        f"chosen alpha ({modality}): slerp {result.params['slerp']['alpha']:.1f}, "
        f"nlerp {result.params['nlerp']['alpha']:.1f}, "
        f"adaptive a={ad['a']:.1f} b={ad['b']:g} c_ref={ad['c_ref']:.4f}; "
        f"head {head.value} -> alpha {head_alpha:.2f}"
    )
    console.print(f"wrote profile {saved.profile_id} to {out} (plot: {out / PLOT_NAME})")


def evaluate(
    profile_dir: Path = typer.Argument(..., help="Compat profile folder."),
    test_dir: Path = typer.Argument(..., help="Test folder, same layout as the support folder."),
    query_modality: str | None = typer.Option(
        None, help="Modality whose weights to use (default: the profile's only fitted modality)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print only a JSON list of rows."),
) -> None:
    """Compare old, new, aligned, midpoint, slerp, nlerp, adaptive and the test-set oracle on a test split."""
    from service.compat.io import load_split
    from service.compat.profile import load_profile
    from service.errors import InputError

    profile = load_profile(profile_dir)
    modality = query_modality
    if modality is None:
        fitted = sorted(profile.params)
        if len(fitted) != 1:
            raise InputError(f"profile fits modalities {', '.join(fitted) or 'none'}; pick one with --query-modality")
        modality = fitted[0]
    split = load_split(test_dir, old_dim=profile.old_dim, new_dim=profile.new_dim)

    from service.compat.evaluation import COLUMNS
    from service.compat.evaluation import evaluate as run_eval

    rows = run_eval(profile, split, modality)
    if as_json:
        typer.echo(json.dumps([{c: r[c] for c in COLUMNS} for r in rows]))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"profile {profile.profile_id} on {test_dir} ({modality} queries)",
        caption="compatible: R@1 strictly above old->old; pfr/nfr vs old->old at R@1; "
        "oracle = best alpha on this test set, an upper bound, not deployable",
    )
    for c in COLUMNS:
        table.add_column(c.replace("recall", "R"), justify="left" if c == "method" else "right")
    for r in rows:
        table.add_row(*[_fmt(r[c]) for c in COLUMNS])
    Console().print(table)


def _show_text(profile: CompatProfile, directory: Path) -> None:
    """Human-readable dump of a profile and its fit report."""
    from rich.console import Console

    console = Console(soft_wrap=True)
    rep = profile.fit_report
    console.print(f"profile {profile.profile_id}  ({directory})")
    console.print(f"  head {profile.head}; modes {', '.join(profile.modes())}")
    console.print(f"  old model {profile.old_model_id} (dim {profile.old_dim})")
    console.print(f"  new model {profile.new_model_id} (dim {profile.new_dim}); R is {profile.dim}x{profile.dim}")
    console.print(
        f"  fit on {profile.fit_on} ({rep.get('fit_rows')} rows), {rep.get('selection')}, folds {profile.folds}"
    )
    console.print(
        f"  support {rep.get('support_queries')} queries / {rep.get('support_targets')} targets; "
        f"{rep.get('eval_queries')} queries scored vs {rep.get('eval_gallery')}"
    )
    console.print(f"  alphas {profile.alphas}")
    for modality, params in profile.params.items():
        for mode, p in params.items():
            console.print(f"  {modality}/{mode}: " + ", ".join(f"{k}={v:.4g}" for k, v in p.items()))
    for mode, best in rep.get("chosen", {}).items():
        recalls = ", ".join(f"R@{k} {best[f'recall@{k}']:.4f}" for k in (1, 5, 10) if f"recall@{k}" in best)
        console.print(f"  chosen {mode}: support {recalls}")
    for key in ("residual_angle_deg", "residual_angle_deg_out_of_fold"):
        if key in rep:
            stats = ", ".join(f"{k} {v:.2f}" for k, v in rep[key].items())
            console.print(f"  {key.replace('_deg', '').replace('_', ' ')} (degrees): {stats}")
    console.print(f"  tensors sha256 {profile.tensors_sha256}; created {profile.created_at}")
    if "support_recall" in rep:
        console.print(_recall_table(rep, f"support recall ({rep.get('selection')}, * = chosen)"))


def profile_show(
    profile_dir: Path = typer.Argument(..., help="Compat profile folder."),
    as_json: bool = typer.Option(False, "--json", help="Print profile.json as loaded (verified) instead."),
) -> None:
    """Show a profile: ids, dims, weights, residual angles, support recall per alpha, checksum."""
    from service.compat.profile import load_profile

    profile = load_profile(profile_dir)
    if as_json:
        typer.echo(json.dumps({"profile_id": profile.profile_id, **profile.metadata()}, indent=2))
        return
    _show_text(profile, profile_dir)
