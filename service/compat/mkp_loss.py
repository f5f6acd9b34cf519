"""The MKP adapter's training loss (003_..., sections 3.2, 4, A): pure functions of tensors, and the samplers
that draw the index tensors they read.  The adapter itself and its training loop: compat/adapter.py.

    L = L_base + lambda * (w_point * P + w_distance * (D_global + D_local) + w_angle * (A_global + A_local))

- L_base: squared L2 between h(new_i) and old_i, averaged over the batch.
- P: squared L2 between g(h(new_i)) and new_i (cycle consistency).
- D: |dist(h_i, h_j) - dist(new_i, new_j)|, Euclidean distances, over (global) random in-batch partners
  of each anchor and (local) the anchor's m nearest in-batch neighbours in the NEW space.
- A: |cos angle(h_i, h_j, h_k) - cos angle(new_i, new_j, new_k)|, angle at vertex j, over (global) random
  in-batch (i, k) pairs and (local) (i, k) pairs drawn from j's m nearest neighbours; at most
  `pairs_per_anchor` pairs per anchor, as in appendix A.1.
Each of P, D_global, D_local, A_global, A_local is a focal-weighted mean: per-item weights
(error / mean error) ** gamma, renormalised to average 1 (gamma = 0 switches re-weighting off).

Every pairwise quantity is read off the two in-batch Gram matrices (h h^T and new new^T), so a batch
costs two [B, B] matmuls on top of the MLPs; nothing of shape [B, m, d] is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from service.compat.adapter import AdapterConfig

DIST_EPS = 1e-12  # floor of a squared distance before its square root (and of a norm in adapter.py)


def base_loss(pred: Tensor, target: Tensor) -> Tensor:
    """Mean over rows of ||pred_i - target_i||^2 (the paper's L_base, averaged instead of summed)."""
    assert pred.shape == target.shape and pred.ndim == 2, f"{tuple(pred.shape)} vs {tuple(target.shape)}"
    return (pred - target).pow(2).sum(dim=1).mean()


def point_errors(recon: Tensor, x: Tensor) -> Tensor:
    """Per-row cycle error ||g(h(x_i)) - x_i||^2, shape [n]."""
    assert recon.shape == x.shape and x.ndim == 2, f"{tuple(recon.shape)} vs {tuple(x.shape)}"
    return (recon - x).pow(2).sum(dim=1)


def focal_weights(errors: Tensor, gamma: float) -> Tensor:
    """Detached weights (e / mean e) ** gamma renormalised to mean 1; all ones when every error is 0."""
    assert errors.ndim == 1 and errors.numel() > 0, f"expected a non-empty vector, got {tuple(errors.shape)}"
    e = errors.detach().clamp_min(0.0)
    if gamma == 0.0:
        return torch.ones_like(e)
    tiny = torch.finfo(e.dtype).tiny
    mean = e.mean()
    w = (e / mean.clamp_min(tiny)).pow(gamma)
    # For gamma = 1 the mean is already 1; other exponents drift, and a mean of 1 keeps lambda's scale.
    w = w / w.mean().clamp_min(tiny)
    # torch.where instead of an `if`: no host sync per call when training on a GPU.
    return torch.where(mean > 0, w, torch.ones_like(w))


def focal_mean(errors: Tensor, gamma: float) -> Tensor:
    """Focal-weighted mean of per-item errors: mean(w_i * e_i) with `focal_weights`."""
    return (focal_weights(errors, gamma) * errors).mean()


def gram(x: Tensor) -> Tensor:
    """In-batch Gram matrix x x^T, shape [n, n]."""
    assert x.ndim == 2, f"expected [n, d], got {tuple(x.shape)}"
    return x @ x.T


def distance_matrix(g: Tensor) -> Tensor:
    """Euclidean distances [n, n] between the rows behind a Gram matrix g [n, n]."""
    assert g.ndim == 2 and g.shape[0] == g.shape[1], f"expected a square Gram matrix, got {tuple(g.shape)}"
    diag = torch.diagonal(g)
    sq = diag[:, None] + diag[None, :] - 2.0 * g
    # Clamping before the sqrt keeps the gradient finite for coincident points (and the diagonal).
    return sq.clamp_min(DIST_EPS).sqrt()


def _take(x: Tensor, i: Tensor, j: Tensor) -> Tensor:
    """x[i, j] for a square matrix x and index vectors i, j (1-d index_select: the fast gather on CPU)."""
    return torch.index_select(x.reshape(-1), 0, i * x.shape[1] + j)


def angle_cosines(g: Tensor, d: Tensor, i: Tensor, j: Tensor, k: Tensor) -> Tensor:
    """cos of the angle at vertex j of triangles (x_i, x_j, x_k), from Gram g and distances d; shape [t]."""
    # <x_i - x_j, x_k - x_j> = g_ik - g_ij - g_kj + g_jj, divided by the two edge lengths.
    dot = _take(g, i, k) - _take(g, i, j) - _take(g, k, j) + _take(g, j, j)
    return dot / (_take(d, i, j) * _take(d, k, j))


def distance_errors(d_out: Tensor, d_in: Tensor, i: Tensor, j: Tensor) -> Tensor:
    """Per-pair |d_out[i, j] - d_in[i, j]| for distance matrices [n, n] and index vectors [p]."""
    assert d_out.shape == d_in.shape, f"distance shapes differ: {tuple(d_out.shape)} vs {tuple(d_in.shape)}"
    assert i.shape == j.shape and i.ndim == 1, "pair indices must be matching vectors"
    return (_take(d_out, i, j) - _take(d_in, i, j)).abs()


def angle_errors(g_out: Tensor, d_out: Tensor, g_in: Tensor, d_in: Tensor, i: Tensor, j: Tensor, k: Tensor) -> Tensor:
    """Per-triplet |cos angle_out(i, j, k) - cos angle_in(i, j, k)| (vertex j), shape [t]."""
    assert g_out.shape == g_in.shape == d_out.shape == d_in.shape, "Gram / distance shapes differ"
    assert i.shape == j.shape == k.shape and i.ndim == 1, "triplet indices must be matching vectors"
    return (angle_cosines(g_out, d_out, i, j, k) - angle_cosines(g_in, d_in, i, j, k)).abs()


def nearest_neighbours(g: Tensor, m: int) -> Tensor:
    """Indices [n, m'] of each row's m' = min(m, n - 1) nearest other rows (Euclidean, from a Gram g)."""
    n = g.shape[0]
    assert g.shape == (n, n) and n >= 2, f"expected a square Gram matrix with n >= 2, got {tuple(g.shape)}"
    diag = torch.diagonal(g)
    sq = diag[:, None] + diag[None, :] - 2.0 * g
    sq.fill_diagonal_(torch.inf)  # a row is not its own neighbour
    return torch.topk(sq, min(m, n - 1), dim=1, largest=False, sorted=False).indices


def _draw_other(upper: int, avoid: Tensor, gen: torch.Generator) -> Tensor:
    """Uniform draw from {0..upper-1} minus {avoid} (0 <= avoid < upper), elementwise."""
    r = (torch.rand(avoid.shape, generator=gen) * (upper - 1)).long().clamp_max(upper - 2)
    return r + (r >= avoid).long()


def sample_pairs(n: int, per_anchor: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(anchor, partner) index vectors [n * per_anchor]: random in-batch partners, never the anchor."""
    assert n >= 2, "pairs need two rows"
    anchor = torch.arange(n).repeat_interleave(per_anchor)
    partner = _draw_other(n, anchor, gen)
    return anchor, partner


def sample_triplets(n: int, per_anchor: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """(i, j, k) index vectors [n * per_anchor], vertex j = anchor, i, k distinct and != j."""
    assert n >= 3, "triplets need three rows"
    j = torch.arange(n).repeat_interleave(per_anchor)
    i = _draw_other(n, j, gen)
    # k avoids j and i: draw among n - 2 slots and skip both (in increasing order of the two).
    lo, hi = torch.minimum(i, j), torch.maximum(i, j)
    k = (torch.rand(j.shape, generator=gen) * (n - 2)).long().clamp_max(n - 3)
    k = k + (k >= lo).long()
    k = k + (k >= hi).long()
    return i, j, k


def local_pairs(nbrs: Tensor) -> tuple[Tensor, Tensor]:
    """(anchor, neighbour) index vectors [n * m'] for every anchor and each of its neighbours."""
    n, mm = nbrs.shape
    return torch.arange(n, device=nbrs.device).repeat_interleave(mm), nbrs.reshape(-1)


def local_triplets(nbrs: Tensor, per_anchor: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """(i, j, k) [n * per_anchor]: vertex j = anchor, i != k drawn from j's neighbour list nbrs [n, m']."""
    n, mm = nbrs.shape
    assert mm >= 2, "local angles need at least two neighbours"
    j = torch.arange(n).repeat_interleave(per_anchor)
    a = (torch.rand(j.shape, generator=gen) * mm).long().clamp_max(mm - 1)
    b = _draw_other(mm, a, gen)
    return nbrs[j, a], j, nbrs[j, b]


@dataclass(frozen=True)
class BatchIndex:
    """The pairs and triplets one batch's preservation losses are evaluated on."""

    global_pairs: tuple[Tensor, Tensor]
    local_pairs: tuple[Tensor, Tensor]
    global_triplets: tuple[Tensor, Tensor, Tensor]
    local_triplets: tuple[Tensor, Tensor, Tensor]


def batch_index(g_new: Tensor, m: int, per_anchor: int, gen: torch.Generator) -> BatchIndex:
    """Draw the global / local pairs and triplets of a batch; neighbours are found in the NEW space."""
    n = g_new.shape[0]
    nbrs = nearest_neighbours(g_new, m)
    dev = g_new.device
    gp = tuple(t.to(dev) for t in sample_pairs(n, per_anchor, gen))
    gt = tuple(t.to(dev) for t in sample_triplets(n, per_anchor, gen))
    lt = tuple(t.to(dev) for t in local_triplets(nbrs.cpu(), per_anchor, gen))
    return BatchIndex((gp[0], gp[1]), local_pairs(nbrs), (gt[0], gt[1], gt[2]), (lt[0], lt[1], lt[2]))


def mkp_loss(
    out: Tensor,
    recon: Tensor,
    new: Tensor,
    old: Tensor,
    index: BatchIndex,
    config: AdapterConfig,
    g_new: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Total MKP loss of a batch and its detached parts (base, point, distance, angle, total).

    out = h(new) [n, d_old], recon = g(out) [n, d_new], new / old the unit support pairs.
    """
    assert out.shape == old.shape and recon.shape == new.shape, "outputs do not match the pairs"
    assert out.shape[0] == new.shape[0], "row counts differ"
    g_in = gram(new) if g_new is None else g_new
    g_out = gram(out)
    d_in, d_out = distance_matrix(g_in), distance_matrix(g_out)
    gamma = config.gamma
    base = base_loss(out, old)
    point = focal_mean(point_errors(recon, new), gamma)
    dist = focal_mean(distance_errors(d_out, d_in, *index.global_pairs), gamma) + focal_mean(
        distance_errors(d_out, d_in, *index.local_pairs), gamma
    )
    ang = focal_mean(angle_errors(g_out, d_out, g_in, d_in, *index.global_triplets), gamma) + focal_mean(
        angle_errors(g_out, d_out, g_in, d_in, *index.local_triplets), gamma
    )
    preserve = config.w_point * point + config.w_distance * dist + config.w_angle * ang
    total = base + config.lam * preserve
    parts = {"base": base, "point": point, "distance": dist, "angle": ang, "total": total}
    return total, {k: v.detach() for k, v in parts.items()}
