"""Choosing the blend weight on a support set: cross-fitted by default, the paper's same-set rule on request.

Cross-fitting (default, k folds): every id (query_ids and target_ids together) is assigned to one fold,
so a query and its relevant targets always share a fold.  For fold f, R is fitted on the rows of the
other folds (query rows, target rows or both, per `fit_on`), and every weight on the grid is scored
by Recall@1 of fold f's queries against a gallery of fold f's old targets only -- the held-out
gallery, so neither R nor the gallery has seen those ids.  Recalls are averaged over folds.  This
removes the bias of the same-set rule, where R was fitted on the very pairs that score alpha, which
makes v look better than it is and pushes alpha toward 1.
Same-set (`same_set=True`, 002_... protocol): R on all support rows, alpha scored on all support
queries against all support targets.
Either way the final R is refitted on all support rows.  At most `max_eval_queries` queries per fold
(a seeded random subset) are scored against the whole held-out gallery to bound the cost; every query
still feeds the residual-angle statistics and the adaptive reference cosine c_ref (median u . v of
out-of-fold pairs).  Ties go to the better Recall@5, then Recall@10, then the smaller weight / slope.

Each fold costs two matmuls whatever the grid (see arcsearch.py), so one pass scores SLERP and NLERP
at every alpha in ALPHA_GRID and adaptive NLERP at every (a, b) in ALPHA_GRID x SLOPE_GRID.
`fit_on="both"` stacks the query pairs with the target pairs where new_target.npy exists (query
pairs only otherwise; the report's `fit_blocks` says which were used).

`fit_mapped_slerp` does the same for a learnt map in place of R (the adapter+slerp head): the map is
trained once per fold on the other folds' rows (k trainings, then one on everything), and SLERP
between u and the map's output is scored on the held-out fold exactly as above.  A trained map has
no cheap "subtract the fold" trick, so its cost is (folds + 1) trainings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from service.compat.arcsearch import PathSummary, summarise_blends, summarise_path
from service.compat.io import Split
from service.compat.metrics import KS, recall_at_k, relevance
from service.compat.procrustes import (
    aligned_old_coords,
    complete_rotation,
    cross_covariance,
    normalize_rows,
    thin_rotation,
)
from service.errors import InputError

FitOn = Literal["query", "target", "both"]
F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
ALPHA_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))
SLOPE_GRID: tuple[float, ...] = (-8.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 8.0)
MAX_EVAL_QUERIES = 5000


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


def _assign_folds(split: Split, folds: int, rng: np.random.Generator) -> tuple[I64, I64]:
    """Fold of every query row and every target row, drawn per id so relevant pairs share a fold.

    Query ids are dealt round-robin over a random permutation first, so every fold gets queries;
    ids that only targets carry (distractors) are dealt the same way afterwards.
    """
    q_ids = np.unique(split.query_ids)
    t_only = np.setdiff1d(np.unique(split.target_ids), q_ids)
    ids = np.concatenate([q_ids, t_only])
    fold_of = np.empty(len(ids), dtype=np.int64)
    fold_of[: len(q_ids)][rng.permutation(len(q_ids))] = np.arange(len(q_ids)) % folds
    fold_of[len(q_ids) :][rng.permutation(len(t_only))] = np.arange(len(t_only)) % folds
    order = np.argsort(ids)
    sorted_ids = ids[order]
    q = fold_of[order[np.searchsorted(sorted_ids, split.query_ids)]]
    t = fold_of[order[np.searchsorted(sorted_ids, split.target_ids)]]
    return q, t


def _total(mats: Sequence[F64]) -> F64:
    """Element-wise sum of equally shaped cross-covariances."""
    out: F64 = np.sum(np.stack(mats), axis=0)
    return out


def _block_cov(block: _Block, rows: npt.NDArray[np.bool_]) -> F64:
    """Cross-covariance of the selected rows of one block."""
    return cross_covariance(block.new[rows], block.old[rows])


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


def _recalls(held: Sequence[_Held], lam_of: Callable[[_Held], npt.NDArray[np.floating]]) -> dict[int, float]:
    """Recall@K averaged over folds for the weights lam_of(held) -> per-query lam."""
    per_fold = [recall_at_k(h.summary.ranks(lam_of(h)), KS) for h in held]
    return {k: float(np.mean([f[k] for f in per_fold])) for k in KS}


def _slerp_weights(alpha: float) -> Callable[[_Held], F64]:
    """Per-query weight on v of SLERP(alpha) in the linear form the path summary reads."""
    return lambda h: slerp_lambda(alpha, h.theta)


def _nlerp_weights(alpha: float) -> Callable[[_Held], F64]:
    """NLERP's weight on v is alpha itself."""
    return lambda h: np.full(len(h.theta), alpha)


def _adaptive_weights(a: float, b: float, c_ref: float) -> Callable[[_Held], F64]:
    """Adaptive NLERP's per-query weight clip(a + b (cos - c_ref), 0, 1)."""
    return lambda h: np.clip(a + b * (h.cos - c_ref), 0.0, 1.0)


def _row(alpha: float, rec: dict[int, float]) -> dict[str, float]:
    """One line of the support-recall curve."""
    return {"alpha": alpha, **{f"recall@{k}": rec[k] for k in KS}}


def _best(rows: list[dict[str, float]], tiebreak: Callable[[dict[str, float]], Any]) -> dict[str, float]:
    """Highest Recall@1, then @5, then @10, then the tiebreak key (larger is preferred)."""
    return max(rows, key=lambda r: (r["recall@1"], r["recall@5"], r["recall@10"], tiebreak(r)))


def _check_fit_args(split: Split, fit_on: str, folds: int, same_set: bool) -> None:
    """Refuse fit options that cannot work on this split (InputError naming the option)."""
    if fit_on not in ("query", "target", "both"):
        raise InputError(f"--fit-on must be query, target or both, not {fit_on!r}")
    if not same_set and folds < 2:
        raise InputError(f"--folds must be at least 2 for cross-fitting, got {folds}")
    if not same_set and len(np.unique(split.query_ids)) < folds:
        raise InputError(f"{split.path / 'old_query.npy'}: fewer distinct query ids than --folds {folds}")


def _sample_rows(rows: I64, cap: int, rng: np.random.Generator) -> I64:
    """At most `cap` of `rows`, a seeded sample kept in order (held-out scoring cost is bounded)."""
    if len(rows) <= cap:
        return rows
    return np.sort(rng.choice(rows, cap, replace=False))


def _report_basics(
    split: Split, blocks: Sequence[_Block], held: Sequence[_Held], fit_on: FitOn, folds: int, same_set: bool
) -> dict[str, Any]:
    """The fit-report fields every head shares: how alpha was selected and on which rows."""
    return {
        "selection": "same-set" if same_set else "cross-fit",
        "folds": 1 if same_set else folds,
        "fit_on": fit_on,
        "fit_blocks": [b.name for b in blocks],
        "fit_rows": int(sum(len(b.new) for b in blocks)),
        "support_queries": len(split.old_query),
        "support_targets": len(split.old_target),
        "eval_queries": int(sum(h.summary.n_queries for h in held)),
        "eval_gallery": "all support targets" if same_set else "old targets of the held-out fold",
    }


def fit(
    split: Split,
    *,
    fit_on: FitOn = "both",
    folds: int = 5,
    same_set: bool = False,
    max_eval_queries: int = MAX_EVAL_QUERIES,
    seed: int = 0,
) -> FitResult:
    """Fit R on the support split and choose the SLERP / NLERP weights and the adaptive (a, b, c_ref)."""
    _check_fit_args(split, fit_on, folds, same_set)
    rng = np.random.default_rng(seed)
    blocks = _fit_blocks(split, fit_on)
    held: list[_Held] = []
    oof_cos = np.empty(0)
    if same_set:
        m_total = _total([cross_covariance(b.new, b.old) for b in blocks])
        r_thin = thin_rotation(m_total)
        q_rows = np.arange(len(split.old_query))
        q_rows = _sample_rows(q_rows, max_eval_queries, rng)
        held.append(_score_fold(split, r_thin, q_rows, np.arange(len(split.old_target))))
        final_cos = _cosines(split.old_query, split.new_query, r_thin)
        c_ref = float(np.median(final_cos))
    else:
        q_fold, t_fold = _assign_folds(split, folds, rng)
        fold_of = {"query": q_fold, "target": t_fold}
        per_fold_m = [_total([_block_cov(b, fold_of[b.name] == f) for b in blocks]) for f in range(folds)]
        m_total = _total(per_fold_m)
        r_thin = thin_rotation(m_total)
        cos_parts = []
        for f in range(folds):
            # R for fold f never sees fold f's rows: subtract its cross-covariance from the total.
            r_f = thin_rotation(m_total - per_fold_m[f])
            q_all = np.flatnonzero(q_fold == f)
            cos_parts.append(_cosines(split.old_query[q_all], split.new_query[q_all], r_f))
            q_rows = q_all
            q_rows = _sample_rows(q_rows, max_eval_queries, rng)
            held.append(_score_fold(split, r_f, q_rows, np.flatnonzero(t_fold == f)))
        oof_cos = np.concatenate(cos_parts)
        c_ref = float(np.median(oof_cos))
        final_cos = _cosines(split.old_query, split.new_query, r_thin)
    # Only the [d_new, d_old] block of R is ever read; the completion makes the stored R square.
    r_final = complete_rotation(r_thin)

    slerp_rows = [_row(a, _recalls(held, _slerp_weights(a))) for a in ALPHA_GRID]
    nlerp_rows = [_row(a, _recalls(held, _nlerp_weights(a))) for a in ALPHA_GRID]
    adaptive_rows = []
    for b in SLOPE_GRID:
        for a in ALPHA_GRID:
            rec = _recalls(held, _adaptive_weights(a, b, c_ref))
            adaptive_rows.append({"a": a, "b": b, **{f"recall@{k}": rec[k] for k in KS}})
    best_slerp = _best(slerp_rows, lambda r: -r["alpha"])
    best_nlerp = _best(nlerp_rows, lambda r: -r["alpha"])
    best_adaptive = _best(adaptive_rows, lambda r: (-abs(r["b"]), -r["a"]))

    params = {
        "slerp": {"alpha": best_slerp["alpha"]},
        "nlerp": {"alpha": best_nlerp["alpha"]},
        "adaptive": {"a": best_adaptive["a"], "b": best_adaptive["b"], "c_ref": c_ref},
    }
    report: dict[str, Any] = {
        **_report_basics(split, blocks, held, fit_on, folds, same_set),
        "alpha_grid": list(ALPHA_GRID),
        "slope_grid": list(SLOPE_GRID),
        "support_recall": {"slerp": slerp_rows, "nlerp": nlerp_rows},
        "chosen": {"slerp": best_slerp, "nlerp": best_nlerp, "adaptive": {**best_adaptive, "c_ref": c_ref}},
        "residual_angle_deg": angle_stats(np.arccos(final_cos)),
    }
    if not same_set:
        report["residual_angle_deg_out_of_fold"] = angle_stats(np.arccos(oof_cos))
    return FitResult(rotation=r_final, params=params, report=report)


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
    fit_map: Callable[[F32, F32], M],
    *,
    mode: str = "adapter+slerp",
    fit_on: FitOn = "both",
    folds: int = 5,
    same_set: bool = False,
    max_eval_queries: int = MAX_EVAL_QUERIES,
    seed: int = 0,
) -> MappedFit[M]:
    """Choose SLERP's weight between u and a learnt map's output, cross-fitting the map like R above.

    fit_map(new [n, d_new], old [n, d_old]) trains a map on paired rows; it is called once per fold on
    the other folds' rows and once more on every row (the map that is kept).
    """
    _check_fit_args(split, fit_on, folds, same_set)
    rng = np.random.default_rng(seed)
    blocks = _fit_blocks(split, fit_on)
    held: list[_Held] = []
    fold_seconds: list[float] = []
    oof_cos = np.empty(0)
    if not same_set:
        q_fold, t_fold = _assign_folds(split, folds, rng)
        fold_of = {"query": q_fold, "target": t_fold}
        cos_parts = []
        for f in range(folds):
            started = time.perf_counter()
            # The fold-f map never sees fold f's rows, neither its queries nor its targets.
            mapper_f = fit_map(*_stack(blocks, [fold_of[b.name] != f for b in blocks]))
            fold_seconds.append(round(time.perf_counter() - started, 3))
            q_all = np.flatnonzero(q_fold == f)
            cos_parts.append(_mapped_cos(split, mapper_f, q_all)[2])
            q_rows = q_all
            q_rows = _sample_rows(q_rows, max_eval_queries, rng)
            held.append(_score_mapped(split, mapper_f, q_rows, np.flatnonzero(t_fold == f)))
        oof_cos = np.concatenate(cos_parts)
    mapper = fit_map(*_stack(blocks))
    if same_set:
        q_rows = np.arange(len(split.old_query))
        q_rows = _sample_rows(q_rows, max_eval_queries, rng)
        held.append(_score_mapped(split, mapper, q_rows, np.arange(len(split.old_target))))
    final_cos = _mapped_cos(split, mapper, np.arange(len(split.old_query)))[2]

    rows = [_row(a, _recalls(held, _slerp_weights(a))) for a in ALPHA_GRID]
    best = _best(rows, lambda r: -r["alpha"])
    report: dict[str, Any] = {
        **_report_basics(split, blocks, held, fit_on, folds, same_set),
        "alpha_grid": list(ALPHA_GRID),
        "support_recall": {mode: rows},
        "chosen": {mode: best},
        "residual_angle_deg": angle_stats(np.arccos(final_cos)),
    }
    if not same_set:
        report["residual_angle_deg_out_of_fold"] = angle_stats(np.arccos(oof_cos))
        report["fold_fit_seconds"] = fold_seconds
    return MappedFit(mapper=mapper, alpha=float(best["alpha"]), report=report)
