"""Scoring held-out folds along the blend path: the support curves a weight is chosen on.

A fold's held-out queries are summarised once along the whole u -> v path (arcsearch.py: two matmuls
whatever the grid), so one pass scores SLERP and NLERP at every alpha in ALPHA_GRID and adaptive NLERP
at every (a, b) in ALPHA_GRID x SLOPE_GRID.  A curve row is one weight's fold-averaged R@1/5/10,
MRR@10 and their mean, with standard errors (criteria.py picks the row); `new_to_new` is the
re-indexed ceiling on the same rows.  selection.py (R) and mapped_selection.py (a learnt map) score
their folds here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.compat.arcsearch import PathSummary, summarise_blends
from service.compat.criteria import choose, choose_adaptive
from service.compat.io import Split
from service.compat.metrics import KS, ranks, relevance
from service.compat.procrustes import normalize_rows
from service.rows import F32, F64, I64

ALPHA_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))
SLOPE_GRID: tuple[float, ...] = (-8.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True)
class Held:
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


def score_fold(split: Split, r: F32, q_rows: I64, t_rows: I64) -> Held:
    """Summarise the whole u -> v path for the given query rows against the given old-target rows."""
    rel = relevance(split.query_ids[q_rows], split.target_ids[t_rows])
    targets = normalize_rows(split.old_target[t_rows])
    summary, theta, cos = summarise_blends(split.old_query[q_rows], split.new_query[q_rows], r, targets, rel, k=max(KS))
    return Held(summary, theta, cos)


def new_to_new(split: Split, parts: Sequence[tuple[I64, I64]]) -> dict[str, float] | None:
    """The re-indexed ceiling on the same held-out rows: new queries against new targets (nothing fitted)."""
    if split.new_target is None:
        return None
    scores = []
    for q_rows, t_rows in parts:
        rel = relevance(split.query_ids[q_rows], split.target_ids[t_rows])
        rank = ranks(normalize_rows(split.new_query[q_rows]), normalize_rows(split.new_target[t_rows]), rel)
        rr = np.where(rank < max(KS), 1.0 / (rank.astype(np.float64) + 1.0), 0.0)
        scores.append(np.stack([*(rank < k for k in KS), rr], axis=1).astype(np.float64))
    return curve_row({}, scores)


def fold_scores(held: Sequence[Held], lam_of: Callable[[Held], npt.NDArray[np.floating]]) -> list[F64]:
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


def curve_row(keys: dict[str, float], scores: Sequence[F64]) -> dict[str, float]:
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


def slerp_weights(alpha: float) -> Callable[[Held], F64]:
    """Per-query weight on v of SLERP(alpha) in the linear form the path summary reads."""
    return lambda h: slerp_lambda(alpha, h.theta)


def _nlerp_weights(alpha: float) -> Callable[[Held], F64]:
    """NLERP's weight on v is alpha itself."""
    return lambda h: np.full(len(h.theta), alpha)


def _adaptive_weights(a: float, b: float, c_ref: float) -> Callable[[Held], F64]:
    """Adaptive NLERP's per-query weight clip(a + b (cos - c_ref), 0, 1)."""
    return lambda h: np.clip(a + b * (h.cos - c_ref), 0.0, 1.0)


def choose_blends(
    held: Sequence[Held], c_ref: float, criterion: str
) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """SLERP / NLERP / adaptive curves over the held-out folds and the parameters the criterion picks."""
    slerp_rows = [curve_row({"alpha": a}, fold_scores(held, slerp_weights(a))) for a in ALPHA_GRID]
    nlerp_rows = [curve_row({"alpha": a}, fold_scores(held, _nlerp_weights(a))) for a in ALPHA_GRID]
    adaptive_rows = [
        curve_row({"a": a, "b": b}, fold_scores(held, _adaptive_weights(a, b, c_ref)))
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
