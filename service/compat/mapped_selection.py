"""Choosing SLERP's weight between u and a learnt map's output (the adapter heads), cross-fitted like R.

`fit_mapped_slerp` does what selection.py does for R with a learnt map in its place: the map is
trained once per fold on the other folds' rows (k trainings, then one on everything), and SLERP
between u and the map's output is scored on the held-out queries against the same held-out gallery
(after every epoch, for early stopping).  A trained map has no cheap "subtract the fold" trick, so
its cost is (folds + 1) trainings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from service.compat.arcsearch import summarise_path
from service.compat.criteria import check_criterion, choose, criterion_score, curve_se
from service.compat.crossfit import CrossFitPlan, FoldRows
from service.compat.curves import ALPHA_GRID, Held, angle_stats, curve_row, fold_scores, score_fold, slerp_weights
from service.compat.fit_options import DEFAULT_OPTIONS, FitOptions
from service.compat.io import Split
from service.compat.metrics import KS, relevance
from service.compat.procrustes import normalize_rows, thin_rotation
from service.compat.support_blocks import (
    check_fit_args,
    fit_blocks,
    fold_covariances,
    report_basics,
    stack_pairs,
    total,
)
from service.rows import F32, F64, I64

_ONLY = "support"  # the one split's name in the cross-fit plan of fit_mapped_slerp


class RowMap(Protocol):
    """A fitted map from new embeddings to unit rows in the old space (e.g. a TrainedAdapter)."""

    def apply(self, new: npt.NDArray[np.floating]) -> F32:
        """Map rows [n, d_new] to unit rows [n, d_old]."""
        ...


M = TypeVar("M", bound=RowMap)


@dataclass(frozen=True)
class MappedFit(Generic[M]):
    """The map fitted on all support rows, the chosen SLERP weight and the JSON-able fit report."""

    mapper: M
    alpha: float
    report: dict[str, Any]


def _mapped_cos(split: Split, mapper: RowMap, rows: I64) -> tuple[F32, F32, F64]:
    """u, v = map(new) and u . v for the given query rows (both unit, old space)."""
    u = normalize_rows(split.old_query[rows])
    v = normalize_rows(mapper.apply(split.new_query[rows]))
    cos = np.clip(np.einsum("ij,ij->i", u, v, dtype=np.float64), -1.0, 1.0)
    return u, v, cos


def _score_mapped(split: Split, mapper: RowMap, q_rows: I64, t_rows: I64) -> Held:
    """Path summary of u -> map(new) for the query rows against the given old-target rows."""
    rel = relevance(split.query_ids[q_rows], split.target_ids[t_rows])
    targets = normalize_rows(split.old_target[t_rows])
    u, v, cos = _mapped_cos(split, mapper, q_rows)
    theta = np.arctan2(np.sqrt(np.maximum(0.0, 1.0 - cos * cos)), cos)
    return Held(summarise_path(u, v, targets, rel, k=max(KS)), theta, cos)


def fit_mapped_slerp(
    split: Split,
    fit_map: Callable[..., M],
    options: FitOptions = DEFAULT_OPTIONS,
    *,
    mode: str = "adapter+slerp",
    early_stop: bool = False,
) -> MappedFit[M]:
    """Choose SLERP's weight between u and a learnt map's output, cross-fitting the map like R above.

    fit_map(new [n, d_new], old [n, d_old]) trains a map on paired rows; it is called once per fold on
    the other folds' rows and once more on every row (the map that is kept).
    early_stop (cross-fit only): fit_map also takes on_epoch= (a hook called with the map after every
    epoch) and stop_after= (epochs to run); every epoch of every fold map is scored on its held-out
    fold, the fewest epochs within one standard error of the best held-out score of the map alone are
    chosen, and the final map is trained for that many (adapter+slerp's weight is then chosen on the
    held-out scores of that epoch).  The report also scores Procrustes
    (R fitted on the same folds) on the same held-out queries, and says when the map loses to it.
    options: as fit_modalities reads them, but query_pairs_weight (a learnt map takes no query pairs).
    """
    fit_on, folds, same_set, criterion, eval_gallery = (
        options.fit_on,
        options.folds,
        options.same_set,
        options.criterion,
        options.eval_gallery,
    )
    check_fit_args(split, fit_on, folds, same_set)
    check_criterion(criterion)
    plan = CrossFitPlan.draw(
        {_ONLY: split},
        folds=folds,
        same_set=same_set,
        seed=options.seed,
        max_eval_queries=options.eval_queries,
        eval_gallery=eval_gallery,
    )
    blocks = fit_blocks(split, fit_on)
    held: list[Held] = []
    by_epoch: list[list[Held]] = []  # [fold][epoch]
    procrustes: list[Held] = []
    fold_seconds: list[float] = []
    oof_cos = np.empty(0)
    stopping: dict[str, Any] | None = None
    if not same_set:
        per_fold_m = fold_covariances(plan, {_ONLY: blocks})
        m_total = total(per_fold_m)
        cos_parts = []
        for fold, m_fold in zip(plan.folds, per_fold_m, strict=True):
            part = fold.rows[_ONLY]
            epochs_f: list[Held] = []

            def hook(_: int, live: RowMap, part: FoldRows = part, out: list[Held] = epochs_f) -> None:
                out.append(_score_mapped(split, live, part.scored, part.gallery))

            started = time.perf_counter()
            # The fold-f map never sees fold f's rows, neither its queries nor its targets.
            pairs = stack_pairs(blocks, [part.train(b.name) for b in blocks])
            mapper_f = fit_map(*pairs, on_epoch=hook) if early_stop else fit_map(*pairs)
            fold_seconds.append(round(time.perf_counter() - started, 3))
            cos_parts.append(_mapped_cos(split, mapper_f, part.queries)[2])
            held.append(_score_mapped(split, mapper_f, part.scored, part.gallery))
            by_epoch.append(epochs_f)
            procrustes.append(score_fold(split, thin_rotation(m_total - m_fold), part.scored, part.gallery))
        oof_cos = np.concatenate(cos_parts)
        if early_stop:
            stopping = _early_stop(by_epoch, criterion)
            held = [epochs[stopping["epochs"] - 1] for epochs in by_epoch]
    if stopping is not None:
        mapper = fit_map(*stack_pairs(blocks), stop_after=stopping["epochs"])
    else:
        mapper = fit_map(*stack_pairs(blocks))
    if same_set:
        (only,) = plan.folds
        held.append(_score_mapped(split, mapper, only.rows[_ONLY].scored, only.rows[_ONLY].gallery))
    final_cos = _mapped_cos(split, mapper, np.arange(len(split.old_query)))[2]

    rows = [curve_row({"alpha": a}, fold_scores(held, slerp_weights(a))) for a in ALPHA_GRID]
    best = choose(rows, criterion)
    report: dict[str, Any] = {
        **report_basics(split, blocks, held, fit_on, folds, same_set, criterion, eval_gallery),
        "alpha_grid": list(ALPHA_GRID),
        "support_recall": {mode: rows},
        "chosen": {mode: best},
        "residual_angle_deg": angle_stats(np.arccos(final_cos)),
    }
    if not same_set:
        report["residual_angle_deg_out_of_fold"] = angle_stats(np.arccos(oof_cos))
        report["fold_fit_seconds"] = fold_seconds
        report["versus_procrustes"] = _versus_procrustes(held, procrustes, rows, criterion, mode)
    if stopping is not None:
        report["early_stopping"] = stopping
    return MappedFit(mapper=mapper, alpha=float(best["alpha"]), report=report)


def _early_stop(by_epoch: Sequence[Sequence[Held]], criterion: str) -> dict[str, Any]:
    """The fewest epochs whose held-out score (the map alone) is within one standard error of the best epoch's.

    The map alone, not the blend: a blend's score hardly moves while its weight stays near 0, so it
    would stop an adapter that is still learning.
    """
    score = criterion_score(criterion)
    n_epochs = min(len(e) for e in by_epoch)
    curve = [
        {"epoch": e + 1, **curve_row({"alpha": 1.0}, fold_scores([ep[e] for ep in by_epoch], slerp_weights(1.0)))}
        for e in range(n_epochs)
    ]
    best = max(curve, key=lambda r: r[score])
    se = curve_se(curve, criterion)
    chosen = min((r for r in curve if r[score] >= best[score] - se), key=lambda r: r["epoch"])
    return {
        "epochs": int(chosen["epoch"]),
        "max_epochs": n_epochs,
        "score": score,
        "rule": "fewest epochs within one standard error of the best held-out epoch",
        "curve": curve,
    }


def _versus_procrustes(
    held: Sequence[Held], procrustes: Sequence[Held], rows: Sequence[dict[str, float]], criterion: str, mode: str
) -> dict[str, Any]:
    """Held-out R@1 of the map against Procrustes on the same queries: alone (weight 1) and blended by SLERP."""
    map_alone = curve_row({"alpha": 1.0}, fold_scores(held, slerp_weights(1.0)))
    r_alone = curve_row({"alpha": 1.0}, fold_scores(procrustes, slerp_weights(1.0)))
    r_rows = [curve_row({"alpha": a}, fold_scores(procrustes, slerp_weights(a))) for a in ALPHA_GRID]
    map_slerp, r_slerp = choose(rows, criterion), choose(r_rows, criterion)
    if mode == "adapter+slerp":
        ours, theirs, what = map_slerp, r_slerp, "adapter+slerp vs Procrustes + SLERP"
    else:
        ours, theirs, what = map_alone, r_alone, "the adapter alone vs Procrustes alone"
    loses = ours["recall@1"] < theirs["recall@1"]
    verdict = (
        f"the adapter loses to Procrustes on the held-out folds ({what}: R@1 "
        f"{ours['recall@1']:.4f} vs {theirs['recall@1']:.4f})"
        if loses
        else f"the adapter beats Procrustes on the held-out folds ({what}: R@1 "
        f"{ours['recall@1']:.4f} vs {theirs['recall@1']:.4f})"
    )
    return {
        "adapter_alone_r1": map_alone["recall@1"],
        "procrustes_alone_r1": r_alone["recall@1"],
        "adapter_slerp_r1": map_slerp["recall@1"],
        "adapter_slerp_alpha": map_slerp["alpha"],
        "procrustes_slerp_r1": r_slerp["recall@1"],
        "procrustes_slerp_alpha": r_slerp["alpha"],
        "adapter_loses": loses,
        "verdict": verdict,
    }
