"""Retrieval metrics on an exact inner-product search: Recall@K, the compatibility criterion, flip rates.

Relevance is id-based: target j is relevant to query i when query_ids[i] == target_ids[j] (by default
ids are row numbers, so row i is relevant to row i).  A query's rank is the number of non-relevant
targets scoring strictly above its best relevant target (ties count in the query's favour); a query
with no relevant target has rank = number of targets, so it fails at every K.
Search is a chunked torch matmul: memory stays at chunk x n_targets floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from service.compat.io import default_ids
from service.compat.procrustes import normalize_rows

__all__ = ["KS", "Relevance", "default_ids", "flip_rates", "is_compatible", "ranks", "recall_at_k", "relevance"]

KS: tuple[int, ...] = (1, 5, 10)
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Relevance:
    """Every (query, relevant target) pair, as parallel index arrays sorted by query."""

    n_queries: int
    n_targets: int
    query_index: npt.NDArray[np.int64]
    target_index: npt.NDArray[np.int64]

    @property
    def single(self) -> bool:
        """True when no query has more than one relevant target."""
        return bool(np.all(np.bincount(self.query_index, minlength=self.n_queries) <= 1))


def relevance(query_ids: npt.NDArray[np.integer], target_ids: npt.NDArray[np.integer]) -> Relevance:
    """Pair each query with every target that carries the same id."""
    qids = np.asarray(query_ids, dtype=np.int64)
    tids = np.asarray(target_ids, dtype=np.int64)
    order = np.argsort(tids, kind="stable")
    sorted_ids = tids[order]
    lo = np.searchsorted(sorted_ids, qids, side="left")
    hi = np.searchsorted(sorted_ids, qids, side="right")
    counts = hi - lo
    q_index = np.repeat(np.arange(len(qids), dtype=np.int64), counts)
    # Position of each pair inside its query's run, then shifted to that run's start in `order`.
    offsets = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(offsets, counts)
    t_index = order[np.repeat(lo, counts) + within].astype(np.int64)
    return Relevance(len(qids), len(tids), q_index, t_index)


def _pair_starts(rel: Relevance) -> npt.NDArray[np.int64]:
    """Index into the pair arrays where each query's pairs begin (length n_queries + 1)."""
    counts = np.bincount(rel.query_index, minlength=rel.n_queries)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def ranks(
    queries: npt.NDArray[np.floating], targets: npt.NDArray[np.floating], rel: Relevance
) -> npt.NDArray[np.int64]:
    """Rank of each query's best relevant target under exact inner-product search (0 = top hit)."""
    assert queries.ndim == 2 and targets.ndim == 2, "expected 2-d arrays"
    assert queries.shape[1] == targets.shape[1], f"dims differ: {queries.shape[1]} vs {targets.shape[1]}"
    assert (rel.n_queries, rel.n_targets) == (len(queries), len(targets)), "relevance does not fit"
    t = torch.from_numpy(np.ascontiguousarray(targets, dtype=np.float32))
    out = np.full(len(queries), len(targets), dtype=np.int64)
    starts = _pair_starts(rel)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, len(targets)))
    for q0 in range(0, len(queries), chunk):
        q1 = min(q0 + chunk, len(queries))
        scores = torch.from_numpy(np.ascontiguousarray(queries[q0:q1], dtype=np.float32)) @ t.T
        p0, p1 = int(starts[q0]), int(starts[q1])
        if p0 == p1:
            continue
        local_q = torch.from_numpy(rel.query_index[p0:p1] - q0)
        tj = torch.from_numpy(rel.target_index[p0:p1])
        rows = scores[local_q]
        ref = rows[torch.arange(len(tj)), tj]
        # Other relevant targets of the same query must not count against it.
        rows[torch.arange(len(tj)), tj] = -torch.inf
        if not rel.single:
            qi, ti = sibling_pairs(rel, p0, p1)
            rows[torch.from_numpy(qi), torch.from_numpy(ti)] = -torch.inf
        pair_rank = (rows > ref[:, None]).sum(dim=1).numpy()
        # A query's rank is that of its best relevant target, i.e. the minimum over its pairs.
        np.minimum.at(out, rel.query_index[p0:p1], pair_rank)
    return out


def sibling_pairs(rel: Relevance, p0: int, p1: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """For pairs p0..p1: (pair index - p0, target index) for every relevant target of the pair's query."""
    q = rel.query_index[p0:p1]
    starts = _pair_starts(rel)
    counts = starts[q + 1] - starts[q]
    local = np.repeat(np.arange(p1 - p0, dtype=np.int64), counts)
    offsets = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(offsets, counts)
    targets = rel.target_index[np.repeat(starts[q], counts) + within]
    return local, targets


def recall_at_k(rank: npt.NDArray[np.integer], ks: Sequence[int] = KS) -> dict[int, float]:
    """Fraction of queries whose best relevant target is in the top K, for each K."""
    if len(rank) == 0:
        return dict.fromkeys(ks, 0.0)
    return {k: float(np.mean(rank < k)) for k in ks}


def search_recall(
    queries: npt.NDArray[np.floating],
    targets: npt.NDArray[np.floating],
    rel: Relevance,
    ks: Sequence[int] = KS,
) -> dict[int, float]:
    """Recall@K of unit-normalised queries against unit-normalised targets."""
    return recall_at_k(ranks(normalize_rows(queries), normalize_rows(targets), rel), ks)


def is_compatible(recall_new_to_old: float, recall_old_to_old: float) -> bool:
    """Empirical compatibility: the upgraded queries beat the old system strictly on the old gallery."""
    return recall_new_to_old > recall_old_to_old


def flip_rates(old_success: npt.NDArray[np.bool_], new_success: npt.NDArray[np.bool_]) -> tuple[float, float]:
    """(PFR, NFR): share of all queries the old system missed and the new hits, and the reverse."""
    assert old_success.shape == new_success.shape, "success vectors differ in length"
    n = max(1, len(old_success))
    pfr = float(np.sum(~old_success & new_success)) / n
    nfr = float(np.sum(old_success & ~new_success)) / n
    return pfr, nfr
