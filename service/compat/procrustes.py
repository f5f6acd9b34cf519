"""Orthogonal Procrustes map from the new embedding space to the old one, with zero-padding.

Both spaces are zero-padded to d = max(d_new, d_old) so R is square whatever the direction of the
upgrade (768 -> 512 pads the old side, 512 -> 768 pads the new side).  Scores against the
old gallery only read the first d_old coordinates, so the gallery itself is never touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt
import torch

# The compat layer's one row normaliser, re-exported: callers have always imported it from here.
from service.rows import normalize_rows as normalize_rows

Array = npt.NDArray[np.float32]

_GRAM_RCOND = 1e-8  # eigenvalues of M^T M are squared singular values: cond(M) up to 1e4 stays exact


def pad(x: npt.NDArray[np.floating], d: int) -> Array:
    """Zero-pad rows of x [n, k] to [n, d] (k <= d), returned as float32."""
    x = np.asarray(x)
    assert x.ndim == 2, f"pad expects a 2-d array, got shape {x.shape}"
    k = x.shape[1]
    assert k <= d, f"cannot pad {k} columns down to {d}"
    if k == d:
        return np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], d), dtype=np.float32)
    out[:, :k] = x
    return out


def cross_covariance(new: npt.NDArray[np.floating], old: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    """Return new^T old [d_new, d_old] of row-normalised pairs, accumulated in float64."""
    assert new.ndim == 2 and old.ndim == 2, "expected 2-d arrays"
    assert new.shape[0] == old.shape[0], f"row mismatch: {new.shape[0]} new vs {old.shape[0]} old"
    # The matmul itself runs in float32 (fast BLAS); chunking bounds the float32 accumulation error.
    acc = np.zeros((new.shape[1], old.shape[1]), dtype=np.float64)
    chunk = 32768
    for start in range(0, new.shape[0], chunk):
        a = torch.from_numpy(normalize_rows(new[start : start + chunk]))
        b = torch.from_numpy(normalize_rows(old[start : start + chunk]))
        acc += (a.T @ b).double().numpy()
    return acc


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run small LAPACK factorisations on one thread.

    On a shared 2-core box, multi-threaded eigh / SVD of a 768 x 512 matrix spin-wait for a busy core
    and take seconds; one thread takes ~0.1 s.  Big matmuls are left on every thread.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thin_rotation(m: npt.NDArray[np.floating]) -> Array:
    """Return the polar factor P Q^T [d_new, d_old] of M = P S Q^T: the block of R that meets real coordinates.

    With zero-padding, M's padded rows / columns are zero, so R is only determined on this block; the
    rest is any orthogonal completion and changes neither u . v, nor |v|, nor any score.
    """
    m64 = torch.from_numpy(np.ascontiguousarray(m, dtype=np.float64))
    tall = m64.shape[0] >= m64.shape[1]
    with _one_thread():
        # Polar factor via the small Gram matrix: M (M^T M)^-1/2, or (M M^T)^-1/2 M when wide; a
        # symmetric eigendecomposition is several times cheaper than an SVD.
        gram = m64.T @ m64 if tall else m64 @ m64.T
        lam, vec = torch.linalg.eigh(gram)
        if float(lam[0]) > _GRAM_RCOND * float(lam[-1]):
            inv_sqrt = (vec / torch.sqrt(lam)) @ vec.T
            r64 = m64 @ inv_sqrt if tall else inv_sqrt @ m64
        else:
            # Rank-deficient or ill-conditioned M (few support pairs, low-rank embeddings): the SVD
            # still returns an orthogonal factor where the Gram route would divide by ~0.
            p, _, qt = torch.linalg.svd(m64, full_matrices=False)
            r64 = p @ qt
    out: Array = r64.numpy().astype(np.float32)
    return out


def complete_rotation(thin: npt.NDArray[np.floating]) -> Array:
    """Extend a [d_new, d_old] block with orthonormal columns (or rows) to a square orthogonal R [d, d]."""
    t = torch.from_numpy(np.ascontiguousarray(thin, dtype=np.float64))
    d_new, d_old = t.shape
    if d_new == d_old:
        return t.numpy().astype(np.float32)
    with _one_thread():
        # The last columns of a complete QR basis span the orthogonal complement of t's columns
        # (of t's rows when the new space is the smaller one).
        if d_new > d_old:
            q, _ = torch.linalg.qr(t, mode="complete")
            full = torch.hstack([t, q[:, d_old:]])
        else:
            q, _ = torch.linalg.qr(t.T, mode="complete")
            full = torch.vstack([t, q[:, d_new:].T])
    out: Array = full.numpy().astype(np.float32)
    return out


def rotation_from_cross_covariance(m: npt.NDArray[np.floating]) -> Array:
    """Return an orthogonal R [d, d] maximising trace(R^T pad(M)) for M [d_new, d_old], d = max of both."""
    # argmin_R ||pad(V) R - pad(U)||_F over orthogonal R is the polar factor of pad(V)^T pad(U).
    return complete_rotation(thin_rotation(m))


def fit_rotation(new: npt.NDArray[np.floating], old: npt.NDArray[np.floating]) -> Array:
    """Fit R [d, d] minimising ||pad(new) R - pad(old)||_F over orthogonal R; rows are L2-normalised first."""
    return rotation_from_cross_covariance(cross_covariance(new, old))


def align(new: npt.NDArray[np.floating], r: npt.NDArray[np.floating], d_old: int) -> Array:
    """Map new rows [n, d_new] through R into the padded old space: unit rows [n, d], d = R.shape[0].

    Only the first d_old coordinates meet the gallery; the rest (when d_new > d_old) still matter
    for the angle between u and v, which is why blending happens in the padded space.
    """
    d = r.shape[0]
    assert r.shape == (d, d), f"R must be square, got {r.shape}"
    assert new.shape[1] <= d and d_old <= d, f"dims {new.shape[1]}/{d_old} do not fit R of size {d}"
    v = torch.from_numpy(pad(normalize_rows(new), d)) @ torch.from_numpy(np.asarray(r, dtype=np.float32))
    return normalize_rows(v.numpy())


def aligned_old_coords(new: npt.NDArray[np.floating], r: npt.NDArray[np.floating], d_old: int) -> Array:
    """The first d_old coordinates of align(new, R): all that scores and u . v ever read.

    R is orthogonal, so |pad(new) R| = |new| and normalising new first gives unit v without
    computing its padding coordinates (a third fewer flops for 768 -> 512).
    """
    d_new = new.shape[1]
    block = torch.from_numpy(np.ascontiguousarray(np.asarray(r, dtype=np.float32)[:d_new, :d_old]))
    out: Array = (torch.from_numpy(normalize_rows(new)) @ block).numpy()
    return out
