"""Putting the new-space scores on the old gallery's scale, so hybrid search can merge the two lists.

Hybrid search ranks moved items by new query . new row, and the others by the compatible query .
old row.  The two cosines live on different scales, so the merge maps the new scores onto the old
scale by a line, scale * s + shift, and leaves the old ones untouched: with nothing moved, hybrid is
exactly the compatible search, scores included.

The line is fitted on the support set, which has both targets, for the decision the merge makes at
rank 1.  Per query: r_old / n_old, the best relevant and best non-relevant score in the old space
(compatible query), and r_new / n_new in the new space.  Within a space a monotone map changes
nothing; across spaces the merge is right when a moved relevant target beats the old side's best miss
(scale * r_new + shift > n_old) and an unmoved one beats the segment's best miss (r_old > scale *
n_new + shift), each counted only where that space alone ranks the target first.  The fit maximises
the number of such right decisions: a grid over log(scale), and for each scale the best shift by
sorting.  The support's compatible queries are in-sample for R (their old scores run a little
high); docs/backfill.md measures the result on held-out test sets against raw cosines and RRF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from service.compat.metrics import Relevance  # only the type: profiles load without torch

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
MAX_QUERIES = 5000
_CHUNK = 256


@dataclass(frozen=True)
class ScoreMap:
    """new-space score s -> scale * s + shift on the old gallery's scale."""

    scale: float
    shift: float

    def apply(self, scores: npt.NDArray[np.floating]) -> F32:
        """Mapped scores (padding -inf stays -inf)."""
        return (np.asarray(scores, dtype=np.float32) * np.float32(self.scale) + np.float32(self.shift)).astype(
            np.float32
        )

    def as_dict(self) -> dict[str, float]:
        """JSON form, as the profile stores it."""
        return {"scale": self.scale, "shift": self.shift}

    @classmethod
    def from_dict(cls, data: Any) -> ScoreMap:
        """Parse as_dict's form; ValueError when it is not two finite numbers with a positive scale."""
        scale, shift = float(data["scale"]), float(data["shift"])
        if not (np.isfinite(scale) and np.isfinite(shift) and scale > 0):
            raise ValueError(f"scale must be finite and > 0, shift finite; got {scale}, {shift}")
        return cls(scale, shift)


IDENTITY = ScoreMap(1.0, 0.0)


SCALES = np.exp(np.linspace(np.log(0.05), np.log(20.0), 161))


def best_scores(queries: F32, targets: F32, rel: Relevance, rows: npt.NDArray[np.int64]) -> tuple[F64, F64]:
    """Per query of `rows`: its best relevant score and its best non-relevant score, in one space."""
    starts = np.concatenate([[0], np.cumsum(np.bincount(rel.query_index, minlength=rel.n_queries))])
    hit, miss = np.empty(len(rows)), np.empty(len(rows))
    for start in range(0, len(rows), _CHUNK):
        block = rows[start : start + _CHUNK]
        s = queries[block] @ targets.T
        for i, q in enumerate(block.tolist()):
            relevant = rel.target_index[starts[q] : starts[q + 1]]
            hit[start + i] = s[i, relevant].max()
            s[i, relevant] = -np.inf
            miss[start + i] = s[i].max()
    return hit, miss


def best_line(r_old: F64, n_old: F64, r_new: F64, n_new: F64) -> tuple[ScoreMap, float]:
    """The (scale, shift) with the most right cross-space decisions, and the share of them that are right."""
    new_first, old_first = r_new > n_new, r_old > n_old
    best, chosen = -1, IDENTITY
    for scale in SCALES:
        low = np.sort((n_old - scale * r_new)[new_first])  # shift must be above these
        high = np.sort((r_old - scale * n_new)[old_first])  # ... and below these
        cuts = np.concatenate([low, high])
        if not len(cuts):
            break
        cuts = np.sort(cuts)
        shifts = np.concatenate([[cuts[0] - 1.0], (cuts[:-1] + cuts[1:]) / 2, [cuts[-1] + 1.0]])
        right = np.searchsorted(low, shifts, side="left") + len(high) - np.searchsorted(high, shifts, side="right")
        i = int(np.argmax(right))
        if right[i] > best:
            best, chosen = int(right[i]), ScoreMap(float(scale), float(shifts[i]))
    decisions = int(new_first.sum() + old_first.sum())
    return chosen, best / decisions if decisions else 0.0


def fit_score_map(
    served: F32, old_targets: F32, new_queries: F32, new_targets: F32, rel: Relevance, seed: int = 0
) -> tuple[ScoreMap, dict[str, Any]]:
    """The map of new scores onto the old scale (see the module docstring) and a JSON-able report.

    All rows must be unit: served = the compatible queries, new_queries / new_targets = the new model's.
    """
    rng = np.random.default_rng(seed)
    with_rel = np.unique(rel.query_index)
    rows = with_rel if len(with_rel) <= MAX_QUERIES else np.sort(rng.choice(with_rel, MAX_QUERIES, replace=False))
    r_old, n_old = best_scores(served, old_targets, rel, rows)
    r_new, n_new = best_scores(new_queries, new_targets, rel, rows)
    score_map, right = best_line(r_old, n_old, r_new, n_new)
    report = {
        "method": "rank-1 decisions",
        "queries": int(len(rows)),
        "right_decisions": round(right, 4),
        "median_scores": {
            "old_hit": float(np.median(r_old)),
            "old_miss": float(np.median(n_old)),
            "new_hit": float(np.median(r_new)),
            "new_miss": float(np.median(n_new)),
        },
        **score_map.as_dict(),
    }
    return score_map, report
