"""Ranks along the whole u -> v blending path from two matmuls, so alpha grids cost no extra search.

Any blend the heads produce is q = c1 u + c2 v with c1, c2 >= 0 (then renormalised), so its scores
against the gallery are c1 S_u + c2 S_v and, up to a positive factor, (1 - lam) S_u + lam S_v with
lam = c2 / (c1 + c2) in [0, 1].  For a query, its relevant target r and another target j, with
du = S_u[j] - S_u[r] and dv = S_v[j] - S_v[r], target j ranks above r at lam iff
(1 - lam) du + lam dv > 0, which is:
    du > 0 and dv > 0   always                    (counted in `n_both`)
    du > 0 and dv <= 0  iff lam < s,  s = du / (du - dv)   (largest K of these kept in `above_until`)
    du <= 0 and dv > 0  iff lam > s                          (smallest K kept in `above_from`)
    otherwise           never.
Keeping only K thresholds per side is exact for every rank < K, i.e. for Recall@1..K.

Where a query has several relevant targets, each (query, relevant target) pair gets its own summary
with the other relevant targets left out; the query's rank is the minimum over its pairs.
SLERP's theta ~ pi fallback direction lies outside span(u, v) and is approximated by the arc formula
here; it only matters for antipodal pairs, which real upgrades do not produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from service.compat.metrics import Relevance, sibling_pairs
from service.compat.procrustes import aligned_old_coords, normalize_rows

_CHUNK_ELEMENTS = 1 << 24  # ~800 queries x 20k targets: big enough for an efficient matmul


@dataclass(frozen=True)
class PathSummary:
    """Per (query, relevant target) pair: what is needed to rank it at any lam, up to rank k."""

    k: int
    n_queries: int
    query_index: npt.NDArray[np.int64]
    n_both: npt.NDArray[np.int64]
    above_until: npt.NDArray[np.float32]  # [pairs, k], descending, padded with -1 (never)
    above_from: npt.NDArray[np.float32]  # [pairs, k], ascending, padded with 2 (never)

    def ranks(self, lam: npt.NDArray[np.floating]) -> npt.NDArray[np.int64]:
        """Rank per query (capped near k; exact below k) for per-query weights lam [n_queries]."""
        lam_p = np.asarray(lam, dtype=np.float32)[self.query_index][:, None]
        pair_rank = self.n_both + np.sum(self.above_until > lam_p, axis=1) + np.sum(self.above_from < lam_p, axis=1)
        out = np.full(self.n_queries, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(out, self.query_index, pair_rank)
        return out


def _top_per_row(
    rows: torch.Tensor, key: torch.Tensor, values: torch.Tensor, out: npt.NDArray[np.float32], p0: int
) -> None:
    """Write, per row, the values with the k smallest keys (ascending) into out[p0 + row, :k]."""
    if rows.numel() == 0:
        return
    k = out.shape[1]
    # One sort on (row, key): rows are integers and keys lie in [0, 1], so row * 4 + key orders both.
    order = torch.argsort(rows.double() * 4.0 + key.double())
    r, v = rows[order], values[order]
    counts = torch.bincount(r)
    first = torch.cumsum(counts, 0) - counts  # where each row's run starts in the sorted order
    pos = torch.arange(len(r)) - first[r]
    keep = pos < k
    out[p0 + r[keep].numpy(), pos[keep].numpy()] = v[keep].numpy()


def summarise_path(
    u: npt.NDArray[np.float32],
    v: npt.NDArray[np.float32],
    targets: npt.NDArray[np.float32],
    rel: Relevance,
    k: int = 10,
) -> PathSummary:
    """Summarise ranks along the u -> v path for rows u, v [n, d] against targets [m, d] (inner products)."""
    assert u.shape == v.shape and u.shape[1] == targets.shape[1], "u, v and targets must share a dim"
    assert (rel.n_queries, rel.n_targets) == (len(u), len(targets)), "relevance does not fit"
    t = torch.from_numpy(np.ascontiguousarray(targets, dtype=np.float32))
    tu = torch.from_numpy(np.ascontiguousarray(u, dtype=np.float32))
    tv = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
    n_pairs = len(rel.query_index)
    n_both = np.zeros(n_pairs, dtype=np.int64)
    until = np.full((n_pairs, k), -1.0, dtype=np.float32)
    from_ = np.full((n_pairs, k), 2.0, dtype=np.float32)
    starts = np.concatenate([[0], np.cumsum(np.bincount(rel.query_index, minlength=rel.n_queries))])
    chunk = max(1, _CHUNK_ELEMENTS // max(1, len(targets)))
    for q0 in range(0, len(u), chunk):
        q1 = min(q0 + chunk, len(u))
        p0, p1 = int(starts[q0]), int(starts[q1])
        if p0 == p1:
            continue
        local_q = torch.from_numpy(rel.query_index[p0:p1] - q0)
        tj = torch.from_numpy(rel.target_index[p0:p1])
        s_u = tu[q0:q1] @ t.T
        s_v = tv[q0:q1] @ t.T
        if not (rel.single and p1 - p0 == q1 - q0):
            s_u, s_v = s_u[local_q], s_v[local_q]  # one row per (query, relevant target) pair
        ar = torch.arange(p1 - p0)
        ref_u, ref_v = s_u[ar, tj], s_v[ar, tj]
        # Only targets above the relevant one at an endpoint can ever outrank it: keep those, sparsely.
        cand = (s_u > ref_u[:, None]) | (s_v > ref_v[:, None])
        if not rel.single:
            li, ti = sibling_pairs(rel, p0, p1)
            cand[torch.from_numpy(li), torch.from_numpy(ti)] = False
        rows, cols = cand.nonzero(as_tuple=True)
        du = s_u[rows, cols] - ref_u[rows]
        dv = s_v[rows, cols] - ref_v[rows]
        pos_u, pos_v = du > 0, dv > 0
        n_both[p0:p1] = np.bincount(rows[pos_u & pos_v].numpy(), minlength=p1 - p0)
        a_only, b_only = pos_u & ~pos_v, pos_v & ~pos_u
        sa = du[a_only] / (du[a_only] - dv[a_only])
        sb = du[b_only] / (du[b_only] - dv[b_only])
        _top_per_row(rows[a_only], 1.0 - sa, sa, until, p0)  # largest thresholds first
        _top_per_row(rows[b_only], sb, sb, from_, p0)  # smallest thresholds first
    return PathSummary(k, rel.n_queries, rel.query_index.copy(), n_both, until, from_)


def summarise_blends(
    old_query: npt.NDArray[np.floating],
    new_query: npt.NDArray[np.floating],
    r: npt.NDArray[np.float32],
    targets: npt.NDArray[np.float32],
    rel: Relevance,
    k: int = 10,
) -> tuple[PathSummary, npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Path summary of raw old / new queries under R against unit old targets, plus per-query theta, cos."""
    d_old = targets.shape[1]
    u = normalize_rows(old_query)
    v_old = aligned_old_coords(new_query, r, d_old)
    cos = np.clip(np.einsum("ij,ij->i", u, v_old, dtype=np.float64), -1.0, 1.0)
    theta = np.arctan2(np.sqrt(np.maximum(0.0, 1.0 - cos * cos)), cos)
    return summarise_path(u, v_old, targets, rel, k=k), theta, cos
