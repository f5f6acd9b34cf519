"""`nobackfill fit`, `nobackfill eval` and `nobackfill profile show`: the offline side of the compat layer.

Heavy imports (numpy, torch, matplotlib, service.compat) happen inside the commands so `nobackfill --help`
stays fast.  Every failure is a service.errors exception, which service.cli turns into one line and exit 2;
a failing `fit` writes nothing (the profile folder appears in one rename at the very end).

`fit --head` picks the family:
- slerp / nlerp / adaptive / aligned: Procrustes R plus every blend weight, cross-fitted.
- adapter: the MKP adapter trained on the support pairs (--fit-on picks query / target / both rows).
- adapter+slerp: the adapter, plus SLERP's weight between the old query and the adapter's output,
  cross-fitted: one adapter per fold on the other folds, then one on everything (folds + 1 trainings).
- psp / lsp: SUPPORT_DIR holds LOGITS (old_query.npy: old-model logits of the queries [n, C_k],
  new_query.npy: new-model logits [n, C_t], old_target.npy: old-model logits of gallery items).  The
  fit is data-free apart from the class counts: P_tk depends on C_k, C_t and the class map only.  The
  logits are used for the class counts and to score the head on the support set for the report.

The model ids (and identities: backend, weights fingerprint, dim) come from SUPPORT_DIR/models.json,
which `nobackfill support build` writes; --old-model-id / --new-model-id override them.  With
neither, the synthetic world's names are recorded and a warning says they were guessed.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import typer

from service.errors import ArtifactError

if TYPE_CHECKING:
    from service.compat.io import Split
    from service.compat.profile import CompatProfile

PLOT_NAME = "fit_recall.png"


class Head(StrEnum):
    """Default head a profile serves."""

    slerp = "slerp"
    nlerp = "nlerp"
    adaptive = "adaptive"
    aligned = "aligned"
    adapter = "adapter"
    adapter_slerp = "adapter+slerp"
    psp = "psp"
    lsp = "lsp"


ADAPTER_HEADS = (Head.adapter, Head.adapter_slerp)
CLASS_HEADS = (Head.psp, Head.lsp)


class ModelIds(NamedTuple):
    """The model ids a profile records, and the two identities (ModelIdentity.as_dict) when known."""

    old: str
    new: str
    record: dict[str, Any] | None


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
    """Rich table of support Recall@1/5/10 per alpha for every curve in the report (SLERP, NLERP, ...)."""
    from rich.table import Table

    curves = report["support_recall"]
    table = Table(title=title)
    table.add_column("alpha", justify="right")
    for mode in curves:
        for k in (1, 5, 10):
            table.add_column(f"{mode} R@{k}", justify="right")
    chosen = {mode: report["chosen"][mode]["alpha"] for mode in curves}
    for i, alpha in enumerate(report["alpha_grid"]):
        cells = [f"{alpha:.1f}"]
        for mode in curves:
            mark = "*" if chosen[mode] == alpha else ""
            cells += [f"{curves[mode][i][f'recall@{k}']:.4f}{mark if k == 1 else ''}" for k in (1, 5, 10)]
        table.add_row(*cells)
    return table


def _plot_png(report: dict[str, Any], title: str) -> bytes:
    """Recall@1 vs alpha for every support curve, chosen weights marked, as PNG bytes (Agg backend)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        for mode, style in zip(report["support_recall"], ("o-", "s--", "^-."), strict=False):
            rows = report["support_recall"][mode]
            ax.plot([r["alpha"] for r in rows], [r["recall@1"] for r in rows], style, label=mode)
            best = report["chosen"][mode]
            ax.axvline(best["alpha"], linestyle=":", alpha=0.5, color=ax.lines[-1].get_color())
        ax.set_xlabel("alpha (0 = old query, 1 = mapped new query)")
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


def _adapter_overrides(**given: Any) -> dict[str, Any]:
    """The adapter options the user set (None = keep AdapterConfig's default)."""
    return {k: v for k, v in given.items() if v is not None}


def _parse_class_map(text: str | None) -> list[int] | None:
    """'3,0,1' -> [3, 0, 1]; None stays None."""
    from service.errors import InputError

    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise InputError(f"--class-map must be comma-separated integers, got {text!r}") from exc


def _check_head_options(head: Head, adapter: dict[str, Any], classes: dict[str, Any]) -> None:
    """Refuse options that the chosen head would silently ignore."""
    from service.errors import InputError

    if adapter and head not in ADAPTER_HEADS:
        names = ", ".join("--" + k.replace("_", "-") for k in adapter)
        raise InputError(f"{names} only apply to --head adapter / adapter+slerp, not {head.value}")
    if classes and head not in CLASS_HEADS:
        names = ", ".join("--" + k.replace("_", "-") for k in classes)
        raise InputError(f"{names} only apply to --head psp / lsp, not {head.value}")


def _model_ids(support_dir: Path, split: Split, old_id: str | None, new_id: str | None) -> ModelIds:
    """Ids from SUPPORT_DIR/models.json (written by `support build`), the given ones overriding them.

    Without models.json and without an id the synthetic world's name is recorded, with a warning: the
    service compares these ids with its encoders', so a guessed id is worth a word.
    """
    from dataclasses import replace

    from service.encoders.identity import MODELS_JSON, read_models_json
    from service.errors import InputError

    found = read_models_json(support_dir)
    if found is None:
        guessed = [f"--{side}-model-id" for side, given in (("old", old_id), ("new", new_id)) if given is None]
        if guessed:
            typer.echo(
                f"warning: no {support_dir / MODELS_JSON} and no {' / '.join(guessed)}: "
                "recording the guessed ids synthetic-old / synthetic-new",
                err=True,
            )
        return ModelIds(old_id or "synthetic-old", new_id or "synthetic-new", None)
    old, new = found
    for identity, dim, side in ((old, split.old_dim, "old"), (new, split.new_dim, "new")):
        if identity.dim != dim:
            raise InputError(
                f"{support_dir / MODELS_JSON}: the {side} model is {identity.dim}-d, "
                f"but {side}_query.npy holds {dim}-d rows"
            )
    old = replace(old, model_id=old_id) if old_id else old
    new = replace(new, model_id=new_id) if new_id else new
    return ModelIds(old.model_id, new.model_id, {"old": old.as_dict(), "new": new.as_dict()})


def fit(
    support_dir: Path = typer.Argument(..., help="Folder with old_query.npy, new_query.npy, old_target.npy, ..."),
    out: Path = typer.Option(..., "--out", help="Profile folder to write."),
    head: Head = typer.Option(Head.slerp, help="Default head the profile serves."),
    fit_on: FitOn = typer.Option(FitOn.both, help="Paired rows R (or the adapter) is fitted on."),
    folds: int = typer.Option(5, help="Cross-fitting folds for choosing alpha."),
    query_modality: Modality = typer.Option(Modality.text, help="Query modality the weight is chosen for."),
    same_set: bool = typer.Option(False, help="Paper's rule: fit the map and choose alpha on the same support set."),
    old_model_id: str | None = typer.Option(
        None, help="Old model id to record (default: SUPPORT_DIR/models.json's, else synthetic-old)."
    ),
    new_model_id: str | None = typer.Option(
        None, help="New model id to record (default: SUPPORT_DIR/models.json's, else synthetic-new)."
    ),
    eval_queries: int = typer.Option(5000, min=1, help="Held-out queries scored per fold (a seeded sample)."),
    seed: int = typer.Option(0, help="Seed of the fold assignment, the query sample and the adapter."),
    force: bool = typer.Option(False, help="Replace a non-empty --out."),
    epochs: int | None = typer.Option(None, min=1, help="Adapter: training epochs [AdapterConfig: 10]."),
    hidden: int | None = typer.Option(None, min=1, help="Adapter: hidden width [AdapterConfig: the input dim]."),
    batch_size: int | None = typer.Option(None, min=3, help="Adapter: batch size [AdapterConfig: 256]."),
    lr: float | None = typer.Option(None, min=0.0, help="Adapter: AdamW learning rate [AdapterConfig: 1e-3]."),
    weight_decay: float | None = typer.Option(None, min=0.0, help="Adapter: weight decay [AdapterConfig: 1e-4]."),
    dropout: float | None = typer.Option(None, min=0.0, help="Adapter: dropout [AdapterConfig: 0.1]."),
    lam: float | None = typer.Option(None, min=0.0, help="Adapter: preservation loss weight [AdapterConfig: 1]."),
    device: str | None = typer.Option(None, help="Adapter: auto / cpu / cuda:N [AdapterConfig: auto]."),
    precision: str | None = typer.Option(None, help="Adapter: auto / bf16 / fp32 [AdapterConfig: auto]."),
    threads: int | None = typer.Option(None, min=1, help="Torch CPU threads while training [torch's default]."),
    old_classes: int | None = typer.Option(
        None, min=2, help="psp / lsp: the old model's classes C_k [the width of old_query.npy]."
    ),
    top_k: int | None = typer.Option(None, min=1, help="psp / lsp: keep the k largest entries per row [all]."),
    class_map: str | None = typer.Option(
        None, help="psp / lsp: new-model output index of each old class, comma-separated [identity]."
    ),
) -> None:
    """Fit a compat profile on a support set: Procrustes + blends, the MKP adapter (+ SLERP), or PSP / LSP."""
    from service.compat.io import load_split

    adapter_opts = _adapter_overrides(
        epochs=epochs,
        hidden=hidden,
        batch_size=batch_size,
        lr=lr,
        weight_decay=weight_decay,
        dropout=dropout,
        lam=lam,
        device=device,
        precision=precision,
        threads=threads,
    )
    class_opts = {
        k: v for k, v in {"old_classes": old_classes, "top_k": top_k, "class_map": class_map}.items() if v is not None
    }
    # Cheap checks first: bad arguments or files are refused before torch is even imported.
    _check_head_options(head, adapter_opts, class_opts)
    _refuse_existing(out, force)
    split = load_split(support_dir, require_new_target=fit_on is FitOn.target and head not in CLASS_HEADS)
    ids = _model_ids(support_dir, split, old_model_id, new_model_id)
    if head in CLASS_HEADS:
        _fit_classes(split, out, head, ids, old_classes, top_k, _parse_class_map(class_map), force)
        return
    if head in ADAPTER_HEADS:
        threads_opt = adapter_opts.pop("threads", None)
        _fit_adapter(
            split,
            out,
            head,
            ids,
            adapter_opts,
            threads_opt,
            fit_on=fit_on.value,
            folds=folds,
            same_set=same_set,
            eval_queries=eval_queries,
            seed=seed,
            modality=query_modality.value,
            force=force,
        )
        return

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
        old_model_id=ids.old,
        new_model_id=ids.new,
        models=ids.record,
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


def _fit_adapter(
    split: Split,
    out: Path,
    head: Head,
    ids: ModelIds,
    overrides: dict[str, Any],
    threads: int | None,
    *,
    fit_on: str,
    folds: int,
    same_set: bool,
    eval_queries: int,
    seed: int,
    modality: str,
    force: bool,
) -> None:
    """--head adapter / adapter+slerp: train the MKP adapter (cross-fitting alpha for adapter+slerp), save."""
    import sys

    import torch
    from rich.console import Console

    from service.compat import selection
    from service.compat.adapter import AdapterConfig, TrainedAdapter, train_adapter
    from service.compat.profile import CompatProfile, save_profile
    from service.errors import InputError

    try:
        config = AdapterConfig(**{**overrides, "seed": seed})
    except ValueError as exc:
        raise InputError(f"adapter options: {exc}") from exc
    progress = sys.stderr.isatty()

    def fit_map(new: selection.F32, old: selection.F32) -> TrainedAdapter:
        return train_adapter(new, old, config, progress=progress)

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if head is Head.adapter:
            new, old, blocks = selection.support_pairs(split, fit_on)  # type: ignore[arg-type]
            adapter = fit_map(new, old)
            report: dict[str, Any] = {
                "selection": "none (the adapter head has no weight to choose)",
                "folds": 0,
                "fit_on": fit_on,
                "fit_blocks": blocks,
                "fit_rows": len(new),
                "support_queries": len(split.old_query),
                "support_targets": len(split.old_target),
            }
            alphas, params = {modality: 1.0}, {}
        else:
            result = selection.fit_mapped_slerp(
                split,
                fit_map,
                mode=head.value,
                fit_on=fit_on,  # type: ignore[arg-type]
                folds=folds,
                same_set=same_set,
                max_eval_queries=eval_queries,
                seed=seed,
            )
            adapter, report = result.mapper, result.report
            alphas = {modality: result.alpha}
            params = {modality: {head.value: {"alpha": result.alpha}}}
    finally:
        torch.set_num_threads(before)
    profile = CompatProfile(
        head=head.value,
        old_dim=split.old_dim,
        new_dim=split.new_dim,
        alphas=alphas,
        params=params,
        fit_on=fit_on,
        folds=int(report["folds"]),
        fit_report={**report, "query_modality": modality},
        tensors={k: v.numpy() for k, v in adapter.state_dict_tensors().items()},
        adapter=adapter.meta(),
        old_model_id=ids.old,
        new_model_id=ids.new,
        models=ids.record,
    )
    extra = {}
    if "support_recall" in report:
        title = f"{split.new_dim} -> {split.old_dim} adapter, {modality} queries, fit on {fit_on}"
        extra[PLOT_NAME] = _plot_png(report, title)
    saved = save_profile(profile, out, overwrite=force, extra_files=extra)

    console = Console(soft_wrap=True)
    if "support_recall" in report:
        console.print(_recall_table(report, f"support recall ({report['selection']}, * = chosen)"))
        console.print(f"chosen alpha ({modality}): {head.value} {alphas[modality]:.1f}")
    last = adapter.report.get("history", [{}])[-1]
    console.print(
        f"adapter {split.new_dim} -> {adapter.hidden} -> {split.old_dim}: {adapter.report.get('pairs')} pairs, "
        f"{adapter.report.get('steps')} steps, {adapter.report.get('seconds')} s on {adapter.report.get('device')}, "
        f"final loss {last.get('total', float('nan')):.4f}"
    )
    console.print(f"wrote profile {saved.profile_id} to {out}" + (f" (plot: {out / PLOT_NAME})" if extra else ""))


def _fit_classes(
    split: Split,
    out: Path,
    head: Head,
    ids: ModelIds,
    old_classes: int | None,
    top_k: int | None,
    class_map: list[int] | None,
    force: bool,
) -> None:
    """--head psp / lsp: P_tk from the class counts alone; the support logits only feed the report."""
    import math

    import numpy as np
    from rich.console import Console

    from service.compat import psp
    from service.compat.evaluation import evaluate as run_eval
    from service.compat.profile import CompatProfile, save_profile
    from service.errors import InputError

    c_old, c_new = split.old_dim, split.new_dim
    if old_classes is not None and old_classes != c_old:
        raise InputError(
            f"{split.path / 'old_query.npy'}: {c_old} columns (old-model logits), but --old-classes is {old_classes}"
        )
    try:
        p_tk = psp.correction_matrix(c_old, c_new, class_map)
        rotation = psp.prototype_rotation(c_old, c_new)
    except ValueError as exc:
        raise InputError(f"{split.path}: {exc} (old logits have {c_old} columns, new logits {c_new})") from exc
    classes = {"old_classes": c_old, "new_classes": c_new, "top_k": top_k, "class_map": class_map}
    report: dict[str, Any] = {
        "selection": "none (data-free: P_tk depends on the class counts only)",
        "folds": 0,
        "support_queries": len(split.old_query),
        "support_targets": len(split.old_target),
        "prototype_rotation_deg": math.degrees(rotation),
    }
    profile = CompatProfile(
        head=head.value,
        old_dim=c_old,
        new_dim=c_new,
        alphas={},
        params={},
        fit_on="none",
        folds=0,
        fit_report=report,
        tensors={"P_tk": p_tk.astype(np.float32)},
        classes=classes,
        old_model_id=ids.old,
        new_model_id=ids.new,
        models=ids.record,
    )
    # The support logits only describe the result (no parameter is chosen on them).
    report["support_eval"] = run_eval(profile, split, "text")
    saved = save_profile(profile, out, overwrite=force)

    console = Console(soft_wrap=True)
    console.print(_eval_table(report["support_eval"], f"{head.value} on the support logits ({split.path})", None))
    console.print(
        f"{head.value}: {c_old} old classes -> {c_new} new classes, top_k {top_k or 'all'}, "
        f"class map {class_map or 'identity'}; old prototypes turn by {math.degrees(rotation):.2f} degrees, "
        "undone by P_tk"
    )
    console.print(f"wrote profile {saved.profile_id} to {out}")


def _eval_table(rows: list[dict[str, Any]], title: str, caption: str | None) -> Any:
    """Rich table of evaluation rows, one column per COLUMNS key."""
    from rich.table import Table

    from service.compat.evaluation import COLUMNS

    table = Table(title=title, caption=caption)
    for c in COLUMNS:
        table.add_column(c.replace("recall", "R"), justify="left" if c == "method" else "right")
    for r in rows:
        table.add_row(*[_fmt(r[c]) for c in COLUMNS])
    return table


_CAPTIONS = {
    "procrustes": "compatible: R@1 strictly above old->old; pfr/nfr vs old->old at R@1; "
    "oracle = best alpha on this test set, an upper bound, not deployable",
    "adapter": "compatible: R@1 strictly above old->old; pfr/nfr vs old->old at R@1",
    "classes": "gallery = the old model's {head} features of old_target; compatible / pfr / nfr vs old->old, "
    "except new-logits: vs old-logits (raw normalised logits on both sides, the baseline {head} replaces)",
}


def evaluate(
    profile_dir: Path = typer.Argument(..., help="Compat profile folder."),
    test_dir: Path = typer.Argument(..., help="Test folder, same layout as the support folder (logits for psp / lsp)."),
    query_modality: str | None = typer.Option(
        None, help="Modality whose weights to use (default: the profile's only fitted modality)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print only a JSON list of rows."),
) -> None:
    """Compare every head the profile has with old->old (and new->new) on a test split, with flips."""
    from service.compat.io import load_split
    from service.compat.profile import ADAPTER_HEADS as ADAPTER_FAMILY
    from service.compat.profile import CLASS_HEADS as CLASS_FAMILY
    from service.compat.profile import load_profile
    from service.errors import InputError

    profile = load_profile(profile_dir)
    modality = query_modality
    if modality is None:
        # psp / lsp weigh nothing per modality: any name will do.
        fitted = sorted(profile.params) or sorted(profile.alphas) or ["text"]
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

    family = (
        "classes" if profile.head in CLASS_FAMILY else "adapter" if profile.head in ADAPTER_FAMILY else "procrustes"
    )
    caption = _CAPTIONS[family].format(head=profile.head)
    title = f"profile {profile.profile_id} ({profile.head}) on {test_dir} ({modality} queries)"
    Console().print(_eval_table(rows, title, caption))


def _show_text(profile: CompatProfile, directory: Path) -> None:
    """Human-readable dump of a profile and its fit report, whatever its head."""
    from rich.console import Console

    from service.compat.profile import ADAPTER_HEADS as ADAPTER_FAMILY
    from service.compat.profile import CLASS_HEADS as CLASS_FAMILY

    console = Console(soft_wrap=True)
    rep = profile.fit_report
    console.print(f"profile {profile.profile_id}  ({directory})")
    console.print(f"  head {profile.head}; modes {', '.join(profile.modes())}")
    console.print(f"  old model {profile.old_model_id} (dim {profile.old_dim})")
    if profile.head in CLASS_FAMILY:
        _show_classes(console, profile)
    elif profile.head in ADAPTER_FAMILY:
        _show_adapter(console, profile)
    else:
        console.print(f"  new model {profile.new_model_id} (dim {profile.new_dim}); R is {profile.dim}x{profile.dim}")
    for side, identity in (profile.models or {}).items():
        console.print(
            f"  {side} model identity: backend {identity.get('backend')}, fingerprint {identity.get('fingerprint')}"
        )
    if "fit_rows" in rep:
        console.print(
            f"  fit on {profile.fit_on} ({rep.get('fit_rows')} rows), {rep.get('selection')}, folds {profile.folds}"
        )
    if "eval_queries" in rep:
        console.print(
            f"  support {rep.get('support_queries')} queries / {rep.get('support_targets')} targets; "
            f"{rep.get('eval_queries')} queries scored vs {rep.get('eval_gallery')}"
        )
    else:
        console.print(f"  support {rep.get('support_queries')} queries / {rep.get('support_targets')} targets")
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
    if "fold_fit_seconds" in rep:
        console.print(f"  fold fits (s): {', '.join(f'{x:.2f}' for x in rep['fold_fit_seconds'])}")
    console.print(f"  tensors sha256 {profile.tensors_sha256}; created {profile.created_at}")
    if "support_recall" in rep:
        console.print(_recall_table(rep, f"support recall ({rep.get('selection')}, * = chosen)"))
    if "support_eval" in rep:
        console.print(_eval_table(rep["support_eval"], "on the support logits", None))


def _show_adapter(console: Any, profile: CompatProfile) -> None:
    """The adapter block of `profile show`: shape, training settings and outcome."""
    meta = profile.adapter or {}
    cfg = meta.get("config", {})
    tr = meta.get("report", {})
    history = tr.get("history") or [{}]
    console.print(
        f"  new model {profile.new_model_id} (dim {profile.new_dim}); MKP adapter "
        f"{profile.new_dim} -> {meta.get('hidden')} -> {profile.old_dim} ({meta.get('format')})"
    )
    settings = ("epochs", "batch_size", "lr", "weight_decay", "dropout", "lam", "m", "gamma", "seed", "precision")
    console.print("  adapter config: " + ", ".join(f"{k}={cfg.get(k)}" for k in settings))
    loss = history[-1].get("total")
    console.print(
        f"  adapter training: {tr.get('pairs')} pairs, {tr.get('steps')} steps, {tr.get('seconds')} s on "
        f"{tr.get('device')} ({tr.get('autocast')}); final loss {_fmt(loss)}"
    )


def _show_classes(console: Any, profile: CompatProfile) -> None:
    """The psp / lsp block of `profile show`: class counts, top-k, class map, P_tk."""
    rep = profile.fit_report
    console.print(
        f"  new model {profile.new_model_id} (dim {profile.new_dim}); {profile.head}: "
        f"{profile.old_classes} old classes -> {profile.new_dim} new classes, top_k {profile.top_k or 'all'}, "
        f"class map {profile.class_map or 'identity'}"
    )
    p_tk = profile.tensors["P_tk"]
    console.print(
        f"  P_tk {p_tk.shape[0]}x{p_tk.shape[1]} (data-free); old prototypes turn by "
        f"{_fmt(rep.get('prototype_rotation_deg'))} degrees without it"
    )


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
