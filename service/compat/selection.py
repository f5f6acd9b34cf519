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
fit and the learnt map's fit below both walk.
Same-set (`same_set=True`, 002_... protocol): R on all support rows, alpha scored on all support
queries against all support targets.
Either way the final R is refitted on all support rows.  At most `max_eval_queries` queries per fold
(a seeded random subset) are scored to bound the cost; every query still feeds the residual-angle
statistics and the adaptive reference cosine c_ref (median u . v of out-of-fold pairs).

Each weight gets R@1/5/10, MRR@10 and the mean of R@1/5/10, averaged over folds, with a standard
error from their spread over the folds.  The criterion (CRITERIA, docs/alpha-selection.md for the
measurements) picks the weight: the arg-max of one score, or -- the default, "mrr-1se" -- the median
of the weights whose MRR@10 is within one standard error of the best, and weight 0 whenever that
plateau reaches it (the data cannot tell the blend from the old system).  Ties go to the better
Recall@1, @5, @10, then the smaller weight.  `head_choice` says whether NLERP or adaptive beats SLERP
by more than the standard error.

Each fold costs two matmuls whatever the grid (see arcsearch.py), so one pass scores SLERP and NLERP
at every alpha in ALPHA_GRID and adaptive NLERP at every (a, b) in ALPHA_GRID x SLOPE_GRID.
`fit_on="both"` stacks the query pairs with the target pairs where new_target.npy exists (query
pairs only otherwise; the report's `fit_blocks` says which were used).  `fit_modalities` fits one R
over several splits (one per query modality), drawing folds per id over all of them, and chooses
each modality's weights on its own held-out queries.

Unlabelled query pairs (`query_pairs`, e.g. sampled from live traffic by service/traffic/) join the
fit of R only: their cross-covariance, times `query_pairs_weight`, is added to every fold's and to the
final one, so they shape R but never score alpha (the held-out folds stay labelled support).  The
report's `query_pairs` block compares the cross-fitted curve with and without them on the same folds.

`fit_mapped_slerp` does the same for a learnt map in place of R (the adapter heads): the map is
trained once per fold on the other folds' rows (k trainings, then one on everything), and SLERP
between u and the map's output is scored on the held-out queries against the same held-out gallery
(after every epoch, for early stopping).  A trained map has no cheap "subtract the fold" trick, so
its cost is (folds + 1) trainings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from service.compat.arcsearch import PathSummary, summarise_blends, summarise_path
from service.compat.crossfit import MAX_EVAL_GALLERY, CrossFitPlan, FoldRows
from service.compat.fit_options import FitOptions
from service.compat.io import Split
from service.compat.metrics import KS, ranks, relevance
from service.compat.procrustes import (
    aligned_old_coords,
    complete_rotation,
    cross_covariance,
    normalize_rows,
    thin_rotation,
)
from service.errors import InputError
from service.rows import F32, F64, I64
from service.vocabulary import Criterion, EvalGallery, FitOn

DEFAULT_EVAL_GALLERY = EvalGallery.support
ALPHA_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))
SLOPE_GRID: tuple[float, ...] = (-8.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 8.0)
MAX_EVAL_QUERIES = 5000
# `nobackfill fit`'s defaults: what a fit called without options selects with.
DEFAULT_OPTIONS = FitOptions()
_ONLY = "support"  # the one split's name in the cross-fit plan of fit_mapped_slerp


class RowMap(Protocol):
    """A fitted map from new embeddings to unit rows in the old space (e.g. a TrainedAdapter)."""

    def apply(self, new: npt.NDArray[np.floating]) -> F32:
        """Map rows [n, d_new] to unit rows [n, d_old]."""
        ...


M = TypeVar("M", bound=RowMap)


@dataclass(frozen=True)
class FitResult:
    """Final R, the chosen parameters per blending mode, and the JSON-able fit report."""

    rotation: npt.NDArray[np.float32]
    params: dict[str, dict[str, float]]
    report: dict[str, Any]


@dataclass(frozen=True)
class _Block:
    """Paired rows R can be fitted on: the query pairs or the target pairs of the split."""

    name: str
    new: F32
    old: F32
    ids: I64


@dataclass(frozen=True)
class _Held:
    """One scored fold: path summary plus per-query angle and cosine."""

    summary: PathSummary
    theta: npt.NDArray[np.float64]
    cos: npt.NDArray[np.float64]


def slerp_lambda(alpha: float, theta: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Weight on v of the renormalised linear form of SLERP(alpha): sin(a t) / (sin((1-a) t) + sin(a t))."""
    c1 = np.sin((1.0 - alpha) * theta)
    c2 = np.sin(alpha * theta)
    den = c1 + c2
    # theta ~ 0: SLERP tends to the linear blend, whose weight on v is alpha itself.
    return np.where(den > 1e-12, c2 / np.maximum(den, 1e-12), alpha)


def angle_stats(theta: npt.NDArray[np.floating]) -> dict[str, float]:
    """Mean / median / p5 / p95 of angles, in degrees."""
    deg = np.degrees(np.asarray(theta, dtype=np.float64))
    if deg.size == 0:
        return {"mean": 0.0, "median": 0.0, "p5": 0.0, "p95": 0.0}
    return {
        "mean": float(deg.mean()),
        "median": float(np.median(deg)),
        "p5": float(np.percentile(deg, 5)),
        "p95": float(np.percentile(deg, 95)),
    }


def _fit_blocks(split: Split, fit_on: FitOn) -> list[_Block]:
    """The paired blocks R is fitted on; `both` uses target pairs only where new_target.npy exists."""
    blocks = []
    if fit_on in ("query", "both"):
        blocks.append(_Block("query", split.new_query, split.old_query, split.query_ids))
    if fit_on in ("target", "both") and split.new_target is not None:
        blocks.append(_Block("target", split.new_target, split.old_target, split.target_ids))
    if fit_on == "target" and split.new_target is None:
        raise InputError(f"{split.path / 'new_target.npy'}: missing (needed by --fit-on target)")
    return blocks


def support_pairs(split: Split, fit_on: FitOn) -> tuple[F32, F32, list[str]]:
    """All (new, old) pairs a map is fitted on for `fit_on`, and the names of the blocks used."""
    blocks = _fit_blocks(split, fit_on)
    new, old = _stack(blocks)
    return new, old, [b.name for b in blocks]


def _total(mats: Sequence[F64]) -> F64:
    """Element-wise sum of equally shaped cross-covariances."""
    out: F64 = np.sum(np.stack(mats), axis=0)
    return out


def _block_cov(block: _Block, rows: npt.NDArray[np.bool_]) -> F64:
    """Cross-covariance of the selected rows of one block."""
    return cross_covariance(block.new[rows], block.old[rows])


def _fold_covariances(plan: CrossFitPlan, blocks: Mapping[str, Sequence[_Block]]) -> list[F64]:
    """Per fold of the plan, the cross-covariance of its own rows of every block (what its fit leaves out)."""
    return [
        _total([_block_cov(b, fold.rows[m].in_fold(b.name)) for m in blocks for b in blocks[m]]) for fold in plan.folds
    ]


def _cosines(old: F32, new: F32, r: F32) -> F64:
    """u . v per row, u = normalised old, v = aligned new (the padding coordinates of u are zero)."""
    out = np.empty(len(old), dtype=np.float64)
    chunk = 16384
    for s in range(0, len(old), chunk):
        v = aligned_old_coords(new[s : s + chunk], r, old.shape[1])
        u = normalize_rows(old[s : s + chunk])
        out[s : s + chunk] = np.einsum("ij,ij->i", u, v, dtype=np.float64)
    return np.clip(out, -1.0, 1.0)


def _score_fold(split: Split, r: F32, q_rows: I64, t_rows: I64) -> _Held:
    """Summarise the whole u -> v path for the given query rows against the given old-target rows."""
    rel = relevance(split.query_ids[q_rows], split.target_ids[t_rows])
    targets = normalize_rows(split.old_target[t_rows])
    summary, theta, cos = summarise_blends(split.old_query[q_rows], split.new_query[q_rows], r, targets, rel, k=max(KS))
    return _Held(summary, theta, cos)


def _new_to_new(split: Split, parts: Sequence[tuple[I64, I64]]) -> dict[str, float] | None:
    """The re-indexed ceiling on the same held-out rows: new queries against new targets (nothing fitted)."""
    if split.new_target is None:
        return None
    scores = []
    for q_rows, t_rows in parts:
        rel = relevance(split.query_ids[q_rows], split.target_ids[t_rows])
        rank = ranks(normalize_rows(split.new_query[q_rows]), normalize_rows(split.new_target[t_rows]), rel)
        rr = np.where(rank < max(KS), 1.0 / (rank.astype(np.float64) + 1.0), 0.0)
        scores.append(np.stack([*(rank < k for k in KS), rr], axis=1).astype(np.float64))
    return _curve_row({}, scores)


def _fold_scores(held: Sequence[_Held], lam_of: Callable[[_Held], npt.NDArray[np.floating]]) -> list[F64]:
    """Per fold, per held-out query: hit@1, hit@5, hit@10 and reciprocal rank (0 past rank 10), [n, 4]."""
    out = []
    for h in held:
        rank = h.summary.ranks(lam_of(h))
        hits = [rank < k for k in KS]
        rr = np.where(rank < max(KS), 1.0 / (rank.astype(np.float64) + 1.0), 0.0)
        out.append(np.stack([*hits, rr], axis=1).astype(np.float64))
    return out


def _se(per_fold: F64, per_query: F64) -> float:
    """Standard error of a fold-averaged score: the spread over folds, or over queries for a single fold."""
    if len(per_fold) > 1:
        return float(np.std(per_fold, ddof=1) / np.sqrt(len(per_fold)))
    return float(np.std(per_query, ddof=1) / np.sqrt(len(per_query))) if len(per_query) > 1 else 0.0


def _curve_row(keys: dict[str, float], scores: Sequence[F64]) -> dict[str, float]:
    """One point of a support curve: fold-averaged R@1/5/10, MRR@10, their mean, and standard errors."""
    means = np.stack([s.mean(axis=0) for s in scores])  # [folds, 4]
    everything = np.concatenate(scores)
    mean3_fold = means[:, :3].mean(axis=1)
    mean3_query = everything[:, :3].mean(axis=1)
    row = {**keys, **{f"recall@{k}": float(means[:, i].mean()) for i, k in enumerate(KS)}}
    row["mrr@10"] = float(means[:, 3].mean())
    row["mean@1-10"] = float(mean3_fold.mean())
    row["se@1"] = _se(means[:, 0], everything[:, 0])
    row["se_mrr@10"] = _se(means[:, 3], everything[:, 3])
    row["se_mean@1-10"] = _se(mean3_fold, mean3_query)
    return row


def _slerp_weights(alpha: float) -> Callable[[_Held], F64]:
    """Per-query weight on v of SLERP(alpha) in the linear form the path summary reads."""
    return lambda h: slerp_lambda(alpha, h.theta)


def _nlerp_weights(alpha: float) -> Callable[[_Held], F64]:
    """NLERP's weight on v is alpha itself."""
    return lambda h: np.full(len(h.theta), alpha)


def _adaptive_weights(a: float, b: float, c_ref: float) -> Callable[[_Held], F64]:
    """Adaptive NLERP's per-query weight clip(a + b (cos - c_ref), 0, 1)."""
    return lambda h: np.clip(a + b * (h.cos - c_ref), 0.0, 1.0)


# criterion -> (score read off a curve row, its standard error, "centre of the one-SE set" or arg-max)
_CRITERIA: dict[str, tuple[str, str, bool]] = {
    Criterion.r1: ("recall@1", "se@1", False),
    Criterion.mean: ("mean@1-10", "se_mean@1-10", False),
    Criterion.mrr: ("mrr@10", "se_mrr@10", False),
    Criterion.r1_1se: ("recall@1", "se@1", True),
    Criterion.mean_1se: ("mean@1-10", "se_mean@1-10", True),
    Criterion.mrr_1se: ("mrr@10", "se_mrr@10", True),
}
CRITERIA: tuple[str, ...] = tuple(c.value for c in Criterion)
DEFAULT_CRITERION = Criterion.mrr_1se
CRITERION_TEXT: dict[str, str] = {
    Criterion.r1: "arg-max of R@1",
    Criterion.mean: "arg-max of the mean of R@1, R@5, R@10",
    Criterion.mrr: "arg-max of MRR@10",
    Criterion.r1_1se: "centre of the weights within one standard error of the best R@1",
    Criterion.mean_1se: "centre of the weights within one standard error of the best mean of R@1/5/10",
    Criterion.mrr_1se: "centre of the weights within one standard error of the best MRR@10",
}


def check_criterion(criterion: str) -> None:
    """Refuse an unknown selection criterion (InputError listing the known ones)."""
    if criterion not in _CRITERIA:
        raise InputError(f"--criterion must be one of {', '.join(CRITERIA)}, not {criterion!r}")


def choose(rows: Sequence[dict[str, float]], criterion: str, weight: str = "alpha") -> dict[str, float]:
    """The row a criterion picks from a 1-d curve (`weight` names its grid key); ties: R@1, @5, @10, smaller weight.

    One-SE rules: the rows whose score is within one standard error of the best form a plateau the data
    cannot tell apart; its median weight is chosen (the lower one of an even count), so noise moving
    the arg-max along a flat top does not move the choice.  The standard error is the median over the
    grid of each row's: one row's spread over 5 folds is itself noisy.  When the plateau reaches weight 0
    the data cannot tell the blend from the old system, so weight 0 it is: never below old -> old.
    """
    check_criterion(criterion)
    score, _, plateau = _CRITERIA[criterion]
    best = max(rows, key=lambda r: (r[score], r["recall@1"], r["recall@5"], r["recall@10"], -r[weight]))
    if not plateau:
        return best
    near = sorted((r for r in rows if r[score] >= best[score] - curve_se(rows, criterion)), key=lambda r: r[weight])
    return near[0] if near[0][weight] == 0.0 else near[(len(near) - 1) // 2]


def curve_se(rows: Sequence[dict[str, float]], criterion: str) -> float:
    """The standard error a one-SE rule uses on this curve: the median of its rows' standard errors."""
    return float(np.median([r[_CRITERIA[criterion][1]] for r in rows]))


def choose_adaptive(rows: Sequence[dict[str, float]], criterion: str) -> dict[str, float]:
    """The (a, b) a criterion picks on the adaptive grid: arg-max, or the one-SE set's smallest |b| and centre a."""
    check_criterion(criterion)
    score, _, plateau = _CRITERIA[criterion]
    best = max(rows, key=lambda r: (r[score], r["recall@1"], r["recall@5"], r["recall@10"], -abs(r["b"]), -r["a"]))
    if not plateau:
        return best
    near = [r for r in rows if r[score] >= best[score] - curve_se(rows, criterion)]
    flattest = min(abs(r["b"]) for r in near)
    return choose([r for r in near if abs(r["b"]) == flattest], criterion, weight="a") if len(near) > 1 else best


def _check_fit_args(split: Split, fit_on: str, folds: int, same_set: bool) -> None:
    """Refuse fit options that cannot work on this split (InputError naming the option)."""
    if fit_on not in ("query", "target", "both"):
        raise InputError(f"--fit-on must be query, target or both, not {fit_on!r}")
    if not same_set and folds < 2:
        raise InputError(f"--folds must be at least 2 for cross-fitting, got {folds}")
    if not same_set and len(np.unique(split.query_ids)) < folds:
        raise InputError(f"{split.path / 'old_query.npy'}: fewer distinct query ids than --folds {folds}")


def _report_basics(
    split: Split,
    blocks: Sequence[_Block],
    held: Sequence[_Held],
    fit_on: FitOn,
    folds: int,
    same_set: bool,
    criterion: str,
    eval_gallery: EvalGallery = EvalGallery.fold,
) -> dict[str, Any]:
    """The fit-report fields every head shares: how alpha was selected and on which rows."""
    gallery = (
        "all support targets"
        if same_set
        else f"old targets of every fold (at most {MAX_EVAL_GALLERY:,})"
        if eval_gallery == "support"
        else "old targets of the held-out fold"
    )
    return {
        "selection": "same-set" if same_set else "cross-fit",
        "criterion": criterion,
        "criterion_text": CRITERION_TEXT[criterion],
        "folds": 1 if same_set else folds,
        "fit_on": fit_on,
        "fit_blocks": [b.name for b in blocks],
        "fit_rows": int(sum(len(b.new) for b in blocks)),
        "support_queries": len(split.old_query),
        "support_targets": len(split.old_target),
        "eval_queries": int(sum(h.summary.n_queries for h in held)),
        "eval_gallery": gallery,
    }


def head_choice(report: dict[str, Any]) -> tuple[str, str]:
    """The blend the cross-fitted curves favour, and why: NLERP / adaptive only when it beats SLERP by > 1 SE.

    Scores are the criterion's, at each mode's chosen point; the margin is the standard error of the
    SLERP curve (curve_se).
    """
    criterion = report.get("criterion", DEFAULT_CRITERION)
    score = _CRITERIA[criterion][0]
    chosen = report["chosen"]
    base = chosen["slerp"]
    se = curve_se(report["support_recall"]["slerp"], criterion)
    margins = {m: chosen[m][score] - base[score] for m in ("nlerp", "adaptive") if m in chosen}
    mode, gain = max(margins.items(), key=lambda kv: kv[1], default=("slerp", 0.0))
    if gain > se:
        return mode, f"{mode} beats slerp on the cross-fitted {score} by {gain:.4f} (> the standard error {se:.4f})"
    return "slerp", f"no blend beats slerp on the cross-fitted {score} by more than the standard error {se:.4f}"


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
        _check_fit_args(s, fit_on, folds, same_set)
    plan = CrossFitPlan.draw(
        splits,
        folds=folds,
        same_set=same_set,
        seed=seed,
        max_eval_queries=options.eval_queries,
        eval_gallery=eval_gallery,
    )
    blocks = {m: _fit_blocks(s, fit_on) for m, s in splits.items()}
    held: dict[str, list[_Held]] = {m: [] for m in names}
    scored_rows: dict[str, list[tuple[I64, I64]]] = {m: [] for m in names}  # (queries, gallery) per fold
    held_without: dict[str, list[_Held]] = {m: [] for m in names}  # the same folds, R without query_pairs
    oof_cos: dict[str, F64] = {}
    extra = _query_pairs_cov(query_pairs, query_pairs_weight)
    if same_set:
        m_all = _total([cross_covariance(b.new, b.old) for m in names for b in blocks[m]])
        r_thin = thin_rotation(m_all + extra)
        r_without = thin_rotation(m_all) if query_pairs else None
        (only,) = plan.folds
        for m, s in splits.items():
            part = only.rows[m]
            held[m].append(_score_fold(s, r_thin, part.scored, part.gallery))
            scored_rows[m].append((part.scored, part.gallery))
            if r_without is not None:
                held_without[m].append(_score_fold(s, r_without, part.scored, part.gallery))
    else:
        per_fold_m = _fold_covariances(plan, blocks)
        m_total = _total(per_fold_m)
        r_thin = thin_rotation(m_total + extra)
        cos_parts: dict[str, list[F64]] = {m: [] for m in names}
        for fold, m_fold in zip(plan.folds, per_fold_m, strict=True):
            # R for fold f never sees fold f's rows: subtract its cross-covariance from the total.
            r_f = thin_rotation(m_total - m_fold + extra)
            r_f_without = thin_rotation(m_total - m_fold) if query_pairs else None  # one SVD per fold
            for m, s in splits.items():
                part = fold.rows[m]
                cos_parts[m].append(_cosines(s.old_query[part.queries], s.new_query[part.queries], r_f))
                held[m].append(_score_fold(s, r_f, part.scored, part.gallery))
                scored_rows[m].append((part.scored, part.gallery))
                if r_f_without is not None:
                    held_without[m].append(_score_fold(s, r_f_without, part.scored, part.gallery))
        oof_cos = {m: np.concatenate(parts) for m, parts in cos_parts.items()}
    # Only the [d_new, d_old] block of R is ever read; the completion makes the stored R square.
    r_final = complete_rotation(r_thin)
    params: dict[str, dict[str, dict[str, float]]] = {}
    reports: dict[str, dict[str, Any]] = {}
    for m, s in splits.items():
        final_cos = _cosines(s.old_query, s.new_query, r_thin)
        c_ref = float(np.median(final_cos if same_set else oof_cos[m]))
        params[m], curves = _choose_blends(held[m], c_ref, criterion)
        report: dict[str, Any] = {
            **_report_basics(s, blocks[m], held[m], fit_on, folds, same_set, criterion, eval_gallery),
            "alpha_grid": list(ALPHA_GRID),
            "slope_grid": list(SLOPE_GRID),
            **curves,
            "residual_angle_deg": angle_stats(np.arccos(final_cos)),
            "new_to_new": _new_to_new(s, scored_rows[m]),
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


def _query_pairs_cov(query_pairs: Sequence[tuple[F32, F32]], weight: float) -> F64:
    """weight x the cross-covariance of the unlabelled (new, old) pairs; a [1, 1] zero (adds nothing) when none."""
    if not query_pairs:
        return np.zeros((1, 1))  # broadcasts as +0 onto any [d_new, d_old] matrix
    if not (np.isfinite(weight) and weight >= 0.0):
        raise InputError(f"the query-pairs weight must be a finite number >= 0, got {weight}")
    return weight * _total([cross_covariance(new, old) for new, old in query_pairs])


def _query_pairs_report(
    report: dict[str, Any],
    held_without: Sequence[_Held],
    c_ref: float,
    criterion: str,
    query_pairs: Sequence[tuple[F32, F32]],
    weight: float,
) -> dict[str, Any]:
    """What the query pairs did to the cross-fitted curve: aligned and chosen-SLERP scores with and without them."""
    params_without, curves_without = _choose_blends(held_without, c_ref, criterion)
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


def _choose_blends(
    held: Sequence[_Held], c_ref: float, criterion: str
) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """SLERP / NLERP / adaptive curves over the held-out folds and the parameters the criterion picks."""
    slerp_rows = [_curve_row({"alpha": a}, _fold_scores(held, _slerp_weights(a))) for a in ALPHA_GRID]
    nlerp_rows = [_curve_row({"alpha": a}, _fold_scores(held, _nlerp_weights(a))) for a in ALPHA_GRID]
    adaptive_rows = [
        _curve_row({"a": a, "b": b}, _fold_scores(held, _adaptive_weights(a, b, c_ref)))
        for b in SLOPE_GRID
        for a in ALPHA_GRID
    ]
    best_slerp = choose(slerp_rows, criterion)
    best_nlerp = choose(nlerp_rows, criterion)
    best_adaptive = choose_adaptive(adaptive_rows, criterion)
    params = {
        "slerp": {"alpha": best_slerp["alpha"]},
        "nlerp": {"alpha": best_nlerp["alpha"]},
        "adaptive": {"a": best_adaptive["a"], "b": best_adaptive["b"], "c_ref": c_ref},
    }
    curves = {
        "support_recall": {"slerp": slerp_rows, "nlerp": nlerp_rows},
        "chosen": {"slerp": best_slerp, "nlerp": best_nlerp, "adaptive": {**best_adaptive, "c_ref": c_ref}},
    }
    return params, curves


@dataclass(frozen=True)
class MappedFit(Generic[M]):
    """The map fitted on all support rows, the chosen SLERP weight and the JSON-able fit report."""

    mapper: M
    alpha: float
    report: dict[str, Any]


def _stack(blocks: Sequence[_Block], masks: Sequence[npt.NDArray[np.bool_]] | None = None) -> tuple[F32, F32]:
    """The (new, old) training pairs of the blocks, optionally restricted to rows where masks hold."""
    if masks is None:
        return np.concatenate([b.new for b in blocks]), np.concatenate([b.old for b in blocks])
    new = np.concatenate([b.new[m] for b, m in zip(blocks, masks, strict=True)])
    old = np.concatenate([b.old[m] for b, m in zip(blocks, masks, strict=True)])
    return new, old


def _mapped_cos(split: Split, mapper: RowMap, rows: I64) -> tuple[F32, F32, F64]:
    """u, v = map(new) and u . v for the given query rows (both unit, old space)."""
    u = normalize_rows(split.old_query[rows])
    v = normalize_rows(mapper.apply(split.new_query[rows]))
    cos = np.clip(np.einsum("ij,ij->i", u, v, dtype=np.float64), -1.0, 1.0)
    return u, v, cos


def _score_mapped(split: Split, mapper: RowMap, q_rows: I64, t_rows: I64) -> _Held:
    """Path summary of u -> map(new) for the query rows against the given old-target rows."""
    rel = relevance(split.query_ids[q_rows], split.target_ids[t_rows])
    targets = normalize_rows(split.old_target[t_rows])
    u, v, cos = _mapped_cos(split, mapper, q_rows)
    theta = np.arctan2(np.sqrt(np.maximum(0.0, 1.0 - cos * cos)), cos)
    return _Held(summarise_path(u, v, targets, rel, k=max(KS)), theta, cos)


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
    _check_fit_args(split, fit_on, folds, same_set)
    check_criterion(criterion)
    plan = CrossFitPlan.draw(
        {_ONLY: split},
        folds=folds,
        same_set=same_set,
        seed=options.seed,
        max_eval_queries=options.eval_queries,
        eval_gallery=eval_gallery,
    )
    blocks = _fit_blocks(split, fit_on)
    held: list[_Held] = []
    by_epoch: list[list[_Held]] = []  # [fold][epoch]
    procrustes: list[_Held] = []
    fold_seconds: list[float] = []
    oof_cos = np.empty(0)
    stopping: dict[str, Any] | None = None
    if not same_set:
        per_fold_m = _fold_covariances(plan, {_ONLY: blocks})
        m_total = _total(per_fold_m)
        cos_parts = []
        for fold, m_fold in zip(plan.folds, per_fold_m, strict=True):
            part = fold.rows[_ONLY]
            epochs_f: list[_Held] = []

            def hook(_: int, live: RowMap, part: FoldRows = part, out: list[_Held] = epochs_f) -> None:
                out.append(_score_mapped(split, live, part.scored, part.gallery))

            started = time.perf_counter()
            # The fold-f map never sees fold f's rows, neither its queries nor its targets.
            pairs = _stack(blocks, [part.train(b.name) for b in blocks])
            mapper_f = fit_map(*pairs, on_epoch=hook) if early_stop else fit_map(*pairs)
            fold_seconds.append(round(time.perf_counter() - started, 3))
            cos_parts.append(_mapped_cos(split, mapper_f, part.queries)[2])
            held.append(_score_mapped(split, mapper_f, part.scored, part.gallery))
            by_epoch.append(epochs_f)
            procrustes.append(_score_fold(split, thin_rotation(m_total - m_fold), part.scored, part.gallery))
        oof_cos = np.concatenate(cos_parts)
        if early_stop:
            stopping = _early_stop(by_epoch, criterion)
            held = [epochs[stopping["epochs"] - 1] for epochs in by_epoch]
    if stopping is not None:
        mapper = fit_map(*_stack(blocks), stop_after=stopping["epochs"])
    else:
        mapper = fit_map(*_stack(blocks))
    if same_set:
        (only,) = plan.folds
        held.append(_score_mapped(split, mapper, only.rows[_ONLY].scored, only.rows[_ONLY].gallery))
    final_cos = _mapped_cos(split, mapper, np.arange(len(split.old_query)))[2]

    rows = [_curve_row({"alpha": a}, _fold_scores(held, _slerp_weights(a))) for a in ALPHA_GRID]
    best = choose(rows, criterion)
    report: dict[str, Any] = {
        **_report_basics(split, blocks, held, fit_on, folds, same_set, criterion, eval_gallery),
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


def _early_stop(by_epoch: Sequence[Sequence[_Held]], criterion: str) -> dict[str, Any]:
    """The fewest epochs whose held-out score (the map alone) is within one standard error of the best epoch's.

    The map alone, not the blend: a blend's score hardly moves while its weight stays near 0, so it
    would stop an adapter that is still learning.
    """
    score = _CRITERIA[criterion][0]
    n_epochs = min(len(e) for e in by_epoch)
    curve = [
        {"epoch": e + 1, **_curve_row({"alpha": 1.0}, _fold_scores([ep[e] for ep in by_epoch], _slerp_weights(1.0)))}
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
    held: Sequence[_Held], procrustes: Sequence[_Held], rows: Sequence[dict[str, float]], criterion: str, mode: str
) -> dict[str, Any]:
    """Held-out R@1 of the map against Procrustes on the same queries: alone (weight 1) and blended by SLERP."""
    map_alone = _curve_row({"alpha": 1.0}, _fold_scores(held, _slerp_weights(1.0)))
    r_alone = _curve_row({"alpha": 1.0}, _fold_scores(procrustes, _slerp_weights(1.0)))
    r_rows = [_curve_row({"alpha": a}, _fold_scores(procrustes, _slerp_weights(a))) for a in ALPHA_GRID]
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
