"""Choosing the blend weight on a support set: cross-fitted by default, the paper's same-set rule on request.

Cross-fitting (default, k folds): every id (query_ids and target_ids together) is assigned to one fold,
so a query and its relevant targets always share a fold.  For fold f, R is fitted on the rows of the
other folds (query rows, target rows or both, per `fit_on`), and every weight on the grid is scored
on fold f's queries, whose relevant targets R has never seen.  They are ranked against a held-out
gallery: by default (`eval_gallery="support"`) the old targets of every fold, at most MAX_EVAL_GALLERY
(the other folds' targets are distractors only; a larger gallery ranks like the production one, and on
the real corpus a fold-sized gallery pushed alpha up), or with "fold" fold f's targets alone.  This
removes the bias of the same-set rule, where R was fitted on the very pairs that score alpha, which
makes v look better than it is and pushes alpha toward 1.  The folds, each fold's training rows and
its sampled held-out queries and gallery are drawn once, as a CrossFitPlan (crossfit.py), which R's
fit and the learnt map's fit (mapped_selection.py) both walk.
Same-set (`same_set=True`, 002_... protocol): R on all support rows, alpha scored on all support
queries against all support targets.
Either way the final R is refitted on all support rows.  At most `eval_queries` queries per fold
(a seeded random subset) are scored to bound the cost; every query still feeds the residual-angle
statistics and the adaptive reference cosine c_ref (median u . v of out-of-fold pairs).

The rows R is fitted on are support_blocks.py's; each fold is scored along the blend path into support
curves (curves.py), and the criterion picks each blend's weight on them (criteria.py).  `fit_modalities`
fits one R over several splits (one per query modality), drawing folds per id over all of them, and
chooses each modality's weights on its own held-out queries.

Unlabelled query pairs (`query_pairs`, e.g. sampled from live traffic by service/traffic/) join the
fit of R only: their cross-covariance, times `query_pairs_weight`, is added to every fold's and to the
final one, so they shape R but never score alpha (the held-out folds stay labelled support).  The
report's `query_pairs` block compares the cross-fitted curve with and without them on the same folds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.compat.criteria import check_criterion, head_choice
from service.compat.crossfit import CrossFitPlan
from service.compat.curves import (
    ALPHA_GRID,
    SLOPE_GRID,
    Held,
    angle_stats,
    choose_blends,
    new_to_new,
    score_fold,
)
from service.compat.fit_options import DEFAULT_OPTIONS, FitOptions
from service.compat.io import Split
from service.compat.procrustes import (
    aligned_old_coords,
    complete_rotation,
    cross_covariance,
    normalize_rows,
    thin_rotation,
)
from service.compat.support_blocks import check_fit_args, fit_blocks, fold_covariances, report_basics, total
from service.errors import InputError
from service.rows import F32, F64, I64
from service.vocabulary import EvalGallery

DEFAULT_EVAL_GALLERY = EvalGallery.support
MAX_EVAL_QUERIES = 5000


@dataclass(frozen=True)
class FitResult:
    """Final R, the chosen parameters per blending mode, and the JSON-able fit report."""

    rotation: npt.NDArray[np.float32]
    params: dict[str, dict[str, float]]
    report: dict[str, Any]


@dataclass(frozen=True)
class MultiFit:
    """One R over every modality's pairs; per modality the chosen parameters and the fit report."""

    rotation: npt.NDArray[np.float32]
    params: dict[str, dict[str, dict[str, float]]]
    reports: dict[str, dict[str, Any]]


def fit(split: Split, options: FitOptions = DEFAULT_OPTIONS, query_pairs: Sequence[tuple[F32, F32]] = ()) -> FitResult:
    """Fit R on the support split and choose the SLERP / NLERP weights and the adaptive (a, b, c_ref).

    fit_modalities for one split.
    """
    multi = fit_modalities({"text": split}, options, query_pairs)
    return FitResult(rotation=multi.rotation, params=multi.params["text"], report=multi.reports["text"])


def fit_modalities(
    splits: Mapping[str, Split],
    options: FitOptions = DEFAULT_OPTIONS,
    query_pairs: Sequence[tuple[F32, F32]] = (),
) -> MultiFit:
    """Fit one R on the pairs of every modality's split; choose each modality's blend weights on its own folds.

    Folds are drawn per id over all splits together; fold f's R never sees fold f's rows of any split,
    and each modality is scored on its own held-out queries against its own held-out (or whole) gallery.
    options: fit_on, folds, same_set, eval_queries (per fold), seed, criterion, eval_gallery and
    query_pairs_weight are read; the rest (the head, the adapter's, the folders) is the caller's.
    query_pairs: unlabelled (new, old) pairs added, times options.query_pairs_weight, to every R fit (never scored).
    """
    fit_on, folds, same_set, seed = options.fit_on, options.folds, options.same_set, options.seed
    criterion, eval_gallery, query_pairs_weight = options.criterion, options.eval_gallery, options.query_pairs_weight
    if not splits:
        raise InputError("no support set given")
    check_criterion(criterion)
    if eval_gallery not in ("fold", "support"):
        raise InputError(f"eval gallery must be fold or support, not {eval_gallery!r}")
    names = list(splits)
    for s in splits.values():
        check_fit_args(s, fit_on, folds, same_set)
    plan = CrossFitPlan.draw(
        splits,
        folds=folds,
        same_set=same_set,
        seed=seed,
        max_eval_queries=options.eval_queries,
        eval_gallery=eval_gallery,
    )
    blocks = {m: fit_blocks(s, fit_on) for m, s in splits.items()}
    held: dict[str, list[Held]] = {m: [] for m in names}
    scored_rows: dict[str, list[tuple[I64, I64]]] = {m: [] for m in names}  # (queries, gallery) per fold
    held_without: dict[str, list[Held]] = {m: [] for m in names}  # the same folds, R without query_pairs
    oof_cos: dict[str, F64] = {}
    extra = _query_pairs_cov(query_pairs, query_pairs_weight)
    if same_set:
        m_all = total([cross_covariance(b.new, b.old) for m in names for b in blocks[m]])
        r_thin = thin_rotation(m_all + extra)
        r_without = thin_rotation(m_all) if query_pairs else None
        (only,) = plan.folds
        for m, s in splits.items():
            part = only.rows[m]
            held[m].append(score_fold(s, r_thin, part.scored, part.gallery))
            scored_rows[m].append((part.scored, part.gallery))
            if r_without is not None:
                held_without[m].append(score_fold(s, r_without, part.scored, part.gallery))
    else:
        per_fold_m = fold_covariances(plan, blocks)
        m_total = total(per_fold_m)
        r_thin = thin_rotation(m_total + extra)
        cos_parts: dict[str, list[F64]] = {m: [] for m in names}
        for fold, m_fold in zip(plan.folds, per_fold_m, strict=True):
            # R for fold f never sees fold f's rows: subtract its cross-covariance from the total.
            r_f = thin_rotation(m_total - m_fold + extra)
            r_f_without = thin_rotation(m_total - m_fold) if query_pairs else None  # one SVD per fold
            for m, s in splits.items():
                part = fold.rows[m]
                cos_parts[m].append(_cosines(s.old_query[part.queries], s.new_query[part.queries], r_f))
                held[m].append(score_fold(s, r_f, part.scored, part.gallery))
                scored_rows[m].append((part.scored, part.gallery))
                if r_f_without is not None:
                    held_without[m].append(score_fold(s, r_f_without, part.scored, part.gallery))
        oof_cos = {m: np.concatenate(parts) for m, parts in cos_parts.items()}
    # Only the [d_new, d_old] block of R is ever read; the completion makes the stored R square.
    r_final = complete_rotation(r_thin)
    params: dict[str, dict[str, dict[str, float]]] = {}
    reports: dict[str, dict[str, Any]] = {}
    for m, s in splits.items():
        final_cos = _cosines(s.old_query, s.new_query, r_thin)
        c_ref = float(np.median(final_cos if same_set else oof_cos[m]))
        params[m], curves = choose_blends(held[m], c_ref, criterion)
        report: dict[str, Any] = {
            **report_basics(s, blocks[m], held[m], fit_on, folds, same_set, criterion, eval_gallery),
            "alpha_grid": list(ALPHA_GRID),
            "slope_grid": list(SLOPE_GRID),
            **curves,
            "residual_angle_deg": angle_stats(np.arccos(final_cos)),
            "new_to_new": new_to_new(s, scored_rows[m]),
        }
        if len(splits) > 1:
            report["fit_rows_all_modalities"] = int(sum(len(b.new) for n in names for b in blocks[n]))
        if not same_set:
            report["residual_angle_deg_out_of_fold"] = angle_stats(np.arccos(oof_cos[m]))
        if query_pairs:
            report["query_pairs"] = _query_pairs_report(
                report, held_without[m], c_ref, criterion, query_pairs, query_pairs_weight
            )
        best_head, why = head_choice(report)
        report["best_head"] = {"head": best_head, "why": why}
        reports[m] = report
    return MultiFit(rotation=r_final, params=params, reports=reports)


def _cosines(old: F32, new: F32, r: F32) -> F64:
    """u . v per row, u = normalised old, v = aligned new (the padding coordinates of u are zero)."""
    out = np.empty(len(old), dtype=np.float64)
    chunk = 16384
    for s in range(0, len(old), chunk):
        v = aligned_old_coords(new[s : s + chunk], r, old.shape[1])
        u = normalize_rows(old[s : s + chunk])
        out[s : s + chunk] = np.einsum("ij,ij->i", u, v, dtype=np.float64)
    return np.clip(out, -1.0, 1.0)


def _query_pairs_cov(query_pairs: Sequence[tuple[F32, F32]], weight: float) -> F64:
    """weight x the cross-covariance of the unlabelled (new, old) pairs; a [1, 1] zero (adds nothing) when none."""
    if not query_pairs:
        return np.zeros((1, 1))  # broadcasts as +0 onto any [d_new, d_old] matrix
    if not (np.isfinite(weight) and weight >= 0.0):
        raise InputError(f"the query-pairs weight must be a finite number >= 0, got {weight}")
    return weight * total([cross_covariance(new, old) for new, old in query_pairs])


def _query_pairs_report(
    report: dict[str, Any],
    held_without: Sequence[Held],
    c_ref: float,
    criterion: str,
    query_pairs: Sequence[tuple[F32, F32]],
    weight: float,
) -> dict[str, Any]:
    """What the query pairs did to the cross-fitted curve: aligned and chosen-SLERP scores with and without them."""
    params_without, curves_without = choose_blends(held_without, c_ref, criterion)
    with_rows = report["support_recall"]["slerp"]
    without_rows = curves_without["support_recall"]["slerp"]
    chosen_with, chosen_without = report["chosen"]["slerp"], curves_without["chosen"]["slerp"]

    def point(rows: Sequence[dict[str, float]], chosen: dict[str, float]) -> dict[str, float]:
        aligned = rows[-1]  # alpha = 1: the map alone
        return {
            "aligned_r1": aligned["recall@1"],
            "aligned_se@1": aligned["se@1"],
            "slerp_alpha": chosen["alpha"],
            "slerp_r1": chosen["recall@1"],
            "slerp_se@1": chosen["se@1"],
            "slerp_mrr@10": chosen["mrr@10"],
        }

    with_, without = point(with_rows, chosen_with), point(without_rows, chosen_without)
    # The standard error of the chosen point (spread over folds): the curve's own noise at R@1.
    gain, se = with_["slerp_r1"] - without["slerp_r1"], max(with_["slerp_se@1"], without["slerp_se@1"])
    # Same-set scores are biased toward whichever R saw the scored pairs: say which curve this is.
    curve = "cross-fitted" if report["selection"] == "cross-fit" else "same-set (biased)"
    if gain > se:
        verdict = f"the query pairs lift the {curve} slerp R@1 by {gain:.4f} (> its standard error {se:.4f})"
    elif gain < -se:
        verdict = (
            f"warning: the query pairs lower the {curve} slerp R@1 by {-gain:.4f} (> its standard error "
            f"{se:.4f}); fit without them (docs/traffic-learning.md)"
        )
    else:
        verdict = (
            f"the query pairs change the {curve} slerp R@1 by {gain:+.4f}, within its standard error {se:.4f}: "
            "no measurable gain for the blend (aligned alone may still gain)"
        )
    return {
        "verdict": verdict,
        "pairs": int(sum(len(new) for new, _ in query_pairs)),
        "weight": weight,
        "labelled_rows": report.get("fit_rows_all_modalities", report["fit_rows"]),  # one R over every modality
        "with": with_,
        "without": without,
        "delta_aligned_r1": with_["aligned_r1"] - without["aligned_r1"],
        "delta_slerp_r1": with_["slerp_r1"] - without["slerp_r1"],
        "curve_r1_without": [r["recall@1"] for r in without_rows],
        "params_without": params_without,
    }
