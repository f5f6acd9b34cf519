"""The quality curve of a migration: R@1 and R@10 of hybrid search as a share of the gallery moves.

Offline and exact, on a test split (old and new targets): for a moved share f, the first f of the
targets in the move order are "in the segment" (ranked by new query . new row, through the merge's
per-query map), the rest stay in the old gallery (compatible query . old row).  The same merge rules as the
service (segment/merge.py), computed as ranks: a relevant target's merged rank is the number of
non-relevant targets of either side scoring above it (rrf: above it in fused score).  Orders are
nested, as a backfill's are: what moved at 10 % is still moved at 25 %.  Intervals: a bootstrap over
queries (percentiles 2.5 / 97.5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from service.compat.calibration import IDENTITY, ScoreMap
from service.compat.io import Split
from service.compat.metrics import relevance
from service.compat.procrustes import normalize_rows
from service.compat.uncertainty import bootstrap_picks, interval95
from service.errors import InputError
from service.rows import F32, I64
from service.segment.merge import RRF_K
from service.vocabulary import Merge

if TYPE_CHECKING:
    from service.compat.profile import CompatProfile

_CHUNK = 128
BOOTSTRAP = 1000


@dataclass(frozen=True)
class Spaces:
    """A split's two searches: the compatible queries over old rows, the new queries over new rows."""

    served: F32  # [n, d_old] unit
    old_targets: F32  # [m, d_old] unit
    new_queries: F32  # [n, d_new] unit
    new_targets: F32  # [m, d_new] unit
    rel_target: I64  # [n] the relevant target of each query (-1: none)

    @classmethod
    def of(cls, split: Split, served: F32) -> Spaces:
        """From a split with new targets and the compatible queries of its old / new queries."""
        if split.new_target is None:
            raise ValueError(f"{split.path}: no new_target.npy; the migration curve needs both targets")
        rel = relevance(split.query_ids, split.target_ids)
        first = np.full(len(split.query_ids), -1, dtype=np.int64)
        first[rel.query_index[::-1]] = rel.target_index[::-1]  # one relevant target per query (the first)
        return cls(
            normalize_rows(served),
            normalize_rows(split.old_target),
            normalize_rows(split.new_query),
            normalize_rows(split.new_target),
            first,
        )


def merged_ranks(spaces: Spaces, moved: npt.NDArray[np.bool_], method: Merge, score_map: ScoreMap) -> I64:
    """Rank (0 = top) of each query's relevant target in the hybrid list; len(targets) when it has none."""
    n, m = len(spaces.served), len(spaces.old_targets)
    out = np.full(n, m, dtype=np.int64)
    for start in range(0, n, _CHUNK):
        rows = np.arange(start, min(n, start + _CHUNK))
        old = spaces.served[rows] @ spaces.old_targets.T
        new = spaces.new_queries[rows] @ spaces.new_targets.T
        if method == Merge.calibrated:
            new = score_map.apply(new, score_map.offsets(spaces.served[rows], spaces.new_queries[rows]))
        scores = np.where(moved[None, :], new, old)
        if method == Merge.rrf:
            scores = _fused(old, new, moved)
        target = spaces.rel_target[rows]
        has = target >= 0
        ref = scores[np.arange(len(rows)), np.maximum(target, 0)]
        ref_moved = moved[np.maximum(target, 0)]
        # Ties go to the old side: a moved relevant target loses a tie with an old one, and wins one with a moved one.
        above = (scores > ref[:, None]) | ((scores == ref[:, None]) & ~moved[None, :] & ref_moved[:, None])
        above[np.arange(len(rows)), np.maximum(target, 0)] = False
        out[rows[has]] = above.sum(axis=1)[has]
    return out


def _fused(old: F32, new: F32, moved: npt.NDArray[np.bool_]) -> F32:
    """RRF scores: 1 / (RRF_K + rank within its own list), the old list over unmoved targets only."""
    fused = np.empty_like(old)
    for side, scores in ((~moved, old), (moved, new)):
        cols = np.flatnonzero(side)
        if not len(cols):
            continue
        part = scores[:, cols]
        rank = np.argsort(np.argsort(-part, axis=1, kind="stable"), axis=1) + 1
        fused[:, cols] = 1.0 / (RRF_K + rank)
    return fused


def move_order(m: int, seed: int) -> I64:
    """A random order of the targets, as `backfill run --order random` draws one."""
    return np.random.default_rng(seed).permutation(m).astype(np.int64)


def curve(
    spaces: Spaces,
    fractions: Sequence[float],
    order: I64,
    method: Merge,
    score_map: ScoreMap = IDENTITY,
    weights: npt.NDArray[np.float64] | None = None,
    seed: int = 0,
    old_right: npt.NDArray[np.bool_] | None = None,
) -> list[dict[str, Any]]:
    """R@1 / R@10 (with bootstrap intervals) at each moved share; `weights`: how often each query is asked.

    old_right: which queries the old system (old query, old gallery) answered right at rank 1; each row
    then has `negative_flips@1`, the share of queries it answered right that this state answers wrong
    (the regression an operator sees, as the online-backfilling literature reports it), with its interval.
    """
    m = len(spaces.old_targets)
    picks = bootstrap_picks(len(spaces.served), BOOTSTRAP, seed)
    w = np.ones(len(spaces.served)) if weights is None else weights
    rows = []
    for fraction in fractions:
        moved = np.zeros(m, dtype=bool)
        moved[order[: int(round(fraction * m))]] = True
        rank = merged_ranks(spaces, moved, method, score_map)
        row: dict[str, Any] = {"fraction": fraction, "moved": int(moved.sum())}
        for k in (1, 10):
            hit = (rank < k).astype(np.float64)
            row[f"recall@{k}"] = float(np.dot(hit, w) / w.sum())
            row[f"ci@{k}"] = list(interval95((hit[picks] * w[picks]).sum(axis=1) / w[picks].sum(axis=1)))
        if old_right is not None:
            flipped = (old_right & (rank >= 1)).astype(np.float64)
            row["negative_flips@1"] = float(np.dot(flipped, w) / w.sum())
            row["flips_ci"] = list(interval95((flipped[picks] * w[picks]).sum(axis=1) / w[picks].sum(axis=1)))
        rows.append(row)
    return rows


def old_system_right(split: Split, spaces: Spaces) -> npt.NDArray[np.bool_]:
    """Which queries the old system answers right at rank 1: the old queries over the old targets, nothing moved."""
    old = Spaces(normalize_rows(split.old_query), spaces.old_targets, spaces.new_queries, spaces.new_targets,
                 spaces.rel_target)  # fmt: skip
    right: npt.NDArray[np.bool_] = (
        merged_ranks(old, np.zeros(len(spaces.old_targets), dtype=bool), Merge.raw, IDENTITY) == 0
    )
    return right


def zipf_weights(n: int, s: float, seed: int) -> npt.NDArray[np.float64]:
    """How often each of n queries is asked under Zipf(s) popularity, the popularity ranks drawn at random."""
    ranks = np.random.default_rng(seed).permutation(n) + 1
    weights: npt.NDArray[np.float64] = 1.0 / ranks.astype(np.float64) ** s
    return weights / float(weights.sum())


def hot_order(spaces: Spaces, weights: npt.NDArray[np.float64], samples: int, seed: int, k: int = 10) -> I64:
    """The targets as `--order hot` would move them: by how often sampled traffic got them, then the rest at random.

    Traffic: `samples` queries drawn by `weights`, each answered by the compatible search of the old
    gallery (nothing moved yet), its top-k ids counted, as the service's hit counter does.
    """
    rng = np.random.default_rng(seed)
    asked = rng.choice(len(spaces.served), size=samples, p=weights)
    counts = np.zeros(len(spaces.old_targets), dtype=np.int64)
    unique, times = np.unique(asked, return_counts=True)
    for start in range(0, len(unique), _CHUNK):
        rows = unique[start : start + _CHUNK]
        scores = spaces.served[rows] @ spaces.old_targets.T
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        np.add.at(counts, top.ravel(), np.repeat(times[start : start + _CHUNK], k))
    counted = np.flatnonzero(counts)
    counted = counted[np.argsort(-counts[counted], kind="stable")]
    rest = move_order(len(counts), seed + 1)
    return np.concatenate([counted, rest[~np.isin(rest, counted)]]).astype(np.int64)


def gain_share(rows: list[dict[str, Any]], key: str = "recall@1") -> list[float]:
    """Per row, the share of the whole migration's gain reached: (R - R at 0 %) / (R at 100 % - R at 0 %)."""
    start, end = rows[0][key], rows[-1][key]
    return [(r[key] - start) / (end - start) if end != start else 0.0 for r in rows]


def compatible_queries(
    profile_dir: Path, test_dir: Path, modality: str | None, needs: str
) -> tuple[CompatProfile, str, Split, F32]:
    """A profile, the modality scored (default: its first), a test split with new targets, the split's served queries.

    `needs` says why new_target.npy is required, for the refusal.
    """
    from service.compat.heads import transform_in_chunks
    from service.compat.io import load_split
    from service.compat.profile import load_profile

    profile = load_profile(profile_dir)
    modality = modality or (sorted(profile.alphas) or ["text"])[0]
    split = load_split(test_dir, old_dim=profile.old_dim, new_dim=profile.new_dim)
    if split.new_target is None:
        raise InputError(f"{test_dir}: no new_target.npy; {needs}")
    served = transform_in_chunks(profile, profile.head, split.old_query, split.new_query, modality).queries
    return profile, modality, split, served
