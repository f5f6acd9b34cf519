"""Procrustes blends for serving: heads.py's padded-space SLERP / NLERP as q = b_u old + b_v (new @ B).

With u = old / |old| (zero past d_old) and v = pad(new) R / |new| (unit, since R is orthogonal),
every blend is a combination b_u u + b_v v, and only its first d_old coordinates reach the gallery.
Those need only B = R[:d_new, :d_old]; the angle needs only cos = u . v (|u| = |v| = 1 in the padded
space, so sin = sqrt(1 - cos^2) already counts v's padding).  So a query costs one [d_new, d_old]
matmul and a handful of per-row scalars: on the serving path, where the transform is pure overhead
over a re-indexed system, that is a fraction of the general interpolation code.  With theta in
(0, pi) the forms agree exactly:
    SLERP:  b_v = sin(a theta) / sin(theta),  b_u = cos(a theta) - b_v cos(theta)
    NLERP:  b_v = a,                          b_u = 1 - a
Rows with sin(theta) < 1e-3 (theta within 0.06 degrees of 0 or pi, where the scalar form loses
digits) and NLERP blends that cancel go through interpolation.py on folded rows, so they follow its
documented degenerate rules:
- near 0: [u, 0] / [v_head, |v past d_old|], whose geometry is the padded one; that padding norm
  carries R's float32 error (~1e-3 where the true one is ~0);
- near pi: u / v_head alone.  Within 0.06 degrees of antipodal, v's padding is no larger than that
  same float32 error, and keeping it would make it the direction of travel: the arc would leave the
  old coordinates, and the served (truncated) query would jump from u to -u at alpha ~ 0.5 (NaN
  exactly there).  Without it the arc turns inside the old coordinates (fallback axis included).
Guards, so no finite non-zero input gives NaN: a blend whose first d_old coordinates hold less than
_LOST of its padded length (v mapped wholly past d_old, e.g. `aligned` or alpha = 1 with such a v)
has no direction of its own in the gallery's space -- it scores every gallery row ~0 -- and serves
the old query u instead (the first axis e_0 where no old query was given).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.compat import interpolation
from service.rows import F64, normalize_rows

Array = npt.NDArray[np.float32]

_FALLBACK_SIN = 1e-3
# Old-coordinate length below which a padded-unit blend is R's float32 rounding (~1e-6), not a direction.
_LOST = 1e-5


def _row_dots(a: npt.NDArray[np.floating], b: npt.NDArray[np.floating]) -> F64:
    """a_i . b_i for each row, accumulated in float64."""
    out: F64 = np.einsum("ij,ij->i", a, b, dtype=np.float64)
    return out


def unit_queries(q: npt.NDArray[np.floating], fallback: npt.NDArray[np.floating] | None = None) -> Array:
    """Unit float32 rows of q [n, d_old] (blends of unit padded length); lost rows take fallback's direction or e_0."""
    out: Array = normalize_rows(q, np.float32, _LOST)
    lost = ~out.any(axis=1)
    if lost.any():
        rows = normalize_rows(fallback[lost]) if fallback is not None else np.zeros((int(lost.sum()), q.shape[1]))
        rows[~rows.any(axis=1), 0] = 1.0  # no fallback, or a zero one: the first axis
        out[lost] = rows
    return out


def aligned(new: npt.NDArray[np.floating], block: Array, old: npt.NDArray[np.floating] | None = None) -> Array:
    """Unit `aligned` rows: the old coordinates of v = pad(new) R / |new| (see the guard above for lost rows)."""
    new64 = np.asarray(new, dtype=np.float64)
    return unit_queries((new64 @ block) / np.sqrt(_row_dots(new64, new64))[:, None], old)


@dataclass(frozen=True)
class Pair:
    """Raw old rows and new rows mapped by B, their norms, and the padded-space angle between them."""

    old: Array  # [n, d_old] as given
    head: Array  # [n, d_old] = new @ B: the first d_old coordinates of pad(new) R
    old_norm: F64
    new_norm: F64  # |pad(new) R|: |new| when padded (R orthogonal), |new @ R| itself otherwise
    padded: bool  # R is wider than d_old: v has coordinates past d_old
    cos: F64
    sin: F64
    theta: F64
    degenerate: npt.NDArray[np.bool_]  # rows too close to theta = 0 or pi for the scalar form

    @classmethod
    def of(cls, old: Array, new: Array, block: Array, padded: bool) -> Pair:
        """Map the new rows through R's [d_new, d_old] block and measure the angle to the old rows."""
        head = new @ block
        old_norm = np.sqrt(_row_dots(old, old))
        new_norm = np.sqrt(_row_dots(new, new))
        if not padded:
            # v is all of new @ R here: scale it by its own length, which equals |new| only up to R's
            # float32 error (~1e-7).  With |v| = 1 exactly, sin = sqrt(1 - cos^2) is |v - cos u|; with
            # |new| it is off by that error over sin^2, ~10% just outside the fallback band.
            mapped = np.sqrt(_row_dots(head, head))
            new_norm = np.where(mapped > 0, mapped, new_norm)
        cos = np.clip(_row_dots(old, head) / (old_norm * new_norm), -1.0, 1.0)
        sin = np.sqrt(1.0 - cos * cos)
        degenerate = sin < _FALLBACK_SIN
        pair = cls(old, head, old_norm, new_norm, padded, cos, sin, np.arctan2(sin, cos), degenerate)
        if degenerate.any():  # theta from the folded rows, as the blends of these rows are
            pair.theta[degenerate] = interpolation.angle(*pair._folded(degenerate))
        return pair

    def _combine(self, b_u: F64, b_v: F64) -> F64:
        """b_u u + b_v v in the old coordinates (unnormalised)."""
        q: F64 = (b_u / self.old_norm)[:, None] * self.old + (b_v / self.new_norm)[:, None] * self.head
        return q

    def _folded(self, rows: npt.NDArray[np.bool_]) -> tuple[F64, F64]:
        """u and v of some rows in the folded space (one coordinate for v's padding, except near pi)."""
        u = self.old[rows] / self.old_norm[rows, None]
        v = self.head[rows] / self.new_norm[rows, None]
        if not self.padded:
            return u, v
        # Near pi the padding norm is float32 noise that would steer the arc out of the old coordinates.
        tail = np.where(self.cos[rows] > 0, np.sqrt(np.maximum(0.0, 1.0 - _row_dots(v, v))), 0.0)
        return np.hstack([u, np.zeros((len(u), 1))]), np.hstack([v, tail[:, None]])

    def _finish(self, q: npt.NDArray[np.floating]) -> Array:
        """Unit query rows from blends of unit padded length, the old query standing in for lost rows."""
        return unit_queries(q, self.old)

    def aligned(self) -> Array:
        """Unit `aligned` rows (v's old coordinates)."""
        return self._finish(self.head / self.new_norm[:, None])

    def slerp(self, alpha: float) -> Array:
        """Unit SLERP(u, v; alpha) query rows."""
        degenerate = self.degenerate
        phi = alpha * self.theta
        b_v = np.sin(phi) / np.where(degenerate, 1.0, self.sin)
        q = self._combine(np.cos(phi) - b_v * self.cos, b_v)
        if degenerate.any():
            u, v = self._folded(degenerate)
            q[degenerate] = interpolation.slerp(u, v, alpha, axes=q.shape[1])[:, : q.shape[1]]
        return self._finish(q)

    def nlerp(self, alpha: F64) -> Array:
        """Unit NLERP(u, v; alpha) query rows for a per-row alpha."""
        q = self._combine(1.0 - alpha, alpha)
        # |(1 - a) u + a v|^2 over every padded coordinate; ~0 only where v ~ -u and a ~ 1/2.
        norm2 = (1.0 - alpha) ** 2 + alpha**2 + 2.0 * alpha * (1.0 - alpha) * self.cos
        cancelled = norm2 < 1e-12
        q /= np.sqrt(np.where(cancelled, 1.0, norm2))[:, None]  # unit padded length, as _finish expects
        if cancelled.any():
            u, v = self._folded(cancelled)
            q[cancelled] = interpolation.nlerp(u, v, alpha[cancelled], axes=q.shape[1])[:, : q.shape[1]]
        return self._finish(q)
