"""`nobackfill fit` and `nobackfill eval`: the offline side of the compat layer, flags in and tables out.

The fitting itself is service/compat/fitting.py (fit_profile with one FitOptions); this module parses
the flags, saves the profile and prints the report (commands/fit_report.py).  Heavy imports (numpy, torch, matplotlib,
service.compat) happen inside the commands so `nobackfill --help` stays fast.  Every failure is a
service.errors exception, which service.cli turns into one line and exit 2; a failing `fit` writes
nothing (the profile folder appears in one rename at the very end).

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
from typing import TYPE_CHECKING, Any

import typer

from service.atomic_dir import check_output
from service.commands import render
from service.commands.fit_report import print_outcome, warn
from service.compat.fit_options import QUERY_PAIRS_WEIGHT
from service.errors import ArtifactError
from service.vocabulary import Criterion, EvalGallery, FitOn, Head, HeadFamily, Modality

if TYPE_CHECKING:
    from service.compat.profile import CompatProfile

PLOT_NAME = "fit_recall.png"


def _adapter_overrides(**given: Any) -> dict[str, Any]:
    """The adapter options the user set (None = keep AdapterConfig's default)."""
    return {k: v for k, v in given.items() if v is not None}


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


# fit's options in four groups of `--help`: what it reads and writes, which head, how alpha is chosen, the adapter.
PANEL_DATA = "Data"
PANEL_HEADS = "Heads"
PANEL_SELECTION = "Choosing alpha"
PANEL_ADAPTER = "Adapter training"


def fit(
    support_dir: Path | None = typer.Argument(
        None,
        help="Folder with old_query.npy, new_query.npy, old_target.npy, ... (queries of --query-modality).",
        metavar="SUPPORT_DIR",
    ),
    out: Path = typer.Option(..., "--out", help="Profile folder to write.", rich_help_panel=PANEL_DATA),
    head: Head | None = typer.Option(
        None,
        help="Default head the profile serves [slerp; nlerp / adaptive when it beats slerp on the cross-fitted "
        "curve by more than slerp's standard error].",
        rich_help_panel=PANEL_HEADS,
    ),
    fit_on: FitOn = typer.Option(
        FitOn.both, help="Paired rows R (or the adapter) is fitted on.", rich_help_panel=PANEL_HEADS
    ),
    folds: int = typer.Option(5, help="Cross-fitting folds for choosing alpha.", rich_help_panel=PANEL_SELECTION),
    query_modality: Modality = typer.Option(
        Modality.text, help="Query modality the weight is chosen for.", rich_help_panel=PANEL_DATA
    ),
    support: list[str] | None = typer.Option(
        None,
        "--support",
        help="MODALITY=DIR, once per query modality (text, image): one R over every folder's pairs, "
        "the blend weights chosen per modality.  Instead of (or beside) SUPPORT_DIR.",
        rich_help_panel=PANEL_DATA,
    ),
    same_set: bool = typer.Option(
        False,
        help="Paper's rule: fit the map and choose alpha on the same support set.",
        rich_help_panel=PANEL_SELECTION,
    ),
    old_model_id: str | None = typer.Option(
        None,
        help="Old model id to record (default: SUPPORT_DIR/models.json's; required without it).",
        rich_help_panel=PANEL_DATA,
    ),
    new_model_id: str | None = typer.Option(
        None,
        help="New model id to record (default: SUPPORT_DIR/models.json's; required without it).",
        rich_help_panel=PANEL_DATA,
    ),
    eval_queries: int = typer.Option(
        5000, min=1, help="Held-out queries scored per fold (a seeded sample).", rich_help_panel=PANEL_SELECTION
    ),
    seed: int = typer.Option(
        0, help="Seed of the fold assignment, the query sample and the adapter.", rich_help_panel=PANEL_SELECTION
    ),
    criterion: Criterion = typer.Option(
        Criterion.mrr_1se,
        help="How alpha is chosen on the cross-fitted curve (docs/alpha-selection.md).",
        rich_help_panel=PANEL_SELECTION,
    ),
    eval_gallery: EvalGallery = typer.Option(
        EvalGallery.support,
        help="Held-out gallery a fold's queries are scored against: the old targets of every fold (at most "
        "50,000; the default) or of the held-out fold only.",
        rich_help_panel=PANEL_SELECTION,
    ),
    force: bool = typer.Option(False, help="Replace a non-empty --out.", rich_help_panel=PANEL_DATA),
    strict: bool = typer.Option(
        False, help="Refuse all-zero rows instead of dropping their pairs.", rich_help_panel=PANEL_DATA
    ),
    epochs: int | None = typer.Option(
        None,
        min=1,
        help="Adapter: most training epochs; the folds pick when to stop [10, more below 300 steps].",
        rich_help_panel=PANEL_ADAPTER,
    ),
    hidden: int | None = typer.Option(
        None, min=1, help="Adapter: hidden width [AdapterConfig: the input dim].", rich_help_panel=PANEL_ADAPTER
    ),
    batch_size: int | None = typer.Option(
        None, min=3, help="Adapter: batch size [AdapterConfig: 256].", rich_help_panel=PANEL_ADAPTER
    ),
    lr: float | None = typer.Option(
        None, min=0.0, help="Adapter: AdamW learning rate [AdapterConfig: 1e-3].", rich_help_panel=PANEL_ADAPTER
    ),
    weight_decay: float | None = typer.Option(
        None, min=0.0, help="Adapter: weight decay [AdapterConfig: 1e-4].", rich_help_panel=PANEL_ADAPTER
    ),
    dropout: float | None = typer.Option(
        None, min=0.0, help="Adapter: dropout [AdapterConfig: 0.1].", rich_help_panel=PANEL_ADAPTER
    ),
    lam: float | None = typer.Option(
        None, min=0.0, help="Adapter: preservation loss weight [AdapterConfig: 1].", rich_help_panel=PANEL_ADAPTER
    ),
    device: str | None = typer.Option(
        None, help="Adapter: auto / cpu / cuda:N [AdapterConfig: auto].", rich_help_panel=PANEL_ADAPTER
    ),
    precision: str | None = typer.Option(
        None, help="Adapter: auto / bf16 / fp32 [AdapterConfig: auto].", rich_help_panel=PANEL_ADAPTER
    ),
    threads: int | None = typer.Option(
        None, min=1, help="Torch CPU threads while training [torch's default].", rich_help_panel=PANEL_ADAPTER
    ),
    old_classes: int | None = typer.Option(
        None,
        min=2,
        help="psp / lsp: the old model's classes C_k [the width of old_query.npy].",
        rich_help_panel=PANEL_HEADS,
    ),
    top_k: int | None = typer.Option(
        None, min=1, help="psp / lsp: keep the k largest entries per row [all].", rich_help_panel=PANEL_HEADS
    ),
    class_map: str | None = typer.Option(
        None,
        help="psp / lsp: new-model output index of each old class, comma-separated [identity].",
        rich_help_panel=PANEL_HEADS,
    ),
    add_query_pairs: list[Path] | None = typer.Option(
        None,
        "--add-query-pairs",
        help="Folder of unlabelled (old, new) query pairs (`nobackfill traffic export`), repeatable: they join R's "
        "fit in every fold; alpha is still scored on the labelled support only.",
        rich_help_panel=PANEL_DATA,
    ),
    query_pairs_weight: float = typer.Option(
        QUERY_PAIRS_WEIGHT,
        min=0.0,
        help="Weight of one query pair against one labelled support row in R's fit (docs/traffic-learning.md).",
        rich_help_panel=PANEL_DATA,
    ),
) -> None:
    """Fit a compat profile on a support set: Procrustes + blends, the MKP adapter (+ SLERP), or PSP / LSP."""
    import sys

    from service.compat.fit_options import FitOptions, check_options

    options = FitOptions(
        head=head,
        fit_on=fit_on,
        folds=folds,
        same_set=same_set,
        eval_queries=eval_queries,
        seed=seed,
        criterion=criterion,
        eval_gallery=eval_gallery,
        strict=strict,
        adapter=_adapter_overrides(
            epochs=epochs,
            hidden=hidden,
            batch_size=batch_size,
            lr=lr,
            weight_decay=weight_decay,
            dropout=dropout,
            lam=lam,
            device=device,
            precision=precision,
        ),
        threads=threads,
        old_classes=old_classes,
        top_k=top_k,
        class_map=class_map,
        query_pairs=tuple(add_query_pairs or ()),
        query_pairs_weight=query_pairs_weight,
        old_model_id=old_model_id,
        new_model_id=new_model_id,
        progress=sys.stderr.isatty(),
    )
    # Cheap checks first: bad arguments or files are refused before torch is even imported.
    check_options(options)
    check_output(out, force, error=ArtifactError)  # what save_profile checks again, before torch loads
    supports = _support_dirs(support_dir, support or [], query_modality.value)

    from service.compat.fitting import fit_profile
    from service.compat.profile import save_profile

    outcome = fit_profile(supports, options, warn=warn)

    def plot(saved: CompatProfile) -> dict[str, bytes]:
        """The fit plot, headed by the saved profile's id (known once its tensors are written)."""
        heading = render.plot_heading(saved, outcome.head_why)
        return {PLOT_NAME: render.plot_png(outcome.panels, heading)} if outcome.panels else {}

    saved = save_profile(outcome.profile, out, overwrite=force, extra_files=plot)
    wrote = f"wrote profile {saved.profile_id} to {out}" + (f" (plot: {out / PLOT_NAME})" if outcome.panels else "")
    print_outcome(outcome, saved, wrote)


_CAPTIONS = {
    HeadFamily.procrustes: "differences from old->old in points with 95 % paired bootstrap intervals; compatible: "
    "the interval is above 0 (below: not compatible; across: not distinguishable); ARR@10 = R@10 / new->new's; "
    "pfr/nfr vs old->old at R@1; oracle = best alpha on this test set, an upper bound, not deployable",
    HeadFamily.adapter: "differences from old->old in points with 95 % paired bootstrap intervals; compatible: the "
    "interval is above 0 (below: not compatible; across: not distinguishable); pfr/nfr vs old->old at R@1",
    HeadFamily.classes: "gallery = the old model's {head} features of old_target; compatible / pfr / nfr vs old->old, "
    "except new-logits: vs old-logits (raw normalised logits on both sides, the baseline {head} replaces)",
}


_SERVED_CAPTION = (
    "ranked by the gallery's own search (IVF-PQ codes, nprobe lists; <head>+csls: the sidecar's re-rank), as the "
    "service answers; differences from old->old in points with 95 % paired bootstrap intervals; pfr/nfr at R@1"
)


def _mapped(profile: Any, hubness_queries: Path | None, modality: str) -> Any:
    """The hubness correction's mapped queries for the exact eval (None without --hubness-queries)."""
    if hubness_queries is None:
        return None
    if profile.family is HeadFamily.classes:
        warn(
            f"--hubness-queries ignored: a {profile.head} profile's gallery holds class features, and the hubness "
            "correction (for a gallery searched by mapped embedding queries) is not scored for it"
        )
        return None
    from service.compat.hubness import mapped_queries

    return mapped_queries(profile, hubness_queries, modality)[0]


def _served(
    profile: Any,
    split: Any,
    modality: str,
    gallery_dir: Path,
    hubness_dir: Path | None,
    nprobe: int,
    candidates: int,
) -> Any:
    """The test queries answered by the gallery (and the sidecar) with the service's own search calls."""
    from service.compat.hubness import Corrected, load_hubness
    from service.index.factory import create_gallery
    from service.scoring.served_eval import served_rankings
    from service.settings import IndexSettings

    gallery = create_gallery(IndexSettings(gallery_dir=gallery_dir))  # opened as the service opens it
    corrected = None
    if hubness_dir is not None:
        corrected = Corrected(load_hubness(hubness_dir, gallery.fingerprint, profile.profile_id), candidates)
    return served_rankings(profile, split, modality, gallery, nprobe, corrected)


def _write_rankings(out: Path, query_ids: Any, ids: dict[str, Any]) -> None:
    """Each method's served top-10 gallery ids per test query, beside the query ids, as one JSON file."""
    document = {"query_ids": query_ids.tolist(), "rankings": {method: found.tolist() for method, found in ids.items()}}
    out.write_text(json.dumps(document) + "\n", encoding="utf-8")


def evaluate(
    profile_dir: Path = typer.Argument(..., help="Compat profile folder.", metavar="PROFILE_DIR"),
    test_dir: Path = typer.Argument(
        ..., help="Test folder, same layout as the support folder (logits for psp / lsp).", metavar="TEST_DIR"
    ),
    query_modality: str | None = typer.Option(
        None, help="Modality whose weights to use (default: the profile's only fitted modality)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print only a JSON list of rows (every figure and interval)."),
    json_out: Path | None = typer.Option(
        None, "--json-out", help="Also write the rows with the profile's id as JSON here (NOBACKFILL_API__UI_EVAL)."
    ),
    strict: bool = typer.Option(False, help="Refuse all-zero rows instead of dropping their pairs."),
    judge: str = typer.Option(
        "recall@10", "--judge", help="Metric `compatible` is judged on: recall@1, recall@5, recall@10, mrr@10, ndcg@10."
    ),
    hubness_queries: Path | None = typer.Option(
        None, "--hubness-queries", help="Support or traffic folder: also score the head with the hubness correction."
    ),
    gallery_dir: Path | None = typer.Option(
        None,
        "--gallery",
        help="Score old and the head through this frozen gallery as the service searches it (the test's target_ids "
        "are its ids), instead of exactly over the test targets.",
    ),
    hubness_dir: Path | None = typer.Option(
        None, "--hubness", help="With --gallery: the hubness sidecar the service serves (adds <head>+csls)."
    ),
    nprobe: int = typer.Option(16, "--nprobe", min=1, help="With --gallery: lists searched (as INDEX__NPROBE)."),
    hubness_candidates: int = typer.Option(
        100, "--hubness-candidates", min=1, help="With --hubness: hits re-ranked (as COMPAT__HUBNESS_CANDIDATES)."
    ),
    rankings_out: Path | None = typer.Option(
        None, "--rankings-out", help="With --gallery: write each method's top-10 gallery ids per test query (JSON)."
    ),
) -> None:
    """Compare every head the profile has with old->old (and new->new) on a test split: intervals, verdicts, flips."""
    from service.compat.io import load_split
    from service.compat.profile import load_profile
    from service.errors import InputError

    profile = load_profile(profile_dir)
    if gallery_dir is None and (hubness_dir is not None or rankings_out is not None):
        raise InputError("--hubness and --rankings-out score what a gallery serves: give --gallery GALLERY_DIR too")
    if gallery_dir is not None and (hubness_queries is not None or profile.family is HeadFamily.classes):
        raise InputError(
            "--gallery scores an embedding head's served search: not with --hubness-queries (give the sidecar as "
            "--hubness) nor a psp / lsp profile"
        )
    modality = query_modality
    if modality is None:
        # psp / lsp weigh nothing per modality: any name will do.
        fitted = sorted(profile.params) or sorted(profile.alphas) or ["text"]
        if len(fitted) != 1:
            raise InputError(f"profile fits modalities {', '.join(fitted) or 'none'}; pick one with --query-modality")
        modality = fitted[0]
    split = load_split(test_dir, old_dim=profile.old_dim, new_dim=profile.new_dim, strict=strict)
    line = split.zero_rows_line()
    if line is not None:
        warn(f"{line} (--strict refuses them)")

    from service.compat.evaluation import evaluate as run_eval
    from service.compat.uncertainty import few_queries_line

    if gallery_dir is not None:
        served = _served(profile, split, modality, gallery_dir, hubness_dir, nprobe, hubness_candidates)
        from service.scoring.served_eval import served_rows

        rows = served_rows(served, judge)
        if rankings_out is not None:
            _write_rankings(rankings_out, split.query_ids, served.ids)
    else:
        rows = run_eval(profile, split, modality, judge, _mapped(profile, hubness_queries, modality))
    few = few_queries_line(len(split.old_query), str(test_dir))
    if few is not None:
        warn(few)
    if json_out is not None:
        from service.compat.saved import eval_document, write_document

        write_document(json_out, eval_document(profile, test_dir, modality, judge, rows))
    if as_json:
        typer.echo(json.dumps(rows))
        return

    caption = _CAPTIONS[profile.family].format(head=profile.head)
    if split.zero_rows:
        caption += f"; {split.zero_rows_line()}"
    title = f"profile {profile.profile_id} ({profile.head}) on {test_dir} ({modality} queries)"
    if gallery_dir is not None:
        title += f", served by gallery {gallery_dir} (nprobe {nprobe})"
        caption = _SERVED_CAPTION
    console = render.console()
    console.print(render.eval_table(rows, title, caption))
    for row in rows:
        if row.get("vs_uncorrected"):
            console.print(render.correction_line(row))
