"""The one numpy row normaliser (the torch one lives in encoders/torch_runtime.py), the rows' principal directions,
and the array aliases.

    F32, F64, I64                 float32 / float64 / int64 numpy arrays, the names every module uses

    principal_directions(rows)
        the rows' uncentred principal directions, most first, and the share of their squared length the
        first 1, 2, ... of them keep: what the calibration's references and the sealed segment graphs
        are read in

    normalize_rows(x, dtype=float32, floor=0.0)
        row / |row| for every row whose float64 norm is finite and above `floor`; every other row
        (all zero, rounding noise below `floor`, or overflowing) comes back as a ZERO row, never NaN.

Norms are taken in float64 whatever the input: a float32 row of subnormal values still has a
direction, and squaring float32 values of 1e20 would overflow in float32.  Dividing x_i by a float64
norm that is > 0 and finite gives |x_i / norm| <= 1, so no output is ever non-finite.  Big inputs go
through in blocks of rows so the float64 copy stays bounded.  Callers that need a unit row where the
input had none (query transforms) test `~out.any(axis=1)` and put their documented fallback there.
Numpy only, and low in the layer table (docs/architecture.md), so any module can use it without
importing torch or the compat maths.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

# Rows per float64 block: 64k rows x 768 d is 400 MB of float64 at most, a few times the float32 input.
_BLOCK_ROWS = 1 << 16
# float32 squared norms inside this range are exact enough (relative error ~1e-7 per term) and neither
# overflowed (|x| ~ 1e19 and up) nor lost to underflow (|x| ~ 1e-19 and down); other rows go through float64.
_SAFE32 = (1e-30, 1e30)


def normalize_rows(
    x: npt.ArrayLike, dtype: type[np.floating[Any]] = np.float32, floor: float = 0.0
) -> npt.NDArray[Any]:
    """Unit rows (last axis) as `dtype`; rows whose norm is <= floor, zero or not finite come back zero."""
    a = np.asarray(x)
    assert a.ndim >= 1, f"normalize_rows expects rows, got a scalar of shape {a.shape}"
    flat = a if a.ndim == 2 else a.reshape(-1, a.shape[-1])
    if dtype is np.float32 and flat.dtype == np.float32:
        out = _unit32(flat, floor)
    else:
        out = np.empty(flat.shape, dtype=dtype)
        for start in range(0, max(flat.shape[0], 1), _BLOCK_ROWS):
            out[start : start + _BLOCK_ROWS] = _unit64(flat[start : start + _BLOCK_ROWS], floor)
    return out if a.ndim == 2 else out.reshape(a.shape)


def principal_directions(rows: npt.ArrayLike) -> tuple[F64, F32]:
    """(kept [m], directions [d, m]): the rows' uncentred principal directions as columns, most first (those that
    keep most of the rows' inner products), and kept[i] the share of their squared length the first i + 1 keep."""
    x = np.asarray(rows, dtype=np.float64)
    # The eigenvectors of the [d, d] Gram matrix are the right singular vectors, its eigenvalues the squared
    # singular values: the same directions as an SVD of the rows, at a sixth of its time for 20,000 x 768.
    energy, vectors = np.linalg.eigh(x.T @ x)  # ascending
    energy, vectors = np.clip(energy[::-1], 0.0, None), vectors[:, ::-1]
    kept: F64 = np.cumsum(energy) / max(float(energy.sum()), 1e-30)
    return kept, vectors.astype(np.float32)


def _unit64(rows: npt.NDArray[Any], floor: float) -> npt.NDArray[np.float64]:
    """The float64 route: norms and quotients in float64."""
    block = np.asarray(rows, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # such rows are zeroed just below
        norms = np.sqrt(np.einsum("ij,ij->i", block, block))
        ok = np.isfinite(norms) & (norms > floor)
        scaled = block / np.where(ok, norms, 1.0)[:, None]
    out: npt.NDArray[np.float64] = np.where(ok[:, None], scaled, 0.0)
    return out


def _unit32(rows: npt.NDArray[np.float32], floor: float) -> npt.NDArray[np.float32]:
    """The float32 route for float32 rows (4x faster on big arrays); rows outside _SAFE32 take the float64 one."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        norms2 = np.einsum("ij,ij->i", rows, rows)
    safe = (norms2 > _SAFE32[0]) & (norms2 < _SAFE32[1]) & (norms2 > floor * floor)
    scale = np.sqrt(np.where(safe, norms2, np.float32(1.0)))[:, None]
    out: npt.NDArray[np.float32] = (rows / scale).astype(np.float32, copy=False)
    if not safe.all():
        out[~safe] = _unit64(rows[~safe], floor)
    return out
