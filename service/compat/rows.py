"""The one numpy row normaliser of the compat layer (the torch one lives in encoders/torch_runtime.py).

    normalize_rows(x, dtype=float32, floor=0.0)
        row / |row| for every row whose float64 norm is finite and above `floor`; every other row
        (all zero, rounding noise below `floor`, or overflowing) comes back as a ZERO row, never NaN.

Norms are taken in float64 whatever the input: a float32 row of subnormal values still has a
direction, and squaring float32 values of 1e20 would overflow in float32.  Dividing x_i by a float64
norm that is > 0 and finite gives |x_i / norm| <= 1, so no output is ever non-finite.  Big inputs go
through in blocks of rows so the float64 copy stays bounded.  Callers that need a unit row where the
input had none (query transforms) test `~out.any(axis=1)` and put their documented fallback there.
Numpy only, so psp.py and profile.py can use it without importing torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

# Rows per float64 block: 64k rows x 768 d is 400 MB of float64 at most, a few times the float32 input.
_BLOCK_ROWS = 1 << 16


def normalize_rows(
    x: npt.ArrayLike, dtype: type[np.floating[Any]] = np.float32, floor: float = 0.0
) -> npt.NDArray[Any]:
    """Unit rows (last axis) as `dtype`; rows whose norm is <= floor, zero or not finite come back zero."""
    a = np.asarray(x)
    assert a.ndim >= 1, f"normalize_rows expects rows, got a scalar of shape {a.shape}"
    flat = a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a
    out = np.empty(flat.shape, dtype=dtype)
    for start in range(0, max(flat.shape[0], 1), _BLOCK_ROWS):
        block = np.asarray(flat[start : start + _BLOCK_ROWS], dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):  # such rows are zeroed just below
            norms = np.sqrt(np.einsum("ij,ij->i", block, block))
            ok = np.isfinite(norms) & (norms > floor)
            scaled = block / np.where(ok, norms, 1.0)[:, None]
        out[start : start + _BLOCK_ROWS] = np.where(ok[:, None], scaled, 0.0)
    return out.reshape(a.shape)
