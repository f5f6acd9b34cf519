"""Merging the old gallery's hits with the segment's into one top-k: what hybrid search returns.

Both lists come in sorted, -1 / -inf padded.  The old list never holds a moved item (its search
excluded them), so an id appears at most once; except that a live store (a pgvector column) may move
an item between the two searches of one request, and then the id is kept once, where it ranks higher.
Three ways to put them on one scale:
    calibrated  the segment's scores through the profile's ScoreMap (compat/calibration.py), each row
                shifted by its query's offset, the old
                scores as they are: with nothing moved, the result is the compatible search's, scores
                included
    raw         both cosines as they are
    rrf         reciprocal rank fusion, 1 / (RRF_K + rank) in each list; scores become RRF scores
Ties go to the old gallery's hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.compat.calibration import ScoreMap
from service.rows import F32, I64
from service.vocabulary import Merge

RRF_K = 60


@dataclass(frozen=True)
class Merged:
    """One top-k per query: scores, ids, and whether each hit came from the segment."""

    scores: F32
    ids: I64
    from_segment: npt.NDArray[np.bool_]


def _rrf(scores: F32) -> F32:
    """1 / (RRF_K + rank) per position of a sorted list; padding gets -inf."""
    ranks = np.arange(1, scores.shape[1] + 1, dtype=np.float32)
    fused = np.broadcast_to(1.0 / (RRF_K + ranks), scores.shape).astype(np.float32)
    return np.where(np.isfinite(scores), fused, -np.inf).astype(np.float32)


def merge(
    old: tuple[F32, I64],
    new: tuple[F32, I64],
    k: int,
    method: Merge,
    score_map: ScoreMap | None = None,
    offsets: F32 | None = None,
) -> Merged:
    """The top-k of both lists on one scale (see the module docstring); offsets: ScoreMap.offsets of each row."""
    old_s, old_i = old
    new_s, new_i = new
    old_s = np.where(old_i >= 0, old_s, -np.inf).astype(np.float32)
    new_s = np.where(new_i >= 0, new_s, -np.inf).astype(np.float32)
    if method == Merge.rrf:
        old_s, new_s = _rrf(old_s), _rrf(new_s)
    elif method == Merge.calibrated and score_map is not None:
        new_s = np.where(np.isfinite(new_s), score_map.apply(new_s, offsets), -np.inf).astype(np.float32)
    scores = np.concatenate([old_s, new_s], axis=1)
    ids = np.concatenate([old_i, new_i], axis=1)
    source = np.concatenate([np.zeros(old_s.shape, bool), np.ones(new_s.shape, bool)], axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")  # stable: the old list's hit wins a tie
    order = _first_of_each_id(scores, ids, order)[:, :k]
    top_s = np.take_along_axis(scores, order, axis=1)
    top_i = np.take_along_axis(ids, order, axis=1)
    top_src = np.take_along_axis(source, order, axis=1)
    empty = ~np.isfinite(top_s)
    top_i = np.where(empty, -1, top_i)
    return Merged(top_s.astype(np.float32), top_i.astype(np.int64), top_src & ~empty)


def _first_of_each_id(scores: F32, ids: I64, order: I64) -> I64:
    """`order` with each id's lower-ranked copy scored -inf (padding); as it was when no id is there twice."""
    ranked = np.take_along_axis(ids, order, axis=1)
    sorted_ids = np.sort(ranked, axis=1)
    if not ((sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)).any():
        return order
    for row in range(len(ranked)):
        _, first = np.unique(ranked[row], return_index=True)
        copy = np.ones(ranked.shape[1], dtype=bool)
        copy[first] = False
        scores[row, order[row][copy & (ranked[row] >= 0)]] = -np.inf
    return np.argsort(-scores, axis=1, kind="stable")
