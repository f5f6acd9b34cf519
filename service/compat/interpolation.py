"""Blending the old query u with the aligned new query v on the unit sphere: SLERP, NLERP, adaptive NLERP.

All functions take float32 rows [n, d] (normalised here again, so slightly off-norm inputs are fine),
vectorise over rows, compute in float64 and return float32 unit rows; they never emit NaN.

Degenerate pairs (theta = angle(u, v)):
- theta ~ 0 (sin theta < 1e-6): the arc has no length; the linear blend normalise((1-a) u + a v)
  is the exact limit of SLERP there, so it is returned (u itself when u == v).
- theta ~ pi (v ~ -u): every great circle through u and -u is a shortest arc.  Rule: travel along
  a deterministic direction w orthogonal to u, namely the standard basis axis e_j with the smallest
  |u_j| (lowest index on ties) among the first `axes` coordinates (all by default) with its
  u-component removed.  So alpha = 0 gives u, alpha = 1 gives -u ~ v, and the same input always
  gives the same output.  A caller that keeps only a leading block of each row (the old coordinates
  of a padded blend) passes that block's width, so the whole arc stays inside the block instead of
  leaving through a padding axis (where u is 0, so it would win the argmin) and coming back as -u.
- NLERP whose blend cancels ((1-a) u + a v ~ 0, i.e. v ~ -u at a ~ 0.5) returns the SLERP point
  of the same row, which follows the rule above.

Adaptive NLERP (002_..., Appendix N): the weight moves with the agreement of the two endpoints,
    alpha_i = clip(a + b * (cos_i - c_ref), 0, 1),   cos_i = u_i . v_i,
with c_ref the median cosine on the support set and (a, b) chosen on the support grid by
`selection.py`.  b > 0 trusts the new model more where the two models agree.  The served blend is
NLERP with these per-row weights (heads.py / procrustes_blend.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.rows import normalize_rows

Array = npt.NDArray[np.float32]
AlphaLike = float | npt.NDArray[np.floating]

_DEGENERATE_SIN = 1e-6
_EPS = 1e-30


def _unit64(x: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    """Rows [n, d] as float64 unit vectors (rows.normalize_rows); zero rows stay zero."""
    assert np.ndim(x) == 2, f"expected [n, d] rows, got shape {np.shape(x)}"
    out: npt.NDArray[np.float64] = normalize_rows(x, np.float64)
    return out


def _alpha_column(alpha: AlphaLike, n: int) -> npt.NDArray[np.float64]:
    """Broadcast a scalar or per-row alpha to a float64 column [n, 1]."""
    a = np.asarray(alpha, dtype=np.float64)
    if a.ndim == 0:
        return np.full((n, 1), float(a))
    assert a.shape == (n,), f"alpha must be a scalar or shape ({n},), got {a.shape}"
    return a.reshape(n, 1)


def _orthogonal_fallback(u: npt.NDArray[np.float64], axes: int | None = None) -> npt.NDArray[np.float64]:
    """Deterministic unit direction orthogonal to each row of u (axis of smallest |u_j|, j < axes, deflated)."""
    n, d = u.shape
    k = d if axes is None else max(1, min(axes, d))
    if k == 1:
        # With one axis to turn in, no orthogonal direction exists: stay on u (documented degenerate case).
        return u.copy()
    j = np.argmin(np.abs(u[:, :k]), axis=1)
    w = np.zeros_like(u)
    w[np.arange(n), j] = 1.0
    w -= u * u[np.arange(n), j][:, None]
    out: npt.NDArray[np.float64] = normalize_rows(w, np.float64)
    return out


@dataclass(frozen=True)
class Geometry:
    """Per-row geometry of a pair: unit u and v, unit tangent w at u pointing to v, angle theta, cosine."""

    u: npt.NDArray[np.float64]
    v: npt.NDArray[np.float64]
    w: npt.NDArray[np.float64]
    theta: npt.NDArray[np.float64]
    cos: npt.NDArray[np.float64]
    near_zero: npt.NDArray[np.bool_]


def geometry(u: npt.NDArray[np.floating], v: npt.NDArray[np.floating], axes: int | None = None) -> Geometry:
    """Decompose v = cos(theta) u + sin(theta) w per row, with the degenerate rules of this module."""
    assert np.shape(u) == np.shape(v), f"u {np.shape(u)} and v {np.shape(v)} differ"
    u64, v64 = _unit64(u), _unit64(v)
    cos = np.clip(np.sum(u64 * v64, axis=1), -1.0, 1.0)
    perp = v64 - cos[:, None] * u64
    sin = np.linalg.norm(perp, axis=1)
    # atan2 keeps theta accurate near 0 and pi, where arccos(cos) loses half the digits.
    theta = np.arctan2(sin, cos)
    degenerate = sin < _DEGENERATE_SIN
    near_zero = degenerate & (cos > 0)
    near_pi = degenerate & (cos <= 0)
    w = perp / np.maximum(sin, _EPS)[:, None]
    if near_pi.any():
        w[near_pi] = _orthogonal_fallback(u64[near_pi], axes)
        theta[near_pi] = np.pi
    return Geometry(u=u64, v=v64, w=w, theta=theta, cos=cos, near_zero=near_zero)


def angle(u: npt.NDArray[np.floating], v: npt.NDArray[np.floating]) -> Array:
    """Angle in radians between matching rows of u and v, in [0, pi]."""
    return geometry(u, v).theta.astype(np.float32)


def _finish(q: npt.NDArray[np.float64]) -> Array:
    """Renormalise float64 rows and hand them back as float32."""
    return _unit64(q).astype(np.float32)


def slerp(u: npt.NDArray[np.floating], v: npt.NDArray[np.floating], alpha: AlphaLike, axes: int | None = None) -> Array:
    """Spherical interpolation: the point at angle alpha * theta from u on the arc to v (unit rows)."""
    return slerp_on(geometry(u, v, axes), alpha)


def slerp_on(g: Geometry, alpha: AlphaLike) -> Array:
    """SLERP of a pair whose geometry is already known (callers that also need theta compute it once)."""
    a = _alpha_column(alpha, g.u.shape[0])
    # cos/sin form of SLERP: identical to sin((1-a)t)/sin(t) u + sin(a t)/sin(t) v, but has no
    # division by sin(theta), so it stays finite up to theta = pi.
    phi = a * g.theta[:, None]
    q = np.cos(phi) * g.u + np.sin(phi) * g.w
    if g.near_zero.any():
        az = a[g.near_zero]
        q[g.near_zero] = (1.0 - az) * g.u[g.near_zero] + az * g.v[g.near_zero]
    return _finish(q)


def nlerp(u: npt.NDArray[np.floating], v: npt.NDArray[np.floating], alpha: AlphaLike, axes: int | None = None) -> Array:
    """Normalised linear interpolation normalise((1-alpha) u + alpha v) of unit rows (unit rows out)."""
    u64, v64 = _unit64(u), _unit64(v)
    a = _alpha_column(alpha, u64.shape[0])
    q = (1.0 - a) * u64 + a * v64
    cancelled = np.linalg.norm(q, axis=1) < _DEGENERATE_SIN
    if cancelled.any():
        idx = np.flatnonzero(cancelled)
        a_sub = a[idx, 0]
        q[idx] = slerp(u64[idx], v64[idx], a_sub, axes).astype(np.float64)
    return _finish(q)


def adaptive_alpha(cos: npt.NDArray[np.floating], a: float, b: float, c_ref: float) -> npt.NDArray[np.float32]:
    """Per-query weight clip(a + b * (cos - c_ref), 0, 1) from the endpoint agreement cos = u . v."""
    return np.clip(a + b * (np.asarray(cos, dtype=np.float64) - c_ref), 0.0, 1.0).astype(np.float32)
