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
which `nobackfill support build` (and `synth support`) writes; --old-model-id / --new-model-id override
them.  With neither, `fit` refuses to guess.  All-zero rows drop their pairs with a warning, counted in
the fit report (`zero_rows_dropped`) and the eval caption; --strict refuses them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import typer

from service.errors import ArtifactError
from service.vocabulary import (
    ADAPTER_HEADS,
    CLASS_HEADS,
    PROCRUSTES_HEADS,
    Criterion,
    EvalGallery,
    FitOn,
    Head,
    HeadFamily,
    Modality,
)

if TYPE_CHECKING:
    from service.compat.io import Split
    from service.compat.profile import CompatProfile

PLOT_NAME = "fit_recall.png"
# Weight of one unlabelled query pair (fit --add-query-pairs) against one labelled support row in R's
# fit; measured in docs/traffic-learning.md.
QUERY_PAIRS_WEIGHT = 1.0


class ModelIds(NamedTuple):
    """The model ids a profile records, and the two identities (ModelIdentity.as_dict) when known."""

    old: str
    new: str
    record: dict[str, Any] | None


def _fmt(x: Any) -> str:
    """Table cell text: 4 decimals for floats, '-' for missing."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4f}"
    return str(x)


# The score a selection criterion reads off a curve row, and its standard error (see selection.py).
_SCORE_OF = {"r1": "recall@1", "mean": "mean@1-10", "mrr": "mrr@10"}
_SE_OF = {"recall@1": "se@1", "mean@1-10": "se_mean@1-10", "mrr@10": "se_mrr@10"}


def _console() -> Any:
    """A rich console for the fit report: the terminal's width, or 200 columns when piped (tables stay unwrapped)."""
    import sys

    from rich.console import Console

    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)


def _criterion_score(report: dict[str, Any]) -> str:
    """The curve key the report's criterion ranks by (R@1 for reports made before criteria existed)."""
    return _SCORE_OF.get(str(report.get("criterion", "r1")).removesuffix("-1se"), "recall@1")


def _pm(row: dict[str, Any], key: str) -> str:
    """'0.5612 ±0.0040' when the row has a standard error for key, else the value alone."""
    se = row.get(_SE_OF.get(key, ""))
    return f"{row[key]:.4f}" if se is None else f"{row[key]:.4f} ±{se:.4f}"


def _recall_table(report: dict[str, Any], title: str) -> Any:
    """Rich table of support Recall@1/5/10 (± standard error) per alpha for every curve, and the criterion's score."""
    from rich.table import Table

    curves = report["support_recall"]
    score = _criterion_score(report)
    extra = score != "recall@1" and all(score in rows[0] for rows in curves.values())
    table = Table(title=title, caption=report.get("criterion_text"))
    table.add_column("alpha", justify="right")
    for mode in curves:
        for k in (1, 5, 10):
            table.add_column(f"{mode} R@{k}", justify="right")
        if extra:
            table.add_column(f"{mode} {score}", justify="right")
    chosen = {mode: report["chosen"][mode]["alpha"] for mode in curves}
    for i, alpha in enumerate(report["alpha_grid"]):
        cells = [f"{alpha:.1f}"]
        for mode in curves:
            row = curves[mode][i]
            mark = "*" if chosen[mode] == alpha else ""
            cells += [_pm(row, "recall@1") + mark, f"{row['recall@5']:.4f}", f"{row['recall@10']:.4f}"]
            if extra:
                cells.append(_pm(row, score))
        table.add_row(*cells)
    return table


def _plot_png(panels: list[tuple[dict[str, Any], str]]) -> bytes:
    """Per (report, title): support R@1 (and the criterion's score) vs alpha with standard-error bars, as PNG."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = max(1 + (_criterion_score(rep) != "recall@1") for rep, _ in panels)
    fig, axes = plt.subplots(len(panels), ncols, figsize=(6 * ncols, 4 * len(panels)), dpi=100, squeeze=False)
    try:
        for row, (report, title) in zip(axes, panels, strict=True):
            score = _criterion_score(report)
            keys = ["recall@1"] + ([score] if score != "recall@1" else [])
            for ax in row[len(keys) :]:
                ax.set_visible(False)
            for ax, key in zip(row, keys, strict=False):
                for mode, style in zip(report["support_recall"], ("o-", "s--", "^-."), strict=False):
                    rows = report["support_recall"][mode]
                    se = [r.get(_SE_OF[key], 0.0) for r in rows]
                    bars = ax.errorbar(
                        [r["alpha"] for r in rows], [r[key] for r in rows], yerr=se, fmt=style, capsize=3
                    )
                    color = bars.lines[0].get_color()
                    best = report["chosen"][mode]
                    ax.axvline(best["alpha"], linestyle=":", alpha=0.5, color=color)
                    ax.plot([], [], style, color=color, label=f"{mode} (chosen {best['alpha']:.1f})")
                without = report.get("query_pairs", {}).get("curve_r1_without")
                if without and key == "recall@1":  # what the query pairs did: the same folds, R without them
                    ax.plot(report["alpha_grid"], without, "x:", color="grey", label="slerp, R without query pairs")
                ax.set_xlabel("alpha (0 = old query, 1 = mapped new query)")
                ax.set_ylabel(f"support {key} ({report['selection']}), ± 1 s.e.")
                ax.set_title(f"{title}\n{report.get('criterion_text', 'arg-max of R@1')}", fontsize=9)
                ax.grid(True, alpha=0.3)
                ax.legend()
        fig.tight_layout()
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


def _warn_zero_rows(split: Split) -> None:
    """One warning line on stderr when all-zero rows were dropped from the split."""
    line = split.zero_rows_line()
    if line is not None:
        typer.echo(f"warning: {line} (--strict refuses them)", err=True)


def _model_ids(support_dir: Path, split: Split, old_id: str | None, new_id: str | None) -> ModelIds:
    """Ids from SUPPORT_DIR/models.json (written by `support build`), the given ones overriding them.

    Without models.json both ids must be given: the service compares them with its encoders' and its
    gallery's, so a guessed id would either refuse a good profile or accept a wrong one.
    """
    from dataclasses import replace

    from service.encoders.identity import MODELS_JSON, read_models_json
    from service.errors import InputError

    found = read_models_json(support_dir)
    if found is None:
        missing = [f"--{side}-model-id" for side, given in (("old", old_id), ("new", new_id)) if given is None]
        if missing:
            raise InputError(
                f"{support_dir / MODELS_JSON}: missing; pass {' and '.join(missing)} "
                "(or build the support set with `nobackfill support build`, which writes it)"
            )
        assert old_id is not None and new_id is not None
        return ModelIds(old_id, new_id, None)
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
    support_dir: Path | None = typer.Argument(
        None, help="Folder with old_query.npy, new_query.npy, old_target.npy, ... (queries of --query-modality)."
    ),
    out: Path = typer.Option(..., "--out", help="Profile folder to write."),
    head: Head | None = typer.Option(
        None,
        help="Default head the profile serves [slerp; nlerp / adaptive when it beats slerp on the cross-fitted "
        "curve by more than slerp's standard error].",
    ),
    fit_on: FitOn = typer.Option(FitOn.both, help="Paired rows R (or the adapter) is fitted on."),
    folds: int = typer.Option(5, help="Cross-fitting folds for choosing alpha."),
    query_modality: Modality = typer.Option(Modality.text, help="Query modality the weight is chosen for."),
    support: list[str] | None = typer.Option(
        None,
        "--support",
        help="MODALITY=DIR, once per query modality (text, image): one R over every folder's pairs, "
        "the blend weights chosen per modality.  Instead of (or beside) SUPPORT_DIR.",
    ),
    same_set: bool = typer.Option(False, help="Paper's rule: fit the map and choose alpha on the same support set."),
    old_model_id: str | None = typer.Option(
        None, help="Old model id to record (default: SUPPORT_DIR/models.json's; required without it)."
    ),
    new_model_id: str | None = typer.Option(
        None, help="New model id to record (default: SUPPORT_DIR/models.json's; required without it)."
    ),
    eval_queries: int = typer.Option(5000, min=1, help="Held-out queries scored per fold (a seeded sample)."),
    seed: int = typer.Option(0, help="Seed of the fold assignment, the query sample and the adapter."),
    criterion: Criterion = typer.Option(
        Criterion.mrr_1se, help="How alpha is chosen on the cross-fitted curve (docs/alpha-selection.md)."
    ),
    eval_gallery: EvalGallery = typer.Option(
        EvalGallery.support,
        help="Held-out gallery a fold's queries are scored against: the old targets of every fold (at most "
        "50,000; the default) or of the held-out fold only.",
    ),
    force: bool = typer.Option(False, help="Replace a non-empty --out."),
    strict: bool = typer.Option(False, help="Refuse all-zero rows instead of dropping their pairs."),
    epochs: int | None = typer.Option(
        None, min=1, help="Adapter: most training epochs; the folds pick when to stop [10, more below 300 steps]."
    ),
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
    add_query_pairs: list[Path] | None = typer.Option(
        None,
        "--add-query-pairs",
        help="Folder of unlabelled (old, new) query pairs (`nobackfill traffic export`), repeatable: they join R's "
        "fit in every fold; alpha is still scored on the labelled support only.",
    ),
    query_pairs_weight: float = typer.Option(
        QUERY_PAIRS_WEIGHT,
        min=0.0,
        help="Weight of one query pair against one labelled support row in R's fit (docs/traffic-learning.md).",
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
    auto_head = head is None
    head = head or Head.slerp
    # Cheap checks first: bad arguments or files are refused before torch is even imported.
    _check_head_options(head, adapter_opts, class_opts)
    if add_query_pairs and head in (*ADAPTER_HEADS, *CLASS_HEADS):
        from service.errors import InputError

        raise InputError(f"--add-query-pairs refits Procrustes' R; --head {head.value} has no R to refit")
    _refuse_existing(out, force)
    dirs = _support_dirs(support_dir, support or [], query_modality.value)
    if len(dirs) > 1:
        _fit_modalities(
            dirs,
            out,
            None if auto_head else head,
            ModelIds(old_model_id or "", new_model_id or "", None),
            fit_on=fit_on,
            folds=folds,
            same_set=same_set,
            eval_queries=eval_queries,
            seed=seed,
            criterion=criterion,
            eval_gallery=eval_gallery,
            strict=strict,
            force=force,
            add_query_pairs=add_query_pairs or [],
            query_pairs_weight=query_pairs_weight,
        )
        return
    ((modality, support_dir),) = dirs.items()
    split = load_split(
        support_dir, require_new_target=fit_on is FitOn.target and head not in CLASS_HEADS, strict=strict
    )
    _warn_zero_rows(split)
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
            fit_on=fit_on,
            folds=folds,
            same_set=same_set,
            eval_queries=eval_queries,
            seed=seed,
            modality=modality,
            force=force,
            criterion=criterion,
            eval_gallery=eval_gallery,
        )
        return

    from service.compat import selection
    from service.compat.profile import CompatProfile, save_profile

    pairs = _query_pairs(add_query_pairs or [], split, ids)
    result = selection.fit(
        split,
        fit_on=fit_on,
        folds=folds,
        same_set=same_set,
        max_eval_queries=eval_queries,
        seed=seed,
        criterion=criterion,
        eval_gallery=eval_gallery,
        query_pairs=pairs,
        query_pairs_weight=query_pairs_weight,
    )
    why = None
    if auto_head:
        head, why = Head(result.report["best_head"]["head"]), result.report["best_head"]["why"]
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
        fit_on=fit_on,
        folds=int(result.report["folds"]),
        fit_report={**result.report, "query_modality": modality, "zero_rows_dropped": split.zero_rows},
        tensors={"R": result.rotation},
    )
    title = f"{split.new_dim} -> {split.old_dim}, {modality} queries, fit on {fit_on.value}"
    png = _plot_png([(result.report, title)])
    saved = save_profile(profile, out, overwrite=force, extra_files={PLOT_NAME: png})

    console = _console()
    console.print(_recall_table(result.report, f"support recall ({result.report['selection']}, * = chosen)"))
    ad = result.params["adaptive"]
    console.print(
        f"chosen alpha ({modality}, {result.report['criterion_text']}): slerp {result.params['slerp']['alpha']:.1f}, "
        f"nlerp {result.params['nlerp']['alpha']:.1f}, "
        f"adaptive a={ad['a']:.1f} b={ad['b']:g} c_ref={ad['c_ref']:.4f}; "
        f"head {head.value} -> alpha {head_alpha:.2f}"
    )
    if "query_pairs" in result.report:
        console.print(query_pairs_line(result.report))
        console.print(result.report["query_pairs"]["verdict"])
    if why is not None:
        console.print(f"head {head.value}: {why}")
    console.print(f"wrote profile {saved.profile_id} to {out} (plot: {out / PLOT_NAME})")


def query_pairs_line(report: dict[str, Any]) -> str:
    """One line: how many labelled rows and query pairs fitted R, and the cross-fitted scores with and without them."""
    qp = report["query_pairs"]
    w, wo = qp["with"], qp["without"]
    curve = "cross-fitted" if report.get("selection") == "cross-fit" else "same-set (biased)"
    return (
        f"R fitted on {qp['labelled_rows']} labelled rows + {qp['pairs']} unlabelled query pairs (weight "
        f"{qp['weight']:g}); {curve} aligned R@1 {wo['aligned_r1']:.4f} -> {w['aligned_r1']:.4f}, "
        f"slerp R@1 {wo['slerp_r1']:.4f} (alpha {wo['slerp_alpha']:.1f}) -> {w['slerp_r1']:.4f} "
        f"(alpha {w['slerp_alpha']:.1f}) without -> with the query pairs (± {w['slerp_se@1']:.4f})"
    )


def _query_pairs(folders: list[Path], split: Split, ids: ModelIds) -> list[tuple[Any, Any]]:
    """(new, old) rows of every --add-query-pairs folder, checked against the support's dims and models."""
    from service.encoders.identity import MODELS_JSON, ModelIdentity
    from service.errors import InputError
    from service.traffic.export import load_query_pairs

    out = []
    for folder in folders:
        pairs = load_query_pairs(folder)
        if (pairs.old.shape[1], pairs.new.shape[1]) != (split.old_dim, split.new_dim):
            raise InputError(
                f"{folder}: query pairs are {pairs.new.shape[1]} -> {pairs.old.shape[1]}, but the support pairs are "
                f"{split.new_dim} -> {split.old_dim}"
            )
        for side, theirs, ours_id in (("old", pairs.old_model, ids.old), ("new", pairs.new_model, ids.new)):
            if theirs is None:
                continue
            ours = ModelIdentity.from_dict(ids.record[side], side) if ids.record else None
            same = ours.same_model(theirs) if ours is not None else theirs.model_id == ours_id
            if not same:
                print_id = f"{theirs.model_id} ({theirs.fingerprint or 'no fingerprint'})"
                raise InputError(
                    f"{folder / MODELS_JSON}: the {side} model is {print_id}, not the support's {ours_id}; "
                    "query pairs must come from the same two models"
                )
        if not len(pairs.new):
            raise InputError(f"{folder}: no usable query pairs (every row is all-zero)")
        out.append((pairs.new, pairs.old))
    return out


# Early stopping needs room to stop in: without --epochs, a small support set trains for at least
# MIN_ADAPTER_STEPS optimiser steps (at most MAX_ADAPTER_EPOCHS epochs); the folds then pick the epoch.
# On the real corpus (4,000 rows, batch 256) 10 epochs left the held-out score still rising.
MIN_ADAPTER_STEPS = 300
MAX_ADAPTER_EPOCHS = 50


def _max_epochs(rows: int, batch_size: int, default: int) -> int:
    """Epochs an early-stopped adapter may train: the config's, raised to reach MIN_ADAPTER_STEPS steps."""
    steps_per_epoch = max(1, -(-rows // batch_size))
    return max(default, min(MAX_ADAPTER_EPOCHS, -(-MIN_ADAPTER_STEPS // steps_per_epoch)))


def _support_dirs(support_dir: Path | None, specs: list[str], modality: str) -> dict[str, Path]:
    """Query modality -> support folder, from SUPPORT_DIR (for --query-modality) and every --support MODALITY=DIR."""
    from service.errors import InputError

    dirs: dict[str, Path] = {}
    if support_dir is not None:
        dirs[modality] = support_dir
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not folder:
            raise InputError(f"--support expects MODALITY=DIR, got {spec!r}")
        if name not in Modality.__members__:
            raise InputError(f"--support {spec}: modality must be one of {', '.join(Modality.__members__)}")
        if name in dirs:
            raise InputError(f"--support {spec}: {name} queries already come from {dirs[name]}")
        dirs[name] = Path(folder)
    if not dirs:
        raise InputError("no support set: pass SUPPORT_DIR or --support MODALITY=DIR")
    return dirs


def _fit_modalities(
    dirs: dict[str, Path],
    out: Path,
    head: Head | None,
    given: ModelIds,
    *,
    fit_on: FitOn,
    folds: int,
    same_set: bool,
    eval_queries: int,
    seed: int,
    criterion: Criterion,
    eval_gallery: EvalGallery,
    strict: bool,
    force: bool,
    add_query_pairs: list[Path] | None = None,
    query_pairs_weight: float = QUERY_PAIRS_WEIGHT,
) -> None:
    """Several --support folders: one R over all their pairs, the blend weights chosen per query modality."""
    from service.compat import selection
    from service.compat.io import load_split
    from service.compat.profile import CompatProfile, save_profile
    from service.errors import InputError

    if head is not None and head not in PROCRUSTES_HEADS:
        raise InputError(
            f"--head {head.value} fits one query modality; several --support folders need "
            f"{' / '.join(PROCRUSTES_HEADS)}"
        )
    splits = {m: load_split(d, require_new_target=fit_on is FitOn.target, strict=strict) for m, d in dirs.items()}
    first = next(iter(splits))
    for m, s in splits.items():
        _warn_zero_rows(s)
        if (s.old_dim, s.new_dim) != (splits[first].old_dim, splits[first].new_dim):
            raise InputError(
                f"{dirs[m]}: {m} pairs are {s.new_dim} -> {s.old_dim}, but the {first} pairs in {dirs[first]} are "
                f"{splits[first].new_dim} -> {splits[first].old_dim}"
            )
    ids = {m: _model_ids(dirs[m], s, given.old or None, given.new or None) for m, s in splits.items()}
    for m, i in ids.items():
        if (i.old, i.new, i.record) != (ids[first].old, ids[first].new, ids[first].record):
            raise InputError(
                f"{dirs[m]}: models {i.old} -> {i.new} differ from {dirs[first]}'s {ids[first].old} -> "
                f"{ids[first].new}; one profile serves one model pair"
            )
    fitted = selection.fit_modalities(
        splits,
        fit_on=fit_on,
        folds=folds,
        same_set=same_set,
        max_eval_queries=eval_queries,
        seed=seed,
        criterion=criterion,
        eval_gallery=eval_gallery,
        query_pairs=_query_pairs(add_query_pairs or [], splits[first], ids[first]),
        query_pairs_weight=query_pairs_weight,
    )
    why = None
    if head is None:
        favoured = {fitted.reports[m]["best_head"]["head"] for m in splits}
        agree = len(favoured) == 1
        head = Head(next(iter(favoured))) if agree else Head.slerp
        why = "; ".join(f"{m}: {fitted.reports[m]['best_head']['why']}" for m in splits)
        if not agree:
            why += " (the modalities disagree, so slerp serves them all)"

    def head_alpha(params: dict[str, dict[str, float]]) -> float:
        return 1.0 if head is Head.aligned else params[head.value].get("alpha", params["adaptive"]["a"])

    first_rep = fitted.reports[first]
    report: dict[str, Any] = {
        **{k: first_rep[k] for k in ("selection", "criterion", "criterion_text", "folds", "fit_on", "eval_gallery")},
        "query_modalities": list(splits),
        "fit_rows": first_rep["fit_rows_all_modalities"],
        "support_queries": sum(len(s.old_query) for s in splits.values()),
        "support_targets": sum(len(s.old_target) for s in splits.values()),
        "modalities": {m: {**fitted.reports[m], "support_dir": str(dirs[m])} for m in splits},
        "zero_rows_dropped": {f"{m}/{f}": c for m, s in splits.items() for f, c in s.zero_rows.items()},
    }
    profile = CompatProfile(
        head=head.value,
        old_model_id=ids[first].old,
        new_model_id=ids[first].new,
        models=ids[first].record,
        old_dim=splits[first].old_dim,
        new_dim=splits[first].new_dim,
        alphas={m: float(head_alpha(fitted.params[m])) for m in splits},
        params=fitted.params,
        fit_on=fit_on,
        folds=int(first_rep["folds"]),
        fit_report=report,
        tensors={"R": fitted.rotation},
    )
    png = _plot_png(
        [
            (fitted.reports[m], f"{splits[m].new_dim} -> {splits[m].old_dim}, {m} queries, fit on {fit_on.value}")
            for m in splits
        ]
    )
    saved = save_profile(profile, out, overwrite=force, extra_files={PLOT_NAME: png})

    console = _console()
    for m in splits:
        console.print(_recall_table(fitted.reports[m], f"{m} queries: support recall ({first_rep['selection']})"))
        p = fitted.params[m]
        console.print(
            f"chosen alpha ({m}): slerp {p['slerp']['alpha']:.1f}, nlerp {p['nlerp']['alpha']:.1f}, "
            f"adaptive a={p['adaptive']['a']:.1f} b={p['adaptive']['b']:g} c_ref={p['adaptive']['c_ref']:.4f}"
        )
        if "query_pairs" in fitted.reports[m]:
            console.print(f"{m} queries: " + query_pairs_line(fitted.reports[m]))
    console.print(
        f"one R over {report['fit_rows']} pairs of {', '.join(splits)} queries ({first_rep['criterion_text']}); "
        f"head {head.value} -> alphas " + ", ".join(f"{m} {a:.2f}" for m, a in profile.alphas.items())
    )
    if why is not None:
        console.print(f"head {head.value}: {why}")
    console.print(f"wrote profile {saved.profile_id} to {out} (plot: {out / PLOT_NAME})")


def _fit_adapter(
    split: Split,
    out: Path,
    head: Head,
    ids: ModelIds,
    overrides: dict[str, Any],
    threads: int | None,
    *,
    fit_on: FitOn,
    folds: int,
    same_set: bool,
    eval_queries: int,
    seed: int,
    modality: str,
    force: bool,
    criterion: Criterion,
    eval_gallery: EvalGallery,
) -> None:
    """--head adapter / adapter+slerp: train the MKP adapter, save.

    Cross-fitted (the default): one adapter per fold on the other folds, scored on its held-out fold
    after every epoch; the epochs are chosen by early stopping there (selection.fit_mapped_slerp), the
    final adapter trains for that many, and adapter+slerp's alpha is chosen at that epoch.  The report
    compares the adapter with Procrustes on the same held-out folds.  --same-set trains once, all epochs.
    """
    import sys
    from dataclasses import replace

    import torch

    from service.compat import selection
    from service.compat.adapter import AdapterConfig, EpochHook, TrainedAdapter, train_adapter
    from service.compat.profile import CompatProfile, save_profile
    from service.errors import InputError

    try:
        config = AdapterConfig(**{**overrides, "seed": seed})
        if "epochs" not in overrides and not same_set:
            rows = len(selection.support_pairs(split, fit_on)[0])
            config = replace(config, epochs=_max_epochs(rows, config.batch_size, config.epochs))
    except ValueError as exc:
        raise InputError(f"adapter options: {exc}") from exc
    progress = sys.stderr.isatty()

    def fit_map(
        new: selection.F32,
        old: selection.F32,
        on_epoch: EpochHook | None = None,
        stop_after: int | None = None,
    ) -> TrainedAdapter:
        return train_adapter(new, old, config, progress=progress, on_epoch=on_epoch, stop_after=stop_after)

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if head is Head.adapter and same_set:
            new, old, blocks = selection.support_pairs(split, fit_on)
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
                fit_on=fit_on,
                folds=folds,
                same_set=same_set,
                max_eval_queries=eval_queries,
                seed=seed,
                criterion=criterion,
                early_stop=not same_set,
                eval_gallery=eval_gallery,
            )
            adapter, report = result.mapper, result.report
            alphas = {modality: result.alpha}
            params = {modality: {head.value: {"alpha": result.alpha}}}
            if head is Head.adapter:
                # The adapter head serves the map alone: the SLERP curve only fed the comparison.
                report = {k: v for k, v in report.items() if k not in ("support_recall", "chosen", "alpha_grid")}
                report["selection"] = f"none (no weight to choose); epochs by early stopping on {folds} folds"
                alphas, params = {modality: 1.0}, {}
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
        fit_report={**report, "query_modality": modality, "zero_rows_dropped": split.zero_rows},
        tensors={k: v.numpy() for k, v in adapter.state_dict_tensors().items()},
        adapter=adapter.meta(),
        old_model_id=ids.old,
        new_model_id=ids.new,
        models=ids.record,
    )
    extra = {}
    if "support_recall" in report:
        title = f"{split.new_dim} -> {split.old_dim} adapter, {modality} queries, fit on {fit_on}"
        extra[PLOT_NAME] = _plot_png([(report, title)])
    saved = save_profile(profile, out, overwrite=force, extra_files=extra)

    console = _console()
    if "support_recall" in report:
        console.print(_recall_table(report, f"support recall ({report['selection']}, * = chosen)"))
        console.print(f"chosen alpha ({modality}): {head.value} {alphas[modality]:.1f}")
    last = adapter.report.get("history", [{}])[-1]
    console.print(
        f"adapter {split.new_dim} -> {adapter.hidden} -> {split.old_dim}: {adapter.report.get('pairs')} pairs, "
        f"{adapter.report.get('steps')} steps, {adapter.report.get('seconds')} s on {adapter.report.get('device')}, "
        f"final loss {last.get('total', float('nan')):.4f}"
    )
    for line in _adapter_verdict(report):
        console.print(line)
    console.print(f"wrote profile {saved.profile_id} to {out}" + (f" (plot: {out / PLOT_NAME})" if extra else ""))


def _adapter_verdict(report: dict[str, Any]) -> list[str]:
    """The early-stopping choice and the held-out comparison with Procrustes, as printable lines."""
    lines = []
    stop = report.get("early_stopping")
    if stop:
        curve = ", ".join(f"{r['epoch']}: {r[stop['score']]:.4f}" for r in stop["curve"])
        lines.append(
            f"epochs: {stop['epochs']} of {stop['max_epochs']} ({stop['rule']}; held-out {stop['score']} by epoch: "
            f"{curve})"
        )
    vs = report.get("versus_procrustes")
    if vs:
        lines.append(("warning: " if vs["adapter_loses"] else "") + vs["verdict"])
    return lines


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
        "zero_rows_dropped": split.zero_rows,
    }
    profile = CompatProfile(
        head=head.value,
        old_dim=c_old,
        new_dim=c_new,
        alphas={},
        params={},
        fit_on="none",
        folds=0,
        fit_report=report,  # support_eval is added below, before saving
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
    HeadFamily.procrustes: "compatible: R@1 strictly above old->old; pfr/nfr vs old->old at R@1; "
    "oracle = best alpha on this test set, an upper bound, not deployable",
    HeadFamily.adapter: "compatible: R@1 strictly above old->old; pfr/nfr vs old->old at R@1",
    HeadFamily.classes: "gallery = the old model's {head} features of old_target; compatible / pfr / nfr vs old->old, "
    "except new-logits: vs old-logits (raw normalised logits on both sides, the baseline {head} replaces)",
}


def evaluate(
    profile_dir: Path = typer.Argument(..., help="Compat profile folder."),
    test_dir: Path = typer.Argument(..., help="Test folder, same layout as the support folder (logits for psp / lsp)."),
    query_modality: str | None = typer.Option(
        None, help="Modality whose weights to use (default: the profile's only fitted modality)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print only a JSON list of rows."),
    strict: bool = typer.Option(False, help="Refuse all-zero rows instead of dropping their pairs."),
) -> None:
    """Compare every head the profile has with old->old (and new->new) on a test split, with flips."""
    from service.compat.io import load_split
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
    split = load_split(test_dir, old_dim=profile.old_dim, new_dim=profile.new_dim, strict=strict)
    _warn_zero_rows(split)

    from service.compat.evaluation import COLUMNS
    from service.compat.evaluation import evaluate as run_eval

    rows = run_eval(profile, split, modality)
    if as_json:
        typer.echo(json.dumps([{c: r[c] for c in COLUMNS} for r in rows]))
        return
    from rich.console import Console

    caption = _CAPTIONS[profile.family].format(head=profile.head)
    if split.zero_rows:
        caption += f"; {split.zero_rows_line()}"
    title = f"profile {profile.profile_id} ({profile.head}) on {test_dir} ({modality} queries)"
    Console().print(_eval_table(rows, title, caption))


def _show_text(profile: CompatProfile, directory: Path) -> None:
    """Human-readable dump of a profile and its fit report, whatever its head."""

    console = _console()
    rep = profile.fit_report
    console.print(f"profile {profile.profile_id}  ({directory})")
    console.print(f"  head {profile.head}; modes {', '.join(profile.modes())}")
    console.print(f"  old model {profile.old_model_id} (dim {profile.old_dim})")
    if profile.family is HeadFamily.classes:
        _show_classes(console, profile)
    elif profile.family is HeadFamily.adapter:
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
    console.print(f"  tensors sha256 {profile.tensors_sha256}; created {profile.created_at}")
    # A profile fitted on several --support folders keeps one selection report per query modality.
    for modality, sub in rep.get("modalities", {"": rep}).items():
        _show_selection(console, sub, modality)
    if "support_eval" in rep:
        console.print(_eval_table(rep["support_eval"], "on the support logits", None))


def _show_selection(console: Any, rep: dict[str, Any], modality: str) -> None:
    """The chosen weights, residual angles and support curve of one selection report."""
    prefix = f"  {modality} queries: " if modality else "  "
    if modality and "support_dir" in rep:
        console.print(f"{prefix}support {rep['support_dir']} ({rep.get('support_queries')} queries)")
    for mode, best in rep.get("chosen", {}).items():
        recalls = ", ".join(f"R@{k} {best[f'recall@{k}']:.4f}" for k in (1, 5, 10) if f"recall@{k}" in best)
        console.print(f"{prefix}chosen {mode}: support {recalls}")
    if "best_head" in rep:
        console.print(f"{prefix}best head {rep['best_head']['head']}: {rep['best_head']['why']}")
    if "query_pairs" in rep:
        console.print(prefix + query_pairs_line(rep))
    for key in ("residual_angle_deg", "residual_angle_deg_out_of_fold"):
        if key in rep:
            stats = ", ".join(f"{k} {v:.2f}" for k, v in rep[key].items())
            console.print(f"{prefix}{key.replace('_deg', '').replace('_', ' ')} (degrees): {stats}")
    if "fold_fit_seconds" in rep:
        console.print(f"{prefix}fold fits (s): {', '.join(f'{x:.2f}' for x in rep['fold_fit_seconds'])}")
    if "support_recall" in rep:
        label = f"{modality} queries: " if modality else ""
        console.print(_recall_table(rep, f"{label}support recall ({rep.get('selection')}, * = chosen)"))


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
    for line in _adapter_verdict(profile.fit_report):
        console.print("  " + line)


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
